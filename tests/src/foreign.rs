//! The foreign-filter differential harness: filters zerolayer did not write
//! (`host-sim/foreign`, in the shape of the proxy-wasm SDK's examples) run by
//! a real host and by host-sim's profile for it, side by side, in front of
//! one [`Backend`] (the upstream, and the callout target): real Envoy 1.40
//! and `host-sim serve` under the Envoy profile, from the same Envoy file;
//! or real ngx_wasm_module and `host-sim serve` under the Kong profile, from
//! the same chain. The same requests go to both; what the client, the
//! upstream and the callout target saw, and what the filters logged, is
//! reduced to what both hosts must agree on.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use host_sim::Profile;
use host_sim_tools::config_file::ChainFile;
use host_sim_tools::serve::{ServeOptions, Server};

use crate::differential::{Observed, Scenario, UpstreamView};
use crate::mock::MockReply;
use crate::ngx::{KongConfig, KongFilter, NgxWasm};
use crate::{Client, EchoUpstream, Envoy, EnvoyConfig, SeenRequest};

/// The built foreign filter `name` (`cargo xtask build-wasm` builds them
/// into `target/wasm32-wasip1/wasm/examples/`).
pub fn wasm(name: &str) -> Result<PathBuf> {
    let path = crate::paths::root()
        .join("target/wasm32-wasip1/wasm/examples")
        .join(format!("{name}.wasm"));
    if !path.is_file() {
        bail!(
            "{} is missing: build the foreign filters with `cargo xtask build-wasm` (the test command does)",
            path.display()
        );
    }
    Ok(path)
}

/// The Envoy file of foreign filter `name` (`host-sim/foreign/envoy/`).
pub fn envoy_file(name: &str) -> PathBuf {
    crate::paths::root()
        .join("host-sim/foreign/envoy")
        .join(format!("{name}.yaml"))
}

/// The upstream and the callout target in one: `GET /bytes/1` answers one
/// byte, [`Backend::set_byte`]'s (the SDK's http_auth_random asks httpbin
/// for a random one); a request with `x-test-bytes: N` gets N bytes of `a`,
/// one with `x-test-body: TEXT` gets TEXT; anything else the echo's JSON.
pub struct Backend {
    upstream: EchoUpstream,
    byte: Arc<AtomicU8>,
}

impl Backend {
    /// Starts on a free loopback port, answering `0` on `/bytes/1`.
    pub fn start() -> Result<Backend> {
        let byte = Arc::new(AtomicU8::new(b'0'));
        let answer = byte.clone();
        let upstream = EchoUpstream::with_handler(move |request: &SeenRequest| {
            if request.path == "/bytes/1" {
                return MockReply {
                    status: 200,
                    headers: vec![],
                    body: char::from(answer.load(Ordering::SeqCst)).to_string(),
                };
            }
            let body = if let Some(n) = request.header("x-test-bytes") {
                "a".repeat(n.parse().unwrap_or(0))
            } else if let Some(text) = request.header("x-test-body") {
                text.to_string()
            } else {
                return EchoUpstream::echo(request);
            };
            MockReply {
                status: 200,
                headers: vec![],
                body,
            }
        })?;
        Ok(Backend { upstream, byte })
    }

    /// The byte `/bytes/1` answers from now on (`b'0'`: even, granted).
    pub fn set_byte(&self, byte: u8) {
        self.byte.store(byte, Ordering::SeqCst);
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.upstream.addr()
    }

    /// Every request it got so far (upstream requests and callouts).
    pub fn seen(&self) -> Vec<SeenRequest> {
        self.upstream.seen()
    }
}

/// The real host of a [`ForeignPair`].
enum RealHost {
    Envoy(Envoy),
    Ngx(NgxWasm),
}

/// A real host and host-sim's profile for it, running the same foreign
/// filters in front of the same [`Backend`].
pub struct ForeignPair {
    /// The upstream and callout target both hosts use.
    pub backend: Backend,
    real: RealHost,
    sim: Server,
    client: Client,
    /// Client and upstream headers compared besides `content-type`.
    compared: Vec<String>,
    _dir: tempfile::TempDir,
}

/// One side of a pair, for [`ForeignPair::observe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Real Envoy or ngx_wasm_module.
    Real,
    /// host-sim serve.
    Sim,
}

