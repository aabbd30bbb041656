//! The whole zerolayer chain in Kong's real Proxy-Wasm host: `kong/kong.yml`
//! (or `kong/kong-fused.yml`) and `kong/kong.conf` run by ngx_wasm_module
//! ([`crate::ngx`]), with every service the filters call on loopback: the
//! GPU backend stub, the identity provider, the API key introspection
//! endpoint, the audit sink, ClickHouse and, optionally, quota's store
//! (Redis + webdis) and the post-cache fleet tier (another Redis + webdis).
//! The callout targets `kong.yml` ships (`127.0.0.1:18091`, …) are pointed
//! at those services; nothing else of the shipped files is changed but
//! what a test needs to be quick (flush intervals, the sample rate).
//!
//! ngx_wasm_module has no metrics endpoint: tests read what the filters did
//! from what the client, the backend and the sinks saw, and the error log.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use zerolayer_stub::{Stub, StubConfig};

use crate::chain::{AuthServices, CACHE_SECRET, anthropic, introspect};
use crate::clickhouse::ClickHouse;
use crate::client::Partial;
use crate::fleet::RedisFleet;
use crate::ngx::{KongConfig, NgxWasm};
use crate::{Client, Reply};

/// How long any one request through Kong may take before the test fails
/// naming it (the stub answers in milliseconds; a hang is a bug).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(10);

/// Which Proxy-Wasm host runs the Kong chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KongHost {
    /// The real one: nginx with ngx_wasm_module.
    NgxWasm,
    /// host-sim's `kong` profile (`host-sim serve`), which must agree with it.
    HostSim,
}

/// The gateway a [`KongChain`] sends requests to.
pub enum KongGateway {
    /// Real ngx_wasm_module.
    NgxWasm(NgxWasm),
    /// host-sim serving the same chain under its `kong` profile.
    HostSim(host_sim_tools::serve::Server),
}

impl KongGateway {
    /// URL of `path` on the listener.
    pub fn url(&self, path: &str) -> String {
        match self {
            KongGateway::NgxWasm(ngx) => ngx.url(path),
            KongGateway::HostSim(server) => format!("http://{}{path}", server.addr()),
        }
    }

    /// The tail of the host's log (ngx_wasm_module's error log; host-sim
    /// echoes module logs to stderr instead).
    pub fn log_tail(&self, lines: usize) -> String {
        match self {
            KongGateway::NgxWasm(ngx) => ngx.log_tail(lines),
            KongGateway::HostSim(_) => "(host-sim: module logs on the test's stderr)".into(),
        }
    }
}

/// How to start the chain in ngx_wasm_module.
#[derive(Debug, Clone)]
pub struct KongChainOptions {
    /// The host that runs it.
    pub host: KongHost,
    /// The backend stub's defaults.
    pub stub: StubConfig,
    /// `kong-fused.yml` (one filter) instead of `kong.yml` (four).
    pub fused: bool,
    /// Metering's sample rate, percent.
    pub sample_percent: f64,
    /// Whether the fleet tier (Redis + webdis) is on.
    pub fleet: bool,
    /// Whether quota runs, with its store: `kong-fused.yml`'s `quota`
    /// section and `kong.yml`'s `zerolayer_quota` kept (left out
    /// otherwise: the other scenarios run without a store).
    pub quota: bool,
    /// nginx worker processes.
    pub workers: usize,
    /// The separate chain's filters to keep (all when `None`).
    pub only: Option<&'static [&'static str]>,
    /// Changes a test makes to the stage configurations (by section:
    /// `activation`, `lazy_auth`, `quota`, `post_cache`, `metering`) after
    /// the harness's own.
    pub configure: Option<fn(&mut Value)>,
    /// Wasmtime's compilation cache directory in ngx_wasm_module (`None`:
    /// the one every run shares).
    pub wasmtime_cache: Option<std::path::PathBuf>,
}

impl Default for KongChainOptions {
    fn default() -> Self {
        KongChainOptions {
            host: KongHost::NgxWasm,
            stub: StubConfig::default(),
            fused: false,
            sample_percent: 100.0,
            fleet: false,
            quota: false,
            workers: 1,
            only: None,
            configure: None,
            wasmtime_cache: None,
        }
    }
}

