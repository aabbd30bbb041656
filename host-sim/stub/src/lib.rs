//! A GPU inference backend stub: a loopback HTTP/1.1 server that speaks
//! Anthropic Messages (`POST /v1/messages`) and OpenAI Chat Completions
//! (`POST /v1/chat/completions`), streamed and not, framed byte for byte as
//! the providers frame them.
//!
//! - **Deterministic answers.** The words come from an xxh3 seed of the
//!   request's model, system prompt, messages and `max_tokens`; the usage
//!   from one documented [`tokenizer`] rule. The same request always gets the
//!   same text, and a test knows which token counts to expect.
//! - **A GPU latency profile.** Time to first token and inter-token latency
//!   ([`StubConfig`], or `x-stub-*` [`headers`] per request); every stream
//!   event leaves as its own flushed body frame on that schedule.
//! - **Faults on demand.** 429/500/503 in the provider's error shape, and
//!   mid-stream disconnects and stalls ([`Fault`]).
//! - **Observability.** The stub logs every request it receives and counts
//!   them by path ([`Stub::requests`], [`Stub::served`]).
//!
//! ```no_run
//! use zerolayer_stub::{Stub, StubConfig};
//! use std::time::Duration;
//!
//! let stub = Stub::start(StubConfig::default().ttft(Duration::from_millis(150)))?;
//! let endpoint = format!("{}/v1/messages", stub.url());
//! // … send requests to `endpoint` …
//! assert_eq!(stub.served("/v1/messages"), 0);
//! # Ok::<(), zerolayer_stub::StubError>(())
//! ```
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

// The README's example compiles as a doc test (`cargo test --doc`; not run:
// it stands for a test driving a gateway at the stub).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
mod readme {}

mod anthropic;
mod completion;
mod config;
pub mod headers;
mod openai;
mod provider;
mod server;
mod sse;
pub mod tokenizer;

use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::Context as _;
use tokio::sync::oneshot;

pub use config::{Compression, Fault, FaultParseError, StubConfig};
pub use server::RecordedRequest;

use server::Shared;

/// Why a stub could not start.
#[derive(Debug, thiserror::Error)]
pub enum StubError {
    /// [`StubConfig::cache_control`] is not a valid header value.
    #[error("cache_control {value:?} is not a valid header value")]
    InvalidCacheControl {
        /// The rejected value.
        value: String,
    },
    /// The listening socket could not be set up.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's error.
        source: io::Error,
    },
    /// The stub's runtime or thread could not be started.
    #[error("starting the stub's runtime: {0}")]
    Runtime(#[source] io::Error),
}

/// A running stub on `127.0.0.1`, served by its own runtime thread; dropping
/// it stops the server and closes every connection, stalled ones included.
#[derive(Debug)]
pub struct Stub {
    addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Stub {
    /// Starts a stub on `127.0.0.1` with an ephemeral port.
    pub fn start(config: StubConfig) -> Result<Self, StubError> {
        let shared = Arc::new(Shared::new(config)?);
        let runtime = runtime()?;
        let wanted = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
        let bind_error = |source| StubError::Bind {
            addr: wanted,
            source,
        };
        let listener = std::net::TcpListener::bind(wanted).map_err(bind_error)?;
        listener.set_nonblocking(true).map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        let listener = {
            let _context = runtime.enter();
            tokio::net::TcpListener::from_std(listener).map_err(bind_error)?
        };

        let (shutdown, stopped) = oneshot::channel::<()>();
        let serving = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("zerolayer-stub-{}", addr.port()))
            .spawn(move || {
                runtime.block_on(async {
                    tokio::select! {
                        () = server::serve(listener, serving) => {}
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime cancels every connection task.
                drop(runtime);
            })
            .map_err(StubError::Runtime)?;
        Ok(Self {
            addr,
            shared,
            shutdown: Some(shutdown),
            thread: Some(thread),
        })
    }

    /// The address the stub listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The stub's base URL, `http://127.0.0.1:PORT` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request received so far, in arrival order (after its body).
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.requests()
    }

    /// How many requests arrived for `path` (any method, any outcome).
    pub fn served(&self, path: &str) -> usize {
        self.shared.served(path)
    }
}

impl Drop for Stub {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Serves the stub on `addr` until the process is killed (the CLI's
/// `host-sim stub --listen …`).
pub fn serve_blocking(addr: SocketAddr, config: StubConfig) -> anyhow::Result<()> {
    let shared = Arc::new(Shared::new(config)?);
    runtime()?.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        server::serve(listener, shared).await;
        Ok(())
    })
}

fn runtime() -> Result<tokio::runtime::Runtime, StubError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("zerolayer-stub")
        .enable_all()
        .build()
        .map_err(StubError::Runtime)
}
