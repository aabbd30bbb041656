//! Kong's form of the chain (`kong/kong.yml`, `kong/kong.conf`), checked
//! structurally: the service, route and filter chain Kong would load, each
//! filter's configuration parsed by that filter's own parser, the
//! shared memory and environment ngx_wasm_module needs, and the chain kept in
//! step with the filters the build produces.
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
use serde::Deserialize;
use serde_json::Value;
use zerolayer_core::activation::RuleSet;
use zerolayer_core::auth::config::{LazyAuthConfig, ObserverLink, ObserverMode};
use zerolayer_core::cache::config::PostCacheConfig;
use zerolayer_core::metering::MeteringConfig;
use zerolayer_e2e::paths;

/// The chain, in the documented order (filter names as the filters call
/// themselves: Kong's name is `zerolayer_<name>` with `_` for `-`, the crate
/// `zerolayer-<name>`).
const CHAIN: [&str; 4] = ["activation", "lazy-auth", "post-cache", "metering"];

/// Crates in xtask's FILTERS that are deliberately not in Kong's chain.
const NOT_IN_KONG: [(&str, &str); 2] = [
    (
        "zerolayer-observer-service",
        "Envoy's singleton; in Kong each filter embeds its observer",
    ),
    ("zerolayer-probe", "a test-only filter"),
];

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

fn declarative() -> Result<Declarative> {
    serde_yaml::from_str(&kong_file("kong.yml")?).context("kong/kong.yml is not valid YAML")
}

/// The `llm` service, the one the chain is attached to.
fn llm_service(config: &Declarative) -> Result<&Service> {
    config
        .services
        .iter()
        .find(|s| s.name.as_deref() == Some("llm"))
        .ok_or_else(|| anyhow!("kong/kong.yml: no service named `llm`"))
}

/// The single filter chain attached to the `llm` service.
fn chain(config: &Declarative) -> Result<&FilterChain> {
    let service = llm_service(config)?;
    match service.filter_chains.as_slice() {
        [chain] => Ok(chain),
        chains => bail!(
            "kong/kong.yml: service `llm` must carry exactly one filter chain, found {}",
            chains.len()
        ),
    }
}

/// Kong's filter name for chain member `name`.
fn kong_name(name: &str) -> String {
    format!("zerolayer_{}", name.replace('-', "_"))
}

/// The JSON configuration string of chain member `name`.
fn filter_config(config: &Declarative, name: &str) -> Result<String> {
    let kong = kong_name(name);
    let filter = chain(config)?
        .filters
        .iter()
        .find(|f| f.name == kong)
        .ok_or_else(|| anyhow!("kong/kong.yml: filter {kong} is not in the chain"))?;
    match &filter.config {
        Some(serde_yaml::Value::String(text)) => Ok(text.clone()),
        // The filters ship no `<name>.meta.json` schema: Kong then accepts a
        // string only, and hands it to on_configure byte for byte.
        Some(other) => bail!(
            "kong/kong.yml: {kong}.config must be the JSON configuration as a string, found {other:?}"
        ),
        None => bail!("kong/kong.yml: {kong} has no config"),
    }
}

/// The observer link of each filter that has one, by chain name.
fn observer_links(config: &Declarative) -> Result<Vec<(&'static str, ObserverLink)>> {
    let lazy = LazyAuthConfig::from_json(filter_config(config, "lazy-auth")?.as_bytes())
        .map_err(|e| anyhow!("lazy-auth config: {e}"))?;
    let cache = PostCacheConfig::from_json(filter_config(config, "post-cache")?.as_bytes())
        .map_err(|e| anyhow!("post-cache config: {e}"))?;
    let metering = MeteringConfig::from_json(filter_config(config, "metering")?.as_bytes())
        .map_err(|e| anyhow!("metering config: {e}"))?;
    Ok(vec![
        ("lazy-auth", lazy.observer),
        ("post-cache", cache.observer),
        ("metering", metering.observer),
    ])
}

