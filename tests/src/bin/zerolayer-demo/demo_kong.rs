//! `cargo xtask demo --host ngx-wasm`: the same twelve requests through the
//! same chain in Kong's real Proxy-Wasm host, ngx_wasm_module, from
//! `kong/kong.yml` (or `kong-fused.yml` with `--fused`) and `kong/kong.conf`.
//!
//! ngx_wasm_module has no access log of filter state and no metrics
//! endpoint, so the table's identity column comes from the audit records
//! lazy-auth's observer ships and the tokens from the usage records in
//! ClickHouse (every request sampled here).

use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use zerolayer_e2e::chain::AuthServices;
use zerolayer_e2e::clickhouse::ClickHouse;
use zerolayer_e2e::ngx::{self, KongConfig, NgxWasm};
use zerolayer_e2e::tokens;
use zerolayer_e2e::{Client, wait};

use crate::demo::{
    Backend, CASES, DEMO_CACHE_SECRET, Form, Seen, credential_header, error_message, introspect,
    or_dash, print_header, print_row, request_body, request_id, summarize,
};
use crate::demo_quota::QuotaSeen;
use zerolayer_layout::step;

/// Runs the demo's requests through ngx_wasm_module in front of `backend`.
pub(crate) fn session(
    backend: &Backend,
    keep_running: bool,
    form: Form,
) -> Result<(Vec<Seen>, Option<QuotaSeen>)> {
    let services = AuthServices::start(introspect)?;
    step("starting ClickHouse (metering's usage sink)");
    let clickhouse = ClickHouse::start()?;
    clickhouse.create_tables()?;
    let file = match form {
        Form::Separate => "kong.yml",
        Form::Fused => "kong-fused.yml",
        Form::Native => bail!("the native module is Envoy's: Kong runs the Wasm forms"),
    };
    step("starting Redis and webdis (quota's store)");
    let quota_store = zerolayer_e2e::fleet::RedisFleet::start_for_quota()?;
    step(&format!(
        "starting nginx + ngx_wasm_module (Kong's Proxy-Wasm host) with kong/{file} and kong/kong.conf"
    ));
    let mut config = KongConfig::shipped(file)?
        .retarget("127.0.0.1:18091", services.idp.addr())
        .retarget("127.0.0.1:18092", services.api_keys.addr())
        .retarget("127.0.0.1:18093", services.audit.addr())
        .retarget("127.0.0.1:8123", clickhouse.addr())
        .retarget("127.0.0.1:7379", quota_store.webdis())
        .env("ZEROLAYER_CACHE_SECRET", DEMO_CACHE_SECRET);
    let mut sections = match form {
        Form::Fused | Form::Native => config.filter_json("zerolayer_fused")?,
        Form::Separate => {
            let mut sections = json!({});
            for (section, filter) in STAGES {
                sections[section] = config.filter_json(filter)?;
            }
            sections
        }
    };
    sections["activation"]["debug_response_header"] = Value::Bool(true);
    sections["lazy_auth"]["jwt"]["issuers"] = json!(["https://idp.test"]);
    sections["lazy_auth"]["audit"]["flush_ms"] = json!(200);
    // Every request's full record, so the table can show its tokens.
    sections["metering"]["sampling"] = json!({"percent": 100.0});
    sections["metering"]["sink"]["flush_ms"] = json!(200);
    // Two workers, each a lease holder.
    crate::demo_quota::for_demo(&mut sections["quota"], 2);
    match form {
        Form::Fused | Form::Native => {
            config.set_filter_config("zerolayer_fused", &sections.to_string())?
        }
        Form::Separate => {
            for (section, filter) in STAGES {
                config.set_filter_config(filter, &sections[section].to_string())?;
            }
        }
    }
    let ngx = NgxWasm::start(&config, backend.addr())?;
    wait::until(
        "the observer's first JWKS fetch",
        Duration::from_secs(20),
        || Ok(ngx.log().contains("observer: JWKS fetched").then_some(())),
    )
    .with_context(|| ngx.log_tail(30))?;

    println!();
    println!(
        "zerolayer demo: lazy-auth, activation, quota, post-cache and metering (Wasm, wasmtime) inside Kong's"
    );
    println!(
        "Proxy-Wasm host, with each filter's observer verifying credentials and shipping records on tick"
    );
    println!(
        "  host      nginx 1.27.4 + ngx_wasm_module ({})",
        ngx::binary()?.display()
    );
    println!("  listener  {}", ngx.url("/"));
    println!("  backend   {}", backend.describe());
    println!(
        "  config    kong/{file}, kong/kong.conf (translated to nginx.conf as Kong renders them)"
    );
    println!(
        "  services  JWKS {}, API key introspection {}, audit sink {} (loopback stand-ins)",
        services.idp.addr(),
        services.api_keys.addr(),
        services.audit.addr()
    );
    println!(
        "  usage     ClickHouse {} (real server, every request sampled)",
        clickhouse.url()
    );
    println!(
        "  quota     webdis {} in front of a real Redis (a daily token budget per tenant)",
        quota_store.webdis()
    );
    println!();

    let client = Client::new();
    let now = tokens::now();
    let mut sent = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let id = request_id(i + 1, case.what);
        let credential = credential_header(case, now);
        let mut headers: Vec<(&str, &str)> = case.headers.to_vec();
        if let Some((name, value)) = &credential {
            headers.push((name, value));
        }
        headers.push(("x-request-id", &id));
        headers.push(("content-type", "application/json"));
        let reply = ngx::send(
            &ngx,
            &client,
            case.what,
            "POST",
            case.path,
            &headers,
            &request_body(case),
        )?;
        sent.push((id, reply));
        if case.then_wait {
            // The observer verifies on its tick (every 200 ms here) and has
            // no metrics endpoint to ask: a few ticks.
            std::thread::sleep(Duration::from_millis(800));
        }
    }

    // Audit records (every request: activation's default observer) and
    // usage records reach their sinks on the observers' ticks.
    let audited = |n: usize| -> usize {
        services
            .audit
            .seen()
            .iter()
            .flat_map(|r| r.body.lines().map(str::to_string).collect::<Vec<_>>())
            .count()
            .min(n)
    };
    wait::until(
        "an audit record per request",
        Duration::from_secs(10),
        || Ok((audited(sent.len()) >= sent.len()).then_some(())),
    )?;
    let audit: Vec<Value> = services
        .audit
        .seen()
        .iter()
        .flat_map(|r| {
            r.body
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .collect::<Vec<_>>()
        })
        .collect();
    let reached = sent
        .iter()
        .filter(|(_, r)| r.status == 200 && r.header("x-cache") != Some("HIT"))
        .count();
    let shipped = clickhouse.wait_rows(reached, Duration::from_secs(10))?;

    let row = print_row;
    print_header();
    let mut seen = Vec::new();
    for (i, (case, (id, reply))) in CASES.iter().zip(&sent).enumerate() {
        let debug = reply.header("x-zerolayer-debug").unwrap_or("");
        let (observers, matched) = debug
            .strip_prefix("observers=")
            .and_then(|d| d.split_once("; rules="))
            .unwrap_or(("-", "-"));
        let identity = if reply.status == 200 {
            identity_of(&audit, id)
        } else {
            "-".to_string()
        };
        let tokens = shipped
            .iter()
            .find(|r| r["request_id"] == id.as_str())
            .map(|r| {
                if r["usage_missing"] == 1 {
                    "missing".to_string()
                } else {
                    format!("{}→{}", r["input_tokens"], r["output_tokens"])
                }
            })
            .unwrap_or_else(|| "-".into());
        let cache = reply.header("x-cache").unwrap_or("-").to_string();
        let internal = backend.internal_headers_seen(id);
        row(
            &(i + 1).to_string(),
            case.what,
            &reply.status.to_string(),
            &identity,
            or_dash(observers),
            &cache,
            &tokens,
            &internal,
        );
        let outcome = if reply.status == 200 {
            summarize(case, &reply.body)
        } else {
            error_message(reply.body.trim_end())
        };
        println!("   rules: {:<40} {outcome}", or_dash(matched));
        seen.push(Seen {
            status: reply.status,
            identity,
            cache,
            internal,
            shipped: tokens != "-",
            tokens,
        });
    }
    println!();
    println!(
        "   identity  = lazy-auth's decision, from its audit record (`unverified`: admitted on first sight and"
    );
    println!(
        "               verified by the observer on tick; the next request gets the cached verdict)"
    );
    crate::demo::print_activation_legend();
    crate::demo::print_cache_legend();
    println!(
        "   tokens    = metering's input→output tokens, from its record in ClickHouse (-: refused or cached)"
    );
    println!(
        "   internal  = x-zerolayer-* headers the backend received (none: decisions never leave the gateway;\n               not reached: refused, or answered from the cache)"
    );
    let quota = {
        let prior: u64 = seen
            .iter()
            .filter(|s| s.identity.starts_with("verified"))
            .filter_map(|s| s.tokens.split_once('→'))
            .filter_map(|(i, o)| Some(i.parse::<u64>().ok()? + o.parse::<u64>().ok()?))
            .sum();
        // The observer verifies on its tick, with no metrics to ask.
        let verified = || {
            std::thread::sleep(Duration::from_millis(800));
            Ok(())
        };
        let what = match form {
            Form::Separate => "kong/kong.yml's zerolayer_quota",
            Form::Fused | Form::Native => "kong/kong-fused.yml's quota section",
        };
        Some(crate::demo_quota::act(
            what,
            &ngx.url("/v1/chat/completions"),
            &quota_store,
            prior,
            false,
            &verified,
        )?)
    };
    println!();
    println!(
        "Audit sink: {} records, shipped by lazy-auth's observer after the responses; usage sink: {} records.",
        audit.len(),
        shipped.len()
    );
    println!(
        "Calls the observers made off the request path: {} JWKS fetch(es), {} API key introspection(s)",
        services.idp.seen().len(),
        services.api_keys.seen().len()
    );
    println!();
    println!("ngx_wasm_module's error log (the filters' lines):");
    for line in ngx.log().lines().filter(|l| l.contains("[proxy-wasm]")) {
        println!("  {line}");
    }
    if keep_running {
        println!();
        println!("nginx keeps running on {}; Ctrl-C stops it.", ngx.url("/"));
        loop {
            std::thread::park();
        }
    }
    Ok((seen, quota))
}

/// The separate filters and their sections in the fused configuration.
const STAGES: [(&str, &str); 5] = [
    ("activation", "zerolayer_activation"),
    ("lazy_auth", "zerolayer_lazy_auth"),
    ("quota", "zerolayer_quota"),
    ("post_cache", "zerolayer_post_cache"),
    ("metering", "zerolayer_metering"),
];

/// `verified tenant=X` / `unverified[ tenant=X]` from request `id`'s audit record.
fn identity_of(audit: &[Value], id: &str) -> String {
    let Some(record) = audit.iter().find(|r| r["request_id"] == id) else {
        return "-".into();
    };
    let verified = record["verified"].as_bool().unwrap_or(false);
    match (verified, record["tenant"].as_str()) {
        (true, Some(tenant)) => format!("verified tenant={tenant}"),
        (true, None) => "verified".into(),
        (false, Some(tenant)) => format!("unverified tenant={tenant}"),
        (false, None) => "unverified".into(),
    }
}
