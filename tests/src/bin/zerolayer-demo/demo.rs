//! `cargo xtask demo`: every landed filter at work inside real Envoy.
//!
//! With the filters built (xtask builds them, then runs this), starts Envoy
//! from the shipped `envoy/zerolayer.yaml` (lazy-auth, activation,
//! post-cache, and the observer as a singleton service; free loopback
//! ports; activation's debug response header on so its decision is
//! visible) in front of the GPU backend stub, or the real llama.cpp model
//! server with `--real-model`, or any `--upstream URL`. A local identity
//! provider (JWKS), API key introspection endpoint and audit sink stand in
//! for the real ones. Sends a handful of LLM requests and prints, per
//! request, what the filters decided, what reached the backend and what came
//! back; then what the observer did off the request path.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{Value, json};
use zerolayer_core::sampling::Rate;
use zerolayer_e2e::chain::AuthServices;
use zerolayer_e2e::clickhouse::ClickHouse;
use zerolayer_e2e::fleet::RedisFleet;
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{Client, Envoy, EnvoyConfig, ModelServer, wait};
pub(crate) use zerolayer_layout::DemoForm as Form;
use zerolayer_layout::{DemoHost, DemoOptions, step};
use zerolayer_stub::{Stub, StubConfig};

use crate::demo_quota::QuotaSeen;

/// The demo's cache secret (a deployment sets its own, ≥ 32 bytes).
pub(crate) const DEMO_CACHE_SECRET: &str = "zerolayer-demo-cache-secret-not-for-production";

