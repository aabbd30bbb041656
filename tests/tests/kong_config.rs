//! Kong's forms of the chain — the five separate filters (`kong/kong.yml`)
//! and the fused filter (`kong/kong-fused.yml`), both run with
//! `kong/kong.conf` — checked structurally: the service, route and filter
//! chain Kong would load, each stage's configuration parsed by that
//! filter's own parser, the shared memory and environment ngx_wasm_module
//! needs, the chains kept in step with the filters the build produces, the
//! fused form kept in step with the separate one and with
//! `envoy/zerolayer-fused.yaml`; and each form configured and given a
//! request under host-sim's Kong profile with the queues kong.conf declares.
//!
//! Kong itself is not run (the project does not install it): the filters'
//! Kong behaviour (observer on tick, per-filter queues, CAS-only overwrites,
//! no callouts from response phases) is exercised under host-sim's `kong`
//! profile by the `*_host_sim` tests. Where these checks model Kong (how
//! kong.conf keys become nginx directives), the model follows Kong's
//! conf_loader and nginx template; kong/README.md says what is unverified.

use std::collections::BTreeSet;
use std::fs;
use std::net::SocketAddr;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail, ensure};
use host_sim::{Host, HostOptions, PluginSpec, Profile};
use serde::Deserialize;
use serde_json::Value;
use zerolayer_core::activation::RuleSet;
use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::cache::config::PostCacheConfig;
use zerolayer_core::config::{ObserverLink, ObserverMode};
use zerolayer_core::metering::MeteringConfig;
use zerolayer_core::quota::config::QuotaConfig;
use zerolayer_e2e::chain::CACHE_SECRET;
use zerolayer_e2e::{EnvoyConfig, paths};

/// The chain, in the documented order (filter names as the filters call
/// themselves: Kong's name is `zerolayer_<name>` with `_` for `-`, the crate
/// `zerolayer-<name>`).
const CHAIN: [&str; 5] = ["lazy-auth", "activation", "quota", "post-cache", "metering"];

/// Kong's name of the fused filter.
const FUSED_FILTER: &str = "zerolayer_fused";

/// Modules xtask builds (by `.wasm` name) that are deliberately not in Kong's chain.
const NOT_IN_KONG: [(&str, &str); 2] = [
    (
        "zerolayer_observer_service",
        "Envoy's singleton; in Kong each filter embeds its observer",
    ),
    ("zerolayer_probe", "a test-only filter"),
];

/// Stages Kong's fused form runs that Envoy's shipped fused form does not
/// (yet), with the reason.
const KONG_ONLY_SECTIONS: [(&str, &str); 1] = [(
    "quota",
    "Envoy's shipped files carry no webdis cluster; its tests insert the stage (tests/tests/quota_envoy.rs)",
)];

/// Stock nginx refuses a single directive string longer than this; Kong's
/// filter_chains are not nginx directives, but a config that fits also works
/// in a plain nginx + ngx_wasm_module deployment (`proxy_wasm name 'config'`).
const NGINX_DIRECTIVE_MAX: usize = 4096;

/// ngx_wasm_module's smallest shared memory zone.
const MIN_SHM_BYTES: u64 = 15 * 1024;

/// Where the build puts the filters (relative to the repository root).
const WASM_DIR: &str = "target/wasm32-wasip1/wasm";

/// The parts of Kong's declarative configuration these checks read
/// (Kong accepts many more fields; unknown ones are ignored here).
#[derive(Debug, Deserialize)]
struct Declarative {
    #[serde(rename = "_format_version")]
    format_version: Option<serde_yaml::Value>,
    #[serde(default)]
    services: Vec<Service>,
    /// Top-level chains would attach by `service:`/`route:` reference; this
    /// project nests its chain under the service, so any here is drift.
    #[serde(default)]
    filter_chains: Vec<serde_yaml::Value>,
}

#[derive(Debug, Deserialize)]
struct Service {
    name: Option<String>,
    url: Option<String>,
    #[serde(default)]
    routes: Vec<Route>,
    #[serde(default)]
    filter_chains: Vec<FilterChain>,
}

