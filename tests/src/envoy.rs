//! Real Envoy, started from the project's own configuration files.
//!
//! [`EnvoyConfig`] loads a shipped config from `envoy/` and adapts only what a
//! test run needs (ports, the upstream address, absolute `.wasm` paths, a
//! test's filter configuration); [`Envoy`] runs it on free loopback ports and
//! stops it by PID when dropped.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_yaml::Value;

use crate::client::Client;
use crate::paths;

/// An Envoy bootstrap document being prepared for a run.
#[derive(Debug, Clone)]
pub struct EnvoyConfig {
    doc: Value,
    name: String,
    /// Environment for the Envoy process (secrets reach VMs through
    /// `vm_config.environment_variables.host_env_keys`).
    env: Vec<(String, String)>,
    /// Worker threads (`--concurrency`; 1 unless a test asks for more).
    workers: usize,
    /// A program Envoy runs under (`valgrind --tool=callgrind …`), which
    /// keeps Envoy's PID.
    wrapper: Vec<String>,
    /// How long Envoy may take to answer `/ready`.
    ready_timeout: Duration,
}

impl EnvoyConfig {
    /// Loads a YAML bootstrap.
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let doc =
            serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "envoy".into());
        Ok(EnvoyConfig {
            doc,
            name,
            env: Vec::new(),
            workers: 1,
            wrapper: Vec::new(),
            ready_timeout: READY_TIMEOUT,
        })
    }

    /// Loads `envoy/<name>`.
    pub fn shipped(name: &str) -> Result<Self> {
        Self::load(&paths::envoy_config(name))
    }

    /// Prepares the config for a loopback run: admin and listeners on port 0,
    /// every static cluster pointed at `upstream`, `.wasm` paths absolute.
    pub fn for_run(mut self, upstream: SocketAddr) -> Result<Self> {
        set_path(
            &mut self.doc,
            &["admin", "address", "socket_address", "port_value"],
            Value::from(0),
        )?;
        for listener in listeners_mut(&mut self.doc) {
            set_path(
                listener,
                &["address", "socket_address", "port_value"],
                Value::from(0),
            )?;
        }
        if let Some(clusters) = lookup_mut(&mut self.doc, &["static_resources", "clusters"])
            .and_then(Value::as_sequence_mut)
        {
            for cluster in clusters {
                point_endpoints(cluster, upstream)?;
            }
        }
        let root = paths::root();
        let filename = ["vm_config", "code", "local", "filename"];
        for filter in self.wasm_filters_mut()? {
            if let Some(file) = wasm_config_mut(filter).and_then(|c| lookup_mut(c, &filename))
                && let Some(rel) = file.as_str()
            {
                let abs = root.join(rel);
                *file = Value::from(abs.to_string_lossy().into_owned());
            }
        }
        if let Some(services) =
            lookup_mut(&mut self.doc, &["bootstrap_extensions"]).and_then(Value::as_sequence_mut)
        {
            for service in services {
                if let Some(file) = lookup_mut(
                    service,
                    &[
                        "typed_config",
                        "config",
                        "vm_config",
                        "code",
                        "local",
                        "filename",
                    ],
                ) && let Some(rel) = file.as_str()
                {
                    let abs = root.join(rel);
                    *file = Value::from(abs.to_string_lossy().into_owned());
                }
            }
        }
        Ok(self)
    }

    /// Sets environment variable `key` for the Envoy process.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// Runs Envoy under `program` (with its `args` first), e.g. callgrind
    /// counting instructions; such an Envoy gets 10 minutes to start.
    pub fn wrapped(mut self, program: &str, args: &[&str]) -> Self {
        self.wrapper = std::iter::once(program)
            .chain(args.iter().copied())
            .map(String::from)
            .collect();
        self.ready_timeout = Duration::from_secs(600);
        self
    }

    /// Runs Envoy with `n` worker threads.
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = n.max(1);
        self
    }

    /// Points static cluster `name` at `addr` (after [`EnvoyConfig::for_run`],
    /// which points every cluster at the upstream).
    pub fn point_cluster(mut self, name: &str, addr: SocketAddr) -> Result<Self> {
        let mut found = false;
        for cluster in seq_mut(&mut self.doc, &["static_resources", "clusters"])? {
            if cluster.get("name").and_then(Value::as_str) == Some(name) {
                found = true;
                point_endpoints(cluster, addr)?;
            }
        }
        if !found {
            bail!("{}: no cluster named {name}", self.name);
        }
        Ok(self)
    }

    /// Adds a static cluster `name` with one endpoint, `addr`.
    pub fn add_cluster(mut self, name: &str, addr: SocketAddr) -> Result<Self> {
        let cluster: Value = serde_yaml::from_str(&format!(
            "{{name: {name}, type: STATIC, connect_timeout: 2s, load_assignment: {{cluster_name: {name}, \
             endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: \
             {{address: '{}', port_value: {}}}}}}}}}]}}]}}}}",
            addr.ip(),
            addr.port()
        ))?;
        let doc_name = self.name.clone();
        lookup_mut(&mut self.doc, &["static_resources", "clusters"])
            .and_then(Value::as_sequence_mut)
            .ok_or_else(|| anyhow!("{doc_name}: no static_resources.clusters"))?
            .push(cluster);
        Ok(self)
    }

    /// Replaces the configuration of bootstrap Wasm service `name`.
    pub fn set_service_config(&mut self, name: &str, json: &str) -> Result<()> {
        *self.service_config_value(name)? = Value::from(json);
        Ok(())
    }

    /// The JSON configuration of bootstrap Wasm service `name`.
    pub fn service_config(&self, name: &str) -> Result<String> {
        let mut copy = self.clone();
        let value = copy.service_config_value(name)?;
        value
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("service {name}: configuration.value is not a string"))
    }

    fn service_config_value(&mut self, name: &str) -> Result<&mut Value> {
        let doc_name = self.name.clone();
        let services = lookup_mut(&mut self.doc, &["bootstrap_extensions"])
            .and_then(Value::as_sequence_mut)
            .ok_or_else(|| anyhow!("{doc_name}: no bootstrap_extensions"))?;
        services
            .iter_mut()
            .find(|s| {
                s.get("typed_config")
                    .and_then(|t| t.get("config"))
                    .and_then(|c| c.get("name"))
                    .and_then(Value::as_str)
                    == Some(name)
            })
            .and_then(|s| lookup_mut(s, &["typed_config", "config", "configuration", "value"]))
            .ok_or_else(|| anyhow!("{doc_name}: no Wasm service named {name}"))
    }

    /// The JSON configuration of the Wasm filter named `filter`.
    pub fn wasm_filter_config(&self, filter: &str) -> Result<String> {
        let mut copy = self.clone();
        let value = copy.wasm_config_value(filter)?;
        value
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("filter {filter}: configuration.value is not a string"))
    }

    /// [`EnvoyConfig::wasm_filter_config`], parsed.
    pub fn wasm_filter_json(&self, filter: &str) -> Result<serde_json::Value> {
        serde_json::from_str(&self.wasm_filter_config(filter)?)
            .with_context(|| format!("filter {filter}: configuration.value is not JSON"))
    }

    /// Replaces the JSON configuration of the Wasm filter named `filter`.
    pub fn set_wasm_filter_config(&mut self, filter: &str, json: &str) -> Result<()> {
        *self.wasm_config_value(filter)? = Value::from(json);
        Ok(())
    }

    /// The JSON configuration (`filter_config`) of the dynamic module
    /// filter named `filter`.
    pub fn native_filter_config(&self, filter: &str) -> Result<String> {
        let name = self.name.clone();
        self.clone()
            .native_config_value(filter)?
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| anyhow!("{name}: {filter}'s filter_config value is not a string"))
    }

    /// Replaces the JSON configuration (`filter_config`) of the dynamic
    /// module filter named `filter`.
    pub fn set_native_filter_config(&mut self, filter: &str, json: &str) -> Result<()> {
        *self.native_config_value(filter)? = Value::from(json);
        Ok(())
    }

    /// Inserts a Wasm filter `name` (module `module`, in VM `vm_id`,
    /// configured with `json`) after the HTTP filter named `after` in every
    /// connection manager that has it.
    pub fn insert_wasm_filter_after(
        &mut self,
        after: &str,
        name: &str,
        module: &str,
        vm_id: &str,
        json: &str,
    ) -> Result<()> {
        let filter: Value = serde_yaml::from_str(&format!(
            "{{name: {name}, typed_config: {{'@type': type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm, \
             config: {{name: {name}, root_id: {name}, allow_on_headers_stop_iteration: true, \
             vm_config: {{vm_id: {vm_id}, runtime: envoy.wasm.runtime.v8, \
             code: {{local: {{filename: '{}'}}}}}}, \
             configuration: {{'@type': type.googleapis.com/google.protobuf.StringValue, value: ''}}}}}}}}",
            paths::wasm(module)?.display()
        ))?;
        let mut filter = filter;
        if let Some(value) = lookup_mut(
            &mut filter,
            &["typed_config", "config", "configuration", "value"],
        ) {
            *value = Value::from(json);
        }
        let doc_name = self.name.clone();
        let mut inserted = 0;
        for hcm in self.http_connection_managers_mut()? {
            let Some(filters) = hcm.get_mut("http_filters").and_then(Value::as_sequence_mut) else {
                continue;
            };
            if let Some(at) = filters
                .iter()
                .position(|f| f.get("name").and_then(Value::as_str) == Some(after))
            {
                filters.insert(at + 1, filter.clone());
                inserted += 1;
            }
        }
        if inserted == 0 {
            bail!("{doc_name}: no HTTP filter named {after}");
        }
        Ok(())
    }

    /// Sets `config.<key>` of the Wasm filter named `filter` (e.g.
    /// `allow_on_headers_stop_iteration`); `None` removes it.
    pub fn set_wasm_filter_option(
        &mut self,
        filter: &str,
        key: &str,
        value: Option<Value>,
    ) -> Result<()> {
        let name = self.name.clone();
        let config = self
            .wasm_filters_mut()?
            .into_iter()
            .find(|f| f.get("name").and_then(Value::as_str) == Some(filter))
            .and_then(wasm_config_mut)
            .and_then(Value::as_mapping_mut)
            .ok_or_else(|| anyhow!("{name}: no Wasm filter named {filter}"))?;
        match value {
            Some(v) => {
                config.insert(Value::from(key), v);
            }
            None => {
                config.remove(key);
            }
        }
        Ok(())
    }

    /// Adds a request header to every route (Envoy's formatter syntax allowed,
    /// e.g. `%FILTER_STATE(…)%`): how a test shows what later filters saw.
    pub fn add_route_request_header(&mut self, key: &str, value: &str) -> Result<()> {
        let header: Value = serde_yaml::from_str(&format!(
            "{{header: {{key: {key}, value: {}}}, append_action: OVERWRITE_IF_EXISTS_OR_ADD}}",
            serde_json::to_string(value)?
        ))?;
        for route in self.routes_mut()? {
            let map = route
                .as_mapping_mut()
                .ok_or_else(|| anyhow!("route is not a map"))?;
            let list = map
                .entry(Value::from("request_headers_to_add"))
                .or_insert_with(|| Value::Sequence(vec![]));
            list.as_sequence_mut()
                .ok_or_else(|| anyhow!("request_headers_to_add is not a list"))?
                .push(header.clone());
        }
        Ok(())
    }

    /// Every route of every virtual host (at least one).
    fn routes_mut(&mut self) -> Result<Vec<&mut Value>> {
        let name = self.name.clone();
        let routes: Vec<&mut Value> = self
            .virtual_hosts_mut()?
            .into_iter()
            .filter_map(|vhost| vhost.get_mut("routes").and_then(Value::as_sequence_mut))
            .flatten()
            .collect();
        if routes.is_empty() {
            bail!("no routes in {name}");
        }
        Ok(routes)
    }

    /// Sets every route's upstream timeout (how long Envoy waits for the
    /// backend's whole response).
    pub fn set_route_timeout(&mut self, timeout: Duration) -> Result<()> {
        for route in self.routes_mut()? {
            let action = route
                .get_mut("route")
                .and_then(Value::as_mapping_mut)
                .ok_or_else(|| anyhow!("a route without a route action"))?;
            action.insert(
                Value::from("timeout"),
                Value::from(format!("{}s", timeout.as_secs_f64())),
            );
        }
        Ok(())
    }

    /// Sets `key` of every HTTP connection manager (e.g. `use_remote_address`
    /// and `xff_num_trusted_hops`, which decide the client address Envoy
    /// gives the filters): how a test runs the chain behind the proxies an
    /// operator's configuration trusts.
    pub fn set_connection_manager_option(&mut self, key: &str, value: Value) -> Result<()> {
        let name = self.name.clone();
        let managers = self.http_connection_managers_mut()?;
        if managers.is_empty() {
            bail!("{name}: no HTTP connection manager");
        }
        for manager in managers {
            manager
                .as_mapping_mut()
                .ok_or_else(|| anyhow!("{name}: an HTTP connection manager is not a map"))?
                .insert(Value::from(key), value.clone());
        }
        Ok(())
    }

    /// Removes the bootstrap Wasm services (the observer): how a test shows
    /// what the filters do when it is gone.
    pub fn remove_services(&mut self) -> Result<()> {
        let map = self
            .doc
            .as_mapping_mut()
            .ok_or_else(|| anyhow!("{} is not a map", self.name))?;
        if map.remove("bootstrap_extensions").is_none() {
            bail!("{}: no bootstrap_extensions", self.name);
        }
        Ok(())
    }

    /// Writes the document into `dir` and returns its path.
    pub fn write(&self, dir: &Path) -> Result<PathBuf> {
        let path = dir.join(format!("{}.yaml", self.name));
        std::fs::write(&path, serde_yaml::to_string(&self.doc)?)?;
        Ok(path)
    }

    fn http_connection_managers_mut(&mut self) -> Result<Vec<&mut Value>> {
        let mut out = vec![];
        for listener in listeners_mut(&mut self.doc) {
            for chain in listener
                .get_mut("filter_chains")
                .and_then(Value::as_sequence_mut)
                .into_iter()
                .flatten()
            {
                for filter in chain
                    .get_mut("filters")
                    .and_then(Value::as_sequence_mut)
                    .into_iter()
                    .flatten()
                {
                    if let Some(hcm) = filter.get_mut("typed_config") {
                        out.push(hcm);
                    }
                }
            }
        }
        Ok(out)
    }

    fn virtual_hosts_mut(&mut self) -> Result<Vec<&mut Value>> {
        let mut out = vec![];
        for hcm in self.http_connection_managers_mut()? {
            if let Some(vhosts) =
                lookup_mut(hcm, &["route_config", "virtual_hosts"]).and_then(Value::as_sequence_mut)
            {
                out.extend(vhosts.iter_mut());
            }
        }
        Ok(out)
    }

    /// Puts `filters` in place of every HTTP filter but the router (which
    /// stays last), in every HTTP connection manager.
    pub fn replace_http_filters(&mut self, filters: &[Value]) -> Result<()> {
        let name = self.name.clone();
        for hcm in self.http_connection_managers_mut()? {
            let chain = hcm
                .get_mut("http_filters")
                .and_then(Value::as_sequence_mut)
                .ok_or_else(|| {
                    anyhow!("{name}: an HTTP connection manager without http_filters")
                })?;
            chain.retain(|f| {
                f.get("name").and_then(Value::as_str) == Some("envoy.filters.http.router")
            });
            for (i, filter) in filters.iter().enumerate() {
                chain.insert(i, filter.clone());
            }
        }
        Ok(())
    }

    fn wasm_filters_mut(&mut self) -> Result<Vec<&mut Value>> {
        let mut out = vec![];
        for hcm in self.http_connection_managers_mut()? {
            for filter in hcm
                .get_mut("http_filters")
                .and_then(Value::as_sequence_mut)
                .into_iter()
                .flatten()
            {
                // Directly, or wrapped in a `TypedStruct` (`type_url`).
                let typed = filter.get("typed_config");
                let is_wasm = [
                    typed.and_then(|t| t.get("@type")),
                    typed.and_then(|t| t.get("type_url")),
                ]
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .any(|t| t.ends_with("envoy.extensions.filters.http.wasm.v3.Wasm"));
                if is_wasm {
                    out.push(filter);
                }
            }
        }
        Ok(out)
    }

    fn native_config_value(&mut self, filter: &str) -> Result<&mut Value> {
        let name = self.name.clone();
        self.http_connection_managers_mut()?
            .into_iter()
            .flat_map(|hcm| {
                hcm.get_mut("http_filters")
                    .and_then(Value::as_sequence_mut)
                    .into_iter()
                    .flatten()
            })
            .find(|f| f.get("name").and_then(Value::as_str) == Some(filter))
            .and_then(|f| lookup_mut(f, &["typed_config", "filter_config", "value"]))
            .ok_or_else(|| anyhow!("{name}: no dynamic module filter named {filter}"))
    }

    fn wasm_config_value(&mut self, filter: &str) -> Result<&mut Value> {
        let name = self.name.clone();
        self.wasm_filters_mut()?
            .into_iter()
            .find(|f| f.get("name").and_then(Value::as_str) == Some(filter))
            .and_then(wasm_config_mut)
            .and_then(|c| lookup_mut(c, &["configuration", "value"]))
            .ok_or_else(|| {
                anyhow!("{name}: no Wasm filter named {filter} with a configuration value")
            })
    }
}

