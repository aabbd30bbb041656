//! What to run, read from a file: either an Envoy bootstrap (the Wasm
//! `http_filters` of its first listener become the chain, `envoy.bootstrap.wasm`
//! extensions become singletons, static clusters become callout targets),
//! so host-sim runs exactly what Envoy would; or a small JSON chain file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use serde_yaml::Value;

use host_sim::PluginSpec;

/// Plugins and clusters to run.
#[derive(Debug, Clone, Default)]
pub struct ChainFile {
    /// HTTP filters, in order.
    pub filters: Vec<PluginSpec>,
    /// Singleton service plugins.
    pub singletons: Vec<PluginSpec>,
    /// Cluster name → loopback address.
    pub clusters: Vec<(String, SocketAddr)>,
    /// The first route's `request_headers_to_add`: (name, format). `serve`
    /// applies them after the chain, as Envoy's router does; the formats
    /// support literal text and `%FILTER_STATE(KEY:PLAIN)%`.
    pub route_request_headers: Vec<(String, String)>,
}

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
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let is_yaml = path.extension().is_some_and(|e| e == "yaml" || e == "yml");
        if is_yaml {
            Self::from_envoy(&text, base)
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
            route_request_headers: Vec::new(),
        })
    }

    /// Reads the Wasm parts of an Envoy bootstrap.
    pub fn from_envoy(text: &str, base: &Path) -> Result<ChainFile> {
        let doc: Value = serde_yaml::from_str(text)?;
        let mut out = ChainFile::default();
        for ext in seq(&doc, &["bootstrap_extensions"]) {
            let config = &ext["typed_config"];
            if type_of(config).ends_with("envoy.extensions.wasm.v3.WasmService") {
                out.singletons.push(plugin(&config["config"], base)?);
            }
        }
        let listeners = seq(&doc, &["static_resources", "listeners"]);
        let listener = listeners.first().ok_or_else(|| anyhow!("no listener"))?;
        for chain in seq(listener, &["filter_chains"]) {
            for filter in seq(&chain, &["filters"]) {
                let vhosts = seq(&filter["typed_config"]["route_config"], &["virtual_hosts"]);
                if let Some(route) = vhosts
                    .first()
                    .and_then(|v| seq(v, &["routes"]).first().cloned())
                {
                    for add in seq(&route, &["request_headers_to_add"]) {
                        let header = &add["header"];
                        if let (Some(k), Some(v)) =
                            (header["key"].as_str(), header["value"].as_str())
                        {
                            out.route_request_headers
                                .push((k.to_ascii_lowercase(), v.to_string()));
                        }
                    }
                }
                for http in seq(&filter["typed_config"], &["http_filters"]) {
                    let config = &http["typed_config"];
                    if type_of(config).ends_with("envoy.extensions.filters.http.wasm.v3.Wasm") {
                        out.filters.push(plugin(&config["config"], base)?);
                    }
                }
            }
        }
        for cluster in seq(&doc, &["static_resources", "clusters"]) {
            let name = cluster["name"].as_str().unwrap_or_default().to_string();
            let endpoint = seq(&cluster["load_assignment"], &["endpoints"])
                .first()
                .and_then(|e| seq(e, &["lb_endpoints"]).first().cloned())
                .map(|e| e["endpoint"]["address"]["socket_address"].clone());
            if let Some(addr) = endpoint {
                let ip = addr["address"].as_str().unwrap_or("127.0.0.1");
                let port = addr["port_value"].as_u64().unwrap_or(0);
                out.clusters.push((name, format!("{ip}:{port}").parse()?));
            }
        }
        if out.filters.is_empty() {
            bail!("no envoy.filters.http.wasm filter in the first listener");
        }
        Ok(out)
    }
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