#[derive(Debug, Deserialize)]
struct Route {
    #[serde(default)]
    paths: Vec<String>,
    #[serde(default)]
    methods: Vec<String>,
    strip_path: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct FilterChain {
    enabled: Option<bool>,
    #[serde(default)]
    filters: Vec<Filter>,
}

#[derive(Debug, Deserialize)]
struct Filter {
    name: String,
    enabled: Option<bool>,
    config: Option<serde_yaml::Value>,
}

fn kong_file(name: &str) -> Result<String> {
    let path = paths::root().join("kong").join(name);
    fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// Kong's two forms of the chain, each a declarative configuration run with
/// the same kong.conf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// The five filters, one chain entry each (`kong/kong.yml`).
    Separate,
    /// The fused filter, one chain entry with a section per stage
    /// (`kong/kong-fused.yml`).
    Fused,
}

impl Form {
    const ALL: [Form; 2] = [Form::Separate, Form::Fused];

    /// The declarative configuration's file in `kong/`.
    fn file(self) -> &'static str {
        match self {
            Form::Separate => "kong.yml",
            Form::Fused => "kong-fused.yml",
        }
    }

    /// The chain's filters in order, as Kong names them.
    fn chain(self) -> Vec<String> {
        match self {
            Form::Separate => CHAIN.iter().map(|n| kong_name(n)).collect(),
            Form::Fused => vec![FUSED_FILTER.to_string()],
        }
    }
}

/// One form's declarative configuration, with where it came from.
struct Kong {
    /// `kong/<file>`, for messages.
    at: String,
    config: Declarative,
}

impl Kong {
    fn load(form: Form) -> Result<Kong> {
        let at = format!("kong/{}", form.file());
        let config = serde_yaml::from_str(&kong_file(form.file())?)
            .with_context(|| format!("{at} is not valid YAML"))?;
        Ok(Kong { at, config })
    }

    /// The `llm` service, the one the chain is attached to.
    fn llm_service(&self) -> Result<&Service> {
        self.config
            .services
            .iter()
            .find(|s| s.name.as_deref() == Some("llm"))
            .ok_or_else(|| anyhow!("{}: no service named `llm`", self.at))
    }

    /// The single filter chain attached to the `llm` service.
    fn chain(&self) -> Result<&FilterChain> {
        let service = self.llm_service()?;
        match service.filter_chains.as_slice() {
            [chain] => Ok(chain),
            chains => bail!(
                "{}: service `llm` must carry exactly one filter chain, found {}",
                self.at,
                chains.len()
            ),
        }
    }

    /// The JSON configuration string of the chain's filter `kong` (Kong's
    /// name).
    fn config_text(&self, kong: &str) -> Result<String> {
        let at = &self.at;
        let filter = self
            .chain()?
            .filters
            .iter()
            .find(|f| f.name == kong)
            .ok_or_else(|| anyhow!("{at}: filter {kong} is not in the chain"))?;
        match &filter.config {
            Some(serde_yaml::Value::String(text)) => Ok(text.clone()),
            // The filters ship no `<name>.meta.json` schema: Kong then
            // accepts a string only, and hands it to on_configure byte for
            // byte.
            Some(other) => bail!(
                "{at}: {kong}.config must be the JSON configuration as a string, found {other:?}"
            ),
            None => bail!("{at}: {kong} has no config"),
        }
    }

    /// Each chain member's whole configuration string, by Kong's name.
    fn config_texts(&self) -> Result<Vec<(String, String)>> {
        self.chain()?
            .filters
            .iter()
            .map(|f| Ok((f.name.clone(), self.config_text(&f.name)?)))
            .collect()
    }

    /// Each stage's configuration as JSON text, in chain order by chain
    /// name: a filter's config (separate form) or a section of the fused
    /// filter's (fused form, which must carry every stage).
    fn stage_configs(&self) -> Result<Vec<(&'static str, String)>> {
        let at = &self.at;
        let fused = self.chain()?.filters.iter().any(|f| f.name == FUSED_FILTER);
        if !fused {
            return CHAIN
                .iter()
                .map(|name| Ok((*name, self.config_text(&kong_name(name))?)))
                .collect();
        }
        let sections = fused_sections(&self.config_text(FUSED_FILTER)?)
            .with_context(|| format!("{at}: {FUSED_FILTER}.config"))?;
        CHAIN
            .iter()
            .map(|name| {
                let section = section_name(name);
                let value = sections.get(&section).with_context(|| {
                    format!("{at}: {FUSED_FILTER}.config has no `{section}` section (Kong's fused form runs the whole chain)")
                })?;
                Ok((*name, value.to_string()))
            })
            .collect()
    }