/// The queue a filter's observer registers in tick mode:
/// `<observer.queue>.<filter>` (filters/observer), so each filter drains only
/// its own jobs.
fn tick_queue(link: &ObserverLink, filter: &str) -> String {
    format!("{}.{filter}", link.queue)
}

#[test]
fn kong_yml_declares_the_llm_service_its_route_and_the_chain_in_order() -> Result<()> {
    let config = declarative()?;
    // Quoted in the file: an unquoted 3.0 is a YAML float, which Kong refuses.
    match &config.format_version {
        Some(serde_yaml::Value::String(v)) if v == "3.0" => {}
        other => {
            bail!("kong/kong.yml: _format_version must be the string \"3.0\", found {other:?}")
        }
    }
    let service = llm_service(&config)?;
    ensure!(
        service.url.as_deref() == Some("http://127.0.0.1:18080"),
        "kong/kong.yml: service llm must point at the loopback backend http://127.0.0.1:18080, found {:?}",
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
            "kong/kong.yml: no POST route of service llm has path {path} (found {routed:?})"
        );
    }
    for route in &service.routes {
        // Kong strips the matched prefix by default: the backend would get `/`.
        ensure!(
            route.strip_path == Some(false),
            "kong/kong.yml: route with paths {:?} must set strip_path: false",
            route.paths
        );
    }
    ensure!(
        config.filter_chains.is_empty(),
        "kong/kong.yml: the chain belongs under service llm, not at the top level"
    );
    let chain = chain(&config)?;
    ensure!(
        chain.enabled != Some(false),
        "kong/kong.yml: the filter chain is disabled"
    );
    let found: Vec<&str> = chain.filters.iter().map(|f| f.name.as_str()).collect();
    let expected: Vec<String> = CHAIN.iter().map(|n| kong_name(n)).collect();
    ensure!(
        found == expected,
        "kong/kong.yml: the chain must be exactly {expected:?} in this order, found {found:?}"
    );
    for filter in &chain.filters {
        ensure!(
            filter.enabled != Some(false),
            "kong/kong.yml: filter {} is disabled",
            filter.name
        );
    }
    Ok(())
}