/// The credential a demo request carries.
#[derive(Clone, Copy)]
pub(crate) enum Credential {
    None,
    /// A JWT for `(subject, tenant)` signed by the demo identity provider.
    Jwt(&'static str, &'static str),
    /// A JWT signed with a key the identity provider never published.
    ForgedJwt,
    ApiKey(&'static str),
}

impl Credential {
    /// Whether verification finds it valid (the demo's identity provider
    /// signs the JWTs; `introspect` knows one API key).
    pub(crate) fn valid(&self) -> bool {
        match self {
            Credential::Jwt(..) => true,
            Credential::ApiKey(key) => *key == "sk-demo-globex",
            Credential::None | Credential::ForgedJwt => false,
        }
    }
}

/// One demo request.
pub(crate) struct Case {
    pub(crate) what: &'static str,
    pub(crate) path: &'static str,
    pub(crate) credential: Credential,
    pub(crate) headers: &'static [(&'static str, &'static str)],
    pub(crate) stream: bool,
    /// Wait for the observer's verdict on this request's credential before
    /// the next request (verification is off the request path).
    pub(crate) then_wait: bool,
}

pub(crate) const CASES: &[Case] = &[
    Case {
        what: "no credential",
        path: "/v1/messages",
        credential: Credential::None,
        headers: &[],
        stream: false,
        then_wait: false,
    },
    Case {
        what: "alice@acme JWT, first sight",
        path: "/v1/messages",
        credential: Credential::Jwt("alice", "acme"),
        headers: &[("x-tenant-id", "acme")],
        stream: true,
        then_wait: true,
    },
    Case {
        what: "same JWT, verified off-path",
        path: "/v1/messages",
        credential: Credential::Jwt("alice", "acme"),
        headers: &[("x-tenant-id", "acme")],
        stream: false,
        then_wait: false,
    },
    Case {
        what: "API key, client says no-store",
        path: "/v1/chat/completions",
        credential: Credential::ApiKey("sk-demo-globex"),
        headers: &[("cache-control", "no-store")],
        stream: false,
        then_wait: true,
    },
    Case {
        what: "same API key again",
        path: "/v1/chat/completions",
        credential: Credential::ApiKey("sk-demo-globex"),
        headers: &[],
        stream: false,
        then_wait: false,
    },
    Case {
        what: "SDK client, id in 10% canary",
        path: "/v1/chat/completions",
        credential: Credential::Jwt("alice", "acme"),
        headers: &[("user-agent", "OpenAI/Python 3.57.0")],
        stream: true,
        then_wait: false,
    },
    Case {
        what: "SDK client, id outside it",
        path: "/v1/messages",
        credential: Credential::Jwt("alice", "acme"),
        headers: &[("user-agent", "Anthropic/Python 2.16.0")],
        stream: false,
        then_wait: false,
    },
    Case {
        what: "forged JWT, first sight",
        path: "/v1/messages",
        credential: Credential::ForgedJwt,
        headers: &[],
        stream: false,
        then_wait: true,
    },
    Case {
        what: "same forged JWT",
        path: "/v1/messages",
        credential: Credential::ForgedJwt,
        headers: &[],
        stream: false,
        then_wait: false,
    },
    Case {
        what: "unknown API key",
        path: "/v1/messages",
        credential: Credential::ApiKey("sk-demo-unknown"),
        headers: &[],
        stream: false,
        then_wait: true,
    },
    Case {
        what: "same unknown API key",
        path: "/v1/messages",
        credential: Credential::ApiKey("sk-demo-unknown"),
        headers: &[],
        stream: false,
        then_wait: false,
    },
    Case {
        what: "forged internal header",
        path: "/v1/messages",
        credential: Credential::Jwt("alice", "acme"),
        headers: &[("x-zerolayer-observers", "metering,cache,shadow")],
        stream: false,
        then_wait: false,
    },
];

/// The demo's introspection endpoint: `sk-demo-globex` is active.
pub(crate) fn introspect(request: &zerolayer_e2e::SeenRequest) -> (u16, String) {
    match request.header("x-api-key") {
        Some("sk-demo-globex") => (
            200,
            r#"{"active":true,"tenant":"globex","sub":"batch-service"}"#.to_string(),
        ),
        _ => (200, r#"{"active":false}"#.to_string()),
    }
}

/// What the demo talks to.
pub(crate) enum Backend {
    Stub(Stub),
    Model(ModelServer),
    External(SocketAddr, String),
}

impl Backend {
    pub(crate) fn addr(&self) -> SocketAddr {
        match self {
            Backend::Stub(s) => s.addr(),
            Backend::Model(m) => m.addr(),
            Backend::External(a, _) => *a,
        }
    }

    pub(crate) fn describe(&self) -> String {
        match self {
            Backend::Stub(s) => format!(
                "GPU backend stub on {} (150 ms to first token, 20 ms/token)",
                s.addr()
            ),
            Backend::Model(m) => format!("real llama.cpp server, SmolLM2-135M, on {}", m.addr()),
            Backend::External(_, url) => url.clone(),
        }
    }

    /// The `x-zerolayer-*` headers the backend received with request `id`.
    pub(crate) fn internal_headers_seen(&self, id: &str) -> String {
        let Backend::Stub(stub) = self else {
            return "(not recorded)".into();
        };
        match stub
            .requests()
            .into_iter()
            .find(|r| r.header("x-request-id") == Some(id))
        {
            Some(r) => {
                let names: Vec<String> = r
                    .headers
                    .iter()
                    .map(|(n, _)| n.clone())
                    .filter(|n| n.starts_with("x-zerolayer-"))
                    .collect();
                if names.is_empty() {
                    "none".into()
                } else {
                    names.join(",")
                }
            }
            None => "(not reached)".into(),
        }
    }
}

/// Runs the demo (the filters, and for `--native` the native module,
/// already built).
pub fn run(args: &[String]) -> Result<()> {
    let DemoOptions {
        upstream_url,
        real_model,
        keep_running,
        form,
        host,
    } = DemoOptions::parse(args)?;

    let backend = match (&upstream_url, real_model) {
        (Some(url), _) => Backend::External(resolve(url)?, url.clone()),
        (None, true) => {
            step("starting the real model server (llama.cpp, SmolLM2-135M)");
            Backend::Model(ModelServer::start()?)
        }
        (None, false) => Backend::Stub(Stub::start(
            StubConfig::default()
                .ttft(Duration::from_millis(150))
                .itl(Duration::from_millis(20)),
        )?),
    };
    let (seen, quota) = match host {
        DemoHost::Envoy => session(&backend, keep_running, form)?,
        DemoHost::NgxWasm => crate::demo_kong::session(&backend, keep_running, form)?,
    };
    let admitted = seen.iter().filter(|s| s.status == 200).count();
    let verified = seen
        .iter()
        .filter(|s| s.identity.starts_with("verified"))
        .count();
    let leaked = seen
        .iter()
        .filter(|s| s.internal.starts_with("x-zerolayer-"))
        .count();
    let leaks = match backend {
        Backend::Stub(_) => format!("; {leaked} carried internal headers to the backend"),
        _ => String::new(),
    };
    let hits = seen.iter().filter(|s| s.cache == "HIT").count();
    let metered = seen.iter().filter(|s| s.tokens != "-").count();
    let shipped = seen.iter().filter(|s| s.shipped).count();
    println!();
    println!(
        "{} requests: {admitted} admitted ({verified} on a cached verified verdict, {hits} answered from the cache), {} refused{leaks}; {metered} metered, {shipped} full records shipped.",
        seen.len(),
        seen.len() - admitted
    );
    if let Some(q) = quota {
        println!(
            "Quota: {} of {} requests admitted within the {}-token budget (the stream {}), then {} ({}); Redis settled {} tokens.",
            q.remaining.len(),
            q.statuses.len(),
            crate::demo_quota::DAILY_TOKENS,
            match &q.stream {
                Some((finish, _)) if finish == "length" => "cut cleanly as its lease ran out",
                Some(_) => "not cut",
                None => "not sent",
            },
            q.statuses.last().copied().unwrap_or_default(),
            q.refusal
                .as_ref()
                .map(|(c, _)| c.as_str())
                .unwrap_or("never refused"),
            q.counter
        );
    }
    Ok(())
}

/// What one demo request came back with, as printed.
#[derive(Debug)]
pub(crate) struct Seen {
    pub(crate) status: u16,
    pub(crate) identity: String,
    pub(crate) cache: String,
    pub(crate) internal: String,
    /// metering's `input→output` tokens from the access log (`-`: not
    /// metered, e.g. refused or answered from the cache).
    pub(crate) tokens: String,
    /// Whether the request's full record landed in ClickHouse.
    pub(crate) shipped: bool,
}

/// The demo's metering sample rate, percent (a deployment uses ~1%).
const DEMO_SAMPLE_PERCENT: f64 = 50.0;

/// Starts the services and Envoy in front of `backend`, sends the cases and
/// prints what happened.
fn session(
    backend: &Backend,
    keep_running: bool,
    form: Form,
) -> Result<(Vec<Seen>, Option<QuotaSeen>)> {
    // The identity provider, introspection endpoint and audit sink the
    // observer calls, on loopback.
    let services = AuthServices::start(introspect)?;
    step("starting ClickHouse (metering's usage sink)");
    let clickhouse = ClickHouse::start()?;
    clickhouse.create_tables()?;
    step("starting Redis and webdis (quota's fleet-wide counters)");
    let fleet = RedisFleet::start_for_quota()?;
    let file = form.file();
    step(&format!(
        "starting Envoy with envoy/{file} (lazy-auth, activation, post-cache, metering{}, observer{})",
        match form {
            Form::Separate => "",
            Form::Fused => " as one filter",
            Form::Native => " as one native filter",
        },
        if form == Form::Native {
            " on the module's own thread"
        } else {
            ""
        }
    ));
    // The stages' configurations as the separate filters ship them (the
    // fused file embeds the same).
    let separate = EnvoyConfig::shipped("zerolayer.yaml")?;
    let mut config = services
        .point(EnvoyConfig::shipped(file)?.for_run(backend.addr())?)?
        // The cache key's secret comes from Envoy's environment; a
        // deployment sets its own.
        .env("ZEROLAYER_CACHE_SECRET", DEMO_CACHE_SECRET)
        .point_cluster("clickhouse", clickhouse.addr())?
        .add_cluster("webdis", fleet.webdis())?;
    let quota = crate::demo_quota::section(&zerolayer_layout::root())?;
    let mut rules = separate.wasm_filter_json("zerolayer.activation")?;
    rules["debug_response_header"] = Value::Bool(true);
    // The demo identity provider's issuer; audit batches flushed quickly.
    let mut lazy = separate.wasm_filter_json("zerolayer.lazy_auth")?;
    lazy["jwt"]["issuers"] = json!(["https://idp.test"]);
    lazy["audit"]["flush_ms"] = json!(200);
    let post = separate.wasm_filter_json("zerolayer.post_cache")?;
    // Half the requests sampled, so the demo shows both sides; records
    // shipped quickly.
    let mut metering = separate.wasm_filter_json("zerolayer.metering")?;
    metering["sampling"] = json!({"percent": DEMO_SAMPLE_PERCENT});
    metering["sink"]["flush_ms"] = json!(200);
    match form {
        Form::Separate => {
            config.set_wasm_filter_config("zerolayer.activation", &rules.to_string())?;
            config.set_wasm_filter_config("zerolayer.lazy_auth", &lazy.to_string())?;
            config.set_wasm_filter_config("zerolayer.post_cache", &post.to_string())?;
            config.set_wasm_filter_config("zerolayer.metering", &metering.to_string())?;
            // quota follows lazy-auth, whose verified identity it reads (and,
            // in vm_id "zerolayer", its verdicts).
            config.insert_wasm_filter_after(
                "zerolayer.lazy_auth",
                "zerolayer.quota",
                "quota",
                "zerolayer",
                &quota.to_string(),
            )?;
        }
        Form::Fused => {
            let sections = json!({"activation": rules, "lazy_auth": lazy, "quota": quota, "post_cache": post, "metering": metering});
            config.set_wasm_filter_config("zerolayer", &sections.to_string())?;
        }
        Form::Native => {
            // The observer's thread reaches its services directly.
            let upstreams = json!({
                "idp": services.idp.addr().to_string(),
                "api_keys": services.api_keys.addr().to_string(),
                "audit": services.audit.addr().to_string(),
                "clickhouse": clickhouse.addr().to_string(),
                "webdis": fleet.webdis().to_string(),
            });
            let sections = json!({"activation": rules, "lazy_auth": lazy, "quota": quota, "post_cache": post, "metering": metering, "native": {"upstreams": upstreams}});
            config.set_native_filter_config("zerolayer", &sections.to_string())?;
        }
    }
    if form != Form::Native {
        config.set_service_config(
            "zerolayer.observer",
            &json!({"lazy_auth": lazy, "metering": metering, "tick_ms": 100}).to_string(),
        )?;
    }
    let envoy = Envoy::start(&config)?;
    // The binary the harness just started (its `$ZEROLAYER_ENVOY` or `.venv`).
    let version = std::process::Command::new(zerolayer_e2e::paths::envoy_binary()?)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();

    println!();
    let runtime = if form == Form::Native {
        "native, an Envoy dynamic module"
    } else {
        "Wasm, V8"
    };
    println!(
        "zerolayer demo: lazy-auth, activation, post-cache and metering ({runtime}) inside real Envoy,"
    );
    println!(
        "with the observer verifying credentials and shipping audit and usage records off the request path{}",
        if form == Form::Native {
            " (on the module's own thread)"
        } else {
            ""
        }
    );
    let version = version
        .split("version: ")
        .nth(1)
        .and_then(|v| v.split('/').nth(1))
        .unwrap_or("?");
    println!(
        "  envoy     {version} ({})",
        if form == Form::Native {
            "dynamic module ABI v0.2.0"
        } else {
            "V8"
        }
    );
    println!("  listener  {}", envoy.url("/"));
    println!("  backend   {}", backend.describe());
    println!(
        "  config    envoy/{}; filters/{{activation,lazy-auth,post-cache,metering}}/example.json",
        form.file()
    );
    println!(
        "  services  JWKS {}, API key introspection {}, audit sink {} (loopback stand-ins)",
        services.idp.addr(),
        services.api_keys.addr(),
        services.audit.addr()
    );
    println!(
        "  usage     ClickHouse {} (real server, {DEMO_SAMPLE_PERCENT}% sample)",
        clickhouse.url()
    );
    println!();

    let client = Client::new();
    let now = tokens::now();
    let mut sent = Vec::new();
    let mut verifications = 0.0;
    for (i, case) in CASES.iter().enumerate() {
        let id = request_id(i + 1, case.what);
        let credential = credential_header(case, now);
        let mut headers: Vec<(&str, &str)> = case.headers.to_vec();
        if let Some((name, value)) = &credential {
            headers.push((name, value));
        }
        headers.push(("x-request-id", &id));
        headers.push(("content-type", "application/json"));
        let reply = client.send("POST", &envoy.url(case.path), &headers, &request_body(case))?;
        sent.push((id, reply));
        if case.then_wait {
            verifications += 1.0;
            wait_for_verdicts(&envoy, verifications)?;
        }
    }

    // The access log and the counters reach us from Envoy's 1 s flush and
    // the filters' ticks, off the request path.
    wait::until(
        "every request in the access log",
        Duration::from_secs(10),
        || Ok((envoy.access_log().lines().count() >= sent.len()).then_some(())),
    )?;
    // Activation decides every request lazy-auth let through (it follows
    // lazy-auth; a refusal never reaches it): those carry its debug header.
    let decided = sent
        .iter()
        .filter(|(_, reply)| reply.header("x-zerolayer-debug").is_some())
        .count();
    envoy.wait_metric("zerolayer_activation_requests", decided as f64)?;
    let log = envoy.access_log();
    let auth_by_id = access_log_field(&log, "auth");
    let usage_by_id = access_log_field(&log, "usage");
    let truth = host_sim_tools::reconcile::read_access_log(log.as_bytes())?;
    // The sample is xxh3(x-request-id) mod 10000 < rate: known in advance.
    let rate = Rate::from_percent(DEMO_SAMPLE_PERCENT).context("demo sample rate")?;
    let sampled = truth
        .rows
        .iter()
        .filter(|r| rate.includes(r.request_id.as_bytes()))
        .count();
    let shipped = clickhouse.wait_rows(sampled, Duration::from_secs(10))?;
    let row = print_row;
    print_header();
    let mut seen = Vec::new();
    for (i, (case, (id, reply))) in CASES.iter().zip(&sent).enumerate() {
        let debug = reply.header("x-zerolayer-debug").unwrap_or("");
        let (observers, matched) = debug
            .strip_prefix("observers=")
            .and_then(|d| d.split_once("; rules="))
            .unwrap_or(("-", "-"));
        let auth = auth_by_id
            .get(id.as_str())
            .map(String::as_str)
            .unwrap_or("-");
        let tokens = usage_by_id
            .get(id.as_str())
            .map(|u| tokens_of(u))
            .unwrap_or_else(|| "-".into());
        let in_sink = shipped.iter().any(|r| r["request_id"] == id.as_str());
        let tokens_shown = if in_sink {
            format!("{tokens}*")
        } else {
            tokens.clone()
        };
        row(
            &(i + 1).to_string(),
            case.what,
            &reply.status.to_string(),
            or_dash(auth),
            or_dash(observers),
            reply.header("x-cache").unwrap_or("-"),
            &tokens_shown,
            &backend.internal_headers_seen(id),
        );
        let outcome = if reply.status == 200 {
            summarize(case, &reply.body)
        } else {
            error_message(&reply.body)
        };
        println!("   rules: {:<40} {outcome}", or_dash(matched));
        seen.push(Seen {
            status: reply.status,
            identity: auth.to_string(),
            cache: reply.header("x-cache").unwrap_or("-").to_string(),
            internal: backend.internal_headers_seen(id),
            tokens,
            shipped: in_sink,
        });
    }
    println!();
    println!(
        "   identity  = lazy-auth's decision (`unverified`: admitted on first sight and verified by the"
    );
    println!(
        "               observer in the background; the next request gets the cached verdict)"
    );
    print_activation_legend();
    print_cache_legend();
    println!(
        "   tokens    = metering's input→output tokens, from the access log (every request); * = in the"
    );
    println!(
        "               hash sample, full record shipped to ClickHouse (-: refused or served from the cache)"
    );
    println!(
        "   internal  = x-zerolayer-* headers the backend received (none: decisions never leave the gateway;\n               not reached: refused, or answered from the cache)"
    );

    // The requests above with a valid credential are billed to their
    // tenants' budgets too: verified ones, and those admitted before
    // verification (charged to the tenant once verified).
    let prior: u64 = CASES
        .iter()
        .zip(&seen)
        .filter(|(case, s)| {
            s.identity.starts_with("verified")
                || (s.identity.starts_with("unverified") && case.credential.valid())
        })
        .filter_map(|(_, s)| s.tokens.split_once('→'))
        .filter_map(|(i, o)| Some(i.parse::<u64>().ok()? + o.parse::<u64>().ok()?))
        .sum();
    let verified = || wait_for_verdicts(&envoy, verifications + 1.0);
    let quota_seen = Some(crate::demo_quota::act(
        "filters/quota/example.json",
        &envoy.url("/v1/chat/completions"),
        &fleet,
        prior,
        true,
        &verified,
    )?);

    println!();
    let audit = services.audit.seen();
    let records: Vec<&str> = audit.iter().flat_map(|r| r.body.lines()).collect();
    println!(
        "Audit sink: {} records in {} batches, shipped by the observer after the responses:",
        records.len(),
        audit.len()
    );
    for line in records {
        println!("  {line}");
    }
    println!();
    println!(
        "Usage sink: {} of {} metered requests in ClickHouse ({DEMO_SAMPLE_PERCENT}% hash sample), shipped by the observer:",
        shipped.len(),
        truth.rows.len()
    );
    for r in &shipped {
        println!(
            "  {} tenant={} model={} tokens={}→{} weight={}",
            r["request_id"].as_str().unwrap_or("?"),
            r["tenant"].as_str().unwrap_or("?"),
            r["model"].as_str().unwrap_or("?"),
            r["input_tokens"],
            r["output_tokens"],
            r["sample_weight"]
        );
    }
    use host_sim_tools::reconcile;
    let mut sample = reconcile::fetch_sample(&clickhouse.url(), reconcile::DEFAULT_TABLE)?;
    // Requests admitted before their credential was verified are billed to
    // the tenant verification found: at once by metering when the verdict
    // came first, else through the observer's attribution rows.
    let attributions =
        reconcile::fetch_attributions(&clickhouse.url(), reconcile::DEFAULT_ATTRIBUTION_TABLE)?;
    let mut truth_rows = truth.rows.clone();
    let attributed = attributions.apply(&mut truth_rows, &mut sample);
    let report = reconcile::reconcile(&truth_rows, &sample, 0.0);
    println!();
    println!(
        "Reconciliation (host-sim reconcile --threshold 0): the sample's estimate against the access log,"
    );
    println!(
        "corrections making billed totals exact. Requests admitted before their credential was verified"
    );
    println!(
        "are their verified tenant's: billed so at their end, or ({attributed} here) through the observer's"
    );
    println!(
        "attribution rows ({} credential(s) found valid); `unverified` is only what credentials verification",
        attributions.len()
    );
    println!("refused sent (forged, unknown):");
    for line in report.summary().lines() {
        println!("  {line}");
    }
    println!();
    println!(
        "Calls the observer made off the request path: {} JWKS fetch(es), {} API key introspection(s)",
        services.idp.seen().len(),
        services.api_keys.seen().len()
    );

    println!();
    println!("Envoy /stats/prometheus (zerolayer_*, non-zero):");
    for line in envoy.prometheus()?.lines().filter(|l| {
        l.starts_with("zerolayer_")
            && !l.ends_with(" 0")
            && !l.contains("_bucket{")
            && !l.contains("_sum{")
    }) {
        println!("  {line}");
    }
    println!();
    println!("Envoy access log (the decisions, read from filter state by Envoy itself):");
    for line in envoy.access_log().lines() {
        println!("  {line}");
    }

    if keep_running {
        println!();
        println!(
            "Envoy keeps running on {} (admin {}); Ctrl-C stops it.",
            envoy.url("/"),
            envoy.admin_url("/")
        );
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    Ok((seen, quota_seen))
}

/// The credential header `case` carries (its JWTs signed at `now`, valid
/// for an hour), as (name, value).
pub(crate) fn credential_header(case: &Case, now: u64) -> Option<(&'static str, String)> {
    match case.credential {
        Credential::None => None,
        Credential::Jwt(sub, tenant) => Some((
            "authorization",
            format!(
                "Bearer {}",
                issuer().es256(&tokens::claims(sub, tenant, now, 3600))
            ),
        )),
        Credential::ForgedJwt => Some((
            "authorization",
            format!(
                "Bearer {}",
                issuer().forged(&tokens::claims("mallory", "acme", now, 3600), 1)
            ),
        )),
        Credential::ApiKey(key) => Some(("x-api-key", key.to_string())),
    }
}

/// One row of the demo's table.
#[allow(clippy::too_many_arguments)]
pub(crate) fn print_row(
    n: &str,
    what: &str,
    status: &str,
    auth: &str,
    obs: &str,
    cache: &str,
    tokens: &str,
    leak: &str,
) {
    println!("{n:<3}{what:<31}{status:>6}  {auth:<46} {obs:<27} {cache:<7} {tokens:<11} {leak}");
}

/// What the table's activation column and its `rules:` line say (both
/// hosts' demos).
pub(crate) fn print_activation_legend() {
    println!(
        "   observers = what activation turned on for the request (each observer decided by the highest-"
    );
    println!(
        "               priority matching rule naming it, else its default), from its x-zerolayer-debug header"
    );
    println!("               (-: refused before activation ran)");
    println!(
        "   rules:    = the activation rules the request matched, in configuration order (-: none), then"
    );
    println!("               what the client got: the reply's text or the error's message");
}

/// What the table's cache column says (both hosts' demos).
pub(crate) fn print_cache_legend() {
    println!(
        "   cache     = post-cache's x-cache (BYPASS: no verified tenant yet, or activation turned the cache off;"
    );
    println!(
        "               MISS: stored after the response completed; HIT: answered from the gateway). The"
    );
    println!(
        "               requests carry no temperature, as the SDKs send them: the shipped post-cache"
    );
    println!(
        "               caches them (missing_temperature 0, the operator's opt-in; a sampled request opts"
    );
    println!("               in with zerolayer-cache: sampled)");
}

/// The demo table's header row.
pub(crate) fn print_header() {
    print_row(
        "#",
        "request",
        "status",
        "identity (lazy-auth)",
        "observers (activation)",
        "cache",
        "tokens",
        "internal",
    );
}

/// A request as the official SDKs write it: no `temperature` (their
/// typed calls send none unless the application sets one).
pub(crate) fn request_body(case: &Case) -> String {
    let messages = r#"[{"role":"user","content":"Say hello to the gateway in five words."}]"#;
    if case.path == "/v1/messages" {
        format!(
            r#"{{"model":"claude-demo","max_tokens":12,"stream":{},"messages":{messages}}}"#,
            case.stream
        )
    } else {
        let usage = if case.stream {
            r#","stream_options":{"include_usage":true}"#
        } else {
            ""
        };
        format!(
            r#"{{"model":"gpt-demo","max_tokens":12,"stream":{}{usage},"messages":{messages}}}"#,
            case.stream
        )
    }
}

/// The generated text (first words) and token usage of a reply.
pub(crate) fn summarize(case: &Case, body: &str) -> String {
    let mut text = String::new();
    let (mut input, mut output) = (None, None);
    let mut events = 0;
    let mut take = |v: &Value| {
        for t in [
            &v["content"][0]["text"],
            &v["choices"][0]["message"]["content"],
            &v["delta"]["text"],
            &v["choices"][0]["delta"]["content"],
        ] {
            if let Some(t) = t.as_str() {
                text.push_str(t);
            }
        }
        let u = if v["usage"].is_object() {
            &v["usage"]
        } else {
            &v["message"]["usage"]
        };
        // Streams spread usage over events (Anthropic: input in
        // message_start, output in message_delta): keep the latest of each.
        if let Some(i) = u["input_tokens"].as_u64().or(u["prompt_tokens"].as_u64()) {
            input = Some(i);
        }
        if let Some(o) = u["output_tokens"]
            .as_u64()
            .or(u["completion_tokens"].as_u64())
        {
            output = Some(o);
        }
    };
    if case.stream {
        for line in body.lines() {
            if let Some(data) = line.strip_prefix("data: ") {
                events += 1;
                if let Ok(v) = serde_json::from_str::<Value>(data) {
                    take(&v);
                }
            }
        }
    } else if let Ok(v) = serde_json::from_str::<Value>(body) {
        take(&v);
    }
    let words: Vec<&str> = text.split_whitespace().take(4).collect();
    let mut out = format!("\"{}…\"", words.join(" "));
    match (input, output) {
        (Some(i), Some(o)) => out.push_str(&format!(" ({i} in / {o} out tokens)")),
        (None, Some(o)) => out.push_str(&format!(" ({o} out tokens)")),
        _ => out.push_str(" (no usage)"),
    }
    if case.stream {
        out.push_str(&format!(", {events} SSE events"));
    }
    out
}

/// `demo-N`, except for the canary cases, which get the first id inside
/// (or outside) the 10% sample: the same `xxh3(id) mod 10000` the filter uses.
pub(crate) fn request_id(n: usize, what: &str) -> String {
    let canary = Rate::from_percent(10.0).unwrap_or(Rate::NONE);
    let want = match what {
        w if w.contains("id in") => Some(true),
        w if w.contains("id outside") => Some(false),
        _ => None,
    };
    match want {
        Some(inside) => (0..)
            .map(|k| format!("demo-{n}-{k}"))
            .find(|id| canary.includes(id.as_bytes()) == inside)
            .unwrap_or_default(),
        None => format!("demo-{n}"),
    }
}

/// Waits until the observer has concluded `n` verifications (valid or
/// invalid verdicts, as counted in Envoy's stats).
fn wait_for_verdicts(envoy: &Envoy, n: f64) -> Result<()> {
    let count = |outcome: &str| -> Result<f64> {
        Ok(envoy
            .metric(&format!("zerolayer_auth_verdicts{{outcome=\"{outcome}\"}}"))?
            .unwrap_or(0.0))
    };
    wait::until(
        &format!("{n} verifications by the observer"),
        Duration::from_secs(10),
        || Ok((count("valid")? + count("invalid")? >= n).then_some(())),
    )
    .with_context(|| format!("is it running?\n{}", envoy.log()))
}

/// `input→output` from a usage entry of the access log (`missing` when
/// the response carried none).
fn tokens_of(usage: &str) -> String {
    let Ok(u) = serde_json::from_str::<Value>(usage) else {
        return "-".into();
    };
    if u["usage_missing"] == 1 {
        return "missing".into();
    }
    format!("{}→{}", u["input_tokens"], u["output_tokens"])
}

/// `request_id → field` from Envoy's JSON access log.
fn access_log_field(log: &str, field: &str) -> std::collections::HashMap<String, String> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            Some((
                v["request_id"].as_str()?.to_string(),
                v[field].as_str()?.to_string(),
            ))
        })
        .collect()
}

