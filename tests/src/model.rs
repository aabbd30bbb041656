//! The real LLM server: llama.cpp's own HTTP server (through `xllamacpp`)
//! serving SmolLM2-135M-Instruct, started by `tools/llm_server.py` from the
//! project's `.venv` (installed by `cargo xtask setup`) on a free loopback
//! port, and stopped by PID when dropped.
//!
//! It speaks OpenAI `/v1/chat/completions` and Anthropic `/v1/messages`,
//! streamed and not, with usage counts. It serves one request at a time (one
//! slot, one thread): keep `max_tokens` small in tests.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use crate::client::Client;
use crate::paths;

/// The model name the server reports in its replies (it serves any name a
/// request asks for).
pub const MODEL_ALIAS: &str = "smollm2";

/// How long the server may take to load the model and answer `/health`
/// (about 0.5 s on an idle machine, a few seconds on a busy or cold one).
const HEALTH_TIMEOUT: Duration = Duration::from_secs(120);

/// How long the server may take to stop after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// Attempts to start when the picked port is taken before the server binds it.
const START_ATTEMPTS: usize = 3;

/// What to tell someone whose `.venv` lacks the server.
const INSTALL_HINT: &str = "install with `cargo xtask setup` (the test command does)";

/// The one server shared by the tests of a test binary (see [`ModelServer::shared`]).
static SHARED: Mutex<Weak<ModelServer>> = Mutex::new(Weak::new());

/// A running real LLM server; stopped (SIGTERM, then SIGKILL) when dropped.
pub struct ModelServer {
    child: Child,
    addr: SocketAddr,
    ready_after: Duration,
    log: tempfile::NamedTempFile,
    /// Held open so the server also stops if this process dies without
    /// dropping it (the server exits when its stdin closes).
    _stdin: Option<ChildStdin>,
}

impl ModelServer {
    /// Starts a server on 127.0.0.1 and a free port and waits until
    /// `GET /health` answers 200. Fails, never skips, when the server is not
    /// installed or does not come up, with the end of its log.
    pub fn start() -> Result<ModelServer> {
        let python = python()?;
        let script = paths::root().join("tools/llm_server.py");
        let mut attempt = 1;
        loop {
            match Self::start_once(&python, &script) {
                Ok(server) => return Ok(server),
                // Another process took the port between our probe and the bind.
                Err((err, port_taken)) if port_taken && attempt < START_ATTEMPTS => {
                    eprintln!("model server: retrying on another port: {err:#}");
                    attempt += 1;
                }
                Err((err, _)) => return Err(err),
            }
        }
    }

    /// The server shared by every caller in this process while any of them
    /// holds it: starting costs a model load and the machine has few cores,
    /// so a test binary should run one. It stops when the last holder drops
    /// it, and starts again for the next caller.
    pub fn shared() -> Result<Arc<ModelServer>> {
        let mut slot = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(server) = slot.upgrade() {
            return Ok(server);
        }
        let server = Arc::new(Self::start()?);
        *slot = Arc::downgrade(&server);
        Ok(server)
    }

    fn start_once(
        python: &Path,
        script: &Path,
    ) -> std::result::Result<ModelServer, (anyhow::Error, bool)> {
        let setup = |e: anyhow::Error| (e, false);
        let port = free_port().map_err(setup)?;
        let log = tempfile::Builder::new()
            .prefix("zerolayer-llm-")
            .suffix(".log")
            .tempfile()
            .context("creating the model server's log file")
            .map_err(setup)?;
        let stdout = log.reopen().map_err(|e| setup(e.into()))?;
        let stderr = log.reopen().map_err(|e| setup(e.into()))?;
        let mut child = Command::new(python)
            .arg(script)
            .args(["--port", &port.to_string(), "--alias", MODEL_ALIAS])
            .args(["--threads", "1", "--stop-on-stdin-eof"])
            .current_dir(paths::root())
            .stdin(Stdio::piped())
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr))
            .spawn()
            .with_context(|| format!("starting {} {}", python.display(), script.display()))
            .map_err(setup)?;
        let stdin = child.stdin.take();
        let mut server = ModelServer {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            ready_after: Duration::ZERO,
            log,
            _stdin: stdin,
        };
        let spawned = Instant::now();
        match server.wait_healthy() {
            Ok(()) => {
                server.ready_after = spawned.elapsed();
                Ok(server)
            }
            Err(err) => {
                let log = server.log();
                let port_taken = log.contains("port taken?");
                let tail = tail(&log, 30);
                Err((
                    anyhow!(
                        "the model server did not become healthy on {}: {err:#}\n\
                         (if the LLM packages are missing: {INSTALL_HINT})\n\
                         --- model server log (tail) ---\n{tail}",
                        server.addr
                    ),
                    port_taken,
                ))
            }
        }
    }

    fn wait_healthy(&mut self) -> Result<()> {
        let client = Client::new();
        let url = self.url_of("/health");
        let deadline = Instant::now() + HEALTH_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("it exited with {status}");
            }
            // 503 while the model loads; connection refused before it binds.
            if client.get(&url, &[]).is_ok_and(|r| r.status == 200) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("no 200 from /health after {HEALTH_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The base URL, `http://127.0.0.1:PORT` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The URL of `path` (which starts with `/`) on the server.
    pub fn url_of(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The loopback address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The model name the server reports ([`MODEL_ALIAS`]).
    pub fn model(&self) -> &str {
        MODEL_ALIAS
    }

    /// How long the server took from spawn to its first 200 from `/health`.
    pub fn ready_after(&self) -> Duration {
        self.ready_after
    }

    /// The server process's id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the server printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }
}

impl Drop for ModelServer {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `.venv/bin/python`, or an error saying how to install it.
fn python() -> Result<PathBuf> {
    let python = paths::root().join(".venv/bin/python");
    if !python.is_file() {
        bail!(
            "{} is missing, so the model server cannot run: {INSTALL_HINT}",
            python.display()
        );
    }
    Ok(python)
}

/// A port the kernel considers free on 127.0.0.1 right now.
pub(crate) fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