    /// The observer link of each stage that has one, by chain name.
    fn observer_links(&self) -> Result<Vec<(&'static str, ObserverLink)>> {
        let configs = self.stage_configs()?;
        let text = |name: &str| -> &str {
            configs
                .iter()
                .find(|(n, _)| *n == name)
                .map_or("", |(_, t)| t.as_str())
        };
        let lazy = LazyAuthConfig::from_json(text("lazy-auth").as_bytes())
            .map_err(|e| anyhow!("{}: lazy-auth config: {e}", self.at))?;
        let cache = self.post_cache()?;
        let metering = MeteringConfig::from_json(text("metering").as_bytes())
            .map_err(|e| anyhow!("{}: metering config: {e}", self.at))?;
        Ok(vec![
            ("lazy-auth", lazy.observer),
            ("post-cache", cache.observer),
            ("metering", metering.observer),
        ])
    }

    /// post-cache's configuration, parsed.
    fn post_cache(&self) -> Result<PostCacheConfig> {
        let configs = self.stage_configs()?;
        let text = configs
            .iter()
            .find(|(n, _)| *n == "post-cache")
            .map(|(_, t)| t.as_str())
            .unwrap_or_default();
        PostCacheConfig::from_json(text.as_bytes())
            .map_err(|e| anyhow!("{}: post-cache config: {e}", self.at))
    }
}

/// The fused filter's section for chain member `name` (`lazy-auth` →
/// `lazy_auth`).
fn section_name(name: &str) -> String {
    name.replace('-', "_")
}

/// A fused configuration's sections by name; a section that names no
/// stage is an error (the fused filter refuses it too).
fn fused_sections(text: &str) -> Result<serde_json::Map<String, Value>> {
    let value: Value = serde_json::from_str(text).context("not JSON")?;
    let Value::Object(sections) = value else {
        bail!("not an object with a section per stage");
    };
    let known: Vec<String> = CHAIN.iter().map(|n| section_name(n)).collect();
    if let Some(unknown) = sections.keys().find(|k| !known.contains(k)) {
        bail!("section `{unknown}` names no stage (expected {known:?})");
    }
    Ok(sections)
}

/// Kong's filter name for chain member `name`.
fn kong_name(name: &str) -> String {
    format!("zerolayer_{}", name.replace('-', "_"))
}

/// The queue a filter's observer registers in tick mode:
/// `<observer.queue>.<filter>` (filters/observer), so each filter drains only
/// its own jobs.
fn tick_queue(link: &ObserverLink, filter: &str) -> String {
    format!("{}.{filter}", link.queue)
}

#[test]
fn both_forms_declare_the_llm_service_its_route_and_the_chain_in_order() -> Result<()> {
    for form in Form::ALL {
        let kong = Kong::load(form)?;
        let at = &kong.at;
        // Quoted in the file: an unquoted 3.0 is a YAML float, which Kong refuses.
        match &kong.config.format_version {
            Some(serde_yaml::Value::String(v)) if v == "3.0" => {}
            other => {
                bail!("{at}: _format_version must be the string \"3.0\", found {other:?}")
            }
        }
        let service = kong.llm_service()?;
        ensure!(
            service.url.as_deref() == Some("http://127.0.0.1:18080"),
            "{at}: service llm must point at the loopback backend http://127.0.0.1:18080, found {:?}",
            service.url
        );
        let routed: BTreeSet<&str> = service
            .routes
            .iter()
            .filter(|r| r.methods.iter().any(|m| m == "POST"))
            .flat_map(|r| r.paths.iter().map(String::as_str))
            .collect();
        for path in ["/v1/messages", "/v1/chat/completions"] {
            ensure!(
                routed.contains(path),
                "{at}: no POST route of service llm has path {path} (found {routed:?})"
            );
        }
        for route in &service.routes {
            // Kong strips the matched prefix by default: the backend would get `/`.
            ensure!(
                route.strip_path == Some(false),
                "{at}: route with paths {:?} must set strip_path: false",
                route.paths
            );
        }
        ensure!(
            kong.config.filter_chains.is_empty(),
            "{at}: the chain belongs under service llm, not at the top level"
        );
        let chain = kong.chain()?;
        ensure!(
            chain.enabled != Some(false),
            "{at}: the filter chain is disabled"
        );
        let found: Vec<&str> = chain.filters.iter().map(|f| f.name.as_str()).collect();
        let expected = form.chain();
        ensure!(
            found == expected,
            "{at}: the chain must be exactly {expected:?} in this order, found {found:?}"
        );
        for filter in &chain.filters {
            ensure!(
                filter.enabled != Some(false),
                "{at}: filter {} is disabled",
                filter.name
            );
        }
    }
    Ok(())
}

