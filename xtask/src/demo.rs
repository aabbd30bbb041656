//! `cargo xtask demo`: every landed filter at work inside real Envoy.
//!
//! Builds the filters, starts Envoy from the shipped `envoy/activation.yaml`
//! (on free loopback ports, the debug response header switched on so the
//! decision is visible) in front of a local echo upstream or `--upstream
//! URL`, sends a handful of requests and prints, per request, what the
//! filter decided and what reached the upstream.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use zerolayer_core::sampling::Rate;
use zerolayer_e2e::{Client, EchoUpstream, Envoy, EnvoyConfig};

use crate::{setup, step};

/// One demo request.
struct Case {
    what: &'static str,
    method: &'static str,
    path: &'static str,
    headers: &'static [(&'static str, &'static str)],
    body: &'static str,
}

const MESSAGE: &str =
    r#"{"model":"claude-demo","max_tokens":32,"messages":[{"role":"user","content":"Hello"}]}"#;

const CASES: &[Case] = &[
    Case {
        what: "health check",
        method: "GET",
        path: "/healthz",
        headers: &[],
        body: "",
    },
    Case {
        what: "anonymous LLM call",
        method: "POST",
        path: "/v1/messages",
        headers: &[("content-type", "application/json")],
        body: MESSAGE,
    },
    Case {
        what: "premium tenant",
        method: "POST",
        path: "/v1/messages",
        headers: &[
            ("content-type", "application/json"),
            ("x-tenant-id", "acme"),
        ],
        body: MESSAGE,
    },
    Case {
        what: "client says no-store",
        method: "POST",
        path: "/v1/chat/completions",
        headers: &[
            ("content-type", "application/json"),
            ("cache-control", "no-store"),
        ],
        body: MESSAGE,
    },
    Case {
        what: "SDK client, id in 10% canary",
        method: "GET",
        path: "/v1/models",
        headers: &[("user-agent", "anthropic-python/0.40.0")],
        body: "",
    },
    Case {
        what: "SDK client, id outside it",
        method: "GET",
        path: "/v1/models",
        headers: &[("user-agent", "anthropic-python/0.40.0")],
        body: "",
    },
    Case {
        what: "forged internal header",
        method: "GET",
        path: "/v1/models",
        headers: &[("x-zerolayer-observers", "metering,cache,shadow")],
        body: "",
    },
];

/// Runs the demo.
pub fn run(args: &[String]) -> Result<()> {
    let mut upstream_url = None;
    let mut keep_running = false;
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "--upstream" => {
                upstream_url = Some(iter.next().context("--upstream needs a URL")?.clone())
            }
            "--keep-running" => keep_running = true,
            other => bail!("unknown demo option {other:?} (try --upstream URL, --keep-running)"),
        }
    }

    setup::all()?;
    crate::build_wasm()?;

    let echo = match upstream_url {
        Some(_) => None,
        None => Some(EchoUpstream::start()?),
    };
    let (upstream, upstream_name) = match (&upstream_url, &echo) {
        (Some(url), _) => (resolve(url)?, url.clone()),
        (None, Some(echo)) => (
            echo.addr(),
            format!("local echo upstream on {}", echo.addr()),
        ),
        (None, None) => bail!("no upstream"),
    };

    step("starting Envoy with envoy/activation.yaml");
    let mut config = EnvoyConfig::shipped("activation.yaml")?.for_run(upstream)?;
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
    println!(
        "  envoy     {}",
        version.split_whitespace().last().unwrap_or("?")
    );
    println!("  listener  {}", envoy.url("/"));
    println!("  upstream  {upstream_name}");
    println!("  rules     filters/activation/example.json (debug response header on for the demo)");
    println!();
    let row = |n: &str, what: &str, req: &str, status: &str, obs: &str, rules: &str, leak: &str| {
        println!("{n:<3} {what:<30} {req:<26} {status:>6}  {obs:<24} {rules:<42} {leak}");
    };
    row(
        "#",
        "request",
        "",
        "status",
        "observers (decision)",
        "rules matched",
        "x-zerolayer-* upstream",
    );
    let client = Client::new();
    for (i, case) in CASES.iter().enumerate() {
        let id = request_id(i + 1, case.what);
        let mut headers: Vec<(&str, &str)> = case.headers.to_vec();
        headers.push(("x-request-id", &id));
        let reply = client.send(case.method, &envoy.url(case.path), &headers, case.body)?;
        let debug = reply.header("x-zerolayer-debug").unwrap_or("");
        let (observers, matched) = debug
            .strip_prefix("observers=")
            .and_then(|d| d.split_once("; rules="))
            .unwrap_or(("?", "?"));
        let leaked = match &echo {
            Some(echo) => match echo.find("x-request-id", &id) {
                Some(seen) => {
                    let names: Vec<&str> = seen
                        .headers
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .filter(|n| n.starts_with("x-zerolayer-"))
                        .collect();
                    if names.is_empty() {
                        "none".to_string()
                    } else {
                        names.join(",")
                    }
                }
                None => "(not reached)".to_string(),
            },
            None => "(external upstream)".to_string(),
        };
        row(
            &(i + 1).to_string(),
            case.what,
            &format!("{} {}", case.method, case.path),
            &reply.status.to_string(),
            or_dash(observers),
            or_dash(matched),
            &leaked,
        );
    }

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
