//! What to run, read from a file: either an Envoy bootstrap (its listener's
//! Wasm `http_filters` become the chain, `envoy.bootstrap.wasm` extensions
//! become singletons, static clusters become callout targets, its routes
//! say what is proxied and what answered directly), so host-sim runs exactly
//! what Envoy would, or refuses naming what it cannot run; or a small JSON
//! chain file.
//!
//! Envoy's own forms are read as Envoy reads them: `listeners` as a list
//! or a single listener, a typed config wrapped in a `TypedStruct`
//! (`udpa.type.v1` or `xds.type.v3`), clusters by IP or DNS name. What
//! host-sim cannot run is an error naming it: an HTTP filter that is
//! neither Wasm nor the router (unless the caller leaves it out on purpose,
//! [`ChainFile::load_skipping`]), a second listener, filter chain, network
//! filter or virtual host, a route matcher other than `prefix`/`path`, a
//! direct response body other than `inline_string`.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use serde_yaml::Value;

use host_sim::PluginSpec;

/// Plugins, clusters and routes to run.
#[derive(Debug, Clone, Default)]
pub struct ChainFile {
    /// HTTP filters, in order.
    pub filters: Vec<PluginSpec>,
    /// Singleton service plugins.
    pub singletons: Vec<PluginSpec>,
    /// Cluster name → loopback address.
    pub clusters: Vec<(String, SocketAddr)>,
    /// Clusters whose DNS name did not resolve when the file was read: Envoy
    /// accepts them and has no healthy host for them (a callout to one gets
    /// its 503 `no healthy upstream`).
    pub unresolved_clusters: Vec<String>,
    /// The listener's routes, in order (none in a JSON chain file or a
    /// bootstrap without listeners: `serve` then proxies every request).
    pub routes: Vec<Route>,
    /// HTTP filters left out because the caller said so
    /// ([`ChainFile::load_skipping`], `serve --skip-filter`), by name.
    pub skipped: Vec<String>,
}

/// One route of the listener's virtual host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// Which requests it takes.
    pub matcher: RouteMatch,
    /// What it does with them.
    pub action: RouteAction,
    /// `request_headers_to_add`: (name, format). `serve` applies them after
    /// the chain, as Envoy's router does; the formats support literal text
    /// and `%FILTER_STATE(KEY:PLAIN)%`.
    pub request_headers: Vec<(String, String)>,
}

/// A route's `match`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteMatch {
    /// `prefix`: the `:path` starts with it.
    Prefix(String),
    /// `path`: the `:path` without its query is exactly it.
    Path(String),
}

/// A route's action.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteAction {
    /// `route`: proxied (by `serve`, to its upstream), with the route's
    /// timeout (Envoy's default 15 s; 0: none), which Envoy announces in
    /// `x-envoy-expected-rq-timeout-ms`.
    Proxy {
        /// Milliseconds.
        timeout_ms: u64,
    },
    /// `direct_response`: Envoy's router answers itself.
    Direct {
        /// Status.
        status: u16,
        /// Body (`inline_string`).
        body: Vec<u8>,
    },
}

impl Route {
    /// Whether this route takes a request for `path`.
    pub fn matches(&self, path: &str) -> bool {
        match &self.matcher {
            RouteMatch::Prefix(prefix) => path.starts_with(prefix.as_str()),
            RouteMatch::Path(exact) => path.split('?').next() == Some(exact.as_str()),
        }
    }
}

/// Envoy's route timeout when a route names none.
pub const ENVOY_ROUTE_TIMEOUT_MS: u64 = 15_000;

/// JSON chain file form.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonChain {
    filters: Vec<JsonPlugin>,
    #[serde(default)]
    singletons: Vec<JsonPlugin>,
    #[serde(default)]
    clusters: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonPlugin {
    name: String,
    wasm: PathBuf,
    #[serde(default)]
    vm_id: Option<String>,
    #[serde(default)]
    root_id: Option<String>,
    /// A string, or any JSON value (sent as its JSON text).
    #[serde(default)]
    configuration: Option<serde_json::Value>,
}

impl ChainFile {
    /// Reads `path`: `.yaml`/`.yml` as an Envoy bootstrap, anything else as
    /// a JSON chain file. Relative `.wasm` paths resolve against `base`.
    pub fn load(path: &Path, base: &Path) -> Result<ChainFile> {
        Self::load_skipping(path, base, &[])
    }