#[test]
fn every_stage_config_parses_with_its_own_parser_and_observes_on_tick() -> Result<()> {
    for form in Form::ALL {
        let kong = Kong::load(form)?;
        let at = &kong.at;
        for (filter, text) in kong.config_texts()? {
            ensure!(
                text.len() <= NGINX_DIRECTIVE_MAX,
                "{at}: {filter}: config is {} bytes, over the {NGINX_DIRECTIVE_MAX}-byte nginx directive limit",
                text.len()
            );
        }
        for (name, text) in kong.stage_configs()? {
            // Each filter's own entry point, the one its on_configure calls
            // (the fused filter hands each stage its section).
            let parsed = match name {
                "activation" => RuleSet::from_json(text.as_bytes()).map(drop),
                "lazy-auth" => LazyAuthConfig::from_json(text.as_bytes()).map(drop),
                "post-cache" => PostCacheConfig::from_json(text.as_bytes()).map(drop),
                "metering" => MeteringConfig::from_json(text.as_bytes()).map(drop),
                "quota" => QuotaConfig::from_json(text.as_bytes()).map(drop),
                other => bail!("no parser known for chain member {other}"),
            };
            parsed.map_err(|e| anyhow!("{at}: {name}: config refused: {e}"))?;
        }
        for (filter, link) in kong.observer_links()? {
            // An absent observer section means singleton, which needs Envoy.
            ensure!(
                link.mode == ObserverMode::Tick,
                "{at}: {filter}: observer.mode is {:?}; Kong has no singleton service nor queue notifications, it needs \"tick\"",
                link.mode
            );
        }
    }
    Ok(())
}

/// `value` without what a host changes about it (observer placement,
/// callout targets, the cache's size): what must be the same in every form.
fn without_host_specifics(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(k, _)| {
                    !["observer", "cluster", "authority", "max_entries"].contains(&k.as_str())
                })
                .map(|(k, v)| (k.clone(), without_host_specifics(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_host_specifics).collect()),
        other => other.clone(),
    }
}