impl ForeignPair {
    /// Real Envoy and host-sim (Envoy profile) from the Envoy file of
    /// foreign filter `name`, every cluster pointed at the backend, then
    /// `configure` applied to the document.
    pub fn envoy(
        name: &str,
        configure: impl FnOnce(EnvoyConfig) -> Result<EnvoyConfig>,
    ) -> Result<Self> {
        let backend = Backend::start()?;
        let config = configure(EnvoyConfig::load(&envoy_file(name))?.for_run(backend.addr())?)?;
        let envoy = Envoy::start(&config)?;
        let dir = tempfile::tempdir()?;
        let path = config.write(dir.path())?;
        let chain = ChainFile::load(&path, &crate::paths::root())?;
        let sim = serve(chain, backend.addr())?;
        Ok(ForeignPair {
            backend,
            real: RealHost::Envoy(envoy),
            sim,
            client: Client::with_timeout(Duration::from_secs(10)),
            compared: Vec::new(),
            _dir: dir,
        })
    }

    /// Real ngx_wasm_module and host-sim (Kong profile), each with the
    /// foreign `filters` (module, configuration) as the chain of `paths`;
    /// a configuration `{backend}` becomes the backend's `IP:port` (callouts
    /// name their target so there).
    pub fn kong(filters: &[(&str, &str)], paths: &[&str]) -> Result<Self> {
        let backend = Backend::start()?;
        let target = backend.addr().to_string();
        let mut modules = Vec::new();
        let mut chain = Vec::new();
        for (name, config) in filters {
            if !modules.iter().any(|(n, _)| n == name) {
                modules.push((name.to_string(), wasm(name)?));
            }
            chain.push(KongFilter {
                name: name.to_string(),
                config: config.replace("{backend}", &target),
            });
        }
        let config = KongConfig::plain(
            modules,
            chain,
            paths.iter().map(|p| p.to_string()).collect(),
        );
        let ngx = NgxWasm::start(&config, backend.addr())?;
        let sim = crate::kong_chain::host_sim_server(&config, backend.addr(), &[backend.addr()])?;
        Ok(ForeignPair {
            backend,
            real: RealHost::Ngx(ngx),
            sim,
            client: Client::with_timeout(Duration::from_secs(10)),
            compared: Vec::new(),
            _dir: tempfile::tempdir()?,
        })
    }

    /// Compares these client and upstream headers too (names lower-case).
    pub fn compare_headers(mut self, names: &[&str]) -> Self {
        self.compared
            .extend(names.iter().map(|n| n.to_ascii_lowercase()));
        self
    }

    /// Whether the real host is ngx_wasm_module.
    pub fn is_kong(&self) -> bool {
        matches!(self.real, RealHost::Ngx(_))
    }

    /// The listener of `side`.
    pub fn listener(&self, side: Side) -> SocketAddr {
        match (side, &self.real) {
            (Side::Real, RealHost::Envoy(envoy)) => envoy.listener(),
            (Side::Real, RealHost::Ngx(ngx)) => ngx.listener(),
            (Side::Sim, _) => self.sim.addr(),
        }
    }

