//! The `host-sim import` and `host-sim replay` commands as an operator runs
//! them: a HAR file imported, then replayed through activation against the
//! responses recorded in it, with the results, report and summary written;
//! bad arguments refused with a message naming them. (The filter is built
//! by `cargo xtask build-wasm`.)

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

fn host_sim(args: &[&str], dir: &Path) -> Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_host-sim"))
        .args(args)
        .current_dir(dir)
        .output()
        .context("running host-sim")
}

fn activation_wasm() -> Result<PathBuf> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/wasm32-wasip1/wasm/zerolayer_activation.wasm");
    if !path.is_file() {
        bail!(
            "{} is missing: run `cargo xtask build-wasm`",
            path.display()
        );
    }
    Ok(path)
}

fn har() -> String {
    let entry = |at: &str, path: &str, tenant: &str, body: &str| {
        json!({
            "startedDateTime": at,
            "request": {
                "method": "POST",
                "url": format!("https://gateway.example{path}"),
                "headers": [
                    {"name": "Content-Type", "value": "application/json"},
                    {"name": "X-Tenant-Id", "value": tenant},
                ],
                "postData": {"mimeType": "application/json", "text": "{}"},
            },
            "response": {
                "status": 200,
                "headers": [{"name": "Content-Type", "value": "application/json"}],
                "content": {"size": body.len(), "text": body},
            },
        })
    };
    json!({"log": {"version": "1.2", "entries": [
        entry("2026-11-29T12:00:00.000Z", "/v1/messages", "acme", "{\"a\":1}"),
        entry("2026-11-29T12:00:00.040Z", "/v1/messages", "initech", "{\"b\":2}"),
        entry("2026-11-29T12:00:00.080Z", "/healthz", "acme", "ok"),
    ]}})
    .to_string()
}

#[test]
fn a_har_file_is_imported_replayed_and_reported() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path();
    std::fs::write(path.join("session.har"), har())?;
    let config: Value = serde_json::from_str(&std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../filters/activation/example.json"),
    )?)?;
    let chain = json!({"filters": [{
        "name": "zerolayer.activation",
        "wasm": activation_wasm()?,
        "vm_id": "activation",
        "configuration": config,
    }]});
    std::fs::write(path.join("chain.json"), chain.to_string())?;

    let import = host_sim(
        &[
            "import",
            "--from",
            "har",
            "session.har",
            "--out",
            "traffic.jsonl",
        ],
        path,
    )?;
    assert!(
        import.status.success(),
        "{}",
        String::from_utf8_lossy(&import.stderr)
    );
    let traffic = std::fs::read_to_string(path.join("traffic.jsonl"))?;
    assert_eq!(traffic.lines().count(), 3);

    let replay = host_sim(
        &[
            "replay",
            "--chain",
            "chain.json",
            "--traffic",
            "traffic.jsonl",
            "--upstream",
            "recorded",
            "--speed",
            "2",
            "--concurrency",
            "2",
            "--out",
            "results.jsonl",
            "--report",
            "report.html",
            "--no-progress",
        ],
        path,
    )?;
    let stdout = String::from_utf8_lossy(&replay.stdout);
    assert!(
        replay.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&replay.stderr)
    );
    assert!(stdout.contains("replay: 3 requests"), "{stdout}");
    assert!(stdout.contains("zerolayer.activation"), "{stdout}");

    let results: Vec<Value> = std::fs::read_to_string(path.join("results.jsonl"))?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(results.len(), 3);
    // The recorded responses came back; activation's example rules decided.
    assert_eq!(results[0]["status"], 200);
    assert_eq!(results[0]["response_bytes"], 7);
    assert_eq!(
        results[0]["decision"],
        json!(["audit", "metering", "cache"])
    );
    assert_eq!(results[1]["decision"], json!(["audit", "cache"]));
    assert_eq!(results[2]["decision"], json!([]));
    // The HAR's 40 ms gaps at speed 2.
    assert_eq!(results[1]["at_ms"], 20.0);
    for result in &results {
        assert_eq!(result["auth"], "none");
        assert!(result["baseline_ms"].as_f64().is_some(), "{result}");
        assert!(
            result["wasm"][0]["us"].as_f64().is_some_and(|us| us > 0.0),
            "{result}"
        );
    }
    let report = std::fs::read_to_string(path.join("report.html"))?;
    assert!(report.starts_with("<!doctype html>") && report.contains("<svg"));
    Ok(())
}

#[test]
fn bad_arguments_are_refused_naming_them() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path();
    std::fs::write(
        path.join("bad.jsonl"),
        "{\"method\":\"GET\",\"path\":\"x\"}\n",
    )?;
    std::fs::write(
        path.join("good.jsonl"),
        "{\"method\":\"GET\",\"path\":\"/\"}\n",
    )?;
    std::fs::write(path.join("chain.json"), r#"{"filters": []}"#)?;
    let cases: [(&[&str], &str); 5] = [
        (
            &["replay", "--chain", "chain.json"],
            "--traffic FILE is required",
        ),
        (
            &[
                "replay",
                "--chain",
                "chain.json",
                "--traffic",
                "bad.jsonl",
                "--upstream",
                "stub",
            ],
            "line 1",
        ),
        (&["replay", "--bogus", "1"], "unknown option --bogus"),
        (
            &["import", "--from", "pcap", "bad.jsonl"],
            "--from: envoy or har",
        ),
        (
            &[
                "replay",
                "--chain",
                "chain.json",
                "--traffic",
                "good.jsonl",
                "--upstream",
                "stub",
                "--speed",
                "-1",
            ],
            "--speed: a factor >= 0",
        ),
    ];
    for (args, needle) in cases {
        let out = host_sim(args, path)?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    Ok(())
}
