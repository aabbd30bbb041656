//! The rule playground (`tools/playground`) in headless Chromium, as an
//! operator uses it: the page built by `cargo xtask build-playground`,
//! served by host-sim's playground server on a loopback port, a
//! configuration and a request pasted into the textareas, Evaluate clicked,
//! the decision (or core's field-naming error) read off the page.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use host_sim_tools::playground::Server;
use serde_json::Value;
use zerolayer_core::activation::RuleSet;
mod browser;

use browser::Browser;
use zerolayer_e2e::paths;

const TIMEOUT: Duration = Duration::from_secs(20);

/// One rule with a header condition: `metering` on when `x-meter` is sent.
const METERED: &str = r#"{
  "defaults": ["audit"],
  "rules": [
    {"name": "metered", "when": {"header": {"name": "x-meter", "exists": true}},
     "activate": ["metering"]}
  ]
}"#;

const WITH_HEADER: &str =
    r#"{"method": "POST", "path": "/v1/messages", "headers": {"X-Meter": "yes"}}"#;
const WITHOUT_HEADER: &str =
    r#"{"method": "POST", "path": "/v1/messages", "headers": {"x-other": "yes"}}"#;

/// A bad regex in the first rule's path condition.
const BAD_REGEX: &str = r#"{"rules": [
  {"name": "api", "when": {"path": {"matches": "^/v1/(messages"}}, "activate": ["cache"]}
]}"#;

/// The served page in a fresh browser; both stop when dropped.
struct Playground {
    browser: Browser,
    _server: Server,
}

impl Playground {
    fn open() -> Result<Playground> {
        let dir = paths::playground()?;
        let server = Server::start("127.0.0.1:0".parse()?, &dir)?;
        assert!(server.addr().ip().is_loopback());
        let browser = Browser::start()?;
        browser.open(&format!("http://{}/", server.addr()))?;
        if let Err(err) = browser.wait_for("document.body.dataset.ready === 'true'", TIMEOUT) {
            let shown = browser.eval("document.querySelector('#error').textContent")?;
            bail!("{err:#}: the page did not start its engine; #error shows {shown}");
        }
        Ok(Playground {
            browser,
            _server: server,
        })
    }

    fn evaluations(&self) -> Result<u64> {
        let n = self
            .browser
            .eval("Number(document.body.dataset.evaluations || 0)")?;
        n.as_u64().with_context(|| format!("evaluation count {n}"))
    }

    /// Pastes `config` and `request`, clicks Evaluate, waits for the run.
    fn evaluate(&self, config: &str, request: &str) -> Result<()> {
        let before = self.evaluations()?;
        self.browser.type_into("#config", config)?;
        self.browser.type_into("#request", request)?;
        let typed = self.evaluations()?;
        assert!(typed > before, "typing evaluates as the operator types");
        self.browser.click("#evaluate")?;
        self.browser.wait_for(
            &format!("Number(document.body.dataset.evaluations) > {typed}"),
            TIMEOUT,
        )?;
        let shown = self.browser.eval(
            "[document.querySelector('#config').value, document.querySelector('#request').value]",
        )?;
        assert_eq!(shown, serde_json::json!([config, request]));
        Ok(())
    }

    /// `(on, decided by)` as the observers table shows `observer`.
    fn observer(&self, observer: &str) -> Result<(bool, String)> {
        let row = self.browser.eval(&format!(
            "(() => {{ const row = document.querySelector('#decision tr[data-observer=\"{observer}\"]'); \
               return row && [row.dataset.on, row.querySelector('.decided-by').textContent, \
                              row.querySelector('.badge').textContent]; }})()"
        ))?;
        let Value::Array(cells) = &row else {
            bail!("no row for {observer} in #decision: {row}");
        };
        let on = cells[0] == "true";
        // The badge says the same as the data attribute.
        assert_eq!(cells[2], if on { "ON" } else { "off" }, "{row}");
        Ok((on, cells[1].as_str().unwrap_or_default().to_string()))
    }

    fn error_shown(&self) -> Result<Option<(String, String)>> {
        let error = self.browser.eval(
            "(() => { const e = document.querySelector('#error'); \
               return e.hidden ? null : [e.querySelector('code.path')?.textContent ?? '', e.textContent]; })()",
        )?;
        Ok(match error {
            Value::Array(parts) => Some((
                parts[0].as_str().unwrap_or_default().to_string(),
                parts[1].as_str().unwrap_or_default().to_string(),
            )),
            _ => None,
        })
    }
}