/// Points every endpoint of a static cluster at `addr`.
fn point_endpoints(cluster: &mut Value, addr: SocketAddr) -> Result<()> {
    for group in lookup_mut(cluster, &["load_assignment", "endpoints"])
        .and_then(Value::as_sequence_mut)
        .into_iter()
        .flatten()
    {
        for ep in group
            .get_mut("lb_endpoints")
            .and_then(Value::as_sequence_mut)
            .into_iter()
            .flatten()
        {
            let at = ["endpoint", "address", "socket_address"];
            set_path(
                ep,
                &[&at[..], &["address"]].concat(),
                Value::from(addr.ip().to_string()),
            )?;
            set_path(
                ep,
                &[&at[..], &["port_value"]].concat(),
                Value::from(addr.port()),
            )?;
        }
    }
    Ok(())
}

/// A Wasm filter's `config` (the `PluginConfig`), under its typed config or
/// under a `TypedStruct`'s `value`.
fn wasm_config_mut(filter: &mut Value) -> Option<&mut Value> {
    let typed = filter.get_mut("typed_config")?;
    if typed.get("type_url").is_some() {
        return lookup_mut(typed, &["value", "config"]);
    }
    typed.get_mut("config")
}

/// The static listeners: a list, or (as Envoy also takes it) a single
/// listener given as a mapping.
fn listeners_mut(doc: &mut Value) -> Vec<&mut Value> {
    match lookup_mut(doc, &["static_resources", "listeners"]) {
        Some(Value::Sequence(list)) => list.iter_mut().collect(),
        Some(single @ Value::Mapping(_)) => vec![single],
        _ => Vec::new(),
    }
}

