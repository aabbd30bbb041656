//! The demo's quota act: a tenant spends its daily token budget through the
//! chain. quota runs with `filters/quota/example.json` (budgets sized for a
//! demo), its leases granted by a real Redis through webdis in the
//! background; each request is admitted or refused against the lease the
//! gateway already holds, and settled with the usage the backend reported.

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{Value, json};
use zerolayer_e2e::Client;
use zerolayer_e2e::fleet::RedisFleet;
use zerolayer_e2e::tokens::{self, issuer};

/// The demo's key prefix in Redis.
pub(crate) const PREFIX: &str = "zl:demo:";

/// Each tenant's daily token budget in the demo (example.json ships
/// 2,000,000): the act's tenant reaches it in a handful of requests.
pub(crate) const DAILY_TOKENS: u64 = 400;

/// The act's requests at most, should the budget never refuse one.
const MAX_REQUESTS: usize = 30;

/// The act's request that asks for a long streamed answer (the stub is
/// asked for 600 words, one every 2 ms; a real model for up to
/// `max_tokens`).
const STREAMED: usize = 4;

/// The quota section the demo runs: the shipped example with its store on
/// the demo's webdis (cluster `webdis`), a quick sync, and demo-sized
/// budgets.
pub(crate) fn section(root: &Path) -> Result<Value> {
    let path = root.join("filters/quota/example.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    let mut quota: Value = serde_json::from_str(&text)?;
    for_demo(&mut quota, 1);
    Ok(quota)
}

/// Makes `quota`'s first policy the demo's budget (`tenant-daily`,
/// [`DAILY_TOKENS`]) and its store quick, for `holders` lease holders.
pub(crate) fn for_demo(quota: &mut Value, holders: u32) {
    quota["store"]["key_prefix"] = json!(PREFIX);
    quota["store"]["sync_interval_ms"] = json!(100);
    quota["store"]["expected_gateways"] = json!(holders);
    // Whole leases: a demo-sized budget is granted in one piece.
    quota["store"]["lease"] = json!({"max_percent": 100});
    // Idle leases go back quickly, so Redis shows what was spent.
    quota["store"]["lease_ttl_ms"] = json!(200);
    quota["store"]["idle_return_ms"] = json!(300);
    quota["policies"][0]["name"] = json!("tenant-daily");
    // A stream that reaches the budget is ended cleanly, billed what it
    // delivered (the act's third request).
    quota["policies"][0]["stream"] = json!("hard");
    quota["policies"][0]["limit"]["budget"]["amount"] = json!(DAILY_TOKENS);
}

/// What the act saw, for the demo's test.
#[derive(Debug, Default)]
pub(crate) struct QuotaSeen {
    /// Each request's status.
    pub(crate) statuses: Vec<u16>,
    /// The `x-ratelimit-remaining-tokens` of each admitted request.
    pub(crate) remaining: Vec<u64>,
    /// Tokens the admitted requests' responses reported, billed to
    /// initech's budget (the first, admitted before verification, only
    /// with an `unverified` budget: it is charged to initech once verified).
    pub(crate) used: u64,
    /// The refusal's `error.code` and `x-should-retry`.
    pub(crate) refusal: Option<(String, String)>,
    /// The streamed request's finish reason (`length`: cut at the budget)
    /// and the bytes of text it delivered.
    pub(crate) stream: Option<(String, u64)>,
    /// What the tenants' daily counters hold in Redis once leases settled.
    pub(crate) counter: i64,
    /// What they should hold: every verified request's reported usage.
    pub(crate) billed: i64,
}

/// Sends `bob@initech`'s requests to `url`, quota configured from
/// `source` with policy `tenant-daily` at [`DAILY_TOKENS`], (the gateway's OpenAI endpoint)
/// until the budget refuses one, printing each (after the first, a JWT's
/// first sight, `verified` waits for the observer's verdict); then waits for
/// Redis to hold what was used: `prior` tokens charged to tenants before
/// the act and the act's own. `with_unverified`: the configuration has an
/// `unverified` budget (the first request, lazily admitted, is then
/// charged to initech once verified; without one quota does not count it).
pub(crate) fn act(
    source: &str,
    url: &str,
    fleet: &RedisFleet,
    prior: u64,
    with_unverified: bool,
    verified: &dyn Fn() -> Result<()>,
) -> Result<QuotaSeen> {
    println!();
    println!(
        "Quota ({source}; demo budget {DAILY_TOKENS} tokens a day per tenant): leases granted by Redis"
    );
    println!(
        "through webdis in the background; each request reserves its bound (body bytes + max_tokens) from"
    );
    println!(
        "the lease already held, no network call, and settles with the usage the backend reported"
    );
    println!("(every request asks max_tokens 64):");
    println!(
        "{:<4}{:<31}{:>6}  {:<11} {:<10} outcome",
        "#", "request", "status", "remaining", "tokens"
    );
    let client = Client::new();
    let jwt = issuer().es256(&tokens::claims("bob", "initech", tokens::now(), 3600));
    let bearer = format!("Bearer {jwt}");
    let mut seen = QuotaSeen::default();
    for n in 1..=MAX_REQUESTS {
        let streamed = n == STREAMED;
        let body = if streamed {
            json!({
                "model": "gpt-demo", "max_tokens": 2_000, "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": "Quota demo: tell a long story."}],
            })
        } else {
            json!({
                "model": "gpt-demo", "max_tokens": 64,
                "messages": [{"role": "user", "content": format!("Quota demo question {n}: what is a lease?")}],
            })
        }
        .to_string();
        let id = format!("quota-{n}");
        let mut headers = vec![
            ("authorization", bearer.as_str()),
            ("content-type", "application/json"),
            ("x-request-id", id.as_str()),
        ];
        if streamed {
            // As a model streams (a token every 2 ms: faster than most), so
            // the lease's refills, sent from the response, keep up.
            headers.push(("x-stub-output-tokens", "600"));
            headers.push(("x-stub-itl-ms", "2"));
        }
        let reply = client.send("POST", url, &headers, &body)?;
        seen.statuses.push(reply.status);
        let remaining = reply
            .header("x-ratelimit-remaining-tokens")
            .unwrap_or("-")
            .to_string();
        let what = match n {
            1 => "bob@initech JWT, first sight",
            STREAMED => "same JWT, a long stream",
            _ => "same JWT, verified",
        };
        if reply.status == 200 {
            let (input, output) = zerolayer_e2e::chain::reported_usage(&reply.body)?;
            let finish = streamed.then(|| {
                let (finishes, text) = zerolayer_e2e::chain::openai_stream_end(&reply.body);
                (finishes.last().cloned().unwrap_or_else(|| "-".into()), text)
            });
            let outcome = if n == 1 {
                // lazy-auth admitted it before verification: the unverified
                // budget's where there is one, never the tenant it claims;
                // once the credential is verified, initech's as well.
                verified()?;
                if with_unverified {
                    seen.used += input + output;
                    "admitted before verification from the unverified budget; charged to initech too once verified".to_string()
                } else {
                    "admitted before verification: not counted by quota (no unverified budget)"
                        .to_string()
                }
            } else if let Some((finish, text)) = finish {
                seen.used += input + output;
                if let Ok(r) = remaining.parse() {
                    seen.remaining.push(r);
                }
                let told = if finish == "length" {
                    // Cut where the lease (refilled from the response as it
                    // drained) ran out: what was left was still being leased.
                    let left = DAILY_TOKENS.saturating_sub(seen.used);
                    format!(
                        "cut cleanly after {text} bytes of text (finish_reason \"length\", then [DONE]) with {left} of the {DAILY_TOKENS} tokens left unleased; billed its input bound and the output it delivered (the usage chunk never came)"
                    )
                } else {
                    format!("not cut: the answer ({text} bytes) ended on its own ({finish})")
                };
                seen.stream = Some((finish, text));
                told
            } else {
                seen.used += input + output;
                if let Ok(r) = remaining.parse() {
                    seen.remaining.push(r);
                }
                "admitted from initech's lease".to_string()
            };
            println!(
                "{:<4}{:<31}{:>6}  {:<11} {:<10} {outcome}",
                format!("q{n}"),
                what,
                reply.status,
                remaining,
                format!("{input}→{output}"),
            );
            continue;
        }
        let error: Value = serde_json::from_str(&reply.body).unwrap_or_default();
        let code = error["error"]["code"].as_str().unwrap_or("-").to_string();
        let retry = reply.header("x-should-retry").unwrap_or("-").to_string();
        println!(
            "{:<4}{:<31}{:>6}  {:<11} {:<10} {} (code {code}, x-should-retry: {retry}; the backend never saw it)",
            format!("q{n}"),
            what,
            reply.status,
            remaining,
            "-",
            crate::demo::error_message(&reply.body),
        );
        seen.refusal = Some((code, retry));
        break;
    }
    // Settled in the background: each idle lease returns what it held, so
    // the counters end at exactly what the responses reported.
    let want = (prior + seen.used) as i64;
    seen.billed = want;
    let total = || fleet.budget_total(&format!("{PREFIX}{{tenant-daily:"));
    seen.counter = zerolayer_e2e::wait::until(
        "Redis to hold what the tenants used",
        std::time::Duration::from_secs(10),
        || {
            let total = total()?;
            Ok((total == want).then_some(total))
        },
    )
    .or_else(|_| {
        // Not settled: show what each counter holds.
        if let Ok(zerolayer_core::quota::store::Reply::Array(Some(keys))) =
            fleet.command(&["KEYS", &format!("{PREFIX}*")])
        {
            for key in keys {
                if let zerolayer_core::quota::store::Reply::Bulk(Some(k)) = key {
                    let k = String::from_utf8_lossy(&k).into_owned();
                    let v = fleet.command(&["GET", &k]);
                    println!("   (not settled) {k} = {v:?}");
                }
            }
        }
        total()
    })?;
    println!(
        "   Redis: the tenants' daily counters hold {} tokens: initech's {} here and the {prior} the first",
        seen.counter, seen.used
    );
    println!(
        "          table's requests were charged to their tenants; every unit was granted to the gateway before it was spent"
    );
    Ok(seen)
}