    /// [`ChainFile::load`], leaving out the Envoy HTTP filters named in
    /// `skip` (which host-sim cannot run; without it, such a filter is an
    /// error). Each one must be in the file.
    pub fn load_skipping(path: &Path, base: &Path, skip: &[String]) -> Result<ChainFile> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let is_yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
        if is_yaml {
            Self::from_envoy_skipping(&text, base, skip)
                .with_context(|| format!("reading Envoy config {}", path.display()))
        } else {
            Self::from_json(&text, base)
                .with_context(|| format!("reading chain file {}", path.display()))
        }
    }

    /// Parses a JSON chain file.
    pub fn from_json(text: &str, base: &Path) -> Result<ChainFile> {
        let chain: JsonChain = serde_json::from_str(text)?;
        let plugin = |p: JsonPlugin| -> PluginSpec {
            let configuration = match p.configuration {
                None => Vec::new(),
                Some(serde_json::Value::String(s)) => s.into_bytes(),
                Some(other) => other.to_string().into_bytes(),
            };
            let mut spec = PluginSpec::new(&p.name, base.join(p.wasm)).configuration(configuration);
            if let Some(vm) = p.vm_id {
                spec = spec.vm_id(&vm);
            }
            if let Some(root) = p.root_id {
                spec = spec.root_id(&root);
            }
            spec
        };
        let clusters = chain
            .clusters
            .into_iter()
            .map(|(name, url)| Ok((name, parse_addr(&url)?)))
            .collect::<Result<_>>()?;
        Ok(ChainFile {
            filters: chain.filters.into_iter().map(plugin).collect(),
            singletons: chain.singletons.into_iter().map(plugin).collect(),
            clusters,
            ..ChainFile::default()
        })
    }

    /// Reads an Envoy bootstrap (see the module docs).
    pub fn from_envoy(text: &str, base: &Path) -> Result<ChainFile> {
        Self::from_envoy_skipping(text, base, &[])
    }

    /// [`ChainFile::from_envoy`], leaving out the HTTP filters named in `skip`.
    pub fn from_envoy_skipping(text: &str, base: &Path, skip: &[String]) -> Result<ChainFile> {
        let doc: Value = serde_yaml::from_str(text)?;
        let mut out = ChainFile::default();
        for ext in seq(&doc, &["bootstrap_extensions"]) {
            let name = ext["name"].as_str().unwrap_or_default();
            let config = typed(&ext["typed_config"]);
            let kind = type_of(&config);
            if kind.ends_with("envoy.extensions.wasm.v3.WasmService") {
                out.singletons.push(plugin(&config["config"], base)?);
            } else {
                bail!(
                    "bootstrap extension {name} ({kind}): host-sim runs only Wasm services \
                     (envoy.bootstrap.wasm)"
                );
            }
        }
        let listeners = match &doc["static_resources"]["listeners"] {
            Value::Sequence(list) => list.clone(),
            Value::Null => Vec::new(),
            // Envoy takes a single listener given as a mapping.
            single => vec![single.clone()],
        };
        if listeners.len() > 1 {
            bail!(
                "{} listeners: host-sim serves one (listener {} is the second)",
                listeners.len(),
                listeners[1]["name"].as_str().unwrap_or("without a name")
            );
        }
        if let Some(listener) = listeners.first() {
            out.read_listener(listener, base, skip)?;
        }
        for name in skip {
            if !out.skipped.contains(name) {
                bail!("--skip-filter {name}: no HTTP filter of that name in the listener");
            }
        }
        for cluster in seq(&doc, &["static_resources", "clusters"]) {
            let name = cluster["name"].as_str().unwrap_or_default().to_string();
            let endpoint = seq(&cluster["load_assignment"], &["endpoints"])
                .first()
                .and_then(|e| seq(e, &["lb_endpoints"]).first().cloned())
                .map(|e| e["endpoint"]["address"]["socket_address"].clone());
            let Some(addr) = endpoint else {
                continue;
            };
            let host = addr["address"].as_str().unwrap_or("127.0.0.1");
            let port = addr["port_value"].as_u64().unwrap_or(0);
            let port = u16::try_from(port)
                .map_err(|_| anyhow!("cluster {name}: port_value {port} is not a port"))?;
            // An IP as it is; a DNS name resolved now (STRICT_DNS and
            // LOGICAL_DNS resolve at start too), IPv4 first.
            let resolved = (host, port).to_socket_addrs().ok().and_then(|addrs| {
                let addrs: Vec<SocketAddr> = addrs.collect();
                addrs
                    .iter()
                    .find(|a| a.is_ipv4())
                    .or(addrs.first())
                    .copied()
            });
            match resolved {
                Some(addr) => out.clusters.push((name, addr)),
                None => out.unresolved_clusters.push(name),
            }
        }
        if out.filters.is_empty() && out.singletons.is_empty() {
            bail!(
                "no envoy.filters.http.wasm filter in the listener and no envoy.bootstrap.wasm service"
            );
        }
        Ok(out)
    }

    /// The listener's HTTP connection manager: its Wasm filters and routes.
    fn read_listener(&mut self, listener: &Value, base: &Path, skip: &[String]) -> Result<()> {
        let chains = seq(listener, &["filter_chains"]);
        if chains.len() > 1 {
            bail!(
                "{} filter chains in the listener: host-sim serves one",
                chains.len()
            );
        }
        let Some(chain) = chains.first() else {
            return Ok(());
        };
        let filters = seq(chain, &["filters"]);
        let mut managers = 0;
        for filter in &filters {
            let name = filter["name"].as_str().unwrap_or_default();
            let config = typed(&filter["typed_config"]);
            let kind = type_of(&config);
            if !kind.ends_with(
                "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            ) && name != "envoy.filters.network.http_connection_manager"
            {
                bail!(
                    "network filter {name} ({kind}): host-sim runs only an HTTP connection manager"
                );
            }
            managers += 1;
            if managers > 1 {
                bail!("a second HTTP connection manager ({name}): host-sim serves one");
            }
            self.read_routes(&config)?;
            for http in seq(&config, &["http_filters"]) {
                let name = http["name"].as_str().unwrap_or_default().to_string();
                let config = typed(&http["typed_config"]);
                let kind = type_of(&config);
                if kind.ends_with("envoy.extensions.filters.http.wasm.v3.Wasm") {
                    self.filters.push(plugin(&config["config"], base)?);
                } else if kind.ends_with("envoy.extensions.filters.http.router.v3.Router")
                    || (kind.is_empty() && name == "envoy.filters.http.router")
                {
                    // The end of the chain: `serve` proxies (or answers, for
                    // a direct response) as the router does.
                } else if skip.contains(&name) {
                    self.skipped.push(name);
                } else {
                    bail!(
                        "HTTP filter {name} ({}): host-sim runs only Wasm filters \
                         (envoy.filters.http.wasm) and the router; leave it out on purpose \
                         with --skip-filter {name}",
                        if kind.is_empty() {
                            "no typed_config"
                        } else {
                            &kind
                        }
                    );
                }
            }
        }
        Ok(())
    }

    /// The connection manager's virtual host's routes.
    fn read_routes(&mut self, manager: &Value) -> Result<()> {
        let vhosts = seq(&manager["route_config"], &["virtual_hosts"]);
        if vhosts.len() > 1 {
            bail!(
                "{} virtual hosts: host-sim serves one (virtual host {} is the second)",
                vhosts.len(),
                vhosts[1]["name"].as_str().unwrap_or("without a name")
            );
        }
        let Some(vhost) = vhosts.first() else {
            return Ok(());
        };
        for (i, route) in seq(vhost, &["routes"]).iter().enumerate() {
            let what = format!(
                "route {} of virtual host {}",
                i + 1,
                vhost["name"].as_str().unwrap_or("?")
            );
            let m = &route["match"];
            let matcher = if let Some(prefix) = m["prefix"].as_str() {
                RouteMatch::Prefix(prefix.to_string())
            } else if let Some(path) = m["path"].as_str() {
                RouteMatch::Path(path.to_string())
            } else {
                let keys: Vec<String> = m
                    .as_mapping()
                    .map(|m| {
                        m.keys()
                            .filter_map(|k| k.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default();
                bail!("{what}: match {keys:?}: host-sim matches routes by prefix or path only");
            };
            if let Some(headers) = m.get("headers")
                && !headers.is_null()
            {
                bail!("{what}: match on headers: host-sim matches routes by prefix or path only");
            }
            let action = if let Some(direct) = route.get("direct_response") {
                let status = direct["status"]
                    .as_u64()
                    .and_then(|s| u16::try_from(s).ok())
                    .ok_or_else(|| anyhow!("{what}: direct_response without a status"))?;
                let body = match &direct["body"] {
                    Value::Null => Vec::new(),
                    body => body["inline_string"]
                        .as_str()
                        .ok_or_else(|| {
                            anyhow!(
                                "{what}: direct_response body: host-sim reads inline_string only"
                            )
                        })?
                        .as_bytes()
                        .to_vec(),
                };
                RouteAction::Direct { status, body }
            } else if route.get("route").is_some() {
                let timeout_ms = match route["route"]["timeout"].as_str() {
                    None => ENVOY_ROUTE_TIMEOUT_MS,
                    Some(t) => duration_ms(t).ok_or_else(|| anyhow!("{what}: timeout {t:?}"))?,
                };
                RouteAction::Proxy { timeout_ms }
            } else {
                bail!("{what}: neither route nor direct_response: host-sim cannot run it");
            };
            let mut request_headers = Vec::new();
            for add in seq(route, &["request_headers_to_add"]) {
                let header = &add["header"];
                if let (Some(k), Some(v)) = (header["key"].as_str(), header["value"].as_str()) {
                    request_headers.push((k.to_ascii_lowercase(), v.to_string()));
                }
            }
            self.routes.push(Route {
                matcher,
                action,
                request_headers,
            });
        }
        Ok(())
    }

    /// The route `serve` takes for `path`: the first that matches; `None`
    /// when routes exist and none matches (Envoy's 404). A file without
    /// routes proxies everything.
    pub fn route_for(&self, path: &str) -> Option<Route> {
        if self.routes.is_empty() {
            return Some(Route {
                matcher: RouteMatch::Prefix("/".into()),
                action: RouteAction::Proxy {
                    timeout_ms: ENVOY_ROUTE_TIMEOUT_MS,
                },
                request_headers: Vec::new(),
            });
        }
        self.routes.iter().find(|r| r.matches(path)).cloned()
    }
}

/// A protobuf `Duration` as Envoy's YAML writes it (`15s`, `0.5s`), in ms.
fn duration_ms(text: &str) -> Option<u64> {
    let seconds: f64 = text.strip_suffix('s')?.parse().ok()?;
    (seconds >= 0.0).then(|| (seconds * 1000.0).round() as u64)
}

/// A typed config as Envoy reads it: a `TypedStruct` (`udpa.type.v1` or
/// `xds.type.v3`) stands for its `value` typed as its `type_url`.
pub(crate) fn typed(config: &Value) -> Value {
    let kind = type_of(config);
    if kind.ends_with("udpa.type.v1.TypedStruct") || kind.ends_with("xds.type.v3.TypedStruct") {
        let mut inner = config["value"].clone();
        if let Value::Mapping(map) = &mut inner {
            map.insert(Value::from("@type"), config["type_url"].clone());
        }
        return inner;
    }
    config.clone()
}

/// The sequence at `path` under `value` (empty when there is none).
pub(crate) fn seq(value: &Value, path: &[&str]) -> Vec<Value> {
    let mut v = value;
    for key in path {
        v = &v[*key];
    }
    v.as_sequence().cloned().unwrap_or_default()
}

/// A typed config's `@type`.
pub(crate) fn type_of(config: &Value) -> String {
    config["@type"].as_str().unwrap_or_default().to_string()
}

fn plugin(config: &Value, base: &Path) -> Result<PluginSpec> {
    let name = config["name"].as_str().unwrap_or_default().to_string();
    let vm = &config["vm_config"];
    let file = vm["code"]["local"]["filename"]
        .as_str()
        .ok_or_else(|| anyhow!("plugin {name}: only vm_config.code.local.filename is supported"))?;
    let mut spec = PluginSpec::new(&name, base.join(file));
    if let Some(vm_id) = vm["vm_id"].as_str() {
        spec = spec.vm_id(vm_id);
    } else {
        spec = spec.vm_id("");
    }
    if let Some(root) = config["root_id"].as_str() {
        spec = spec.root_id(root);
    } else {
        spec = spec.root_id("");
    }
    let configuration = string_value(&config["configuration"])?;
    // Envoy: `environment_variables.key_values` are literal, `host_env_keys`
    // come from the proxy's own environment.
    let vars = &vm["environment_variables"];
    if let Some(map) = vars["key_values"].as_mapping() {
        for (k, v) in map {
            if let (Some(k), Some(v)) = (k.as_str(), v.as_str()) {
                spec = spec.env(k, v);
            }
        }
    }
    for key in seq(vars, &["host_env_keys"]) {
        if let Some(key) = key.as_str()
            && let Ok(value) = std::env::var(key)
        {
            spec = spec.env(key, &value);
        }
    }
    let stop_iteration = config["allow_on_headers_stop_iteration"]
        .as_bool()
        .unwrap_or(false);
    Ok(spec
        .configuration(configuration)
        .allow_on_headers_stop_iteration(stop_iteration))
}

/// The bytes of a `google.protobuf.StringValue` (`{"@type": …, value: …}`)
/// as a Wasm plugin's or dynamic module's configuration: the string, or any
/// other YAML value as its JSON text; empty when there is none.
pub(crate) fn string_value(holder: &Value) -> Result<Vec<u8>, serde_json::Error> {
    Ok(match &holder["value"] {
        Value::String(s) => s.clone().into_bytes(),
        Value::Null => Vec::new(),
        other => serde_json::to_string(other)?.into_bytes(),
    })
}

fn parse_addr(url: &str) -> Result<SocketAddr> {
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let authority = rest.split('/').next().unwrap_or(rest);
    authority
        .parse()
        .with_context(|| format!("{url}: expected http://IP:PORT (loopback)"))
}

/// Expands an Envoy header format: literal text plus `%FILTER_STATE(KEY:PLAIN)%`
/// (other `%…%` operators expand to `-`, Envoy's "no value").
pub fn expand_format(format: &str, filter_state: impl Fn(&str) -> Option<Vec<u8>>) -> String {
    let mut out = String::new();
    let mut rest = format;
    while let Some(start) = rest.find('%') {
        out.push_str(&rest[..start]);
        let after = &rest[start + 1..];
        let Some(end) = after.find('%') else {
            out.push_str(&rest[start..]);
            return out;
        };
        let op = &after[..end];
        let value = op
            .strip_prefix("FILTER_STATE(")
            .and_then(|o| o.strip_suffix(')'))
            .map(|inner| inner.strip_suffix(":PLAIN").unwrap_or(inner))
            .and_then(&filter_state)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_else(|| "-".to_string());
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_an_envoy_bootstrap() {
        let yaml = r#"
bootstrap_extensions:
- name: envoy.bootstrap.wasm
  typed_config:
    "@type": type.googleapis.com/envoy.extensions.wasm.v3.WasmService
    singleton: true
    config:
      name: observer
      vm_config: {vm_id: observer, runtime: envoy.wasm.runtime.v8, code: {local: {filename: o.wasm}}}
static_resources:
  listeners:
  - address: {socket_address: {address: 127.0.0.1, port_value: 0}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          http_filters:
          - name: a
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
              config:
                name: zerolayer.activation
                root_id: zerolayer.activation
                vm_config: {vm_id: act, runtime: envoy.wasm.runtime.v8, code: {local: {filename: a.wasm}}}
                configuration: {"@type": type.googleapis.com/google.protobuf.StringValue, value: '{"rules":[]}'}
          - name: envoy.filters.http.router
  clusters:
  - name: backend
    load_assignment:
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 18080}}}
"#;
        let chain = ChainFile::from_envoy(yaml, Path::new("/base")).unwrap();
        assert_eq!(chain.filters.len(), 1);
        assert_eq!(chain.filters[0].name, "zerolayer.activation");
        assert_eq!(chain.filters[0].vm_id, "act");
        assert_eq!(chain.filters[0].wasm, Path::new("/base/a.wasm"));
        assert_eq!(chain.filters[0].configuration, br#"{"rules":[]}"#);
        assert_eq!(chain.singletons[0].name, "observer");
        assert_eq!(chain.singletons[0].root_id, "");
        assert_eq!(
            chain.clusters,
            vec![("backend".to_string(), "127.0.0.1:18080".parse().unwrap())]
        );
    }

    /// The proxy-wasm SDK examples' form: one listener as a mapping, the
    /// filter in a `TypedStruct`, clusters by DNS name, a direct response.
    const SDK_SHAPED: &str = r#"
static_resources:
  listeners:
    address: {socket_address: {address: 0.0.0.0, port_value: 10000}}
    filter_chains:
      - filters:
          - name: envoy.filters.network.http_connection_manager
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
              stat_prefix: ingress_http
              route_config:
                virtual_hosts:
                  - name: local_service
                    domains: ["*"]
                    routes:
                      - match: {prefix: "/direct"}
                        direct_response: {status: 200, body: {inline_string: "hi\n"}}
                      - match: {path: "/exact"}
                        route: {cluster: httpbin, timeout: 2.5s}
                      - match: {prefix: "/"}
                        route: {cluster: httpbin}
              http_filters:
                - name: envoy.filters.http.wasm
                  typed_config:
                    "@type": type.googleapis.com/udpa.type.v1.TypedStruct
                    type_url: type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm
                    value:
                      config:
                        name: "http_config"
                        configuration: {"@type": "type.googleapis.com/google.protobuf.StringValue", value: The secret}
                        vm_config: {runtime: envoy.wasm.runtime.v8, code: {local: {filename: "c.wasm"}}}
                FILTER
                - name: envoy.filters.http.router
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: httpbin
      type: STRICT_DNS
      load_assignment:
        cluster_name: httpbin
        endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: httpbin.invalid, port_value: 8080}}}}]}]
    - name: local
      type: STRICT_DNS
      load_assignment:
        cluster_name: local
        endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: localhost, port_value: 8081}}}}]}]