#[test]
fn the_fused_form_runs_the_separate_chains_stages_as_envoys_fused_form_does() -> Result<()> {
    let separate = Kong::load(Form::Separate)?.stage_configs()?;
    let fused = Kong::load(Form::Fused)?.stage_configs()?;
    // The two Kong forms run the same stages with the same configurations.
    for (name, theirs) in &separate {
        let ours = &fused
            .iter()
            .find(|(n, _)| n == name)
            .with_context(|| {
                format!(
                    "kong/kong-fused.yml has no `{}` section",
                    section_name(name)
                )
            })?
            .1;
        let ours: Value = serde_json::from_str(ours)?;
        let theirs: Value = serde_json::from_str(theirs)?;
        ensure!(
            ours == theirs,
            "kong/kong-fused.yml's `{}` section differs from {}'s config in kong/kong.yml: keep them the same",
            section_name(name),
            kong_name(name)
        );
    }
    // And the same stages as Envoy's fused form, configured alike except
    // where Kong needs otherwise (kong/kong.yml's header lists what).
    let envoy = EnvoyConfig::shipped("zerolayer-fused.yaml")?.wasm_filter_json("zerolayer")?;
    let envoy = envoy
        .as_object()
        .context("envoy/zerolayer-fused.yaml: the fused configuration is not an object")?;
    let envoy_sections: BTreeSet<&str> = envoy.keys().map(String::as_str).collect();
    let kong_sections: BTreeSet<String> = fused.iter().map(|(n, _)| section_name(n)).collect();
    let kong_sections: BTreeSet<&str> = kong_sections
        .iter()
        .map(String::as_str)
        .filter(|s| !KONG_ONLY_SECTIONS.iter().any(|(k, _)| k == s) || envoy_sections.contains(s))
        .collect();
    ensure!(
        envoy_sections == kong_sections,
        "envoy/zerolayer-fused.yaml has the sections {envoy_sections:?}, kong/kong-fused.yml {kong_sections:?}: the two fused forms must run the same stages"
    );
    for (name, ours) in &fused {
        let section = section_name(name);
        if !envoy.contains_key(&section) {
            // A KONG_ONLY_SECTIONS stage (checked above).
            continue;
        }
        let ours = without_host_specifics(&serde_json::from_str(ours)?);
        let theirs = without_host_specifics(&envoy[&section]);
        ensure!(
            ours == theirs,
            "`{section}` differs between kong/kong-fused.yml and envoy/zerolayer-fused.yaml beyond observers, callout targets and max_entries:\n kong:  {ours}\n envoy: {theirs}"
        );
    }
    Ok(())
}

