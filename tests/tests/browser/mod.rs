//! Headless Chromium for tests of the project's pages: Debian's `chromium`
//! (installed by `cargo xtask setup`) started headless with a temporary
//! profile and its DevTools endpoint on a loopback port the kernel picks,
//! driven over the DevTools protocol (the `headless_chrome` crate, connected
//! to the process started here), and stopped by PID when dropped.
//!
//! A module of the browser test crates (`mod browser;`), not of the
//! harness library: `headless_chrome` is a dev-dependency, so `cargo xtask`
//! (which links the harness library) never waits for it to compile. Each
//! test crate uses part of it, hence `dead_code` is allowed.
//!
//! ```text
//! let browser = Browser::start()?;
//! browser.open("http://127.0.0.1:8787/")?;
//! browser.wait_for("document.body.dataset.ready === 'true'", Duration::from_secs(10))?;
//! browser.type_into("#request", r#"{"method":"GET","path":"/"}"#)?;
//! browser.click("#evaluate")?;
//! let shown = browser.eval("document.querySelector('#decision').textContent")?;
//! ```

#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use headless_chrome::Tab;
use headless_chrome::protocol::cdp::{Input, Page, Runtime};
use serde_json::Value;

use zerolayer_e2e::{paths, wait};

/// How long Chromium may take to open its DevTools endpoint.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one DevTools call (navigation included) may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a stopping Chromium gets before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// The window (and screenshot) size.
const WINDOW: (u32, u32) = (1400, 1000);

/// A headless Chromium with one tab.
pub struct Browser {
    tab: Arc<Tab>,
    /// The DevTools connection; dropped before the process is stopped.
    connection: Option<headless_chrome::Browser>,
    child: Child,
    profile: tempfile::TempDir,
}