fn lookup_mut<'a>(mut value: &'a mut Value, path: &[&str]) -> Option<&'a mut Value> {
    for key in path {
        value = value.get_mut(*key)?;
    }
    Some(value)
}

fn set_path(value: &mut Value, path: &[&str], new: Value) -> Result<()> {
    let target =
        lookup_mut(value, path).ok_or_else(|| anyhow!("no {} in the config", path.join(".")))?;
    *target = new;
    Ok(())
}

fn seq_mut<'a>(value: &'a mut Value, path: &[&str]) -> Result<std::slice::IterMut<'a, Value>> {
    Ok(lookup_mut(value, path)
        .and_then(Value::as_sequence_mut)
        .ok_or_else(|| anyhow!("no list at {}", path.join(".")))?
        .iter_mut())
}

/// The outcome of `envoy --mode validate`.
#[derive(Debug)]
pub struct Validation {
    /// Whether Envoy accepted the config.
    pub ok: bool,
    /// Everything Envoy printed.
    pub output: String,
}

/// `host-sim check`, the operator's gate before a deploy, run on every file
/// a test has Envoy validate: where Envoy refuses a zerolayer filter's
/// configuration the check must refuse it too, and where Envoy accepts a
/// file the check must not refuse it.
fn agrees_with_check(path: &Path, env: &[(String, String)], envoy: &Validation) -> Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let lookup = |name: &str| {
        env.iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var(name).ok())
    };
    let shown = path.display().to_string();
    let problems = host_sim_tools::check::check_envoy(&shown, &text, &paths::root(), &lookup);
    let listed = problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    if envoy.ok && !problems.is_empty() {
        bail!("Envoy accepts {shown} but host-sim check refuses it:\n{listed}");
    }
    if !envoy.ok && envoy.output.contains("invalid configuration") && problems.is_empty() {
        bail!(
            "Envoy refuses {shown} for a filter's configuration but host-sim check passes it; \
             Envoy said:\n{}",
            envoy.output
        );
    }
    Ok(())
}