    fn tag(side: Side) -> &'static str {
        match side {
            Side::Real => "real",
            Side::Sim => "sim",
        }
    }

    /// Sends `scenario` to `side` and reduces what the client and the
    /// upstream saw. Under Kong every request goes on a connection of its
    /// own (`connection: close`): ngx_wasm_module 3bed278 does not hold a
    /// request paused for a callout on a reused keep-alive connection (see
    /// host-sim/README.md), which host-sim does not reproduce.
    pub fn observe(&self, side: Side, scenario: &Scenario) -> Result<Observed> {
        let case = format!("{}@{}", scenario.name, Self::tag(side));
        let mut headers = scenario.headers_for(&case);
        if self.is_kong() {
            headers.push(("connection", "close"));
        }
        let gateway = self.listener(side).to_string();
        let url = format!("http://{gateway}{}", scenario.path);
        let reply = self
            .client
            .send_partial(&scenario.method, &url, &headers, &scenario.body)
            .with_context(|| format!("{} via {}", scenario.name, Self::tag(side)))?;
        let mut client_body = reply.reply.body;
        if reply.cut.is_some() {
            // What a client sees of a cut response: the bytes before it.
            client_body.push_str(&format!("[cut after {} bytes]", reply.reply.raw.len()));
        }
        let seen = self.backend.upstream.find("x-test-case", &case);
        let normalize = |v: &str| v.replace(&gateway, "<gateway>");
        Ok(Observed {
            status: reply.reply.status,
            client_headers: self.select(
                reply
                    .reply
                    .headers
                    .iter()
                    .map(|(n, v)| (n.as_str(), v.as_str())),
                &normalize,
            ),
            client_body: normalize(&client_body),
            upstream: seen.map(|s| UpstreamView {
                method: s.method,
                path: s.path,
                headers: self.upstream_headers(&s.headers, &normalize),
                body: s.body,
            }),
        })
    }

    /// Sends `scenario` through the real host, then through host-sim.
    pub fn run(&self, scenario: &Scenario) -> Result<(Observed, Observed)> {
        Ok((
            self.observe(Side::Real, scenario)?,
            self.observe(Side::Sim, scenario)?,
        ))
    }

    fn select<'a>(
        &self,
        headers: impl Iterator<Item = (&'a str, &'a str)>,
        normalize: &dyn Fn(&str) -> String,
    ) -> BTreeMap<String, String> {
        headers
            .map(|(n, v)| (n.to_ascii_lowercase(), v))
            .filter(|(n, _)| n == "content-type" || self.compared.contains(n))
            .map(|(n, v)| (n, normalize(v)))
            .collect()
    }

    /// Every header the upstream got, values that differ by nature masked:
    /// the request id each host makes up, the gateway's own address, and
    /// under Kong the `Host` nginx sets from its `proxy_pass` upstream.
    fn upstream_headers(
        &self,
        headers: &[(String, String)],
        normalize: &dyn Fn(&str) -> String,
    ) -> BTreeMap<String, String> {
        headers
            .iter()
            .filter(|(n, _)| n != "x-test-case")
            .map(|(n, v)| {
                let n = n.to_ascii_lowercase();
                let v = match n.as_str() {
                    "x-request-id" => "<request id>".to_string(),
                    "host" if self.is_kong() => "<proxy_pass host>".to_string(),
                    _ => normalize(v),
                };
                (n, v)
            })
            .collect()
    }

    /// The callouts the backend got (`GET /bytes/1`), in order, as
    /// (method, path, headers): all of them, names lower-case.
    pub fn callouts(&self) -> Vec<(String, String, BTreeMap<String, String>)> {
        self.backend
            .seen()
            .into_iter()
            .filter(|r| r.path == "/bytes/1")
            .map(|r| {
                let headers = r
                    .headers
                    .iter()
                    .map(|(n, v)| (n.to_ascii_lowercase(), v.clone()))
                    .collect();
                (r.method, r.path, headers)
            })
            .collect()
    }

    /// What the filters logged so far on `side`, messages only, in order:
    /// context ids (`#12`) made `#`, the gateway's address `<gateway>` (its
    /// port after any host name `:<port>`),
    /// header names lower-case and the values of headers that differ by
    /// nature (dates, request ids, timings) masked; panics' continuation
    /// lines left out.
    pub fn logs(&self, side: Side) -> Result<Vec<String>> {
        let gateway = self.listener(side).to_string();
        let port = self.listener(side).port();
        let raw: Vec<String> = match (side, &self.real) {
            (Side::Real, RealHost::Envoy(envoy)) => envoy
                .log()
                .lines()
                .filter_map(|l| l.split_once("wasm log")?.1.split_once(": "))
                .map(|(_, m)| m.to_string())
                .collect(),
            (Side::Real, RealHost::Ngx(ngx)) => ngx
                .log()
                .lines()
                .filter_map(|l| l.split_once("[proxy-wasm][\"")?.1.split_once("] "))
                .map(|(_, m)| ngx_message(m))
                .collect(),
            (Side::Sim, _) => {
                let text = self
                    .client
                    .get(&format!("http://{}/logs", self.sim.admin()), &[])?
                    .body;
                text.lines()
                    .filter_map(|l| l.split_once("] ")?.1.split_once(": "))
                    .filter(|(plugin, _)| *plugin != "host-sim")
                    .map(|(_, m)| m.to_string())
                    .collect()
            }
        };
        Ok(raw
            .into_iter()
            .map(|m| {
                // ngx_wasm_module's `:authority` is the server's name and port.
                let m = m
                    .replace(&gateway, "<gateway>")
                    .replace(&format!(":{port}"), ":<port>");
                normalize_log(&m)
            })
            .collect())
    }

    /// Waits until both sides logged `count` lines matching `pred` (Envoy
    /// writes its log every 200 ms), then returns both logs.
    pub fn logs_settled(
        &self,
        pred: impl Fn(&str) -> bool,
        count: usize,
    ) -> Result<(Vec<String>, Vec<String>)> {
        crate::wait::until(
            &format!("{count} matching log lines in both hosts"),
            Duration::from_secs(5),
            || {
                let real = self.logs(Side::Real)?;
                let sim = self.logs(Side::Sim)?;
                let n = |l: &[String]| l.iter().filter(|m| pred(m)).count();
                Ok((n(&real) >= count && n(&sim) >= count).then_some((real, sim)))
            },
        )
    }

    /// The real host's raw log tail (for failure messages).
    pub fn real_log_tail(&self, lines: usize) -> String {
        match &self.real {
            RealHost::Envoy(envoy) => envoy.log_tail(lines),
            RealHost::Ngx(ngx) => ngx.log_tail(lines),
        }
    }
}