/// Checks `path` holds a PNG of the browser window's size with real content.
fn assert_screenshot(path: &std::path::Path, written: usize) -> Result<()> {
    let png = std::fs::read(path)?;
    assert_eq!(png.len(), written);
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    let width = u32::from_be_bytes(png[16..20].try_into()?);
    let height = u32::from_be_bytes(png[20..24].try_into()?);
    assert_eq!((width, height), (1400, 1000));
    // A blank 1400×1000 page compresses to a few KB; text and tables don't.
    assert!(png.len() > 30_000, "screenshot is only {} bytes", png.len());
    Ok(())
}

#[test]
fn a_header_rule_turns_metering_on_only_for_requests_that_carry_the_header() -> Result<()> {
    let page = Playground::open()?;

    // The first view: the filter's example and the sample request, decided.
    let first = page.browser.eval(
        "[document.querySelector('#config').value.includes('\"sdk_canary\"'), \
          document.querySelector('#published').textContent]",
    )?;
    assert_eq!(
        first,
        serde_json::json!([
            true,
            "wasmx.zerolayer_observers = \"audit,metering,cache,shadow\""
        ])
    );

    page.evaluate(METERED, WITH_HEADER)?;
    assert_eq!(page.error_shown()?, None);
    assert_eq!(page.observer("metering")?, (true, "metered".to_string()));
    assert_eq!(page.observer("audit")?, (true, "— (default)".to_string()));
    assert!(!page.observer("cache")?.0);
    let matched = page
        .browser
        .eval("document.querySelector('#matched').textContent")?;
    assert_eq!(matched, "Matched: metered");
    let written = page
        .browser
        .screenshot_png(&paths::root().join("target/playground-test.png"))?;
    assert_screenshot(&paths::root().join("target/playground-test.png"), written)?;

    page.evaluate(METERED, WITHOUT_HEADER)?;
    assert_eq!(page.error_shown()?, None);
    assert_eq!(
        page.observer("metering")?,
        (false, "— (default)".to_string())
    );
    assert!(page.observer("audit")?.0);
    let rule = page
        .browser
        .eval("document.querySelector('#rules tr[data-rule=\"metered\"]').dataset.matched")?;
    assert_eq!(rule, "false");
    Ok(())
}

#[test]
fn an_invalid_config_shows_cores_error_with_the_field_path() -> Result<()> {
    let want = RuleSet::from_json(BAD_REGEX.as_bytes())
        .err()
        .context("the bad configuration compiles")?;
    assert_eq!(want.path(), "rules[0].when.path.matches");

    let page = Playground::open()?;
    page.evaluate(BAD_REGEX, WITH_HEADER)?;
    let (path, text) = page
        .error_shown()?
        .context("no error shown for a configuration with a bad regex")?;
    assert_eq!(path, "rules[0].when.path.matches");
    assert!(
        text.contains(&want.to_string()),
        "#error shows {text:?}, core says {want}"
    );
    assert!(
        text.contains(r#"rules[0].when.path.matches: invalid regex "^/v1/(messages": "#),
        "{text}"
    );
    assert!(text.starts_with("Configuration refused"), "{text}");
    // No stale decision next to the error.
    let decision = page
        .browser
        .eval("document.querySelector('#decision').textContent")?;
    assert_eq!(decision, "");
    let written = page
        .browser
        .screenshot_png(&paths::root().join("target/playground-test-error.png"))?;
    assert_screenshot(
        &paths::root().join("target/playground-test-error.png"),
        written,
    )?;

    // A bad request is refused as the request's, naming its field.
    page.evaluate(METERED, r#"{"method": "GET", "path": "/", "time": "noon"}"#)?;
    let (path, text) = page.error_shown()?.context("no error for a bad request")?;
    assert_eq!(path, "request.time");
    assert!(text.starts_with("Request refused"), "{text}");

    // Fixed, the error goes and the decision comes back.
    page.evaluate(METERED, WITH_HEADER)?;
    assert_eq!(page.error_shown()?, None);
    assert!(page.observer("metering")?.0);
    Ok(())
}
