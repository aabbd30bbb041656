//! The official OpenAI and Anthropic Python SDKs as clients of a gateway:
//! runs `tests/clients/sdk_suite.py` from the project's `.venv` (where
//! `cargo xtask setup` installs the pinned SDKs) and reads its report.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde::Deserialize;

use crate::paths;

/// What the SDKs saw of one request they completed.
#[derive(Debug, Clone, Deserialize)]
pub struct Seen {
    /// The suite's name for it.
    pub case: String,
    /// The request id the SDK read (`_request_id`, or the stream's header).
    pub request_id: String,
    /// The usage the SDK parsed, `[input, output]` (none: the stream
    /// carried none, as its client asked).
    pub usage: Option<[u64; 2]>,
    /// The response's `x-cache`, where the suite read it.
    pub cache: Option<String>,
}

/// The suite's report.
#[derive(Debug, Clone, Deserialize)]
pub struct Report {
    /// One line per failed check (empty: all passed).
    pub failures: Vec<String>,
    /// Every request the SDKs completed.
    pub seen: Vec<Seen>,
    /// HTTP requests the SDKs sent in all, retries included.
    pub attempts: u64,
}

/// Credentials the suite uses (raw: the SDKs add `Bearer`).
pub struct Credentials<'a> {
    /// A JWT the gateway has verified (its tenant's repeats are cached).
    pub jwt: &'a str,
    /// An API key the introspection endpoint knows.
    pub api_key: &'a str,
    /// An API key it does not.
    pub bad_key: &'a str,
}

fn python() -> Result<PathBuf> {
    let python = paths::root().join(".venv/bin/python");
    if !python.is_file() {
        bail!(
            "{} is missing: run `cargo xtask setup` (installs the pinned SDKs, \
             tools/requirements-clients.txt)",
            python.display()
        );
    }
    Ok(python)
}

/// Runs `tests/clients/<script>` with `args` from the project's `.venv`
/// (loopback only) and returns the JSON its last stdout line prints.
pub fn run_client(script: &str, args: &[&str]) -> Result<serde_json::Value> {
    let path = paths::root().join("tests/clients").join(script);
    let output = Command::new(python()?)
        .arg(&path)
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("NO_PROXY", "*")
        .current_dir(paths::root())
        .output()
        .with_context(|| format!("running {}", path.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .last()
        .and_then(|line| serde_json::from_str(line).ok())
        .with_context(|| {
            format!(
                "{script} printed no report (exit {}):\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            )
        })
}

/// Runs the suite against `gateway` (`http://IP:PORT`); `run` makes its
/// prompts unique. Fails naming every check that failed, with the SDKs'
/// own output.
pub fn run_suite(gateway: &str, credentials: &Credentials<'_>, run: &str) -> Result<Report> {
    let script = paths::root().join("tests/clients/sdk_suite.py");
    let output = Command::new(python()?)
        .arg(&script)
        .args(["--gateway", gateway])
        .args(["--jwt", credentials.jwt])
        .args(["--api-key", credentials.api_key])
        .args(["--bad-key", credentials.bad_key])
        .args(["--run", run])
        // No credentials, proxies or config of the machine's: loopback only.
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("NO_PROXY", "*")
        .current_dir(paths::root())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let report: Report = stdout
        .lines()
        .last()
        .and_then(|line| serde_json::from_str(line).ok())
        .with_context(|| {
            format!(
                "the SDK suite printed no report (exit {}):\n{stderr}",
                output.status
            )
        })?;
    if !report.failures.is_empty() || !output.status.success() {
        bail!(
            "the official SDKs failed against {gateway}:\n  {}\n--- their output ---\n{stderr}",
            report.failures.join("\n  ")
        );
    }
    Ok(report)
}