/// `host-sim serve` under the Envoy profile.
fn serve(chain: ChainFile, upstream: SocketAddr) -> Result<Server> {
    Server::start(ServeOptions {
        chain,
        upstream,
        listen: "127.0.0.1:0".parse()?,
        admin: "127.0.0.1:0".parse()?,
        profile: Profile::Envoy,
        echo_logs: std::env::var_os("ZEROLAYER_ECHO_LOGS").is_some(),
        kong_queues: Vec::new(),
        kong_body_buffer_bytes: None,
        records: None,
    })
    .context("starting host-sim serve")
}

/// A raw HTTP/1.x exchange with `addr` (for requests a client library will
/// not send: no `Host`, HTTP/1.0): the status, the headers (names
/// lower-case) and the body, read until the peer closes.
pub fn raw_request(addr: SocketAddr, request: &str) -> Result<RawReply> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(request.as_bytes())?;
    let mut bytes = Vec::new();
    stream
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading the answer to {request:?}"))?;
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status line in {text:?}"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(RawReply {
        status,
        headers,
        body: body.to_string(),
    })
}

/// What [`raw_request`] got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawReply {
    /// Status.
    pub status: u16,
    /// Headers, names lower-case.
    pub headers: BTreeMap<String, String>,
    /// Body.
    pub body: String,
}

/// An ngx_wasm_module log message without nginx's context (`, client: …`,
/// ` while logging request`).
fn ngx_message(message: &str) -> String {
    let message = message.split(", client: ").next().unwrap_or(message);
    match message.rsplit_once(" while ") {
        Some((text, context)) if context.chars().all(|c| c.is_ascii_lowercase() || c == ' ') => {
            text.to_string()
        }
        _ => message.to_string(),
    }
}

/// Header values that differ between any two runs.
const VOLATILE: [&str; 5] = [
    "date",
    "x-request-id",
    "x-envoy-upstream-service-time",
    "server",
    "x-test-case",
];

/// Context ids made `#`; a logged header (`#N -> name: value`,
/// `#N <- …`, `callout answer header name: value`) with its name
/// lower-case and a volatile value masked.
fn normalize_log(message: &str) -> String {
    let mut out = String::new();
    let mut chars = message.chars().peekable();
    while let Some(c) = chars.next() {
        out.push(c);
        if c == '#' {
            while chars.peek().is_some_and(char::is_ascii_digit) {
                chars.next();
            }
        }
    }
    for prefix in ["# -> ", "# <- ", "callout answer header "] {
        if let Some(rest) = out.strip_prefix(prefix) {
            let (name, value) = match rest.strip_prefix(':') {
                // A pseudo-header: `:status: 200`.
                Some(pseudo) => match pseudo.split_once(": ") {
                    Some((n, v)) => (format!(":{n}"), v.to_string()),
                    None => return out,
                },
                None => match rest.split_once(": ") {
                    Some((n, v)) => (n.to_ascii_lowercase(), v.to_string()),
                    None => return out,
                },
            };
            let value = if VOLATILE.contains(&name.as_str()) {
                "…".to_string()
            } else {
                value
            };
            return format!("{prefix}{name}: {value}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_are_normalized() {
        assert_eq!(normalize_log("#12 -> User-Agent: x"), "# -> user-agent: x");
        assert_eq!(normalize_log("#3 <- :status: 200"), "# <- :status: 200");
        assert_eq!(normalize_log("#3 <- Date: Sat"), "# <- date: …");
        assert_eq!(
            normalize_log("callout answer header x-envoy-upstream-service-time: 3"),
            "callout answer header x-envoy-upstream-service-time: …"
        );
        assert_eq!(normalize_log("#4 completed."), "# completed.");
        assert_eq!(
            ngx_message("#1 completed. while logging request, client: 127.0.0.1, server: "),
            "#1 completed."
        );
        assert_eq!(
            ngx_message("#1 -> :path: /foo, client: 127.0.0.1"),
            "#1 -> :path: /foo"
        );
    }
}
