//! A loopback upstream that records what reached it and answers with a small
//! JSON document: the end of the chain, where tests check what the filters
//! let through. A request header `x-echo-set-header: name=value` makes it
//! add that header to its response (to test what clients may see).

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

/// One request as the upstream received it.
#[derive(Debug, Clone)]
pub struct SeenRequest {
    /// Method.
    pub method: String,
    /// Path with query.
    pub path: String,
    /// Headers, names lower-case, in order.
    pub headers: Vec<(String, String)>,
    /// Body as text.
    pub body: String,
}

impl SeenRequest {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A running echo upstream; stops when dropped.
pub struct EchoUpstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<SeenRequest>>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl EchoUpstream {
    /// Starts on 127.0.0.1 and a free port.
    pub fn start() -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("starting the upstream's runtime")?;
        let listener = runtime
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .context("binding the upstream")?;
        let addr = listener.local_addr()?;
        let seen: Arc<Mutex<Vec<SeenRequest>>> = Arc::default();
        let log = seen.clone();
        runtime.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let log = log.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| answer(req, log.clone()));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(EchoUpstream {
            addr,
            seen,
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

    /// The request carrying header `name: value` (e.g. a test's request id).
    pub fn find(&self, name: &str, value: &str) -> Option<SeenRequest> {
        self.seen()
            .into_iter()
            .find(|r| r.header(name) == Some(value))
    }
}

impl Drop for EchoUpstream {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

async fn answer(
    req: Request<Incoming>,
    seen: Arc<Mutex<Vec<SeenRequest>>>,
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
    // Only what is the same behind any proxy: tests compare these bodies.
    let reply = serde_json::json!({
        "upstream": "echo",
        "method": request.method,
        "path": request.path,
        "body_bytes": request.body.len(),
    });
    let extra = request
        .header("x-echo-set-header")
        .and_then(|h| h.split_once('='))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()));
    if let Ok(mut log) = seen.lock() {
        log.push(request);
    }
    let mut builder = Response::builder().header("content-type", "application/json");
    if let Some((name, value)) = extra {
        builder = builder.header(name, value);
    }
    Ok(builder
        .body(Full::new(Bytes::from(reply.to_string())))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::from_static(b"bad x-echo-set-header")))))
}
