//! The observer's callouts: HTTP/1.1 over pooled keep-alive connections,
//! one pool per upstream address (`native.upstreams`), with hyper-util's
//! client. A JWKS refresh, an introspection or a sink's batch reuses an idle
//! connection to its upstream instead of opening one per call.
//!
//! Bounds and retries:
//! - at most [`MAX_IDLE_PER_UPSTREAM`] idle connections per address (a
//!   burst of concurrent calls may open more; the rest are closed when
//!   done), each closed after [`IDLE_TIMEOUT`] unused;
//! - a connection the server closed, or one that failed, is never handed
//!   out again;
//! - a request is sent again only if none of it was written: hyper hands it
//!   back unsent when the pooled connection it was given turns out closed,
//!   and hyper-util retries it on another connection (each retry drops the
//!   dead one, so at most one per idle connection, ending on a fresh one).
//!   A request written to a connection that then fails is not repeated,
//!   however idempotent (a GET for JWKS included): the answer is a failed
//!   call and the observer's own backoff and breakers decide, as for any
//!   other failure (a sink's batch must not be inserted twice);
//! - the caller's timeout covers the whole call (connect, send, answer), as
//!   before pooling.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use zerolayer_host::CalloutAnswer;

/// The most bytes of a callout's answer kept (a JWKS document, an
/// introspection answer, a sink's reply): more is a failed call.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// Idle keep-alive connections kept per upstream address at most: the
/// observer makes a few calls at a time per upstream (a JWKS refresh, an
/// introspection, one batch per sink), so a few cover its steady state.
pub const MAX_IDLE_PER_UPSTREAM: usize = 4;

/// How long an idle connection is kept: below the keep-alive timeouts
/// servers commonly use (Node's default is 5 s), so the pool rarely hands
/// out a connection the server is closing at that moment, and long enough
/// to span the observer's ticks and batches.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(2);

/// The pooled client of every upstream the observer calls. Cloning shares
/// the pool.
#[derive(Clone)]
pub struct Upstreams {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Upstreams {
    /// A pool with no connection yet; connections open on the first call
    /// (inside the observer's runtime, which also runs the idle reaper).
    pub fn new() -> Upstreams {
        Upstreams::build(true)
    }

    /// [`Upstreams::new`] writing each request (headers and body) in one
    /// write, copied together: webdis 0.1.9 now and then never answered a
    /// `POST` whose body came in a later TCP segment (`filters/quota`'s
    /// README, "Transport"), which a vectored write may produce.
    pub fn single_write() -> Upstreams {
        Upstreams::build(false)
    }

    fn build(vectored: bool) -> Upstreams {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(MAX_IDLE_PER_UPSTREAM)
            .pool_idle_timeout(IDLE_TIMEOUT)
            .pool_timer(TokioTimer::new())
            .http1_writev(vectored)
            .build(connector);
        Upstreams { client }
    }

    /// One callout: `headers` (pseudo-headers included) and `body` to
    /// `addr`, within `timeout`; the answer, or why it failed.
    pub async fn call(
        &self,
        addr: SocketAddr,
        headers: &[(String, String)],
        body: Vec<u8>,
        timeout: Duration,
    ) -> Result<CalloutAnswer, String> {
        let request = request(addr, headers, body)?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| format!("{addr}: {}", error_chain(&e)))?;
            let status = response.status().as_u16();
            let retry_after_secs = response
                .headers()
                .get(hyper::header::RETRY_AFTER)
                .and_then(|v| zerolayer_core::reply::retry_after_secs(v.as_bytes()));
            let limited = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES);
            let body = limited
                .collect()
                .await
                .map_err(|e| format!("body: {e}"))?
                .to_bytes();
            Ok(CalloutAnswer {
                status: Some(status),
                body: body.to_vec(),
                retry_after_secs,
            })
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(format!("timed out after {} ms", timeout.as_millis())),
        }
    }
}

impl Default for Upstreams {
    fn default() -> Upstreams {
        Upstreams::new()
    }
}

