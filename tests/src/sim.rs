//! host-sim under the host profile a test run asks for: the filters'
//! host-sim suites run twice in `cargo xtask test`, once as Envoy and once
//! as Kong (`ZEROLAYER_HOST_PROFILE=kong`), and must pass under both. Under
//! Kong there is no singleton service: the observer runs inside each
//! filter's root context on tick (`observer.mode: tick`), owning the queue
//! `<observer.queue>.<filter>`, which the operator declares (`shm_queue`).

use anyhow::{Result, bail};
use host_sim::{Host, HostOptions, PluginSpec, Profile, StreamHandle};
use serde_json::{Value, json};

use crate::paths;

pub use zerolayer_layout::PROFILE_ENV;

/// The queues the filters' embedded observers register in tick mode, as
/// `kong/kong.conf` declares them.
pub const KONG_QUEUES: [&str; 3] = [
    "zerolayer.jobs.lazy-auth",
    "zerolayer.jobs.post-cache",
    "zerolayer.jobs.metering",
];

/// The profile of this test run.
pub fn profile() -> Result<Profile> {
    match std::env::var(PROFILE_ENV).as_deref() {
        Err(_) | Ok("envoy") | Ok("") => Ok(Profile::Envoy),
        Ok("kong") => Ok(Profile::Kong),
        Ok(other) => bail!("{PROFILE_ENV}={other:?}: expected envoy or kong"),
    }
}

/// Whether this run plays Kong.
pub fn kong() -> bool {
    matches!(profile(), Ok(Profile::Kong))
}

/// The body a client gets for a gateway-made (local) response of `body`
/// under this run's profile: ngx_wasm_module appends a line feed, which
/// the filters avoid by dropping a final one of their own (kong/README.md).
pub fn local_body(body: &str) -> String {
    if kong() && !body.ends_with('\n') {
        format!("{body}\n")
    } else {
        body.to_string()
    }
}

/// Host options for this run's profile (Kong: the zerolayer queues declared).
pub fn options() -> Result<HostOptions> {
    Ok(HostOptions {
        profile: profile()?,
        kong_queues: KONG_QUEUES.iter().map(|q| q.to_string()).collect(),
        // Kong Gateway's build: hand-offs through `kong.ctx.shared.*`.
        kong_gateway: true,
        ..Default::default()
    })
}

/// A fresh host for this run's profile.
pub fn host() -> Result<Host> {
    Host::with_options(options()?)
}

/// Puts the observer where this profile runs it, for a filter whose
/// configuration is `config` (its observer's section name in the service
/// configuration is `section`: `lazy_auth`, `post_cache`, `metering`).
/// Envoy: the observer singleton (`vm_id` zerolayer) with `{section:
/// config}` and `env`; Kong: `observer.mode: tick` in `config`, so the
/// filter embeds it.
pub fn observer(
    host: &mut Host,
    section: &str,
    config: &mut Value,
    env: &[(&str, &str)],
) -> Result<()> {
    if kong() {
        config["observer"]["mode"] = json!("tick");
        return Ok(());
    }
    let mut spec = PluginSpec::new("observer", paths::wasm("observer_service")?)
        .vm_id("zerolayer")
        .configuration(json!({section: config, "tick_ms": 100}).to_string());
    for (k, v) in env {
        spec = spec.env(k, v);
    }
    host.add_singleton(spec)
}

/// Under Kong, switches a filter configuration's observer to tick mode
/// (for filters that need no observer service in the test but must not
/// reach for a singleton Kong does not have).
pub fn observer_mode(config: &mut Value) {
    if kong() {
        config["observer"]["mode"] = json!("tick");
    }
}

/// Lets the observer catch up: Envoy wakes it on enqueue (nothing to do);
/// Kong drains on the filters' tick, so advance past one.
pub fn settle(host: &mut Host) {
    if kong() {
        host.advance(std::time::Duration::from_millis(250));
    }
}

/// A property published for later filters and the access log, by path
/// (`wasmx.zerolayer_usage`): Envoy's filter state `wasm.<path>`,
/// ngx_wasm_module's `wasmx.*` host property, or Kong Gateway's
/// `kong.ctx.shared.*`.
pub fn published(stream: &StreamHandle<'_>, path: &str) -> Option<Vec<u8>> {
    stream.published(path)
}
