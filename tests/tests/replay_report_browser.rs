//! The replay report renders in headless Chromium: the shipped example
//! traffic (`host-sim/tools/traffic/example.jsonl`) through `envoy/zerolayer.yaml`
//! against the stub, with the identity services on loopback knowing the
//! example's keys and the usage sink captured; every chart is drawn and the
//! screenshot is a real picture.

use std::time::Duration;

use anyhow::{Context, Result};
use host_sim_tools::replay::{self, ReplayOptions, Upstream};
use host_sim_tools::{report, traffic};
mod browser;

use browser::Browser;
use zerolayer_e2e::chain::{AuthServices, host_sim_chain};
use zerolayer_e2e::{SeenRequest, paths};

/// The example traffic's keys: acme's and globex's are active.
fn introspect(request: &SeenRequest) -> (u16, String) {
    match request.header("x-api-key") {
        Some("sk-example-acme") => (200, r#"{"active":true,"tenant":"acme","sub":"app"}"#.into()),
        Some("sk-example-globex") => (
            200,
            r#"{"active":true,"tenant":"globex","sub":"batch"}"#.into(),
        ),
        _ => (200, r#"{"active":false}"#.into()),
    }
}

#[test]
fn the_report_renders_every_chart_in_chromium() -> Result<()> {
    let root = paths::root();
    // Half the requests sampled, so 40 requests give an estimate.
    let chain = host_sim_chain(50.0)?;
    let file = std::fs::File::open(root.join("host-sim/tools/traffic/example.jsonl"))?;
    let records = traffic::read(std::io::BufReader::new(file))?;
    let services = AuthServices::start(introspect)?;
    let mut options = ReplayOptions::new(chain, records);
    options.upstream = Upstream::Stub(Default::default());
    options.clusters = vec![
        ("idp".into(), services.idp.addr()),
        ("api_keys".into(), services.api_keys.addr()),
    ];
    options.capture = vec!["clickhouse".into(), "audit".into()];
    options.sink_wait = Duration::from_secs(20);
    let replay = replay::run(options)?;
    assert!(replay.notes.is_empty(), "{:?}", replay.notes);
    assert!(
        !replay.sample.is_empty(),
        "nothing shipped to the usage sink"
    );
    let hits = replay
        .requests
        .iter()
        .filter(|r| r.cache.as_deref() == Some("HIT"))
        .count();
    assert!(hits > 0, "the example's repeated prompt never hit");

    let out = root.join("target/replay-report");
    std::fs::create_dir_all(&out)?;
    let page = out.join("report.html");
    std::fs::write(
        &page,
        report::html(&replay, "zerolayer replay: example traffic"),
    )?;

    let browser = Browser::start()?;
    browser.open(&format!("file://{}", page.display()))?;
    browser
        .wait_for(
            "document.readyState === 'complete'",
            Duration::from_secs(10),
        )
        .with_context(|| browser.log())?;
    // Each chart: an SVG with drawn series (bars or lines) and a non-zero size.
    for id in ["latency", "wasm", "cache", "metering", "auth"] {
        let drawn = browser.eval(&format!(
            "(() => {{ const svg = document.querySelector('#{id} svg');
                if (!svg) return 0;
                const box = svg.getBoundingClientRect();
                if (box.width < 100 || box.height < 100) return 0;
                return svg.querySelectorAll('.series').length; }})()"
        ))?;
        assert!(
            drawn.as_u64().is_some_and(|n| n > 0),
            "chart #{id} is not drawn: {drawn}"
        );
    }
    let bars = browser.eval(
        "Array.from(document.querySelectorAll('#metering rect.series'))
            .filter(r => r.getBBox().height > 0).length",
    )?;
    assert!(
        bars.as_u64().is_some_and(|n| n >= 2),
        "metering bars: {bars}"
    );
    let rows = browser.eval("document.querySelectorAll('#requests tr').length")?;
    assert_eq!(rows.as_u64(), Some(41), "a header row and one per request");
    let summary = browser.eval("document.querySelector('#summary').textContent")?;
    assert!(
        summary
            .as_str()
            .is_some_and(|s| s.contains("replay: 40 requests")),
        "{summary}"
    );

    let png = out.join("report.png");
    let bytes = browser.screenshot_png(&png)?;
    assert!(
        bytes > 20_000,
        "a {bytes}-byte screenshot is no rendered report"
    );
    Ok(())
}
