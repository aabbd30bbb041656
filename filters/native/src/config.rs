//! The native chain's configuration beyond the stages' sections: the
//! `native` section, the observer's configuration and the addresses of the
//! clusters it calls, and what the stages may hold in shared data.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::cache::config::PostCacheConfig;
use zerolayer_core::config::{Endpoint, ObserverMode, ROOT};
use zerolayer_core::footprint::{self, KeySpace};
use zerolayer_core::metering::MeteringConfig;
use zerolayer_core::native::NativeSection;
use zerolayer_core::quota::config::QuotaConfig;
use zerolayer_fused::{Document, Stage};
use zerolayer_observer::ObserverConfig;

/// The module's configuration as far as it is checked without Envoy: what
/// [`load`] found. Pure (no thread, no metric, no host call), so the
/// `host-sim check` command reads it too (`#[path]`-included there).
pub(crate) struct Loaded<'a> {
    /// The `native` section (its defaults when absent).
    pub(crate) native: NativeSection,
    /// The stages' sections, in chain order, each as its bytes in the document.
    pub(crate) sections: Vec<(Stage, &'a [u8])>,
    /// What the stages may hold in shared data, by purpose.
    pub(crate) spaces: Vec<KeySpace>,
    /// The observer's configuration, if any stage has work for it.
    pub(crate) observer: Option<ObserverConfig>,
    /// The addresses of the clusters the observer's thread calls.
    pub(crate) upstreams: BTreeMap<String, SocketAddr>,
    /// The quota section and its store's cluster and address.
    pub(crate) quota: Option<(&'a [u8], (String, SocketAddr))>,
}

/// Reads and checks the configuration document: its sections, the `native`
/// section, the observer's configuration, the upstream addresses, the quota
/// store and the shared-data caps; `Err` is one line naming the field
/// (`native.upstreams: …`, `lazy_auth.jwt.issuers: …`). The stages' own
/// roots check their sections again when they are configured.
pub(crate) fn load(config: &[u8]) -> Result<Loaded<'_>, String> {
    let mut document = Document::parse(config)?;
    let native = match document.take("native") {
        Some(native) => zerolayer_core::config::from_json::<NativeSection>(native.get().as_bytes())
            .map_err(|e| match e.path() {
                ROOT => format!("native: {}", e.message()),
                path => format!("native.{path}: {}", e.message()),
            })?,
        None => NativeSection::default(),
    };
    let sections = document.sections()?;
    let parsed = ObserverSections::parse(&sections)?;
    let spaces = parsed.key_spaces();
    let observer = parsed.into_observer_config()?;
    let upstreams = upstreams(&native, observer.as_ref())?;
    let quota = match sections.iter().find(|(stage, _)| *stage == Stage::Quota) {
        Some(&(_, section)) => Some((section, quota_store(section, &upstreams)?)),
        None => None,
    };
    let (keys, bytes) = footprint::total(&spaces);
    if let Some(max) = native.shared_max_entries.filter(|&max| max < keys) {
        return Err(format!(
            "native.shared_max_entries: {max} is less than the {keys} keys the stages may hold ({})",
            footprint::describe(&spaces)
        ));
    }
    if let Some(max) = native.shared_max_bytes.filter(|&max| max < bytes) {
        return Err(format!(
            "native.shared_max_bytes: {max} is less than the {bytes} bytes the stages may hold ({})",
            footprint::describe(&spaces)
        ));
    }
    Ok(Loaded {
        native,
        sections,
        spaces,
        observer,
        upstreams,
        quota,
    })
}

/// The sections the module reads itself besides their stages — lazy-auth,
/// post-cache and metering, for the observer's configuration and shared
/// data's footprint — each parsed once, here.
#[derive(Default)]
pub(crate) struct ObserverSections {
    lazy_auth: Option<LazyAuthConfig>,
    post_cache: Option<PostCacheConfig>,
    metering: Option<MeteringConfig>,
}

impl ObserverSections {
    /// Parses the sections the observer works for; `Err` names the field
    /// (`lazy_auth.jwt.issuers: …`), as the observer's own configuration
    /// does.
    pub(crate) fn parse(sections: &[(Stage, &[u8])]) -> Result<ObserverSections, String> {
        fn section<T: serde::de::DeserializeOwned>(
            name: &str,
            bytes: &[u8],
        ) -> Result<Option<T>, String> {
            zerolayer_core::config::from_json(bytes)
                .map(Some)
                .map_err(|e| match e.path() {
                    ROOT => format!("{name}: {}", e.message()),
                    path => format!("{name}.{path}: {}", e.message()),
                })
        }
        let mut parsed = ObserverSections::default();
        // In the order the sections' names sort, as the observer reads them.
        for stage in [Stage::LazyAuth, Stage::Metering, Stage::PostCache] {
            let Some(&(_, bytes)) = sections.iter().find(|(s, _)| *s == stage) else {
                continue;
            };
            match stage {
                Stage::LazyAuth => parsed.lazy_auth = section(stage.section(), bytes)?,
                Stage::PostCache => parsed.post_cache = section(stage.section(), bytes)?,
                Stage::Metering => parsed.metering = section(stage.section(), bytes)?,
                Stage::Activation | Stage::Quota => {}
            }
        }
        Ok(parsed)
    }

    /// What the configured stages may hold in shared data, by purpose.
    pub(crate) fn key_spaces(&self) -> Vec<KeySpace> {
        let mut spaces = Vec::new();
        if let Some(lazy) = &self.lazy_auth {
            spaces.extend(lazy.key_spaces());
        }
        if let Some(cache) = &self.post_cache {
            spaces.extend(cache.key_spaces());
        }
        spaces
    }

    /// The observer's configuration from the sections it works for (none
    /// when none of them is there), checked as the observer checks its own.
    /// Natively it always runs on its own thread: a section asking for the
    /// tick mode is refused, naming it.
    pub(crate) fn into_observer_config(self) -> Result<Option<ObserverConfig>, String> {
        if self.lazy_auth.is_none() && self.post_cache.is_none() && self.metering.is_none() {
            return Ok(None);
        }
        let config = ObserverConfig::from_sections(self.lazy_auth, self.post_cache, self.metering)
            .map_err(|e| e.to_string())?;
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

/// The quota stage's store (`quota.store.cluster`) and the address the
/// module's quota thread reaches it at, from `native.upstreams`
/// (`addresses`); `Err` names the field. A request waiting for its grant
/// calls the store through Envoy's cluster of that name instead.
pub(crate) fn quota_store(
    section: &[u8],
    addresses: &BTreeMap<String, SocketAddr>,
) -> Result<(String, SocketAddr), String> {
    let config = QuotaConfig::from_json(section).map_err(|e| match e.path() {
        ROOT => format!("quota: {}", e.message()),
        path => format!("quota.{path}: {}", e.message()),
    })?;
    let cluster = config.store.endpoint.cluster;
    match addresses.get(&cluster) {
        Some(&address) => Ok((cluster, address)),
        None => Err(format!(
            "native.upstreams: no address for cluster {cluster:?} (quota.store.cluster): the module's quota thread calls it directly"
        )),
    }
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
