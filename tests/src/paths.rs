//! Where the project's artifacts live. The test command (`cargo xtask test`)
//! builds and installs them first; a test that finds one missing fails with
//! a message saying how to get it, never skips.

use std::path::PathBuf;

use anyhow::{Result, bail};

pub use zerolayer_layout::root;

/// The built `.wasm` of filter `name` (`activation` → `zerolayer_activation.wasm`).
pub fn wasm(name: &str) -> Result<PathBuf> {
    let path = root()
        .join("target/wasm32-wasip1/wasm")
        .join(format!("zerolayer_{}.wasm", name.replace('-', "_")));
    if !path.is_file() {
        bail!(
            "{} is missing: build the filters with `cargo xtask build-wasm` (the test command does)",
            path.display()
        );
    }
    Ok(path)
}

/// The directory Envoy loads dynamic modules from
/// (`ENVOY_DYNAMIC_MODULES_SEARCH_PATH`): where `cargo xtask build-native`
/// puts `libzerolayer_native.so`.
pub fn native_modules() -> PathBuf {
    root().join("target/release")
}

/// The built native module, `libzerolayer_native.so` (see [`native_modules`]).
pub fn native_module() -> Result<PathBuf> {
    let path = native_modules().join("libzerolayer_native.so");
    if !path.is_file() {
        bail!(
            "{} is missing: build it with `cargo xtask build-native` (the test command does)",
            path.display()
        );
    }
    Ok(path)
}

/// Where `cargo xtask build-native --probes` puts the native module built
/// with its floor probes (feature `probes`; the shipped module has none):
/// the `ENVOY_DYNAMIC_MODULES_SEARCH_PATH` of an Envoy that runs them.
pub fn native_probe_modules() -> Result<PathBuf> {
    let dir = root().join("target/probes/release");
    if !dir.join("libzerolayer_native.so").is_file() {
        bail!(
            "{} is missing: build it with `cargo xtask build-native --probes` (the test and bench commands do)",
            dir.join("libzerolayer_native.so").display()
        );
    }
    Ok(dir)
}

/// The project-local Envoy (installed by `cargo xtask setup` into `.venv`),
/// or `$ZEROLAYER_ENVOY`.
pub fn envoy_binary() -> Result<PathBuf> {
    let path = std::env::var_os("ZEROLAYER_ENVOY")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/envoy"));
    if !path.is_file() {
        bail!(
            "Envoy not found at {}: install it with `cargo xtask setup` (the test command does)",
            path.display()
        );
    }
    Ok(path)
}

/// A file under `envoy/`.
pub fn envoy_config(name: &str) -> PathBuf {
    root().join("envoy").join(name)
}

/// Debian's Chromium (installed by `cargo xtask setup`), or `$ZEROLAYER_CHROMIUM`.
pub fn chromium() -> Result<PathBuf> {
    require_chromium(
        std::env::var_os("ZEROLAYER_CHROMIUM")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium")),
    )
}

/// `path` if it is a file, else the error that says how to install Chromium.
pub fn require_chromium(path: PathBuf) -> Result<PathBuf> {
    if !path.is_file() {
        bail!(
            "Chromium not found at {}: install it with `cargo xtask setup` (the test command does)",
            path.display()
        );
    }
    Ok(path)
}

/// The built rule playground page (`target/playground/`, with its `index.html`).
pub fn playground() -> Result<PathBuf> {
    let dir = root().join("target/playground");
    if !dir.join("index.html").is_file() || !dir.join("zerolayer_playground_bg.wasm").is_file() {
        bail!(
            "{} is missing or incomplete: build it with `cargo xtask build-playground` (the test command does)",
            dir.display()
        );
    }
    Ok(dir)
}