/// Every object with a `cluster` key in `value` (a callout target), with
/// its JSON path.
fn callout_targets<'a>(value: &'a Value, at: &str, out: &mut Vec<(String, &'a Value)>) {
    match value {
        Value::Object(map) => {
            if map.contains_key("cluster") {
                out.push((at.to_string(), value));
            }
            for (key, inner) in map {
                callout_targets(inner, &format!("{at}.{key}"), out);
            }
        }
        Value::Array(items) => {
            for (i, inner) in items.iter().enumerate() {
                callout_targets(inner, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

#[test]
fn callout_targets_are_ip_and_port_with_an_explicit_authority() -> Result<()> {
    for form in Form::ALL {
        let kong = Kong::load(form)?;
        let mut checked = Vec::new();
        for (name, text) in kong.stage_configs()? {
            let json: Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: {name}: config is not JSON", kong.at))?;
            let mut targets = Vec::new();
            callout_targets(&json, &format!("{}: {name}", kong.at), &mut targets);
            for (at, target) in targets {
                let cluster = target["cluster"].as_str().unwrap_or_default();
                // ngx_wasm_module takes a host (with an optional port) where
                // Envoy takes a cluster name; an IP address needs no
                // resolver, a name would depend on the resolver Kong is given.
                ensure!(
                    cluster.parse::<SocketAddr>().is_ok(),
                    "{at}.cluster is {cluster:?}: in Kong it must be an IP:port (e.g. 127.0.0.1:18091), not a name"
                );
                // Otherwise the Host header would be the bare IP:port.
                ensure!(
                    target["authority"].as_str().is_some_and(|a| !a.is_empty()),
                    "{at}: set `authority` explicitly (the Host header the backend expects)"
                );
                checked.push(at);
            }
        }
        // JWKS, API key introspection, audit sink, usage sink, quota's
        // store: the walk found them.
        ensure!(
            checked.len() >= 5,
            "{}: expected at least 5 callout targets, found {checked:?}",
            kong.at
        );
    }
    Ok(())
}

/// The `.wasm` files xtask builds, by name: one per crate of its MODULES
/// list (`zerolayer-<name>-module` makes `zerolayer_<name>.wasm`, any other
/// crate its own name with `_` for `-`).
fn built_modules() -> Result<Vec<String>> {
    let source = fs::read_to_string(paths::root().join("xtask/src/main.rs"))
        .context("reading xtask/src/main.rs")?;
    let start = source
        .find("pub const MODULES: &[&str] = &[")
        .context("xtask/src/main.rs: no `pub const MODULES: &[&str] = &[` list")?;
    let list = &source[start..];
    let end = list
        .find("];")
        .context("xtask/src/main.rs: MODULES list not closed")?;
    Ok(list[..end]
        .split('"')
        .skip(1)
        .step_by(2)
        .map(|krate| {
            krate
                .strip_suffix("-module")
                .unwrap_or(krate)
                .replace('-', "_")
        })
        .collect())
}

#[test]
fn the_chains_and_the_build_list_the_same_filters() -> Result<()> {
    let built: BTreeSet<String> = built_modules()?.into_iter().collect();
    ensure!(
        !built.is_empty(),
        "xtask/src/main.rs: MODULES lists no crates"
    );
    let mut chain = BTreeSet::new();
    for form in Form::ALL {
        let kong = Kong::load(form)?;
        for filter in &kong.chain()?.filters {
            // Kong's name is the .wasm file name: zerolayer_<name>.
            let module = filter.name.clone();
            ensure!(
                built.contains(&module),
                "{} names {}, which no crate xtask builds makes (Kong would find no {WASM_DIR}/{}.wasm)",
                kong.at,
                filter.name,
                filter.name
            );
            chain.insert(module);
        }
    }
    let skipped: BTreeSet<String> = NOT_IN_KONG.iter().map(|(c, _)| c.to_string()).collect();
    let missing: Vec<&String> = built
        .difference(&chain)
        .filter(|c| !skipped.contains(*c))
        .collect();
    ensure!(
        missing.is_empty(),
        "xtask builds {missing:?}, which neither kong/kong.yml's nor kong/kong-fused.yml's chain has: add it to a chain (and kong/README.md), or to NOT_IN_KONG here with the reason"
    );
    for (module, why) in NOT_IN_KONG {
        ensure!(
            built.contains(module),
            "NOT_IN_KONG lists {module} ({why}), which xtask's MODULES no longer builds: drop it here"
        );
    }
    Ok(())
}

/// kong.conf as Kong reads it: `key = value` lines, `#` comments (a `#`
/// not escaped with `\` ends the value), keys kept as written.
fn kong_conf() -> Result<Vec<(String, String)>> {
    let text = kong_file("kong.conf")?;
    let mut entries = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .with_context(|| format!("kong/kong.conf:{}: not `key = value`", n + 1))?;
        let value = match value
            .char_indices()
            .find(|&(i, c)| c == '#' && (i == 0 || value.as_bytes()[i - 1] != b'\\'))
        {
            Some((i, _)) => &value[..i],
            None => value,
        };
        entries.push((key.trim().to_string(), value.trim().to_string()));
    }
    Ok(entries)
}

fn conf_value<'a>(conf: &'a [(String, String)], key: &str) -> Result<&'a str> {
    let mut found = conf.iter().filter(|(k, _)| k == key);
    let (_, value) = found
        .next()
        .with_context(|| format!("kong/kong.conf: `{key}` is not set"))?;
    // Kong keeps one value per key: a second line silently wins.
    ensure!(
        found.next().is_none(),
        "kong/kong.conf: `{key}` is set twice; Kong keeps only one value"
    );
    Ok(value)
}

/// The directives Kong injects into the `wasm{}` block from kong.conf
/// (kong/templates/nginx.lua): `nginx_wasm_shm_kv_<name> = v` becomes
/// `shm_kv <name> v;`, any other `nginx_wasm_<directive> = v` becomes
/// `<directive> v;` (runtime flags `nginx_wasm_{wasmtime,v8,wasmer}_*` go to
/// sub-blocks and are left out). Split at `;` into argument lists.
fn wasm_block(conf: &[(String, String)]) -> Vec<Vec<String>> {
    let mut text = String::new();
    for (key, value) in conf {
        if let Some(name) = key.strip_prefix("nginx_wasm_shm_kv_") {
            text.push_str(&format!("shm_kv {name} {value};"));
        } else if let Some(directive) = key.strip_prefix("nginx_wasm_") {
            let runtime = ["wasmtime_", "v8_", "wasmer_"];
            if !runtime.iter().any(|r| directive.starts_with(r)) {
                text.push_str(&format!("{directive} {value};"));
            }
        }
    }
    text.split(';')
        .map(|d| d.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .filter(|d| !d.is_empty())
        .collect()
}

/// An nginx size (`512`, `64k`, `128m`, `1g`) in bytes.
fn nginx_size(text: &str) -> Result<u64> {
    let (digits, unit) = match text.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&text[..i], c.to_ascii_lowercase()),
        _ => (text, 'b'),
    };
    let n: u64 = digits
        .parse()
        .with_context(|| format!("{text:?} is not an nginx size"))?;
    let scale = match unit {
        'b' => 1,
        'k' => 1 << 10,
        'm' => 1 << 20,
        'g' => 1 << 30,
        other => bail!("{text:?}: unknown size unit {other:?}"),
    };
    Ok(n * scale)
}

#[test]
fn kong_conf_enables_wasm_and_declares_what_the_filters_need() -> Result<()> {
    let conf = kong_conf()?;
    // Kong's config reader turns any other character of a key into `_`
    // (`nginx_wasm_shm_kv_*` would declare a zone named `_`).
    for (key, _) in &conf {
        ensure!(
            key.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
            "kong/kong.conf: key {key:?} has characters Kong rewrites to `_`"
        );
    }
    let expect = |key: &str, want: &str| -> Result<()> {
        let got = conf_value(&conf, key)?;
        ensure!(
            got == want,
            "kong/kong.conf: `{key}` must be {want:?}, found {got:?}"
        );
        Ok(())
    };
    expect("database", "off")?;
    expect("wasm", "on")?;
    expect("wasm_filters_path", WASM_DIR)?;
    let declarative_path = conf_value(&conf, "declarative_config")?;
    ensure!(
        paths::root().join(declarative_path).is_file(),
        "kong/kong.conf: declarative_config {declarative_path:?} is not a file relative to the repository root"
    );
    ensure!(
        Path::new(declarative_path).ends_with("kong/kong.yml"),
        "kong/kong.conf: declarative_config must be kong/kong.yml, found {declarative_path:?}"
    );
    for key in ["proxy_listen", "admin_listen"] {
        let listen = conf_value(&conf, key)?;
        ensure!(
            listen
                .split(',')
                .all(|l| l.trim().starts_with("127.0.0.1:")),
            "kong/kong.conf: `{key}` must stay on loopback, found {listen:?}"
        );
    }

    // One kong.conf for both forms (the fused one is chosen with
    // KONG_DECLARATIVE_CONFIG=kong/kong-fused.yml): its stages need the same
    // secret, zone and queues as the separate filters.
    let block = wasm_block(&conf);
    for form in Form::ALL {
        kong_conf_serves(&conf, &block, &Kong::load(form)?)?;
    }
    Ok(())
}

/// The directives of kong.conf's `wasm{}` block naming the queues the
/// filters' observers register (`shm_queue <name> <size>`): name and size.
fn declared_queues(block: &[Vec<String>]) -> Vec<(String, String)> {
    block
        .iter()
        .filter(|d| d[0] == "shm_queue")
        .filter_map(|d| Some((d.get(1)?.clone(), d.get(2)?.clone())))
        .collect()
}

/// Checks that kong.conf (`conf`, its `wasm{}` directives `block`) gives
/// `kong`'s stages what they need: the secret's `env`, the `*` zone, one
/// queue per observer.
fn kong_conf_serves(conf: &[(String, String)], block: &[Vec<String>], kong: &Kong) -> Result<()> {
    let at = &kong.at;
    // nginx clears the workers' environment except `env`-declared variables:
    // post-cache's secret must be one of them.
    let cache = kong.post_cache()?;
    let env = conf_value(conf, "nginx_main_env")?;
    ensure!(
        env.split(|c: char| c == ';' || c.is_whitespace())
            .any(|v| v == cache.secret_env),
        "kong/kong.conf: nginx_main_env must declare post-cache's secret_env {:?} ({at}), found {env:?}",
        cache.secret_env
    );

    // zerolayer's shared-data keys (`zl:…`) carry no `<zone>/` prefix: they
    // live in the default zone `*`, and without it every access traps.
    let kv: Vec<&Vec<String>> = block
        .iter()
        .filter(|d| d[0] == "shm_kv" && d.get(1).map(String::as_str) == Some("*"))
        .collect();
    let [kv] = kv.as_slice() else {
        bail!(
            "kong/kong.conf must declare the shared key/value zone `*` exactly once (wasm{{}} gets {block:?})"
        );
    };
    let kv_size = nginx_size(kv.get(2).context("shm_kv * has no size")?)?;
    ensure!(
        kv_size > cache.memory_bound(),
        "kong/kong.conf: the `*` zone ({kv_size} bytes) cannot hold post-cache's bound in {at} ({} bytes: max_entries × max_entry_bytes); raise it or lower max_entries",
        cache.memory_bound()
    );

    // One queue per stage observer, each declared once (nginx refuses a
    // second zone with the same name).
    let queues = declared_queues(block);
    for (filter, link) in kong.observer_links()? {
        let queue = tick_queue(&link, filter);
        let declared: Vec<&String> = queues
            .iter()
            .filter(|(name, _)| *name == queue)
            .map(|(_, size)| size)
            .collect();
        let [size] = declared.as_slice() else {
            bail!(
                "kong/kong.conf must declare `shm_queue {queue} <size>` exactly once for {filter}'s observer in {at} (declared {}; wasm{{}} gets {block:?})",
                declared.len()
            );
        };
        let size = nginx_size(size)?;
        ensure!(
            size >= MIN_SHM_BYTES,
            "kong/kong.conf: queue {queue} is {size} bytes; ngx_wasm_module needs at least 15k"
        );
        if filter == "post-cache" {
            // A fleet write carries a whole entry.
            ensure!(
                size > u64::from(cache.max_entry_bytes),
                "kong/kong.conf: queue {queue} ({size} bytes) cannot hold one entry of max_entry_bytes ({})",
                cache.max_entry_bytes
            );
        }
    }
    Ok(())
}

/// Kong's form `form` in host-sim's Kong profile (Kong Gateway's build),
/// with exactly the queues kong.conf declares and the cache secret in the
/// environment (`nginx_main_env`).
fn kong_gateway(form: Form) -> Result<(Host, host_sim::ChainId)> {
    let conf = kong_conf()?;
    let mut host = Host::with_options(HostOptions {
        profile: Profile::Kong,
        kong_queues: declared_queues(&wasm_block(&conf))
            .into_iter()
            .map(|(name, _)| name)
            .collect(),
        kong_gateway: true,
        ..Default::default()
    })?;
    let kong = Kong::load(form)?;
    let specs = kong
        .config_texts()?
        .into_iter()
        .map(|(name, config)| {
            let file = name.strip_prefix("zerolayer_").unwrap_or(&name);
            Ok(PluginSpec::new(&name, paths::wasm(file)?)
                .configuration(config)
                .env("ZEROLAYER_CACHE_SECRET", CACHE_SECRET))
        })
        .collect::<Result<Vec<_>>>()?;
    let chain = host
        .add_chain(specs)
        .with_context(|| format!("{}: a filter refused its configuration", kong.at))?;
    Ok((host, chain))
}

#[test]
fn both_forms_configure_under_the_kong_profile_with_kong_confs_queues_and_agree() -> Result<()> {
    // A request without a credential: activation decides, lazy-auth refuses
    // it; the same answer from both forms.
    let mut answers = Vec::new();
    for form in Form::ALL {
        let (mut host, chain) = kong_gateway(form)?;
        let mut s = host.stream(chain)?;
        s.request_headers(
            &[
                (":method", "POST"),
                (":path", "/v1/messages"),
                (":authority", "gw"),
                ("content-type", "application/json"),
            ],
            false,
        );
        s.request_body(
            br#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#,
            true,
        );
        let client = s.client();
        ensure!(
            !s.upstream().complete,
            "{form:?}: a request without a credential reached the backend"
        );
        answers.push((client.status(), client.text()));
    }
    ensure!(
        answers[0].0 == Some(401),
        "the separate chain answered {:?}, expected 401",
        answers[0]
    );
    ensure!(
        answers[0] == answers[1],
        "separate and fused forms answered differently: {answers:?}"
    );
    Ok(())
}
