//! A loopback upstream that records what reached it and answers with a small
//! JSON document: the end of the chain, where tests check what the filters
//! let through. A request header `x-echo-set-header: name=value` makes it
//! add that header to its response (to test what clients may see).

use std::net::SocketAddr;

use anyhow::Result;

use crate::mock::{MockReply, MockServer};

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

/// A running echo upstream (a [`MockServer`] answering with what it got);
/// stops when dropped.
pub struct EchoUpstream(MockServer);

impl EchoUpstream {
    /// Starts on 127.0.0.1 and a free port.
    pub fn start() -> Result<Self> {
        Ok(EchoUpstream(MockServer::start(echo)?))
    }

    /// Starts one that answers with `handler` (recording what it got all
    /// the same), e.g. an upstream that is also a callout target.
    pub fn with_handler(
        handler: impl Fn(&SeenRequest) -> MockReply + Send + Sync + 'static,
    ) -> Result<Self> {
        Ok(EchoUpstream(MockServer::start(handler)?))
    }

    /// The echo answer to `request` (for handlers that echo most requests).
    pub fn echo(request: &SeenRequest) -> MockReply {
        echo(request)
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.0.addr()
    }

    /// Everything received so far.
    pub fn seen(&self) -> Vec<SeenRequest> {
        self.0.seen()
    }

    /// The request carrying header `name: value` (e.g. a test's request id).
    pub fn find(&self, name: &str, value: &str) -> Option<SeenRequest> {
        self.0.find(name, value)
    }
}

fn echo(request: &SeenRequest) -> MockReply {
    // Only what is the same behind any proxy: tests compare these bodies.
    let body = serde_json::json!({
        "upstream": "echo",
        "method": request.method,
        "path": request.path,
        "body_bytes": request.body.len(),
    });
    let headers = request
        .header("x-echo-set-header")
        .and_then(|h| h.split_once('='))
        .map(|(n, v)| vec![(n.trim().to_string(), v.trim().to_string())])
        .unwrap_or_default();
    MockReply {
        status: 200,
        headers,
        body: body.to_string(),
    }
}
