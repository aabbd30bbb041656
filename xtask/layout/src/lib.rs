//! What xtask and the e2e harness (`zerolayer-e2e`) both need, defined
//! once: the workspace's layout, the host-profile variable, the demo's
//! options and the progress line. It depends on `anyhow` alone, so xtask
//! builds in seconds and links no Wasm runtime.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

/// The workspace root (this crate lives at `xtask/layout`).
pub fn root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.ancestors().nth(2).map(PathBuf::from).unwrap_or(here)
}

/// Environment variable choosing host-sim's profile for a test run:
/// `envoy` (default) or `kong`.
pub const PROFILE_ENV: &str = "ZEROLAYER_HOST_PROFILE";

/// LiteLLM's virtualenv for the `peers` bench (`cargo xtask setup-peers`).
pub fn peers_venv() -> PathBuf {
    root().join(".venv-peers")
}

/// Prints a progress line.
pub fn step(what: &str) {
    eprintln!("\x1b[1m==> {what}\x1b[0m");
}

/// The demo's binary (`zerolayer-e2e`'s `[[bin]]`, which may link the
/// harness): `cargo xtask demo` builds the filters, then runs it.
pub const DEMO_BIN: &str = "zerolayer-demo";

/// The form of the chain the demo runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DemoForm {
    /// `envoy/zerolayer.yaml`: four filters and the observer singleton.
    Separate,
    /// `envoy/zerolayer-fused.yaml`: the chain as one filter instance.
    Fused,
    /// `envoy/zerolayer-native.yaml`: the stages as an Envoy dynamic
    /// module, the observer on a thread of its own (Envoy only).
    Native,
}

impl DemoForm {
    /// Its shipped Envoy configuration (under `envoy/`).
    pub fn file(self) -> &'static str {
        match self {
            DemoForm::Separate => "zerolayer.yaml",
            DemoForm::Fused => "zerolayer-fused.yaml",
            DemoForm::Native => "zerolayer-native.yaml",
        }
    }
}

/// Which Proxy-Wasm host the demo runs the chain in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DemoHost {
    /// Real Envoy (`envoy/`), the default.
    Envoy,
    /// Kong's host, ngx_wasm_module (`kong/`).
    NgxWasm,
}

/// `cargo xtask demo`'s options, read by xtask (to fail before any set-up
/// and to know whether to build the native module) and by the demo binary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoOptions {
    /// `--upstream URL`: any backend instead of the stub.
    pub upstream_url: Option<String>,
    /// `--real-model`: the llama.cpp model server instead of the stub.
    pub real_model: bool,
    /// `--keep-running`: leave the chain up after the requests.
    pub keep_running: bool,
    /// `--fused` or `--native`.
    pub form: DemoForm,
    /// `--host envoy|ngx-wasm`.
    pub host: DemoHost,
}

impl DemoOptions {
    /// Reads the demo's command-line options.
    pub fn parse(args: &[String]) -> Result<DemoOptions> {
        let mut options = DemoOptions {
            upstream_url: None,
            real_model: false,
            keep_running: false,
            form: DemoForm::Separate,
            host: DemoHost::Envoy,
        };
        let mut iter = args.iter();
        while let Some(arg) = iter.next() {
            match arg.as_str() {
                "--upstream" => {
                    options.upstream_url =
                        Some(iter.next().context("--upstream needs a URL")?.clone())
                }
                "--real-model" => options.real_model = true,
                "--keep-running" => options.keep_running = true,
                "--fused" => options.form = DemoForm::Fused,
                "--native" => options.form = DemoForm::Native,
                "--host" => {
                    options.host = match iter.next().map(String::as_str) {
                        Some("envoy") => DemoHost::Envoy,
                        Some("ngx-wasm") => DemoHost::NgxWasm,
                        other => bail!("--host: envoy or ngx-wasm, not {other:?}"),
                    }
                }
                other => bail!(
                    "unknown demo option {other:?} (try --real-model, --upstream URL, --fused, --native, --host envoy|ngx-wasm, --keep-running)"
                ),
            }
        }
        if options.form == DemoForm::Native && options.host == DemoHost::NgxWasm {
            bail!(
                "--native is Envoy's dynamic module: it does not run in ngx_wasm_module (use --fused)"
            );
        }
        Ok(options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<DemoOptions> {
        DemoOptions::parse(&args.iter().map(|a| a.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn the_root_holds_the_workspace_manifest() {
        let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap_or_default();
        assert!(manifest.contains("[workspace]"), "{}", root().display());
    }

    #[test]
    fn demo_options_read_every_flag() -> Result<()> {
        assert_eq!(
            parse(&[
                "--upstream",
                "http://x:1",
                "--fused",
                "--host",
                "ngx-wasm",
                "--keep-running"
            ])?,
            DemoOptions {
                upstream_url: Some("http://x:1".into()),
                real_model: false,
                keep_running: true,
                form: DemoForm::Fused,
                host: DemoHost::NgxWasm,
            }
        );
        let native = parse(&["--real-model", "--native"])?;
        assert!(native.real_model);
        assert_eq!(
            (native.form, native.host),
            (DemoForm::Native, DemoHost::Envoy)
        );
        Ok(())
    }

    #[test]
    fn demo_options_refuse_what_cannot_run() {
        for (args, wanted) in [
            (
                &["--native", "--host", "ngx-wasm"][..],
                "does not run in ngx_wasm_module",
            ),
            (&["--host", "kong"][..], "envoy or ngx-wasm"),
            (&["--upstream"][..], "needs a URL"),
            (&["--fast"][..], "unknown demo option \"--fast\""),
        ] {
            let err = parse(args).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(wanted), "{args:?}: {err:?}");
        }
    }
}