/// A running Envoy; killed when dropped.
pub struct Envoy {
    child: Child,
    admin: SocketAddr,
    listener: SocketAddr,
    dir: tempfile::TempDir,
    client: Client,
}

/// How long Envoy may take to become ready (V8 compiles each `.wasm` once).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

impl Envoy {
    /// Runs `envoy --mode validate` on `config` (which really loads the Wasm
    /// and runs its configuration callbacks).
    pub fn validate(config: &EnvoyConfig) -> Result<Validation> {
        let dir = tempfile::tempdir()?;
        let path = config.write(dir.path())?;
        Self::validate_file_with_env(&path, &config.env)
    }

    /// Runs `envoy --mode validate` on a file as it is.
    pub fn validate_file(path: &Path) -> Result<Validation> {
        Self::validate_file_with_env(path, &[])
    }

    /// Runs `envoy --mode validate` on a file with `env` in Envoy's
    /// environment (secrets the shipped configs take from there).
    pub fn validate_file_with_env(path: &Path, env: &[(String, String)]) -> Result<Validation> {
        let output = Command::new(paths::envoy_binary()?)
            .args([
                "--mode",
                "validate",
                "--disable-hot-restart",
                "-l",
                "info",
                "-c",
            ])
            .arg(path)
            .current_dir(paths::root())
            .env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", paths::native_modules())
            .envs(env.iter().map(|(k, v)| (k, v)))
            .output()
            .context("running envoy --mode validate")?;
        let validation = Validation {
            ok: output.status.success(),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            ),
        };
        agrees_with_check(path, env, &validation)?;
        Ok(validation)
    }

    /// Starts Envoy with `config` (see [`EnvoyConfig::for_run`]) and waits
    /// until its admin `/ready` answers 200.
    pub fn start(config: &EnvoyConfig) -> Result<Envoy> {
        let dir = tempfile::Builder::new()
            .prefix("zerolayer-envoy-")
            .tempdir()?;
        let path = config.write(dir.path())?;
        let admin_file = dir.path().join("admin-address");
        let stdout = std::fs::File::create(dir.path().join("access.log"))?;
        let envoy = paths::envoy_binary()?;
        let mut command = match config.wrapper.split_first() {
            None => Command::new(&envoy),
            Some((program, args)) => {
                let mut command = Command::new(program);
                command.args(args).arg(&envoy);
                command
            }
        };
        let child = command
            .arg("-c")
            .arg(&path)
            .args(["--disable-hot-restart", "--concurrency"])
            .arg(config.workers.to_string())
            .args(["-l", "info"])
            // Access logs reach the file within 200 ms instead of 10 s.
            .args(["--file-flush-interval-msec", "200"])
            .arg("--admin-address-path")
            .arg(&admin_file)
            .arg("--log-path")
            .arg(dir.path().join("envoy.log"))
            .current_dir(paths::root())
            // Where `envoy.filters.http.dynamic_modules` finds zerolayer's
            // native module (a config without one never looks).
            .env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", paths::native_modules())
            .envs(config.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::null())
            .spawn()
            .context("starting envoy")?;
        let mut envoy = Envoy {
            child,
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            listener: SocketAddr::from(([127, 0, 0, 1], 0)),
            dir,
            client: Client::new(),
        };
        envoy
            .wait_ready(&admin_file, config.ready_timeout)
            .map_err(|err| {
                anyhow!(
                    "Envoy did not become ready: {err:#}\n--- envoy.log (tail) ---\n{}",
                    envoy.log_tail(40)
                )
            })?;
        Ok(envoy)
    }

    fn wait_ready(&mut self, admin_file: &Path, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("envoy exited with {status}");
            }
            if Instant::now() > deadline {
                bail!("timed out after {timeout:?}");
            }
            if self.admin.port() == 0 {
                if let Ok(text) = std::fs::read_to_string(admin_file)
                    && let Ok(addr) = text.trim().parse()
                {
                    self.admin = addr;
                }
            } else if let Ok(reply) = self.client.get(&self.admin_url("/ready"), &[])
                && reply.status == 200
            {
                self.listener = self.first_listener()?;
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn first_listener(&self) -> Result<SocketAddr> {
        let reply = self
            .client
            .get(&self.admin_url("/listeners?format=json"), &[])?;
        let doc: serde_json::Value = serde_json::from_str(&reply.body)?;
        let addr = &doc["listener_statuses"][0]["local_address"]["socket_address"];
        let ip = addr["address"]
            .as_str()
            .ok_or_else(|| anyhow!("no listener address in {}", reply.body))?;
        let port = addr["port_value"]
            .as_u64()
            .ok_or_else(|| anyhow!("no listener port in {}", reply.body))?;
        Ok(SocketAddr::new(ip.parse()?, u16::try_from(port)?))
    }

    /// URL of `path` on the listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.listener, path)
    }

    /// URL of `path` on the admin interface.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    /// The Envoy process's id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Envoy's resident memory (`VmRSS`), bytes.
    pub fn rss_bytes(&self) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))?;
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow!("no VmRSS in /proc/{}/status", self.pid()))?;
        Ok(kib * 1024)
    }

    /// The listener's address.
    pub fn listener(&self) -> SocketAddr {
        self.listener
    }

    /// `GET /stats/prometheus`.
    pub fn prometheus(&self) -> Result<String> {
        Ok(self
            .client
            .get(&self.admin_url("/stats/prometheus"), &[])?
            .body)
    }

    /// The value of Prometheus sample `series` (e.g. `name{rule="x"}`), if
    /// present. Envoy prints unlabelled samples as `name{}`; `name` finds them.
    pub fn metric(&self, series: &str) -> Result<Option<f64>> {
        let text = self.prometheus()?;
        let bare = format!("{series}{{}}");
        Ok(text.lines().find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series || name == bare)
                .then(|| value.parse().ok())
                .flatten()
        }))
    }

    /// Polls until `series` reaches at least `want` (counters are flushed on
    /// the filters' tick) and returns its value; fails after 10 s.
    pub fn wait_metric(&self, series: &str, want: f64) -> Result<f64> {
        let mut last = None;
        crate::wait::until(
            &format!("{series} ≥ {want}"),
            Duration::from_secs(10),
            || {
                last = self.metric(series)?;
                Ok(last.filter(|v| *v >= want))
            },
        )
        .with_context(|| {
            format!(
                "it is {last:?}; prometheus:\n{}",
                self.prometheus().unwrap_or_default()
            )
        })
    }

    /// Envoy's own log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }

    /// The access log so far (the shipped configs log to stdout).
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }

    /// The last `lines` lines of Envoy's own log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

impl Envoy {
    /// Kills the process (SIGKILL) and waits for it: everything in its
    /// memory is gone, as after a crash or a restart.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        self.stop();
    }
}