"#;

    const LUA: &str = r#"- name: envoy.filters.http.lua
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
                    default_source_code: {inline_string: "function envoy_on_request(h) end"}"#;

    #[test]
    fn reads_the_sdk_examples_form_of_an_envoy_bootstrap() {
        let chain =
            ChainFile::from_envoy(&SDK_SHAPED.replace("FILTER", ""), Path::new("/b")).unwrap();
        assert_eq!(chain.filters.len(), 1);
        assert_eq!(chain.filters[0].name, "http_config");
        assert_eq!(chain.filters[0].configuration, b"The secret");
        assert_eq!(chain.filters[0].wasm, Path::new("/b/c.wasm"));
        // `httpbin.invalid` cannot resolve; `localhost` does.
        assert_eq!(chain.unresolved_clusters, vec!["httpbin".to_string()]);
        assert_eq!(chain.clusters[0].0, "local");
        assert_eq!(chain.clusters[0].1.port(), 8081);
        let direct = chain.route_for("/direct/x").unwrap();
        assert_eq!(
            direct.action,
            RouteAction::Direct {
                status: 200,
                body: b"hi\n".to_vec()
            }
        );
        assert_eq!(
            chain.route_for("/exact?q=1").unwrap().action,
            RouteAction::Proxy { timeout_ms: 2500 }
        );
        assert_eq!(
            chain.route_for("/exact/more").unwrap().action,
            RouteAction::Proxy {
                timeout_ms: ENVOY_ROUTE_TIMEOUT_MS
            }
        );
    }

    #[test]
    fn refuses_a_filter_it_cannot_run_naming_it_unless_left_out_on_purpose() {
        let yaml = SDK_SHAPED.replace("FILTER", LUA);
        let err = ChainFile::from_envoy(&yaml, Path::new("/b")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "HTTP filter envoy.filters.http.lua (type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua): \
             host-sim runs only Wasm filters (envoy.filters.http.wasm) and the router; leave it out on \
             purpose with --skip-filter envoy.filters.http.lua"
        );
        let skip = ["envoy.filters.http.lua".to_string()];
        let chain = ChainFile::from_envoy_skipping(&yaml, Path::new("/b"), &skip).unwrap();
        assert_eq!(chain.skipped, skip);
        assert_eq!(chain.filters.len(), 1);
        let err = ChainFile::from_envoy_skipping(
            &SDK_SHAPED.replace("FILTER", ""),
            Path::new("/b"),
            &skip,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("no HTTP filter of that name"),
            "{err}"
        );
    }

    #[test]
    fn refuses_route_matchers_it_cannot_evaluate() {
        let yaml = SDK_SHAPED.replace("FILTER", "").replace(
            r#"match: {path: "/exact"}"#,
            r#"match: {safe_regex: {regex: "/e.*"}}"#,
        );
        let err = ChainFile::from_envoy(&yaml, Path::new("/b")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "route 2 of virtual host local_service: match [\"safe_regex\"]: host-sim matches \
             routes by prefix or path only"
        );
    }

    #[test]
    fn header_formats() {
        let state = |k: &str| (k == "wasm.x").then(|| b"v".to_vec());
        assert_eq!(expand_format("%FILTER_STATE(wasm.x:PLAIN)%", state), "v");
        assert_eq!(
            expand_format("a-%FILTER_STATE(wasm.y:PLAIN)%-b", state),
            "a---b"
        );
        assert_eq!(expand_format("%REQ(x)%", state), "-");
        assert_eq!(expand_format("100%", state), "100%");
    }
}
