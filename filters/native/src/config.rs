//! The native chain's configuration beyond the stages' sections: the
//! `native` section, the observer's configuration and the addresses of the
//! clusters it calls, and what the stages may hold in shared data.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::Deserialize;
use serde_json::Value;
use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::cache::config::PostCacheConfig;
use zerolayer_core::config::{Endpoint, ObserverMode};
use zerolayer_core::footprint::KeySpace;
use zerolayer_core::metering::MeteringConfig;
use zerolayer_fused::Stage;
use zerolayer_observer::ObserverConfig;

/// The `native` section: what only the native form needs.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NativeSection {
    /// Where the observer's thread reaches each cluster the configuration
    /// names for off-path work (JWKS, introspection, sinks, the fleet
    /// tier): `"cluster": "host:port"`. Envoy's cluster manager serves
    /// only its own threads; callouts a stream makes still use Envoy's
    /// clusters.
    #[serde(default)]
    pub upstreams: BTreeMap<String, String>,
    /// Shared data's keys at most, if the operator caps them: refused at
    /// load when the stages' configurations may need more (by default the
    /// store holds exactly what they declare, each purpose its own quota).
    #[serde(default)]
    pub shared_max_entries: Option<u64>,
    /// Shared data's bytes of keys and values at most, if the operator caps
    /// them (as `shared_max_entries`).
    #[serde(default)]
    pub shared_max_bytes: Option<u64>,
    /// Jobs waiting for the observer at most (a full queue refuses jobs,
    /// counted by the stage that posts).
    #[serde(default = "default_queue")]
    pub queue_capacity: usize,
}

fn default_queue() -> usize {
    65_536
}

impl Default for NativeSection {
    fn default() -> Self {
        NativeSection {
            upstreams: BTreeMap::new(),
            shared_max_entries: None,
            shared_max_bytes: None,
            queue_capacity: default_queue(),
        }
    }
}

/// What the configured stages may hold in shared data, by purpose (a
/// section that does not parse declares nothing: its stage refuses it).
pub(crate) fn key_spaces(sections: &[(Stage, Vec<u8>)]) -> Vec<KeySpace> {
    sections
        .iter()
        .flat_map(|(stage, section)| match stage {
            Stage::LazyAuth => LazyAuthConfig::from_json(section)
                .map(|c| c.key_spaces())
                .unwrap_or_default(),
            Stage::PostCache => PostCacheConfig::from_json(section)
                .map(|c| c.key_spaces())
                .unwrap_or_default(),
            Stage::Activation | Stage::Metering => Vec::new(),
        })
        .collect()
}

/// The observer's configuration from the stage sections it works for
/// (none when none of them is there). Natively it always runs on its own
/// thread: a section asking for the tick mode is refused, naming it.
pub(crate) fn observer_config(value: &Value) -> Result<Option<ObserverConfig>, String> {
    let mut sections = serde_json::Map::new();
    for name in ["lazy_auth", "post_cache", "metering"] {
        if let Some(section) = value.get(name) {
            sections.insert(name.into(), section.clone());
        }
    }
    if sections.is_empty() {
        return Ok(None);
    }
    let bytes = Value::Object(sections).to_string();
    let config = ObserverConfig::from_json(bytes.as_bytes()).map_err(|e| e.to_string())?;
    let links = [
        ("lazy_auth", config.lazy_auth.as_ref().map(|c| &c.observer)),
        (
            "post_cache",
            config.post_cache.as_ref().map(|c| &c.observer),
        ),
        ("metering", config.metering.as_ref().map(|c| &c.observer)),
    ];
    for (name, link) in links {
        if let Some(link) = link
            && link.mode != ObserverMode::Singleton
        {
            return Err(format!(
                "{name}.observer.mode: the native module runs its observer on a thread of its own: use \"singleton\""
            ));
        }
    }
    Ok(Some(config))
}

/// The addresses of the clusters the observer calls, every one of them
/// given in `native.upstreams`.
pub(crate) fn upstreams(
    native: &NativeSection,
    config: Option<&ObserverConfig>,
) -> Result<BTreeMap<String, SocketAddr>, String> {
    let mut needed: Vec<(&str, &Endpoint)> = Vec::new();
    if let Some(config) = config {
        if let Some(lazy) = &config.lazy_auth {
            endpoints_of_lazy_auth(lazy, &mut needed);
        }
        if let Some(cache) = &config.post_cache {
            endpoints_of_post_cache(cache, &mut needed);
        }
        if let Some(metering) = &config.metering {
            endpoints_of_metering(metering, &mut needed);
        }
    }
    let mut addresses = BTreeMap::new();
    for (name, address) in &native.upstreams {
        let address: SocketAddr = address
            .parse()
            .map_err(|e| format!("native.upstreams.{name}: {address:?} is not host:port ({e})"))?;
        addresses.insert(name.clone(), address);
    }
    for (field, endpoint) in needed {
        if !addresses.contains_key(&endpoint.cluster) {
            return Err(format!(
                "native.upstreams: no address for cluster {:?} ({field}.cluster): the observer's thread calls it directly",
                endpoint.cluster
            ));
        }
    }
    Ok(addresses)
}

fn endpoints_of_lazy_auth<'a>(c: &'a LazyAuthConfig, out: &mut Vec<(&'static str, &'a Endpoint)>) {
    if let Some(jwks) = &c.jwt.jwks {
        out.push(("lazy_auth.jwt.jwks", &jwks.endpoint));
    }
    if let Some(keys) = &c.api_keys {
        out.push(("lazy_auth.api_keys", &keys.endpoint));
    }
    if let Some(audit) = &c.audit {
        out.push(("lazy_auth.audit", &audit.endpoint));
    }
}

fn endpoints_of_post_cache<'a>(
    c: &'a PostCacheConfig,
    out: &mut Vec<(&'static str, &'a Endpoint)>,
) {
    if let Some(fleet) = &c.fleet {
        out.push(("post_cache.fleet", &fleet.endpoint));
    }
}

fn endpoints_of_metering<'a>(c: &'a MeteringConfig, out: &mut Vec<(&'static str, &'a Endpoint)>) {
    if let Some(sink) = &c.sink {
        out.push(("metering.sink", &sink.endpoint));
    }
}
