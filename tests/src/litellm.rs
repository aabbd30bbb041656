//! LiteLLM's proxy (Python, PyPI), the open-source LLM gateway the `peers`
//! bench compares the chain with: started from `.venv-peers` (pinned by
//! `tools/requirements-peers.txt`, installed by `cargo xtask setup-peers`,
//! only for that bench) in front of one OpenAI-compatible backend, with
//! master-key auth and its in-memory response cache, on a free loopback
//! port; stopped by its process group when dropped.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::json;

use crate::{Client, paths};

/// The key LiteLLM's master-key auth accepts (`general_settings.master_key`;
/// LiteLLM wants the `sk-` prefix).
pub const MASTER_KEY: &str = "sk-zerolayer-peers-master";

/// The model name clients ask for; LiteLLM routes it to the backend.
pub const MODEL: &str = "gpt-test";

/// How long LiteLLM may take to start (it imports a lot: ~10 s here).
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The virtualenv LiteLLM is installed in: its own, beside the project's
/// `.venv`, so its hundred-odd dependencies never meet the pinned tools.
pub fn venv() -> PathBuf {
    zerolayer_layout::peers_venv()
}

/// The LiteLLM version `tools/requirements-peers.txt` pins.
pub fn pinned_version() -> Result<String> {
    let file = paths::root().join("tools/requirements-peers.txt");
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("litellm=="))
        .and_then(|rest| rest.split_whitespace().next())
        .map(str::to_string)
        .ok_or_else(|| anyhow!("{} pins no litellm", file.display()))
}

/// The `litellm` command at the pinned version; the error says how to
/// install it.
pub fn binary() -> Result<PathBuf> {
    let pinned = pinned_version()?;
    let binary = venv().join("bin/litellm");
    let how = "install it with `cargo xtask setup-peers` (`cargo xtask bench` does)";
    if !binary.is_file() {
        bail!(
            "LiteLLM's proxy is not installed at {}: {how}",
            binary.display()
        );
    }
    let installed = installed_version()?;
    if installed != pinned {
        bail!("LiteLLM {installed} is installed, the bench pins {pinned}: {how}");
    }
    Ok(binary)
}

