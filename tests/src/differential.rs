//! The differential harness: one Envoy config, run by real Envoy and by
//! `host-sim serve` side by side in front of the same echo upstream; the
//! same requests go to both, and what the client and the upstream saw is
//! reduced to the parts both hosts must agree on.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use host_sim::Profile;
use host_sim_tools::config_file::ChainFile;
use host_sim_tools::serve::{ServeOptions, Server};

use crate::{Client, EchoUpstream, Envoy, EnvoyConfig, SeenRequest};

/// One request to send through both hosts.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Unique name (also sent as `x-test-case`).
    pub name: String,
    /// Method.
    pub method: String,
    /// Path with query.
    pub path: String,
    /// Extra request headers.
    pub headers: Vec<(String, String)>,
    /// Request body.
    pub body: String,
}

impl Scenario {
    /// A `GET path` scenario.
    pub fn get(name: &str, path: &str) -> Self {
        Scenario {
            name: name.into(),
            method: "GET".into(),
            path: path.into(),
            headers: vec![],
            body: String::new(),
        }
    }

    /// A `POST path` scenario with a body.
    pub fn post(name: &str, path: &str, body: &str) -> Self {
        Scenario {
            method: "POST".into(),
            body: body.into(),
            ..Scenario::get(name, path)
        }
    }

    /// Adds a request header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The request's headers, with `x-test-case: case` (how the upstream's
    /// view of it is found again).
    pub fn headers_for<'a>(&'a self, case: &'a str) -> Vec<(&'a str, &'a str)> {
        self.headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .chain([("x-test-case", case)])
            .collect()
    }
}

/// What one host did with a scenario, reduced to comparable parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// Status the client got.
    pub status: u16,
    /// Client-visible headers that both hosts must agree on.
    pub client_headers: BTreeMap<String, String>,
    /// Client-visible body.
    pub client_body: String,
    /// What the upstream received, if the request got there.
    pub upstream: Option<UpstreamView>,
}

/// The comparable part of what the upstream received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamView {
    /// Method.
    pub method: String,
    /// Path.
    pub path: String,
    /// Selected headers.
    pub headers: BTreeMap<String, String>,
    /// Body.
    pub body: String,
}

/// Headers whose presence and value both hosts must agree on: everything
/// the filters under test set or are meant to strip, and `content-type`.
/// (Envoy adds `date`, `server`, `x-envoy-*`; framing headers may differ.)
pub fn compared_header(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    name.starts_with("x-probe-")
        || name.starts_with("x-zerolayer-")
        || name.starts_with("x-test-")
        || name == "content-type"
}

fn select<'a>(headers: impl Iterator<Item = (&'a str, &'a str)>) -> BTreeMap<String, String> {
    headers
        .filter(|(n, _)| compared_header(n) && !n.eq_ignore_ascii_case("x-test-case"))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.to_string()))
        .collect()
}

/// Envoy and host-sim running one config.
pub struct Pair {
    /// The shared upstream.
    pub upstream: EchoUpstream,
    /// Real Envoy.
    pub envoy: Envoy,
    /// host-sim serve.
    pub sim: Server,
    client: Client,
    _dir: tempfile::TempDir,
}

impl Pair {
    /// Starts both hosts from `config` (as shipped; ports and clusters are
    /// rewritten to loopback and the shared echo upstream).
    pub fn start(config: EnvoyConfig) -> Result<Pair> {
        Self::start_in_front_of(config, None)
    }

