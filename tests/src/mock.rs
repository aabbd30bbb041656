//! A programmable loopback HTTP service (identity provider, introspection
//! endpoint, audit sink) that records what it received and answers with
//! whatever the test's handler returns.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::upstream::SeenRequest;

/// What a mock answers.
#[derive(Debug, Clone, Default)]
pub struct MockReply {
    /// Status.
    pub status: u16,
    /// Headers besides `content-type: application/json`.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: String,
}

impl From<(u16, String)> for MockReply {
    fn from((status, body): (u16, String)) -> Self {
        MockReply {
            status,
            headers: vec![],
            body,
        }
    }
}

/// The handler: request in, reply out.
pub type Handler = Arc<dyn Fn(&SeenRequest) -> MockReply + Send + Sync>;

/// A running mock service; stops when dropped.
pub struct MockServer {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<SeenRequest>>>,
    handler: Arc<Mutex<Handler>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl MockServer {
    /// Starts on 127.0.0.1 and a free port with `handler`.
    pub fn start<R: Into<MockReply>>(
        handler: impl Fn(&SeenRequest) -> R + Send + Sync + 'static,
    ) -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("starting the mock's runtime")?;
        let listener = runtime
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .context("binding the mock")?;
        let addr = listener.local_addr()?;
        let seen: Arc<Mutex<Vec<SeenRequest>>> = Arc::default();
        let handler: Handler = Arc::new(move |r: &SeenRequest| handler(r).into());
        let handler: Arc<Mutex<Handler>> = Arc::new(Mutex::new(handler));
        let (log, h) = (seen.clone(), handler.clone());
        runtime.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (log, h) = (log.clone(), h.clone());
                tokio::spawn(async move {
                    let service = service_fn(move |req| answer(req, log.clone(), h.clone()));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(MockServer {
            addr,
            seen,
            handler,
            runtime: Some(runtime),
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Everything received so far.
    pub fn seen(&self) -> Vec<SeenRequest> {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Replaces the handler (e.g. to take the service down).
    pub fn set_handler<R: Into<MockReply>>(
        &self,
        handler: impl Fn(&SeenRequest) -> R + Send + Sync + 'static,
    ) {
        if let Ok(mut h) = self.handler.lock() {
            *h = Arc::new(move |r: &SeenRequest| handler(r).into());
        }
    }

    /// The request carrying header `name: value`.
    pub fn find(&self, name: &str, value: &str) -> Option<SeenRequest> {
        self.seen()
            .into_iter()
            .find(|r| r.header(name) == Some(value))
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn answer(
    req: Request<Incoming>,
    seen: Arc<Mutex<Vec<SeenRequest>>>,
    handler: Arc<Mutex<Handler>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let request = SeenRequest {
        method: parts.method.to_string(),
        path: parts
            .uri
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default(),
        headers: parts
            .headers
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    let handler = handler.lock().map(|h| h.clone()).ok();
    let reply = handler.map(|h| h(&request)).unwrap_or(MockReply {
        status: 500,
        ..Default::default()
    });
    if let Ok(mut log) = seen.lock() {
        log.push(request);
    }
    let mut builder = Response::builder()
        .status(reply.status)
        .header("content-type", "application/json");
    for (name, value) in &reply.headers {
        builder = builder.header(name.as_str(), value.as_str());
    }
    Ok(builder
        .body(Full::new(Bytes::from(reply.body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::from_static(b"bad mock reply")))))
}