/// The version of the `litellm` package in [`venv`].
pub fn installed_version() -> Result<String> {
    let output = Command::new(venv().join("bin/python"))
        .args([
            "-c",
            "import importlib.metadata as m; print(m.version('litellm'))",
        ])
        .stderr(Stdio::null())
        .output()
        .context("running .venv-peers/bin/python")?;
    if !output.status.success() {
        bail!("the litellm package is not in {}", venv().display());
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// The event loop LiteLLM's uvicorn runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventLoop {
    /// LiteLLM's own choice: uvloop.
    Uvloop,
    /// asyncio's default loop. On CPython 3.11 (this project's Python),
    /// LiteLLM 1.108.7 on uvloop (0.22.1 and 0.23.0 alike) dies of a
    /// segmentation fault in libpython within seconds of serving streamed
    /// cache hits; on asyncio's loop, or on CPython 3.12 with uvloop, it
    /// does not.
    Asyncio,
}

/// Runs LiteLLM's command line with uvicorn on asyncio's loop (LiteLLM
/// hard-codes uvloop; this is the one place it is chosen).
const ASYNCIO_LAUNCHER: &str = "import sys\n\
from litellm.proxy import proxy_cli\n\
proxy_cli.ProxyInitializationHelpers.get_loop_type = staticmethod(lambda: 'asyncio')\n\
sys.exit(proxy_cli.run_server())\n";

/// A running LiteLLM proxy; stopped when dropped.
pub struct LiteLlm {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl LiteLlm {
    /// Starts `litellm --config … --num_workers 1` with [`MODEL`] routed to
    /// the OpenAI-compatible `backend` (`/v1/chat/completions`), the master
    /// key [`MASTER_KEY`], no database, and, when `cache`, its in-memory
    /// response cache (entries kept an hour), uvicorn on `event_loop`;
    /// waits until it answers.
    pub fn start(backend: SocketAddr, cache: bool, event_loop: EventLoop) -> Result<LiteLlm> {
        let binary = binary()?;
        let dir = tempfile::Builder::new()
            .prefix("zerolayer-litellm-")
            .tempdir()?;
        let mut settings = json!({"telemetry": false});
        if cache {
            settings["cache"] = json!(true);
            settings["cache_params"] = json!({"type": "local", "ttl": 3600});
        }
        let config = json!({
            "model_list": [{
                "model_name": MODEL,
                "litellm_params": {
                    "model": format!("openai/{MODEL}"),
                    "api_base": format!("http://{backend}/v1"),
                    "api_key": "sk-backend-stub",
                },
            }],
            "litellm_settings": settings,
            "general_settings": {"master_key": MASTER_KEY},
        });
        let config_path = dir.path().join("litellm.yaml");
        std::fs::write(&config_path, serde_yaml::to_string(&config)?)?;
        let addr = free_port()?;
        let log = std::fs::File::create(dir.path().join("litellm.log"))?;
        let mut command = match event_loop {
            EventLoop::Uvloop => Command::new(&binary),
            EventLoop::Asyncio => {
                let mut python = Command::new(venv().join("bin/python"));
                python.args(["-c", ASYNCIO_LAUNCHER]);
                python
            }
        };
        let child = command
            .arg("--config")
            .arg(&config_path)
            .args(["--host", &addr.ip().to_string()])
            .args(["--port", &addr.port().to_string()])
            .args(["--num_workers", "1"])
            // The model cost map from the package, not fetched from GitHub.
            .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            // Its own process group: whatever it starts stops with it.
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut litellm = LiteLlm { child, addr, dir };
        litellm.wait_ready().map_err(|err| {
            anyhow!(
                "LiteLLM did not become ready: {err:#}\n--- litellm.log (tail) ---\n{}",
                litellm.log_tail(40)
            )
        })?;
        Ok(litellm)
    }

    fn wait_ready(&mut self) -> Result<()> {
        let client = Client::new();
        let url = self.url("/health/liveliness");
        crate::wait::until("LiteLLM answering", READY_TIMEOUT, || {
            if let Some(status) = self.child.try_wait()? {
                bail!("litellm exited with {status}");
            }
            Ok(client
                .get(&url, &[])
                .is_ok_and(|r| r.status == 200)
                .then_some(()))
        })
    }

    /// URL of `path` on the proxy.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// The process's id (its process group's too).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The proxy's log (its stdout and stderr) so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("litellm.log")).unwrap_or_default()
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The directory of its configuration and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Whether the process has ended (a zombie not yet reaped included).
    pub fn exited(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.pid()))
            .ok()
            .and_then(|stat| {
                let (_, rest) = stat.rsplit_once(')')?;
                rest.split_whitespace().next().map(|state| state == "Z")
            })
            .unwrap_or(true)
    }
}

impl Drop for LiteLlm {
    fn drop(&mut self) {
        // SIGTERM to the group (uvicorn shuts down in a second), then KILL
        // whatever is left of it.
        let group = self.child.id();
        let signal = |name: &str| {
            let _ = Command::new("kill")
                .args([name, "--", &format!("-{group}")])
                .stderr(Stdio::null())
                .status();
        };
        signal("-TERM");
        let exited = crate::wait::until("LiteLLM exiting", Duration::from_secs(5), || {
            Ok(matches!(self.child.try_wait(), Ok(Some(_))).then_some(()))
        })
        .is_ok();
        // Once the leader is reaped its id may be reused: the group is
        // signalled again only while a member of it is left.
        if !exited || !group_members(group).is_empty() {
            signal("-KILL");
        }
        let _ = self.child.wait();
    }
}

/// The processes in process group `group`.
fn group_members(group: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // After "(comm)": state, ppid, pgrp.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(2))
                .and_then(|p| p.parse::<u32>().ok())
                == Some(group)
        })
        .collect()
}

/// A loopback port nothing listens on now.
fn free_port() -> Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?)
}