#[test]
fn every_filter_config_parses_with_its_own_parser_and_observes_on_tick() -> Result<()> {
    let config = declarative()?;
    for name in CHAIN {
        let text = filter_config(&config, name)?;
        ensure!(
            text.len() <= NGINX_DIRECTIVE_MAX,
            "{name}: config is {} bytes, over the {NGINX_DIRECTIVE_MAX}-byte nginx directive limit",
            text.len()
        );
        // Each filter's own entry point, the one its on_configure calls.
        let parsed = match name {
            "activation" => RuleSet::from_json(text.as_bytes()).map(drop),
            "lazy-auth" => LazyAuthConfig::from_json(text.as_bytes()).map(drop),
            "post-cache" => PostCacheConfig::from_json(text.as_bytes()).map(drop),
            "metering" => MeteringConfig::from_json(text.as_bytes()).map(drop),
            other => bail!("no parser known for chain member {other}"),
        };
        parsed.map_err(|e| anyhow!("{name}: config refused: {e}"))?;
    }
    for (filter, link) in observer_links(&config)? {
        // An absent observer section means singleton, which needs Envoy.
        ensure!(
            link.mode == ObserverMode::Tick,
            "{filter}: observer.mode is {:?}; Kong has no singleton service nor queue notifications, it needs \"tick\"",
            link.mode
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
    let config = declarative()?;
    let mut checked = Vec::new();
    for name in CHAIN {
        let json: Value = serde_json::from_str(&filter_config(&config, name)?)
            .with_context(|| format!("{name}: config is not JSON"))?;
        let mut targets = Vec::new();
        callout_targets(&json, name, &mut targets);
        for (at, target) in targets {
            let cluster = target["cluster"].as_str().unwrap_or_default();
            // ngx_wasm_module takes a host (with an optional port) where
            // Envoy takes a cluster name; an IP address needs no resolver,
            // a name would depend on the resolver Kong is given.
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
    // JWKS, API key introspection, audit sink, usage sink: the walk found them.
    ensure!(
        checked.len() >= 4,
        "expected at least 4 callout targets, found {checked:?}"
    );
    Ok(())
}

/// The crate names in xtask's FILTERS list (what `cargo xtask build-wasm` builds).
fn built_filters() -> Result<Vec<String>> {
    let source = fs::read_to_string(paths::root().join("xtask/src/main.rs"))
        .context("reading xtask/src/main.rs")?;
    let start = source
        .find("pub const FILTERS: &[&str] = &[")
        .context("xtask/src/main.rs: no `pub const FILTERS: &[&str] = &[` list")?;
    let list = &source[start..];
    let end = list
        .find("];")
        .context("xtask/src/main.rs: FILTERS list not closed")?;
    Ok(list[..end]
        .split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect())
}

#[test]
fn the_chain_and_the_build_list_the_same_filters() -> Result<()> {
    let config = declarative()?;
    let built: BTreeSet<String> = built_filters()?.into_iter().collect();
    ensure!(
        !built.is_empty(),
        "xtask/src/main.rs: FILTERS lists no crates"
    );
    let chain: BTreeSet<String> = chain(&config)?
        .filters
        .iter()
        .map(|f| {
            // Kong's name is the .wasm file name: zerolayer_<name>, built
            // from the crate zerolayer-<name>.
            f.name
                .strip_prefix("zerolayer_")
                .map(|n| format!("zerolayer-{}", n.replace('_', "-")))
                .unwrap_or_else(|| f.name.clone())
        })
        .collect();
    let unbuilt: Vec<&String> = chain.difference(&built).collect();
    ensure!(
        unbuilt.is_empty(),
        "kong/kong.yml names filters no crate in xtask's FILTERS builds: {unbuilt:?} (Kong would find no {WASM_DIR}/<name>.wasm)"
    );
    let skipped: BTreeSet<String> = NOT_IN_KONG.iter().map(|(c, _)| c.to_string()).collect();
    let missing: Vec<&String> = built
        .difference(&chain)
        .filter(|c| !skipped.contains(*c))
        .collect();
    ensure!(
        missing.is_empty(),
        "xtask's FILTERS builds {missing:?}, which kong/kong.yml's chain lacks: add it to the chain (and kong/README.md), or to NOT_IN_KONG here with the reason"
    );
    for (krate, why) in NOT_IN_KONG {
        ensure!(
            built.contains(krate),
            "NOT_IN_KONG lists {krate} ({why}), which xtask's FILTERS no longer builds: drop it here"
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

    // nginx clears the workers' environment except `env`-declared variables:
    // post-cache's secret must be one of them.
    let config = declarative()?;
    let cache = PostCacheConfig::from_json(filter_config(&config, "post-cache")?.as_bytes())
        .map_err(|e| anyhow!("post-cache config: {e}"))?;
    let env = conf_value(&conf, "nginx_main_env")?;
    ensure!(
        env.split(|c: char| c == ';' || c.is_whitespace())
            .any(|v| v == cache.secret_env),
        "kong/kong.conf: nginx_main_env must declare post-cache's secret_env {:?}, found {env:?}",
        cache.secret_env
    );

    let block = wasm_block(&conf);
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
        "kong/kong.conf: the `*` zone ({kv_size} bytes) cannot hold post-cache's bound ({} bytes: max_entries × max_entry_bytes); raise it or lower max_entries",
        cache.memory_bound()
    );

    // One queue per filter observer, each declared once (nginx refuses a
    // second zone with the same name).
    for (filter, link) in observer_links(&config)? {
        let queue = tick_queue(&link, filter);
        let declared: Vec<&Vec<String>> = block
            .iter()
            .filter(|d| d[0] == "shm_queue" && d.get(1) == Some(&queue))
            .collect();
        let [declared] = declared.as_slice() else {
            bail!(
                "kong/kong.conf must declare `shm_queue {queue} <size>` exactly once for {filter}'s observer (declared {}; wasm{{}} gets {block:?})",
                declared.len()
            );
        };
        let size = nginx_size(declared.get(2).context("shm_queue has no size")?)?;
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