/// The message of a JSON error reply (`{"error":{"message":…}}`).
pub(crate) fn error_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| {
            v["error"]["message"]
                .as_str()
                .map(|m| format!("error: {m}"))
        })
        .unwrap_or_else(|| body.chars().take(80).collect())
}

pub(crate) fn or_dash(s: &str) -> &str {
    if s.is_empty() { "-" } else { s }
}

/// `http://host:port[/…]` → a socket address.
fn resolve(url: &str) -> Result<SocketAddr> {
    let rest = url
        .strip_prefix("http://")
        .with_context(|| format!("--upstream must be an http:// URL, got {url}"))?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let with_port = if authority.contains(':') {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    with_port
        .to_socket_addrs()
        .with_context(|| format!("resolving {authority}"))?
        .next()
        .with_context(|| format!("{authority} has no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The demo's story holds in real Envoy: refusals, lazy admission,
    /// verification off the path, forged credentials cut off, the cache
    /// only for verified tenants, nothing internal reaching the backend;
    /// with four filters, `--fused` with one, and `--native` as Envoy's
    /// dynamic module.
    #[test]
    fn the_demo_tells_what_it_claims() -> Result<()> {
        for form in [Form::Native, Form::Separate, Form::Fused] {
            the_demo_tells_what_it_claims_as(form)?;
        }
        Ok(())
    }

    /// The same story in Kong's host: the same twelve requests, the same
    /// statuses and cache column, identities from the audit records.
    #[test]
    fn the_demo_tells_the_same_story_in_ngx_wasm_module() -> Result<()> {
        for form in [Form::Separate, Form::Fused] {
            let backend = Backend::Stub(Stub::start(StubConfig::default())?);
            let (seen, quota) = crate::demo_kong::session(&backend, false, form)?;
            if form == Form::Fused {
                let q = quota.context("the quota act did not run")?;
                assert!(q.remaining.len() >= 3, "only {:?}", q);
                assert_eq!(q.statuses.last(), Some(&429), "{q:?}");
                assert_eq!(
                    q.refusal,
                    Some(("insufficient_quota".into(), "false".into())),
                    "in ngx_wasm_module"
                );
                assert_eq!(
                    q.stream.as_ref().map(|(finish, _)| finish.as_str()),
                    Some("length"),
                    "the long stream cut at the budget in ngx_wasm_module: {q:?}"
                );
                assert_eq!(q.counter, q.billed, "Redis against the usage billed");
            }
            let what: Vec<(&str, u16, &str, &str)> = CASES
                .iter()
                .zip(&seen)
                .map(|(c, s)| (c.what, s.status, s.identity.as_str(), s.cache.as_str()))
                .collect();
            let acme = "verified tenant=acme";
            let want: Vec<(&str, u16, &str, &str)> = vec![
                ("no credential", 401, "-", "-"),
                (
                    "alice@acme JWT, first sight",
                    200,
                    "unverified tenant=acme",
                    "BYPASS",
                ),
                ("same JWT, verified off-path", 200, acme, "MISS"),
                ("API key, client says no-store", 200, "unverified", "BYPASS"),
                ("same API key again", 200, "verified tenant=globex", "MISS"),
                ("SDK client, id in 10% canary", 200, acme, "MISS"),
                ("SDK client, id outside it", 200, acme, "HIT"),
                (
                    "forged JWT, first sight",
                    200,
                    "unverified tenant=acme",
                    "BYPASS",
                ),
                ("same forged JWT", 401, "-", "-"),
                ("unknown API key", 200, "unverified", "BYPASS"),
                ("same unknown API key", 401, "-", "-"),
                ("forged internal header", 200, acme, "HIT"),
            ];
            assert_eq!(what, want, "{form:?} in ngx_wasm_module");
            for (case, s) in CASES.iter().zip(&seen) {
                let reached = s.status == 200 && s.cache != "HIT";
                let expected = if reached { "none" } else { "(not reached)" };
                assert_eq!(s.internal, expected, "{}", case.what);
                assert_eq!(
                    s.tokens.contains('→'),
                    reached,
                    "{}: {}",
                    case.what,
                    s.tokens
                );
            }
        }
        Ok(())
    }

    fn the_demo_tells_what_it_claims_as(form: Form) -> Result<()> {
        let backend = Backend::Stub(Stub::start(StubConfig::default())?);
        let (seen, quota) = session(&backend, false, form)?;
        {
            let q = quota.context("the quota act did not run")?;
            let admitted = q.remaining.len();
            assert!(admitted >= 3, "{form:?}: only {admitted} admitted: {q:?}");
            assert_eq!(q.statuses.last(), Some(&429), "{form:?}: {q:?}");
            assert_eq!(
                q.refusal,
                Some(("insufficient_quota".into(), "false".into())),
                "{form:?}"
            );
            assert!(
                q.remaining.windows(2).all(|w| w[1] < w[0]),
                "{form:?}: remaining must go down: {:?}",
                q.remaining
            );
            assert_eq!(
                q.stream.as_ref().map(|(finish, _)| finish.as_str()),
                Some("length"),
                "{form:?}: the long stream cut at the budget: {q:?}"
            );
            assert_eq!(
                q.counter, q.billed,
                "{form:?}: Redis against the usage billed"
            );
        }
        let what: Vec<(&str, u16, &str, &str)> = CASES
            .iter()
            .zip(&seen)
            .map(|(c, s)| (c.what, s.status, s.identity.as_str(), s.cache.as_str()))
            .collect();
        let alice = "verified tenant=acme subject=alice";
        let want: Vec<(&str, u16, &str, &str)> = vec![
            ("no credential", 401, "-", "-"),
            (
                "alice@acme JWT, first sight",
                200,
                "unverified tenant=acme",
                "BYPASS",
            ),
            ("same JWT, verified off-path", 200, alice, "MISS"),
            ("API key, client says no-store", 200, "unverified", "BYPASS"),
            (
                "same API key again",
                200,
                "verified tenant=globex subject=batch-service",
                "MISS",
            ),
            ("SDK client, id in 10% canary", 200, alice, "MISS"),
            ("SDK client, id outside it", 200, alice, "HIT"),
            (
                "forged JWT, first sight",
                200,
                "unverified tenant=acme",
                "BYPASS",
            ),
            ("same forged JWT", 401, "-", "-"),
            ("unknown API key", 200, "unverified", "BYPASS"),
            ("same unknown API key", 401, "-", "-"),
            ("forged internal header", 200, alice, "HIT"),
        ];
        assert_eq!(what, want, "{form:?}");
        for (case, s) in CASES.iter().zip(&seen) {
            // Refused and cached requests never reach the backend.
            let expected = if s.status == 200 && s.cache != "HIT" {
                "none"
            } else {
                "(not reached)"
            };
            assert_eq!(s.internal, expected, "{}", case.what);
            // What reached the backend is metered (tokens from the access
            // log); only metered requests can be in the sample.
            let reached = s.status == 200 && s.cache != "HIT";
            assert_eq!(
                s.tokens.contains('→'),
                reached,
                "{}: {}",
                case.what,
                s.tokens
            );
            assert!(!s.shipped || reached, "{}", case.what);
        }
        let shipped = seen.iter().filter(|s| s.shipped).count();
        assert!(shipped > 0, "no record reached ClickHouse");
        Ok(())
    }
}
