//! `cargo xtask demo`: every landed filter at work inside real Envoy.
//!
//! Builds the filters and starts Envoy from the shipped `envoy/activation.yaml`
//! (free loopback ports; the debug response header switched on so the
//! decision is visible) in front of the GPU backend stub, or the real
//! llama.cpp model server with `--real-model`, or any `--upstream URL`. Sends
//! a handful of LLM requests and prints, per request, what the filters
//! decided, what reached the backend and what came back.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use zerolayer_core::sampling::Rate;
use zerolayer_e2e::{Client, Envoy, EnvoyConfig, ModelServer};
use zerolayer_stub::{Stub, StubConfig};

use crate::{setup, step};

/// One demo request.
struct Case {
    what: &'static str,
    path: &'static str,
    headers: &'static [(&'static str, &'static str)],
    stream: bool,
}

const CASES: &[Case] = &[
    Case {
        what: "anonymous call",
        path: "/v1/messages",
        headers: &[],
        stream: false,
    },
    Case {
        what: "premium tenant, streamed",
        path: "/v1/messages",
        headers: &[("x-tenant-id", "acme")],
        stream: true,
    },
    Case {
        what: "client says no-store",
        path: "/v1/chat/completions",
        headers: &[("cache-control", "no-store")],
        stream: false,
    },
    Case {
        what: "SDK client, id in 10% canary",
        path: "/v1/chat/completions",
        headers: &[("user-agent", "openai-python/1.54.0")],
        stream: true,
    },
    Case {
        what: "SDK client, id outside it",
        path: "/v1/messages",
        headers: &[("user-agent", "anthropic-python/0.40.0")],
        stream: false,
    },
    Case {
        what: "forged internal header",
        path: "/v1/messages",
        headers: &[("x-zerolayer-observers", "metering,cache,shadow")],
        stream: false,
    },
];

/// What the demo talks to.
enum Backend {
    Stub(Stub),
    Model(ModelServer),
    External(SocketAddr, String),
}

impl Backend {
    fn addr(&self) -> SocketAddr {
        match self {
            Backend::Stub(s) => s.addr(),
            Backend::Model(m) => m.addr(),
            Backend::External(a, _) => *a,
        }
    }

    fn describe(&self) -> String {
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
    fn internal_headers_seen(&self, id: &str) -> String {
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

/// Runs the demo.
pub fn run(args: &[String]) -> Result<()> {
    let mut upstream_url = None;
    let mut real_model = false;
    let mut keep_running = false;
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "--upstream" => {
                upstream_url = Some(iter.next().context("--upstream needs a URL")?.clone())
            }
            "--real-model" => real_model = true,
            "--keep-running" => keep_running = true,
            other => bail!(
                "unknown demo option {other:?} (try --real-model, --upstream URL, --keep-running)"
            ),
        }
    }

    setup::all()?;
    crate::build_wasm()?;

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

    step("starting Envoy with envoy/activation.yaml");
    let mut config = EnvoyConfig::shipped("activation.yaml")?.for_run(backend.addr())?;
    let mut rules: serde_json::Value =
        serde_json::from_str(&config.wasm_filter_config("zerolayer.activation")?)?;
    rules["debug_response_header"] = serde_json::Value::Bool(true);
    config.set_wasm_filter_config("zerolayer.activation", &rules.to_string())?;
    let envoy = Envoy::start(&config)?;
    let version = std::process::Command::new(zerolayer_e2e::paths::envoy_binary()?)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();

    println!();
    println!("zerolayer demo: the activation filter (Wasm, V8) inside real Envoy");
    let version = version
        .split("version: ")
        .nth(1)
        .and_then(|v| v.split('/').nth(1))
        .unwrap_or("?");
    println!("  envoy     {version} (V8)");
    println!("  listener  {}", envoy.url("/"));
    println!("  backend   {}", backend.describe());
    println!("  rules     filters/activation/example.json (debug response header on for the demo)");
    println!();
    let row =
        |n: &str, what: &str, status: &str, obs: &str, rules: &str, leak: &str, answer: &str| {
            println!("{n:<2} {what:<29} {status:>6}  {obs:<21} {rules:<40} {leak:<9} {answer}");
        };
    row(
        "#",
        "request",
        "status",
        "observers decided",
        "rules matched",
        "internal",
        "answer",
    );
    let client = Client::new();
    for (i, case) in CASES.iter().enumerate() {
        let id = request_id(i + 1, case.what);
        let mut headers: Vec<(&str, &str)> = case.headers.to_vec();
        headers.push(("x-request-id", &id));
        headers.push(("content-type", "application/json"));
        let body = request_body(case);
        let reply = client.send("POST", &envoy.url(case.path), &headers, &body)?;
        let debug = reply.header("x-zerolayer-debug").unwrap_or("");
        let (observers, matched) = debug
            .strip_prefix("observers=")
            .and_then(|d| d.split_once("; rules="))
            .unwrap_or(("?", "?"));
        row(
            &(i + 1).to_string(),
            case.what,
            &reply.status.to_string(),
            or_dash(observers),
            or_dash(matched),
            &backend.internal_headers_seen(&id),
            &summarize(case, &reply.body),
        );
    }
    println!(
        "   `internal` = x-zerolayer-* headers the backend received (none: the decision never leaves the gateway)"
    );

    // Counters reach Envoy from the filter's 1 s tick, off the request path.
    std::thread::sleep(Duration::from_millis(1500));
    println!();
    println!("Envoy /stats/prometheus (zerolayer_*):");
    for line in envoy
        .prometheus()?
        .lines()
        .filter(|l| l.starts_with("zerolayer_"))
    {
        println!("  {line}");
    }
    println!();
    println!("Envoy access log (the decision, read from filter state by Envoy itself):");
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
    Ok(())
}

fn request_body(case: &Case) -> String {
    let messages = r#"[{"role":"user","content":"Say hello to the gateway in five words."}]"#;
    if case.path == "/v1/messages" {
        format!(
            r#"{{"model":"claude-demo","max_tokens":12,"temperature":0,"stream":{},"messages":{messages}}}"#,
            case.stream
        )
    } else {
        let usage = if case.stream {
            r#","stream_options":{"include_usage":true}"#
        } else {
            ""
        };
        format!(
            r#"{{"model":"gpt-demo","max_tokens":12,"temperature":0,"stream":{}{usage},"messages":{messages}}}"#,
            case.stream
        )
    }
}

/// The generated text (first words) and token usage of a reply.
fn summarize(case: &Case, body: &str) -> String {
    let mut text = String::new();
    let (mut input, mut output) = (None, None);
    let mut events = 0;
    let mut take = |v: &serde_json::Value| {
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
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(data) {
                    take(&v);
                }
            }
        }
    } else if let Ok(v) = serde_json::from_str::<serde_json::Value>(body) {
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
fn request_id(n: usize, what: &str) -> String {
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

fn or_dash(s: &str) -> &str {
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