/// The running chain and everything it talks to.
pub struct KongChain {
    /// The host running the chain.
    pub gateway: KongGateway,
    /// The GPU backend stub.
    pub stub: Stub,
    /// The JWKS endpoint, the introspection endpoint, the audit sink.
    pub services: AuthServices,
    /// The usage sink.
    pub clickhouse: ClickHouse,
    /// The fleet cache tier, when on.
    pub fleet: Option<RedisFleet>,
    /// quota's store (Redis + webdis allowing its scripts), when quota is
    /// in the chain; its keys start with [`QUOTA_PREFIX`].
    pub quota_store: Option<RedisFleet>,
    client: Client,
    /// Which file the chain came from and which host runs it (named in failures).
    pub form: String,
}

/// The stage sections of the chain's configuration, by stage.
const STAGES: [(&str, &str); 5] = [
    ("lazy_auth", "zerolayer_lazy_auth"),
    ("activation", "zerolayer_activation"),
    ("quota", "zerolayer_quota"),
    ("post_cache", "zerolayer_post_cache"),
    ("metering", "zerolayer_metering"),
];

/// The key prefix of quota's store in the tests.
pub const QUOTA_PREFIX: &str = "zl:kong:";

impl KongChain {
    /// Starts every service, then ngx_wasm_module; returns once the
    /// observer holds the issuer's keys, so JWTs verify from the first request.
    pub fn start(options: KongChainOptions) -> Result<KongChain> {
        let stub = Stub::start(options.stub.clone()).context("starting the backend stub")?;
        let services = AuthServices::start(introspect)?;
        let clickhouse = ClickHouse::start()?;
        clickhouse.create_tables()?;
        let fleet = options.fleet.then(RedisFleet::start).transpose()?;
        let quota_store = options
            .quota
            .then(RedisFleet::start_for_quota)
            .transpose()
            .context("starting quota's Redis and webdis")?;
        let form = if options.fused {
            "kong/kong-fused.yml"
        } else {
            "kong/kong.yml"
        };
        let file = form.trim_start_matches("kong/");
        let mut config = KongConfig::shipped(file)?
            .retarget("127.0.0.1:18091", services.idp.addr())
            .retarget("127.0.0.1:18092", services.api_keys.addr())
            .retarget("127.0.0.1:18093", services.audit.addr())
            .retarget("127.0.0.1:8123", clickhouse.addr())
            .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET);
        config.workers = options.workers;
        config.wasmtime_cache = options.wasmtime_cache.clone();
        let mut sections = Self::sections(&config, options.fused)?;
        if !options.quota
            && let Some(sections) = sections.as_object_mut()
        {
            sections.remove("quota");
        }
        if !options.quota {
            config.filters.retain(|f| f.name != "zerolayer_quota");
        }
        // As the Envoy chain (tests/src/chain.rs): the test issuer, quick flushes.
        sections["lazy_auth"]["jwt"]["issuers"] = json!(["https://idp.test"]);
        sections["lazy_auth"]["audit"]["flush_ms"] = json!(200);
        sections["lazy_auth"]["attribution"]["flush_ms"] = json!(200);
        if let Some(fleet) = &fleet {
            sections["post_cache"]["fleet"] = json!({
                "cluster": fleet.webdis().to_string(),
                "authority": "webdis",
                "path": "/",
                "timeout_ms": 500,
            });
        }
        if let Some(store) = &quota_store {
            // As tests/tests/quota_envoy.rs: quick syncs, and idle leases
            // given back soon, so Redis comes to hold exactly what was spent.
            let store_config = &mut sections["quota"]["store"];
            store_config["cluster"] = json!(store.webdis().to_string());
            store_config["key_prefix"] = json!(QUOTA_PREFIX);
            store_config["sync_interval_ms"] = json!(100);
            store_config["lease_ttl_ms"] = json!(200);
            store_config["idle_return_ms"] = json!(300);
            store_config["expected_gateways"] = json!(options.workers);
        }
        let metering = &mut sections["metering"];
        metering["sampling"] = json!({"percent": options.sample_percent});
        metering["sink"]["flush_ms"] = json!(200);
        metering["sink"]["backoff_ms"] = json!(100);
        metering["sink"]["max_backoff_ms"] = json!(1000);
        metering["sink"]["breaker"] = json!({"failures": 5, "open_secs": 1});
        if let Some(configure) = options.configure {
            configure(&mut sections);
        }
        if options.fused {
            config.set_filter_config("zerolayer_fused", &sections.to_string())?;
        } else {
            for (section, filter) in STAGES {
                if section == "quota" && !options.quota {
                    continue;
                }
                config.set_filter_config(filter, &sections[section].to_string())?;
            }
        }
        if let Some(only) = options.only {
            config.filters.retain(|f| only.contains(&f.name.as_str()));
        }
        let gateway = match options.host {
            KongHost::NgxWasm => KongGateway::NgxWasm(NgxWasm::start(&config, stub.addr())?),
            KongHost::HostSim => {
                let mut targets = vec![services.idp.addr(), services.api_keys.addr()];
                targets.extend([services.audit.addr(), clickhouse.addr()]);
                targets.extend(fleet.as_ref().map(RedisFleet::webdis));
                targets.extend(quota_store.as_ref().map(RedisFleet::webdis));
                KongGateway::HostSim(host_sim_server(&config, stub.addr(), &targets)?)
            }
        };
        let chain = KongChain {
            gateway,
            stub,
            services,
            clickhouse,
            fleet,
            quota_store,
            client: Client::with_timeout(REQUEST_DEADLINE),
            form: format!("{form} in {:?}", options.host),
        };
        match &chain.gateway {
            KongGateway::NgxWasm(ngx) => crate::wait::until(
                "the observer's first JWKS fetch in ngx_wasm_module",
                Duration::from_secs(20),
                || Ok(ngx.log().contains("observer: JWKS fetched").then_some(())),
            )
            .with_context(|| format!("error.log:\n{}", ngx.log_tail(30)))?,
            KongGateway::HostSim(_) => crate::wait::until(
                "the observer's first JWKS fetch in host-sim",
                Duration::from_secs(20),
                || Ok((!chain.services.idp.seen().is_empty()).then_some(())),
            )?,
        }
        Ok(chain)
    }

    /// The stage configurations as one object by section (the fused
    /// filter's own form; the separate filters' configs gathered into it).
    fn sections(config: &KongConfig, fused: bool) -> Result<Value> {
        if fused {
            return config.filter_json("zerolayer_fused");
        }
        let mut sections = json!({});
        for (section, filter) in STAGES {
            sections[section] = config.filter_json(filter)?;
        }
        Ok(sections)
    }

    /// POSTs `body` to `path` with JSON content type and `headers`; a
    /// request that gets no answer within [`REQUEST_DEADLINE`] fails,
    /// naming `what`, the chain's form and the error log.
    pub fn post(
        &self,
        what: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<Reply> {
        let mut all = headers.to_vec();
        all.push(("content-type", "application/json"));
        self.client
            .send("POST", &self.gateway.url(path), &all, body)
            .map_err(|err| {
                // Where it stopped: before the backend, or after it answered.
                let id = headers
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case("x-request-id"))
                    .map(|(_, v)| *v);
                let upstream = id.map_or("(no x-request-id)".to_string(), |id| {
                    format!(
                        "{} request(s) with it reached the backend",
                        crate::chain::backend_requests(&self.stub, id)
                    )
                });
                anyhow::anyhow!(
                    "{what}: POST {path} through {} got no answer within {REQUEST_DEADLINE:?} \
                     ({err:#}); {upstream}; log tail:\n{}",
                    self.form,
                    self.gateway.log_tail(40)
                )
            })
    }

    /// `POST path` with `body` sent chunked (no `content-length`).
    pub fn post_chunked(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<Reply> {
        let mut all = headers.to_vec();
        all.push(("content-type", "application/json"));
        self.client
            .post_chunked(&self.gateway.url(path), &all, body)
            .with_context(|| {
                format!(
                    "through {}; log tail:\n{}",
                    self.form,
                    self.gateway.log_tail(40)
                )
            })
    }

    /// [`KongChain::post`] for a response that may break off mid-body.
    pub fn post_partial(
        &self,
        what: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Result<Partial> {
        let mut all = headers.to_vec();
        all.push(("content-type", "application/json"));
        self.client
            .send_partial("POST", &self.gateway.url(path), &all, body)
            .with_context(|| {
                format!(
                    "{what} ({}): no answer; log tail:\n{}",
                    self.form,
                    self.gateway.log_tail(20)
                )
            })
    }

    /// Backend requests whose `x-request-id` starts with `prefix`.
    pub fn backend_requests(&self, prefix: &str) -> usize {
        crate::chain::backend_requests(&self.stub, prefix)
    }

    /// The requests the backend received with `x-request-id: id`, in order.
    pub fn upstream(&self, id: &str) -> Vec<zerolayer_stub::RecordedRequest> {
        self.stub
            .requests()
            .into_iter()
            .filter(|r| r.header("x-request-id") == Some(id))
            .collect()
    }

    /// A Bearer JWT for `subject` of `tenant` that the observer has
    /// verified: a first request admits it lazily, then requests with fresh
    /// prompts are sent until post-cache stops bypassing it for want of a
    /// verified tenant (ngx_wasm_module has no metrics endpoint to ask).
    pub fn verified_bearer(&self, subject: &str, tenant: &str) -> Result<String> {
        let bearer = crate::chain::Chain::bearer(subject, tenant);
        let mut n = 0;
        let mut last = None;
        crate::wait::until(
            &format!("{subject}'s token verified in ngx_wasm_module"),
            Duration::from_secs(10),
            || {
                n += 1;
                let id = format!("warm-up-{subject}-{n}");
                let reply = self.post(
                    &id,
                    "/v1/messages",
                    &[("authorization", &bearer), ("x-request-id", &id)],
                    &anthropic(&id, false),
                )?;
                ensure!(reply.status == 200, "{id}: {} {}", reply.status, reply.body);
                last = reply.header("x-cache").map(str::to_string);
                Ok((last.as_deref() == Some("MISS")).then_some(()))
            },
        )
        .with_context(|| {
            format!(
                "in {}: the last warm-up's x-cache was {last:?}; log tail:\n{}",
                self.form,
                self.gateway.log_tail(20)
            )
        })?;
        Ok(bearer)
    }
}

/// `host-sim serve` running `config`'s chain under the `kong` profile (plain
/// ngx_wasm_module, as [`NgxWasm`] runs), with the queues `kong.conf`
/// declares and each callout target (`IP:port`) a cluster of that name.
pub fn host_sim_server(
    config: &KongConfig,
    upstream: std::net::SocketAddr,
    targets: &[std::net::SocketAddr],
) -> Result<host_sim_tools::serve::Server> {
    let mut filters = Vec::new();
    for filter in &config.filters {
        let wasm = config.module_file(&filter.name)?;
        let mut spec = host_sim::PluginSpec::new(&filter.name, wasm)
            .configuration(filter.config.as_bytes().to_vec());
        for (key, value) in config.environment() {
            spec = spec.env(key, value);
        }
        filters.push(spec);
    }
    let chain = host_sim_tools::config_file::ChainFile {
        filters,
        singletons: Vec::new(),
        clusters: targets.iter().map(|a| (a.to_string(), *a)).collect(),
        ..Default::default()
    };
    host_sim_tools::serve::Server::start(host_sim_tools::serve::ServeOptions {
        chain,
        upstream,
        listen: "127.0.0.1:0".parse()?,
        admin: "127.0.0.1:0".parse()?,
        profile: host_sim::Profile::Kong,
        echo_logs: std::env::var_os("ZEROLAYER_ECHO_LOGS").is_some(),
        kong_queues: config.queues(),
        kong_body_buffer_bytes: config.client_body_buffer_bytes(),
        records: None,
    })
}