impl Browser {
    /// Starts Chromium headless on a free loopback DevTools port with a fresh
    /// profile and opens a blank tab; fails naming the binary and `cargo
    /// xtask setup` when Chromium is not installed.
    pub fn start() -> Result<Browser> {
        let binary = paths::chromium()?;
        let profile = tempfile::Builder::new()
            .prefix("zerolayer-chromium-")
            .tempdir()?;
        let log = std::fs::File::create(profile.path().join("chromium.log"))?;
        let child = Command::new(&binary)
            .args([
                "--headless=new",
                // Tests run as root, where Chromium's sandbox cannot start.
                "--no-sandbox",
                "--disable-gpu",
                "--remote-debugging-address=127.0.0.1",
                // 0: the kernel picks; Chromium writes it to DevToolsActivePort.
                "--remote-debugging-port=0",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-sync",
                // No traffic beyond what a test's page asks for.
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-default-apps",
                "--disable-domain-reliability",
                "--metrics-recording-only",
                "--mute-audio",
                "--hide-scrollbars",
                &format!("--window-size={},{}", WINDOW.0, WINDOW.1),
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            // Its own process group, so its helpers stop with it.
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let browser = Browser::connect(child, profile)?;
        browser.tab.set_default_timeout(CALL_TIMEOUT);
        browser.ready()
    }

    /// Waits for the DevTools endpoint and connects a tab to it.
    fn connect(mut child: Child, profile: tempfile::TempDir) -> Result<Browser> {
        let active_port = profile.path().join("DevToolsActivePort");
        let ws_url = wait::until(
            "Chromium's DevTools endpoint (DevToolsActivePort)",
            START_TIMEOUT,
            || {
                if let Some(status) = child.try_wait()? {
                    bail!(
                        "chromium exited with {status} during start-up:\n{}",
                        log_tail(profile.path(), 20)
                    );
                }
                let Ok(text) = std::fs::read_to_string(&active_port) else {
                    return Ok(None);
                };
                let mut lines = text.lines();
                match (lines.next().map(str::parse::<u16>), lines.next()) {
                    (Some(Ok(port)), Some(path)) if path.starts_with('/') => {
                        Ok(Some(format!("ws://127.0.0.1:{port}{path}")))
                    }
                    _ => Ok(None),
                }
            },
        );
        let connected = ws_url.and_then(|url| {
            // The connection lives as long as the test: no idle cut-off.
            let connection =
                headless_chrome::Browser::connect_with_timeout(url, Duration::from_secs(3600))?;
            let tab = connection.new_tab()?;
            Ok((connection, tab))
        });
        match connected {
            Ok((connection, tab)) => Ok(Browser {
                tab,
                connection: Some(connection),
                child,
                profile,
            }),
            Err(err) => {
                stop(&mut child);
                Err(err.context(format!(
                    "connecting to Chromium; its log:\n{}",
                    log_tail(profile.path(), 20)
                )))
            }
        }
    }

    /// Sizes the viewport like the window, so screenshots are predictable.
    fn ready(self) -> Result<Browser> {
        self.tab.call_method(
            headless_chrome::protocol::cdp::Emulation::SetDeviceMetricsOverride {
                width: WINDOW.0,
                height: WINDOW.1,
                device_scale_factor: 1.0,
                mobile: false,
                scale: None,
                screen_width: None,
                screen_height: None,
                position_x: None,
                position_y: None,
                dont_set_visible_size: None,
                screen_orientation: None,
                viewport: None,
                display_feature: None,
                device_posture: None,
            },
        )?;
        Ok(self)
    }

    /// Navigates to `url` and waits until the page has loaded.
    pub fn open(&self, url: &str) -> Result<()> {
        self.tab
            .navigate_to(url)
            .and_then(|tab| tab.wait_until_navigated())
            .with_context(|| format!("opening {url}"))?;
        Ok(())
    }

    /// Evaluates `js` in the page (awaiting a promise) and returns its value as JSON.
    pub fn eval(&self, js: &str) -> Result<Value> {
        let reply = self
            .tab
            .call_method(Runtime::Evaluate {
                expression: js.to_string(),
                object_group: None,
                include_command_line_api: None,
                silent: Some(false),
                context_id: None,
                return_by_value: Some(true),
                generate_preview: None,
                user_gesture: Some(true),
                await_promise: Some(true),
                throw_on_side_effect: None,
                timeout: None,
                disable_breaks: None,
                repl_mode: None,
                allow_unsafe_eval_blocked_by_csp: None,
                unique_context_id: None,
                serialization_options: None,
            })
            .with_context(|| format!("evaluating {js}"))?;
        if let Some(exception) = reply.exception_details {
            let detail = exception
                .exception
                .and_then(|e| e.description)
                .unwrap_or(exception.text);
            bail!("{js} threw: {detail}");
        }
        Ok(reply.result.value.unwrap_or(Value::Null))
    }

    /// Polls `js_condition` until it is truthy (returning its value), for at most `timeout`.
    pub fn wait_for(&self, js_condition: &str, timeout: Duration) -> Result<Value> {
        wait::until(&format!("page condition {js_condition}"), timeout, || {
            let value = self.eval(js_condition)?;
            Ok(truthy(&value).then_some(value))
        })
    }

    /// Replaces the text of the input or textarea at `selector` with `text` as a user pasting would (focus, select all, insert: the page gets `input` events).
    pub fn type_into(&self, selector: &str, text: &str) -> Result<()> {
        let selector_js = serde_json::to_string(selector)?;
        let found = self.eval(&format!(
            "(() => {{ const el = document.querySelector({selector_js}); \
             if (!el) return false; el.focus(); el.select(); return document.activeElement === el; }})()"
        ))?;
        if found != Value::Bool(true) {
            bail!("no focusable text field {selector} on the page");
        }
        if text.is_empty() {
            self.tab.press_key("Delete")?;
        } else {
            self.tab.call_method(Input::InsertText {
                text: text.to_string(),
            })?;
        }
        Ok(())
    }

    /// Clicks the middle of the element at `selector` with the mouse.
    pub fn click(&self, selector: &str) -> Result<()> {
        self.tab
            .find_element(selector)
            .and_then(|element| element.click().map(|_| ()))
            .with_context(|| format!("clicking {selector}"))
    }

    /// Writes a PNG screenshot of the viewport to `path` and returns its size in bytes.
    pub fn screenshot_png(&self, path: &Path) -> Result<usize> {
        let png = self.tab.capture_screenshot(
            Page::CaptureScreenshotFormatOption::Png,
            None,
            None,
            true,
        )?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, &png).with_context(|| format!("writing {}", path.display()))?;
        Ok(png.len())
    }

    /// The browser's own log so far (stderr), for failure messages.
    pub fn log(&self) -> String {
        log_tail(self.profile.path(), 200)
    }

    /// The PID of the Chromium process.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        self.connection.take();
        stop(&mut self.child);
    }
}

/// SIGTERM to Chromium, then SIGKILL to its process group if it lingers.
fn stop(child: &mut Child) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    let pid = child.id().to_string();
    let _ = Command::new("kill")
        .args(["-TERM", &pid])
        .stderr(Stdio::null())
        .status();
    let deadline = Instant::now() + STOP_TIMEOUT;
    while Instant::now() < deadline {
        if !matches!(child.try_wait(), Ok(None)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // The group (helpers included), by the id it was started with.
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pid}")])
        .stderr(Stdio::null())
        .status();
    let _ = child.wait();
}

/// JavaScript truthiness of a JSON value.
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0 && !f.is_nan()),
        Value::String(s) => !s.is_empty(),
        Value::Array(_) | Value::Object(_) => true,
    }
}

fn log_tail(profile: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(profile.join("chromium.log")).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn truthiness_follows_javascript() {
        for (value, want) in [
            (Value::Null, false),
            (Value::Bool(false), false),
            (serde_json::json!(0), false),
            (serde_json::json!(""), false),
            (serde_json::json!(2), true),
            (serde_json::json!("0"), true),
            (serde_json::json!([]), true),
            (serde_json::json!({}), true),
        ] {
            assert_eq!(truthy(&value), want, "{value}");
        }
    }

    #[test]
    fn a_missing_browser_names_the_binary_and_the_set_up_command() {
        let text = paths::require_chromium(PathBuf::from("/nowhere/chromium"))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(text.contains("/nowhere/chromium"), "{text}");
        assert!(text.contains("cargo xtask setup"), "{text}");
    }
}