/// The request for `addr`: `:method` and `:path` make the request line,
/// `:authority` the `host` header (the absolute URI only picks the pool;
/// hyper-util sends the path alone).
fn request(
    addr: SocketAddr,
    headers: &[(String, String)],
    body: Vec<u8>,
) -> Result<hyper::Request<Full<Bytes>>, String> {
    let mut path = "/";
    let mut request = hyper::Request::builder();
    for (name, value) in headers {
        request = match name.as_str() {
            ":method" => request.method(value.as_str()),
            ":path" => {
                path = value;
                request
            }
            ":authority" => request.header(hyper::header::HOST, value.as_str()),
            other => request.header(other, value.as_str()),
        };
    }
    // Anything else would be read as part of the authority.
    if !path.starts_with('/') {
        return Err(format!("request: :path {path:?} does not start with /"));
    }
    request
        .uri(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("request: {e}"))
}

/// An error with its causes: hyper-util's own says only "client error
/// (Connect)"; the reason is in its sources.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        line.push_str(": ");
        line.push_str(&cause.to_string());
        source = cause.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// What the loopback server does after answering a request.
    #[derive(Clone, Copy)]
    enum AfterAnswer {
        /// Waits for the next request on the same connection.
        KeepAlive,
        /// Closes the connection (as a server's keep-alive timeout does),
        /// without having said `connection: close`.
        Close,
    }

    /// A loopback HTTP/1.1 server answering `200 ok:<body>` to every
    /// request, each after `delay`, counting the connections it accepts
    /// and the connections it has closed.
    struct Server {
        addr: SocketAddr,
        accepted: Arc<AtomicUsize>,
        closed: Arc<AtomicUsize>,
    }

    impl Server {
        fn start(after: AfterAnswer, delay: Duration) -> Server {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let accepted = Arc::new(AtomicUsize::new(0));
            let closed = Arc::new(AtomicUsize::new(0));
            let (count, done) = (accepted.clone(), closed.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { return };
                    count.fetch_add(1, Ordering::SeqCst);
                    let done = done.clone();
                    std::thread::spawn(move || {
                        serve(stream, after, delay);
                        done.fetch_add(1, Ordering::SeqCst);
                    });
                }
            });
            Server {
                addr,
                accepted,
                closed,
            }
        }

        fn accepted(&self) -> usize {
            self.accepted.load(Ordering::SeqCst)
        }
    }

    /// Answers the requests of one connection until the client closes it
    /// (or after the first, for [`AfterAnswer::Close`]).
    fn serve(stream: TcpStream, after: AfterAnswer, delay: Duration) {
        let mut writer = stream.try_clone().unwrap();
        let mut reader = BufReader::new(stream);
        loop {
            let mut length = 0;
            let mut line = String::new();
            // The request line, then headers up to the empty line.
            let mut first = true;
            loop {
                line.clear();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    return;
                }
                if line == "\r\n" && !first {
                    break;
                }
                first = false;
                if let Some((name, value)) = line.split_once(':')
                    && name.eq_ignore_ascii_case("content-length")
                {
                    length = value.trim().parse().unwrap();
                }
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            std::thread::sleep(delay);
            let answer = format!("ok:{}", String::from_utf8_lossy(&body));
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
                answer.len()
            );
            if writer.write_all(head.as_bytes()).is_err()
                || writer.write_all(answer.as_bytes()).is_err()
            {
                return;
            }
            if let AfterAnswer::Close = after {
                let _ = writer.shutdown(std::net::Shutdown::Both);
                return;
            }
        }
    }

    fn headers(addr: SocketAddr) -> Vec<(String, String)> {
        vec![
            (":method".into(), "POST".into()),
            (":path".into(), "/sink".into()),
            (":authority".into(), addr.to_string()),
        ]
    }

    fn runtime() -> tokio::runtime::Runtime {
        // The observer's own kind of runtime.
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .unwrap()
    }

    const TIMEOUT: Duration = Duration::from_secs(5);

    /// Posts `i` to the test server at `addr`, which echoes it.
    async fn post(upstreams: &Upstreams, addr: SocketAddr, i: usize) -> CalloutAnswer {
        let answer = upstreams
            .call(addr, &headers(addr), format!("{i}").into(), TIMEOUT)
            .await
            .unwrap();
        assert_eq!(answer.status, Some(200));
        assert_eq!(answer.body, format!("ok:{i}").into_bytes());
        answer
    }

    #[test]
    fn sequential_calls_share_one_connection() {
        let server = Server::start(AfterAnswer::KeepAlive, Duration::ZERO);
        let upstreams = Upstreams::new();
        runtime().block_on(async {
            for i in 0..10 {
                post(&upstreams, server.addr, i).await;
            }
        });
        assert_eq!(server.accepted(), 1, "10 calls, one connection");
    }

    #[test]
    fn a_connection_the_server_closed_is_replaced() {
        let server = Server::start(AfterAnswer::Close, Duration::ZERO);
        let upstreams = Upstreams::new();
        runtime().block_on(async {
            for i in 0..3 {
                post(&upstreams, server.addr, i).await;
                // Between calls: the server has closed this call's
                // connection, and the client's side has had time to see it.
                while server.closed.load(Ordering::SeqCst) <= i {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        assert_eq!(server.accepted(), 3, "a fresh connection for each call");
    }

    #[test]
    fn idle_connections_are_bounded_per_upstream() {
        // Slow answers: eight calls at once need eight connections.
        let server = Server::start(AfterAnswer::KeepAlive, Duration::from_millis(200));
        let upstreams = Upstreams::new();
        let burst = |upstreams: Upstreams, addr: SocketAddr| async move {
            let calls: Vec<_> = (0..8)
                .map(|i| {
                    let upstreams = upstreams.clone();
                    tokio::spawn(async move {
                        upstreams
                            .call(addr, &headers(addr), format!("{i}").into(), TIMEOUT)
                            .await
                    })
                })
                .collect();
            for call in calls {
                assert_eq!(call.await.unwrap().unwrap().status, Some(200));
            }
        };
        runtime().block_on(async {
            burst(upstreams.clone(), server.addr).await;
            assert_eq!(server.accepted(), 8);
            // A connection goes back to the pool once its answer is read.
            tokio::time::sleep(Duration::from_millis(50)).await;
            // Four were kept idle, four closed: the next burst reuses four.
            burst(upstreams.clone(), server.addr).await;
        });
        assert_eq!(server.accepted(), 8 + 8 - MAX_IDLE_PER_UPSTREAM);
    }

    #[test]
    fn the_timeout_covers_the_whole_call() {
        let server = Server::start(AfterAnswer::KeepAlive, Duration::from_millis(500));
        let upstreams = Upstreams::new();
        let failed = runtime().block_on(upstreams.call(
            server.addr,
            &headers(server.addr),
            Vec::new(),
            Duration::from_millis(100),
        ));
        assert_eq!(failed.unwrap_err(), "timed out after 100 ms");
    }

    #[test]
    fn a_refused_connection_is_a_failed_call_naming_the_upstream() {
        // A port nothing listens on: bound, then released.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let failed = runtime()
            .block_on(Upstreams::new().call(addr, &headers(addr), Vec::new(), TIMEOUT))
            .unwrap_err();
        assert!(failed.starts_with(&format!("{addr}: ")), "{failed}");
        assert!(failed.contains("refused"), "{failed}");
    }

    #[test]
    fn the_request_carries_method_path_host_and_headers() {
        let addr: SocketAddr = "127.0.0.1:8123".parse().unwrap();
        let headers = vec![
            (":method".to_string(), "GET".to_string()),
            (
                ":path".to_string(),
                "/.well-known/jwks.json?x=1".to_string(),
            ),
            (":authority".to_string(), "idp".to_string()),
            ("x-key".to_string(), "v".to_string()),
        ];
        let request = request(addr, &headers, Vec::new()).unwrap();
        assert_eq!(request.method(), "GET");
        assert_eq!(
            request.uri(),
            "http://127.0.0.1:8123/.well-known/jwks.json?x=1"
        );
        assert_eq!(request.headers()["host"], "idp");
        assert_eq!(request.headers()["x-key"], "v");
        let bad = vec![(":path".to_string(), "@evil:80/x".to_string())];
        assert_eq!(
            super::request(addr, &bad, Vec::new()).unwrap_err(),
            "request: :path \"@evil:80/x\" does not start with /"
        );
    }
}