    /// Like [`Pair::start`], with the route's cluster pointed at `backend`
    /// (a stub or a model server) instead of the echo upstream.
    pub fn start_in_front_of(config: EnvoyConfig, backend: Option<SocketAddr>) -> Result<Pair> {
        let upstream = EchoUpstream::start()?;
        let target = backend.unwrap_or(upstream.addr());
        let config = config.for_run(target)?;
        let envoy = Envoy::start(&config)?;
        let dir = tempfile::tempdir()?;
        let path = config.write(dir.path())?;
        let chain = ChainFile::load(&path, &crate::paths::root())?;
        let sim = Server::start(ServeOptions {
            chain,
            upstream: target,
            listen: "127.0.0.1:0".parse()?,
            admin: "127.0.0.1:0".parse()?,
            profile: Profile::Envoy,
            echo_logs: false,
            kong_queues: Vec::new(),
            kong_body_buffer_bytes: None,
            records: None,
        })
        .context("starting host-sim serve")?;
        Ok(Pair {
            upstream,
            envoy,
            sim,
            client: Client::new(),
            _dir: dir,
        })
    }

    fn observe(&self, base: &str, tag: &str, scenario: &Scenario) -> Result<Observed> {
        let case = format!("{}@{tag}", scenario.name);
        let headers = scenario.headers_for(&case);
        let url = format!("{base}{}", scenario.path);
        let reply = self
            .client
            .send(&scenario.method, &url, &headers, &scenario.body)
            .with_context(|| format!("{} via {tag}", scenario.name))?;
        let seen: Option<SeenRequest> = self.upstream.find("x-test-case", &case);
        Ok(Observed {
            status: reply.status,
            client_headers: select(reply.headers.iter().map(|(n, v)| (n.as_str(), v.as_str()))),
            client_body: reply.body,
            upstream: seen.map(|s| UpstreamView {
                method: s.method,
                path: s.path,
                headers: select(s.headers.iter().map(|(n, v)| (n.as_str(), v.as_str()))),
                body: s.body,
            }),
        })
    }

    /// Base URLs of (Envoy, host-sim).
    pub fn bases(&self) -> (String, String) {
        (
            format!("http://{}", self.envoy.listener()),
            format!("http://{}", self.sim.addr()),
        )
    }

    /// Sends `scenario` through Envoy, then through host-sim.
    pub fn run(&self, scenario: &Scenario) -> Result<(Observed, Observed)> {
        let envoy = self.observe(
            &format!("http://{}", self.envoy.listener()),
            "envoy",
            scenario,
        )?;
        let sim = self.observe(&format!("http://{}", self.sim.addr()), "sim", scenario)?;
        Ok((envoy, sim))
    }

    /// Prometheus samples whose name starts with one of `prefixes`, from
    /// both hosts: (Envoy, host-sim).
    pub fn metrics(
        &self,
        prefixes: &[&str],
    ) -> Result<(BTreeMap<String, f64>, BTreeMap<String, f64>)> {
        let envoy = parse_prometheus(&self.envoy.prometheus()?, prefixes);
        let text = self
            .client
            .get(
                &format!("http://{}/stats/prometheus", self.sim.admin()),
                &[],
            )?
            .body;
        Ok((envoy, parse_prometheus(&text, prefixes)))
    }

    /// Polls both hosts until `series` has the same value on both and at
    /// least `min` (counters are flushed on ticks); returns the value.
    pub fn wait_metric_agree(&self, series: &str, min: f64) -> Result<f64> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (e, s) = self.metrics(&[series.split('{').next().unwrap_or(series)])?;
            let (ev, sv) = (e.get(series).copied(), s.get(series).copied());
            if let (Some(ev), Some(sv)) = (ev, sv)
                && ev == sv
                && ev >= min
            {
                return Ok(ev);
            }
            if Instant::now() > deadline {
                return Err(anyhow!(
                    "{series}: Envoy {ev:?}, host-sim {sv:?} (wanted equal and ≥ {min})"
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// `name{labels} value` lines; `name{}` is normalized to `name`.
pub fn parse_prometheus(text: &str, prefixes: &[&str]) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            let name = name.strip_suffix("{}").unwrap_or(name);
            prefixes
                .iter()
                .any(|p| name.starts_with(p))
                .then(|| Some((name.to_string(), value.parse().ok()?)))
                .flatten()
        })
        .collect()
}
