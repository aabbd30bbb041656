//! `host-sim check`: a deployment's configuration checked before it goes
//! live. ngx_wasm_module (Kong) and Envoy find a bad filter configuration
//! only when they load it, and then every worker fails or every request
//! goes unanswered; this reads the same files first.
//!
//! Each zerolayer filter's configuration is loaded with the filters' own
//! loaders (`zerolayer_core`'s `from_json`, the observer's configuration,
//! the fused [`Document`], the native module's `load`, included from
//! `filters/native/src/config.rs`), and what the host must provide for it
//! is looked up in the host's files: the clusters (Envoy) or callout
//! addresses (Kong) the configurations name, the observer's queue and
//! `vm_id`, the environment variables that carry secrets, the Wasm files,
//! the shared memory and queues Kong's `kong.conf` declares. Every problem
//! is one [`Problem`]: the file, the field, what is wrong.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use serde_yaml::Value;
use zerolayer_core::ConfigError;
use zerolayer_core::activation::RuleSet;
use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::cache::config::PostCacheConfig;
use zerolayer_core::config::{Endpoint, ObserverLink, ObserverMode, ROOT, quoted};
use zerolayer_core::metering::MeteringConfig;
use zerolayer_core::quota::GatewayQuota;
use zerolayer_core::quota::config::{QuotaConfig, StreamMode};
use zerolayer_fused::Document;
use zerolayer_observer::ObserverConfig;

use crate::config_file::{seq, string_value, type_of};

/// The native module's configuration loader, the module's own source
/// (`filters/native` builds only as Envoy's shared library, so it cannot be
/// a dependency).
#[allow(dead_code, unreachable_pub)]
#[path = "../../../filters/native/src/config.rs"]
mod native_config;

/// One problem: the file it is in, the field (a dotted path in a filter's
/// configuration, or the host file's key) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}: {field}: {message}")]
pub struct Problem {
    /// The file as the operator named it.
    pub file: String,
    /// The field: `lazy_auth.jwt.jwks.cluster`, `vm_config.vm_id`, `nginx_main_env`.
    pub field: String,
    /// What is wrong, and where in the file when the field alone does not say.
    pub message: String,
}

/// Where the environment variables a configuration names are read from:
/// the process's environment in the command, a map in tests.
pub type Environment<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The bytes a Wasm module starts with.
const WASM_MAGIC: &[u8; 4] = b"\0asm";

/// The native module's library and filter names.
const NATIVE_MODULE: &str = "zerolayer_native";
const NATIVE_FILTER: &str = "zerolayer";

/// Who a tick-mode observer works for, as it names its queue
/// (`<observer.queue>.<who>`): the separate filters' names.
fn who(section: &str) -> &'static str {
    match section {
        "lazy_auth" => "lazy-auth",
        "post_cache" => "post-cache",
        "metering" => "metering",
        "quota" => "quota",
        _ => "activation",
    }
}

/// A stage's configuration, loaded by its filter's own loader.
#[derive(Debug)]
enum StageConfig {
    Activation,
    LazyAuth(Box<LazyAuthConfig>),
    PostCache(Box<PostCacheConfig>),
    Metering(Box<MeteringConfig>),
    Quota(Box<QuotaConfig>),
}

impl StageConfig {
    /// The section's name in a fused document.
    fn section(&self) -> &'static str {
        match self {
            StageConfig::Activation => "activation",
            StageConfig::LazyAuth(_) => "lazy_auth",
            StageConfig::PostCache(_) => "post_cache",
            StageConfig::Metering(_) => "metering",
            StageConfig::Quota(_) => "quota",
        }
    }

    /// The endpoints the stage (or the observer working for it) calls, by field.
    fn endpoints(&self) -> Vec<(String, &Endpoint)> {
        let mut out = Vec::new();
        let s = self.section();
        match self {
            StageConfig::LazyAuth(c) => {
                if let Some(jwks) = &c.jwt.jwks {
                    out.push((format!("{s}.jwt.jwks.cluster"), &jwks.endpoint));
                }
                if let Some(keys) = &c.api_keys {
                    out.push((format!("{s}.api_keys.cluster"), &keys.endpoint));
                }
                if let Some(audit) = &c.audit {
                    out.push((format!("{s}.audit.cluster"), &audit.endpoint));
                }
                if let Some(attribution) = &c.attribution {
                    out.push((format!("{s}.attribution.cluster"), &attribution.endpoint));
                }
            }
            StageConfig::PostCache(c) => {
                if let Some(fleet) = &c.fleet {
                    out.push((format!("{s}.fleet.cluster"), &fleet.endpoint));
                }
            }
            StageConfig::Metering(c) => {
                if let Some(sink) = &c.sink {
                    out.push((format!("{s}.sink.cluster"), &sink.endpoint));
                }
            }
            StageConfig::Quota(c) => out.push((format!("{s}.store.cluster"), &c.store.endpoint)),
            StageConfig::Activation => {}
        }
        out
    }

    /// The observer link of a stage that posts jobs to an observer with
    /// this configuration (lazy-auth always, post-cache with a fleet tier,
    /// metering with a sink).
    fn posting_link(&self) -> Option<&ObserverLink> {
        match self {
            StageConfig::LazyAuth(c) => Some(&c.observer),
            StageConfig::PostCache(c) => c.fleet.as_ref().map(|_| &c.observer),
            StageConfig::Metering(c) => c.sink.as_ref().map(|_| &c.observer),
            StageConfig::Activation | StageConfig::Quota(_) => None,
        }
    }

    /// The environment variables the configuration reads secrets from, by field.
    fn secret_vars(&self) -> Vec<(String, &str)> {
        let s = self.section();
        match self {
            StageConfig::LazyAuth(c) => c
                .jwt
                .hs256_secret_env
                .iter()
                .map(|v| (format!("{s}.jwt.hs256_secret_env"), v.as_str()))
                .collect(),
            StageConfig::PostCache(c) => vec![(format!("{s}.secret_env"), c.secret_env.as_str())],
            _ => Vec::new(),
        }
    }

    /// Whether the secret in `value` is one the stage accepts (`Err`: why not).
    fn check_secret(&self, value: &str) -> Result<(), String> {
        match self {
            StageConfig::PostCache(c) => c
                .check_secret(Some(value.as_bytes()))
                .map_err(|e| e.message().to_string()),
            StageConfig::LazyAuth(_) => {
                zerolayer_core::auth::jwt::VerifyingKey::from_secret(value.as_bytes())
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
            _ => Ok(()),
        }
    }
}

/// A problem inside a configuration document: the field and the message.
type FieldError = (String, String);

/// `path` within `section` (`lazy_auth.jwt.issuers`; the section itself
/// for an error about the whole document).
fn within(section: &str, e: &ConfigError) -> FieldError {
    let field = match e.path() {
        // `?`: serde_path_to_error's "somewhere" for a syntax error.
        ROOT | "?" => section.to_string(),
        path => format!("{section}.{path}"),
    };
    (field, e.message().to_string())
}

/// A `field: message` line (the filters' own error form) split in two.
fn split_line(line: &str, default_field: &str) -> FieldError {
    match line.split_once(": ") {
        Some((field, message)) if !field.contains(' ') => (field.to_string(), message.to_string()),
        _ => (default_field.to_string(), line.to_string()),
    }
}

/// Loads section `section` with its filter's own loader, as the filter's
/// root does when it is configured (the environment aside: secrets are
/// checked against the deployment's environment separately).
fn load_stage(section: &str, bytes: &[u8]) -> Result<StageConfig, FieldError> {
    let err = |e: ConfigError| within(section, &e);
    Ok(match section {
        "activation" => {
            RuleSet::from_json(bytes).map_err(err)?;
            StageConfig::Activation
        }
        "lazy_auth" => {
            let config = LazyAuthConfig::from_json(bytes).map_err(err)?;
            check_keys(section, &config)?;
            StageConfig::LazyAuth(Box::new(config))
        }
        "post_cache" => {
            StageConfig::PostCache(Box::new(PostCacheConfig::from_json(bytes).map_err(err)?))
        }
        "metering" => {
            StageConfig::Metering(Box::new(MeteringConfig::from_json(bytes).map_err(err)?))
        }
        "quota" => {
            let config = QuotaConfig::from_json(bytes).map_err(err)?;
            GatewayQuota::new(&config, 1, 1).map_err(err)?;
            StageConfig::Quota(Box::new(config))
        }
        other => return Err((other.to_string(), "not a zerolayer stage".to_string())),
    })
}

/// The configured verification keys (JWKs) parse, as lazy-auth's root and
/// the observer read them (the HS256 secret is the environment's, checked
/// with the other secrets).
fn check_keys(section: &str, config: &LazyAuthConfig) -> Result<(), FieldError> {
    let mut keys_only = config.clone();
    keys_only.jwt.hs256_secret_env = None;
    zerolayer_observer::auth::configured_keys(&keys_only)
        .map(|_| ())
        .map_err(|line| {
            let (field, message) = split_line(&line, "jwt.keys");
            (format!("{section}.{field}"), message)
        })
}

/// A fused document's sections, each loaded by its stage's loader; the
/// native module's own section `native` is taken out first when `native`.
fn load_document(bytes: &[u8], native: bool) -> Result<Vec<StageConfig>, Vec<FieldError>> {
    let mut document =
        Document::parse(bytes).map_err(|m| vec![("configuration".to_string(), m)])?;
    if native {
        document.take("native");
    }
    let sections = document.sections().map_err(|line| {
        vec![if line.starts_with("no stage configured") {
            ("configuration".to_string(), line)
        } else {
            split_line(&line, "configuration")
        }]
    })?;
    let mut loaded = Vec::new();
    let mut errors = Vec::new();
    for (stage, section) in sections {
        match load_stage(stage.section(), section) {
            Ok(config) => loaded.push(config),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(loaded)
    } else {
        Err(errors)
    }
}

/// The observer singleton's configuration, as its module loads it.
fn load_observer(bytes: &[u8]) -> Result<(ObserverConfig, Vec<StageConfig>), FieldError> {
    let config = ObserverConfig::from_json(bytes).map_err(|e| within_root(&e))?;
    if let Some(lazy) = &config.lazy_auth {
        check_keys("lazy_auth", lazy)?;
    }
    let mut stages = Vec::new();
    if let Some(c) = &config.lazy_auth {
        stages.push(StageConfig::LazyAuth(Box::new(c.clone())));
    }
    if let Some(c) = &config.post_cache {
        stages.push(StageConfig::PostCache(Box::new(c.clone())));
    }
    if let Some(c) = &config.metering {
        stages.push(StageConfig::Metering(Box::new(c.clone())));
    }
    Ok((config, stages))
}

/// An error whose path is already the document's (`lazy_auth.jwt.issuers`).
fn within_root(e: &ConfigError) -> FieldError {
    (e.path().to_string(), e.message().to_string())
}

/// Collects problems for one file.
struct Report<'a> {
    file: &'a str,
    problems: Vec<Problem>,
}

impl<'a> Report<'a> {
    fn new(file: &'a str) -> Self {
        Report {
            file,
            problems: Vec::new(),
        }
    }

    fn add(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem {
            file: self.file.to_string(),
            field: field.into(),
            message: message.into(),
        });
    }

    /// A problem inside the configuration of `at` (`http filter zerolayer.lazy_auth`).
    fn add_in(&mut self, (field, message): FieldError, at: &str) {
        self.add(field, format!("{message} (in {at})"));
    }
}

/// `path` resolved against `base` (absolute paths stay).
fn resolve(base: &Path, path: &str) -> std::path::PathBuf {
    base.join(path)
}

/// Why the Wasm module at `path` cannot be loaded, if it cannot.
fn wasm_file_problem(base: &Path, path: &str) -> Option<String> {
    let full = resolve(base, path);
    match std::fs::read(&full) {
        Err(_) => Some(format!(
            "no file {} (resolved against {})",
            quoted(path),
            base.display()
        )),
        Ok(bytes) if !bytes.starts_with(WASM_MAGIC) => {
            Some(format!("{} is not a Wasm module", quoted(path)))
        }
        Ok(_) => None,
    }
}

/// A Wasm plugin of an Envoy bootstrap: an HTTP filter or a bootstrap
/// extension (the observer singleton).
struct EnvoyPlugin {
    /// Where it is, for messages: `http filter NAME`, `bootstrap extension NAME`.
    at: String,
    /// What it runs, from its file's name (`zerolayer_<kind>.wasm`) or root_id.
    kind: String,
    vm_id: String,
    filename: Option<String>,
    configuration: Result<Vec<u8>, String>,
    /// `environment_variables.host_env_keys`: read from Envoy's environment.
    host_env_keys: Vec<String>,
    /// `environment_variables.key_values`: given literally.
    key_values: Vec<String>,
    /// `singleton: true` (bootstrap extensions).
    singleton: bool,
    /// What its configuration loaded to (`None`: it did not load).
    stages: Option<Vec<StageConfig>>,
    /// The observer's configuration (observer singletons).
    observer: Option<ObserverConfig>,
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_sequence()
        .map(|s| {
            s.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

impl EnvoyPlugin {
    /// Reads `config` (a `PluginConfig`: `name`, `root_id`, `vm_config`,
    /// `configuration`).
    fn read(config: &Value, at: String, singleton: bool) -> EnvoyPlugin {
        let vm = &config["vm_config"];
        let filename = vm["code"]["local"]["filename"].as_str().map(str::to_string);
        let stem = filename
            .as_deref()
            .and_then(|f| Path::new(f).file_stem())
            .and_then(|s| s.to_str())
            .and_then(|s| s.strip_prefix("zerolayer_"))
            .map(str::to_string);
        let kind = stem
            .or_else(|| {
                config["root_id"]
                    .as_str()
                    .and_then(|r| r.strip_prefix("zerolayer."))
                    .map(str::to_string)
            })
            .unwrap_or_default();
        let vars = &vm["environment_variables"];
        EnvoyPlugin {
            at,
            kind,
            vm_id: vm["vm_id"].as_str().unwrap_or_default().to_string(),
            filename,
            configuration: string_value(&config["configuration"]).map_err(|e| e.to_string()),
            host_env_keys: strings(&vars["host_env_keys"]),
            key_values: vars["key_values"]
                .as_mapping()
                .map(|m| {
                    m.keys()
                        .filter_map(|k| k.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
            singleton,
            stages: None,
            observer: None,
        }
    }

    fn is_observer(&self) -> bool {
        matches!(self.kind.as_str(), "observer_service" | "observer")
    }
}

/// Checks an Envoy bootstrap (`shown` is its name as the operator gave it):
/// every zerolayer Wasm filter, observer singleton and native module
/// filter in it. Relative Wasm paths resolve against `base`.
pub fn check_envoy(shown: &str, text: &str, base: &Path, env: Environment<'_>) -> Vec<Problem> {
    let mut report = Report::new(shown);
    let doc: Value = match serde_yaml::from_str(text) {
        Ok(doc) => doc,
        Err(e) => {
            report.add("yaml", format!("not YAML: {e}"));
            return report.problems;
        }
    };
    // Clusters from CDS are not in the file: their names cannot be checked.
    let clusters: Option<Vec<String>> =
        doc["dynamic_resources"]["cds_config"].is_null().then(|| {
            seq(&doc, &["static_resources", "clusters"])
                .iter()
                .filter_map(|c| c["name"].as_str().map(str::to_string))
                .collect()
        });

    let mut singletons = Vec::new();
    for ext in seq(&doc, &["bootstrap_extensions"]) {
        let config = &ext["typed_config"];
        if type_of(config).ends_with("envoy.extensions.wasm.v3.WasmService") {
            let name = config["config"]["name"].as_str().unwrap_or_default();
            let singleton = config["singleton"].as_bool().unwrap_or(false);
            singletons.push(EnvoyPlugin::read(
                &config["config"],
                format!("bootstrap extension {name}"),
                singleton,
            ));
        }
    }
    let mut filters = Vec::new();
    let mut natives = Vec::new();
    for listener in seq(&doc, &["static_resources", "listeners"]) {
        for chain in seq(&listener, &["filter_chains"]) {
            for filter in seq(&chain, &["filters"]) {
                for http in seq(&filter["typed_config"], &["http_filters"]) {
                    let config = &http["typed_config"];
                    let name = http["name"].as_str().unwrap_or_default();
                    let ty = type_of(config);
                    if ty.ends_with("envoy.extensions.filters.http.wasm.v3.Wasm") {
                        filters.push(EnvoyPlugin::read(
                            &config["config"],
                            format!("http filter {name}"),
                            false,
                        ));
                    } else if ty.ends_with("dynamic_modules.v3.DynamicModuleFilter") {
                        natives.push((name.to_string(), config.clone()));
                    }
                }
            }
        }
    }

    for plugin in singletons.iter_mut().chain(filters.iter_mut()) {
        load_envoy_plugin(plugin, base, &mut report);
    }
    for plugin in &singletons {
        if plugin.is_observer() && !plugin.singleton {
            report.add_in(
                (
                    "singleton".to_string(),
                    "not true: the observer must run once per Envoy, as a singleton service"
                        .to_string(),
                ),
                &plugin.at,
            );
        }
    }
    let lazy_auth_vm = filters
        .iter()
        .find(|p| p.kind == "lazy_auth")
        .map(|p| p.vm_id.clone());
    for plugin in singletons.iter().chain(filters.iter()) {
        let Some(stages) = &plugin.stages else {
            continue;
        };
        for stage in stages {
            check_clusters(stage, clusters.as_deref(), &plugin.at, &mut report);
            check_vm_secrets(stage, plugin, env, &mut report);
            if !plugin.is_observer() {
                check_singleton_link(stage, plugin, &singletons, &mut report);
            }
        }
        if plugin.kind == "metering"
            && let Some(vm) = &lazy_auth_vm
            && plugin.vm_id != *vm
        {
            report.add_in(
                (
                    "vm_config.vm_id".to_string(),
                    format!(
                        "{} is not lazy-auth's vm_id {}: metering reads the verdicts of credentials admitted before verification in that vm_id's shared data",
                        quoted(&plugin.vm_id),
                        quoted(vm)
                    ),
                ),
                &plugin.at,
            );
        }
    }
    for (name, config) in &natives {
        check_native(name, config, clusters.as_deref(), base, env, &mut report);
    }
    report.problems
}

/// Checks a Wasm plugin's file and loads its configuration.
fn load_envoy_plugin(plugin: &mut EnvoyPlugin, base: &Path, report: &mut Report<'_>) {
    if let Some(file) = &plugin.filename
        && let Some(problem) = wasm_file_problem(base, file)
    {
        report.add_in(
            ("vm_config.code.local.filename".to_string(), problem),
            &plugin.at,
        );
    }
    let bytes = match &plugin.configuration {
        Ok(bytes) => bytes.clone(),
        Err(e) => {
            report.add_in(("configuration.value".to_string(), e.clone()), &plugin.at);
            return;
        }
    };
    match plugin.kind.as_str() {
        "activation" | "lazy_auth" | "post_cache" | "metering" | "quota" => {
            match load_stage(&plugin.kind, &bytes) {
                Ok(stage) => plugin.stages = Some(vec![stage]),
                Err(e) => report.add_in(e, &plugin.at),
            }
        }
        "fused" => match load_document(&bytes, false) {
            Ok(stages) => plugin.stages = Some(stages),
            Err(errors) => errors
                .into_iter()
                .for_each(|e| report.add_in(e, &plugin.at)),
        },
        "observer_service" | "observer" => match load_observer(&bytes) {
            Ok((config, stages)) => {
                plugin.observer = Some(config);
                plugin.stages = Some(stages);
            }
            Err(e) => report.add_in(e, &plugin.at),
        },
        // Not a zerolayer filter: its configuration is its own business.
        _ => {}
    }
}

/// Every cluster `stage` names is one of `clusters` (unknown: CDS).
fn check_clusters(
    stage: &StageConfig,
    clusters: Option<&[String]>,
    at: &str,
    report: &mut Report<'_>,
) {
    let Some(clusters) = clusters else {
        return;
    };
    for (field, endpoint) in stage.endpoints() {
        if !clusters.contains(&endpoint.cluster) {
            report.add_in(
                (
                    field,
                    format!(
                        "no cluster {} in static_resources.clusters",
                        quoted(&endpoint.cluster)
                    ),
                ),
                at,
            );
        }
    }
}

/// The secrets `stage` reads from its VM's environment reach the VM
/// (`host_env_keys` or `key_values`), and those Envoy reads from its own
/// environment are set there, and acceptable.
fn check_vm_secrets(
    stage: &StageConfig,
    plugin: &EnvoyPlugin,
    env: Environment<'_>,
    report: &mut Report<'_>,
) {
    for (field, var) in stage.secret_vars() {
        if plugin.key_values.iter().any(|k| k == var) {
            continue;
        }
        if !plugin.host_env_keys.iter().any(|k| k == var) {
            report.add_in(
                (
                    field,
                    format!(
                        "{} is not in vm_config.environment_variables.host_env_keys: the VM would not see it",
                        quoted(var)
                    ),
                ),
                &plugin.at,
            );
            continue;
        }
        check_env_var(stage, &field, var, env, &plugin.at, report);
    }
}

/// `var` is set in the environment and its secret is one `stage` accepts.
fn check_env_var(
    stage: &StageConfig,
    field: &str,
    var: &str,
    env: Environment<'_>,
    at: &str,
    report: &mut Report<'_>,
) {
    match env(var) {
        None => report.add_in(
            (
                field.to_string(),
                format!("environment variable {} is not set", quoted(var)),
            ),
            at,
        ),
        Some(value) => {
            if let Err(why) = stage.check_secret(&value) {
                report.add_in((field.to_string(), why), at);
            }
        }
    }
}

/// A filter in singleton mode posts to a queue some observer singleton in
/// its `observer.vm_id` registers, and that observer does the filter's
/// work; lazy-auth runs in the observer's `vm_id` (verdicts live in its
/// shared data).
fn check_singleton_link(
    stage: &StageConfig,
    plugin: &EnvoyPlugin,
    singletons: &[EnvoyPlugin],
    report: &mut Report<'_>,
) {
    let Some(link) = stage.posting_link() else {
        return;
    };
    if link.mode != ObserverMode::Singleton {
        return;
    }
    let s = stage.section();
    if matches!(stage, StageConfig::LazyAuth(_)) && plugin.vm_id != link.vm_id {
        report.add_in(
            (
                format!("{s}.observer.vm_id"),
                format!(
                    "{} but the filter runs in vm_id {} (vm_config.vm_id): the observer writes verdicts into its own vm_id's shared data",
                    quoted(&link.vm_id),
                    quoted(&plugin.vm_id)
                ),
            ),
            &plugin.at,
        );
    }
    let observers: Vec<&EnvoyPlugin> = singletons
        .iter()
        .filter(|p| p.is_observer() && p.vm_id == link.vm_id)
        .collect();
    if observers.is_empty() {
        let running: Vec<String> = singletons
            .iter()
            .filter(|p| p.is_observer())
            .map(|p| quoted(&p.vm_id))
            .collect();
        report.add_in(
            (
                format!("{s}.observer.vm_id"),
                format!(
                    "no observer singleton (envoy.bootstrap.wasm) runs in vm_id {}{}: queue {} is never registered, the filter's jobs are lost",
                    quoted(&link.vm_id),
                    if running.is_empty() {
                        String::new()
                    } else {
                        format!(" (observers run in {})", running.join(", "))
                    },
                    quoted(&link.queue)
                ),
            ),
            &plugin.at,
        );
        return;
    }
    // An observer that did not load is reported already.
    let loaded: Vec<&ObserverConfig> = observers
        .iter()
        .filter_map(|p| p.observer.as_ref())
        .collect();
    if loaded.is_empty() {
        return;
    }
    let Some(observer) = loaded.iter().find(|c| c.link().queue == link.queue) else {
        let registered: Vec<String> = loaded.iter().map(|c| quoted(&c.link().queue)).collect();
        report.add_in(
            (
                format!("{s}.observer.queue"),
                format!(
                    "no observer singleton in vm_id {} registers queue {} (it registers {})",
                    quoted(&link.vm_id),
                    quoted(&link.queue),
                    registered.join(", ")
                ),
            ),
            &plugin.at,
        );
        return;
    };
    let serves = match stage {
        StageConfig::LazyAuth(_) => observer.lazy_auth.is_some(),
        StageConfig::PostCache(_) => observer.post_cache.is_some(),
        StageConfig::Metering(_) => observer.metering.is_some(),
        _ => true,
    };
    if !serves {
        report.add_in(
            (
                format!("{s}.observer"),
                format!(
                    "the observer singleton on queue {} has no {s} section: it would drop this filter's jobs",
                    quoted(&link.queue)
                ),
            ),
            &plugin.at,
        );
    }
}

/// Checks a dynamic module filter: the native module's configuration as
/// the module loads it, the clusters it names, its secrets (the module
/// reads Envoy's own environment) and, when the search path is set, its
/// library.
fn check_native(
    name: &str,
    config: &Value,
    clusters: Option<&[String]>,
    base: &Path,
    env: Environment<'_>,
    report: &mut Report<'_>,
) {
    let at = format!("http filter {name}");
    let module = config["dynamic_module_config"]["name"]
        .as_str()
        .unwrap_or_default();
    if module != NATIVE_MODULE {
        return;
    }
    if let Some(dir) = env("ENVOY_DYNAMIC_MODULES_SEARCH_PATH") {
        let file = format!("{dir}/lib{module}.so");
        if !resolve(base, &file).is_file() {
            report.add_in(
                (
                    "dynamic_module_config.name".to_string(),
                    format!(
                        "no lib{module}.so in ENVOY_DYNAMIC_MODULES_SEARCH_PATH {}",
                        quoted(&dir)
                    ),
                ),
                &at,
            );
        }
    }
    let filter_name = config["filter_name"].as_str().unwrap_or_default();
    if filter_name != NATIVE_FILTER {
        report.add_in(
            (
                "filter_name".to_string(),
                format!(
                    "unknown filter {} (expected {})",
                    quoted(filter_name),
                    quoted(NATIVE_FILTER)
                ),
            ),
            &at,
        );
        return;
    }
    let bytes = match string_value(&config["filter_config"]) {
        Ok(bytes) => bytes,
        Err(e) => {
            report.add_in(("filter_config.value".to_string(), e.to_string()), &at);
            return;
        }
    };
    let stages = match load_document(&bytes, true) {
        Ok(stages) => stages,
        Err(errors) => {
            errors.into_iter().for_each(|e| report.add_in(e, &at));
            return;
        }
    };
    if let Err(line) = native_config::load(&bytes) {
        report.add_in(split_line(&line, "configuration"), &at);
        return;
    }
    for stage in &stages {
        check_clusters(stage, clusters, &at, report);
        for (field, var) in stage.secret_vars() {
            check_env_var(stage, &field, var, env, &at, report);
        }
    }
}

/// What `kong.conf` sets that the filters depend on.
#[derive(Debug, Default)]
struct KongConf {
    /// `key = value` settings, the last of each key.
    settings: BTreeMap<String, String>,
    /// `env` directives in nginx's main block (`nginx_main_env`).
    env: Vec<String>,
    /// Key/value zones (`shm_kv NAME SIZE`): name → bytes.
    kv_zones: BTreeMap<String, Option<u64>>,
    /// Queues (`shm_queue NAME SIZE`): name → bytes.
    queues: BTreeMap<String, Option<u64>>,
}

/// An nginx size (`4m`, `512k`, `1g`, bytes).
fn nginx_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().last()? {
        (at, 'k' | 'K') => (&text[..at], 1024),
        (at, 'm' | 'M') => (&text[..at], 1024 * 1024),
        (at, 'g' | 'G') => (&text[..at], 1024 * 1024 * 1024),
        _ => (text, 1),
    };
    digits.parse::<u64>().ok().map(|n| n * unit)
}

impl KongConf {
    /// Reads `kong.conf`: Kong's `key = value` lines, its injected nginx
    /// directives (`nginx_<block>_<directive> = value` becomes `<directive>
    /// value;` in that block, so one value may chain several directives
    /// with `;`), `nginx_wasm_shm_kv_<name> = size` (Kong 3.6+).
    fn parse(text: &str) -> Result<KongConf, String> {
        let mut conf = KongConf::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((key, value)) = line.split_once('=') else {
                return Err(format!("line {}: not `key = value`", n + 1));
            };
            let (key, value) = (key.trim().to_string(), value.trim());
            // Kong strips a comment that follows a value.
            let value = match value.find(" #") {
                Some(at) => value[..at].trim(),
                None => value,
            };
            let directives = if let Some(zone) = key.strip_prefix("nginx_wasm_shm_kv_") {
                vec![("wasm", format!("shm_kv {zone} {value}"))]
            } else if let Some(d) = key.strip_prefix("nginx_wasm_") {
                vec![("wasm", format!("{d} {value}"))]
            } else if let Some(d) = key.strip_prefix("nginx_main_") {
                vec![("main", format!("{d} {value}"))]
            } else {
                Vec::new()
            };
            for (block, rendered) in directives {
                for directive in rendered.split(';') {
                    let words: Vec<&str> = directive.split_whitespace().collect();
                    match (block, words.as_slice()) {
                        ("main", ["env", name, ..]) => {
                            let name = name.split('=').next().unwrap_or(name);
                            conf.env.push(name.to_string());
                        }
                        ("wasm", ["shm_kv", name, size, ..]) => {
                            conf.kv_zones.insert(name.to_string(), nginx_size(size));
                        }
                        ("wasm", ["shm_queue", name, size, ..]) => {
                            conf.queues.insert(name.to_string(), nginx_size(size));
                        }
                        _ => {}
                    }
                }
            }
            conf.settings.insert(key, value.to_string());
        }
        Ok(conf)
    }
}

/// A filter entry of Kong's declarative configuration.
struct KongFilter {
    name: String,
    /// Where it is, for messages: `filter NAME`.
    at: String,
    config: Option<Value>,
    /// The routes it runs on that buffer responses (`response_buffering`
    /// not false), as `routes[NAME]`.
    buffered_routes: Vec<String>,
}

/// A route's name for messages and whether it buffers responses (Kong's
/// default).
fn kong_route(route: &Value, at: String) -> (String, bool) {
    let name = route["name"]
        .as_str()
        .map_or(at, |name| format!("routes[{name}]"));
    (name, route["response_buffering"].as_bool() != Some(false))
}

/// Every enabled filter of every filter chain (top level, on services, on
/// routes), with the routes each runs on.
fn kong_filters(doc: &Value) -> Vec<KongFilter> {
    let top_routes: Vec<(String, bool)> = seq(doc, &["routes"])
        .iter()
        .enumerate()
        .map(|(i, r)| kong_route(r, format!("routes[{i}]")))
        .collect();
    let mut every_route = top_routes.clone();
    let mut chains: Vec<(Value, Vec<(String, bool)>)> = Vec::new();
    for (s, service) in seq(doc, &["services"]).iter().enumerate() {
        let routes: Vec<(Value, (String, bool))> = seq(service, &["routes"])
            .into_iter()
            .enumerate()
            .map(|(r, route)| {
                let named = kong_route(&route, format!("services[{s}].routes[{r}]"));
                (route, named)
            })
            .collect();
        let named: Vec<(String, bool)> = routes.iter().map(|(_, n)| n.clone()).collect();
        every_route.extend(named.iter().cloned());
        for chain in seq(service, &["filter_chains"]) {
            chains.push((chain, named.clone()));
        }
        for (route, named) in routes {
            for chain in seq(&route, &["filter_chains"]) {
                chains.push((chain, vec![named.clone()]));
            }
        }
    }
    for (route, named) in seq(doc, &["routes"]).iter().zip(&top_routes) {
        for chain in seq(route, &["filter_chains"]) {
            chains.push((chain, vec![named.clone()]));
        }
    }
    for chain in seq(doc, &["filter_chains"]) {
        chains.push((chain, every_route.clone()));
    }
    let mut out = Vec::new();
    for (chain, routes) in chains {
        if chain["enabled"].as_bool() == Some(false) {
            continue;
        }
        let buffered_routes: Vec<String> = routes
            .into_iter()
            .filter_map(|(name, buffered)| buffered.then_some(name))
            .collect();
        for filter in seq(&chain, &["filters"]) {
            if filter["enabled"].as_bool() == Some(false) {
                continue;
            }
            let name = filter["name"].as_str().unwrap_or_default().to_string();
            out.push(KongFilter {
                at: format!("filter {name}"),
                name,
                config: (!filter["config"].is_null()).then(|| filter["config"].clone()),
                buffered_routes: buffered_routes.clone(),
            });
        }
    }
    out
}

/// Checks Kong's declarative configuration (`yml`, shown as `yml_shown`)
/// with the `kong.conf` it runs with (`conf`): each zerolayer filter's
/// configuration, its Wasm file in `wasm_filters_path`, its observer's queue
/// among the declared `shm_queue`s, the `*` key/value zone, the secrets'
/// `env` declarations and values, and its callout targets.
pub fn check_kong(
    yml_shown: &str,
    yml: &str,
    conf_shown: &str,
    conf: &str,
    base: &Path,
    env: Environment<'_>,
) -> Vec<Problem> {
    let mut on_yml = Report::new(yml_shown);
    let mut on_conf = Report::new(conf_shown);
    let kong = match KongConf::parse(conf) {
        Ok(kong) => kong,
        Err(e) => {
            on_conf.add("kong.conf", e);
            KongConf::default()
        }
    };
    let doc: Value = match serde_yaml::from_str(yml) {
        Ok(doc) => doc,
        Err(e) => {
            on_yml.add("yaml", format!("not YAML: {e}"));
            return [on_yml.problems, on_conf.problems].concat();
        }
    };
    let filters = kong_filters(&doc);
    let ours: Vec<&KongFilter> = filters
        .iter()
        .filter(|f| f.name.starts_with("zerolayer_"))
        .collect();
    if !filters.is_empty() && kong.settings.get("wasm").map(String::as_str) != Some("on") {
        on_conf.add(
            "wasm",
            format!("not on: Kong loads no Wasm filter (the filter chains of {yml_shown} need it)"),
        );
    }
    match kong.settings.get("wasm_filters_path") {
        None if !filters.is_empty() => {
            on_conf.add("wasm_filters_path", "not set: Kong finds no filter module")
        }
        None => {}
        Some(dir) => {
            for filter in &filters {
                let file = format!("{dir}/{}.wasm", filter.name);
                if let Some(problem) = wasm_file_problem(base, &file) {
                    on_conf.add(
                        "wasm_filters_path",
                        format!(
                            "{problem}: Kong has no filter {} ({} in {yml_shown})",
                            quoted(&filter.name),
                            filter.at
                        ),
                    );
                }
            }
        }
    }
    if !ours.is_empty() && !kong.kv_zones.contains_key("*") {
        on_conf.add(
            "nginx_wasm_shm_kv",
            "no `*` zone: zerolayer's shared-data keys have no zone prefix, so every get/set_shared_data traps",
        );
    }
    for filter in ours {
        let kind = filter.name.trim_start_matches("zerolayer_");
        let bytes = match &filter.config {
            Some(Value::String(s)) => s.clone().into_bytes(),
            None => {
                on_yml.add_in(
                    (
                        "config".to_string(),
                        "missing: the filter needs its JSON configuration".to_string(),
                    ),
                    &filter.at,
                );
                continue;
            }
            Some(_) => {
                on_yml.add_in(
                    (
                        "config".to_string(),
                        "not a string: the filters ship no .meta.json schema, so Kong takes the JSON configuration only as a string".to_string(),
                    ),
                    &filter.at,
                );
                continue;
            }
        };
        let stages = match kind {
            "activation" | "lazy_auth" | "post_cache" | "metering" | "quota" => {
                load_stage(kind, &bytes)
                    .map(|s| vec![s])
                    .map_err(|e| vec![e])
            }
            "fused" => load_document(&bytes, false),
            other => {
                on_yml.add_in(
                    (
                        "name".to_string(),
                        format!(
                            "no zerolayer filter {} (activation, lazy_auth, post_cache, metering, quota, fused)",
                            quoted(other)
                        ),
                    ),
                    &filter.at,
                );
                continue;
            }
        };
        let stages = match stages {
            Ok(stages) => stages,
            Err(errors) => {
                errors
                    .into_iter()
                    .for_each(|e| on_yml.add_in(e, &filter.at));
                continue;
            }
        };
        for stage in &stages {
            check_kong_stage(
                stage,
                filter,
                &kong,
                env,
                yml_shown,
                &mut on_yml,
                &mut on_conf,
            );
        }
    }
    [on_yml.problems, on_conf.problems].concat()
}

/// One stage of a Kong filter against what `kong.conf` declares.
fn check_kong_stage(
    stage: &StageConfig,
    filter: &KongFilter,
    kong: &KongConf,
    env: Environment<'_>,
    yml_shown: &str,
    on_yml: &mut Report<'_>,
    on_conf: &mut Report<'_>,
) {
    let s = stage.section();
    for (field, endpoint) in stage.endpoints() {
        if endpoint.cluster.parse::<SocketAddr>().is_err() {
            on_yml.add_in(
                (
                    field,
                    format!(
                        "{} is not IP:port: ngx_wasm_module calls an address (a name goes to DNS; kong/README.md)",
                        quoted(&endpoint.cluster)
                    ),
                ),
                &filter.at,
            );
        }
    }
    if let Some(link) = stage.posting_link() {
        if link.mode == ObserverMode::Singleton {
            on_yml.add_in(
                (
                    format!("{s}.observer.mode"),
                    "\"singleton\": Kong has no singleton service; use \"tick\"".to_string(),
                ),
                &filter.at,
            );
        } else {
            let queue = link.queue_name(who(s));
            match kong.queues.get(&queue) {
                None => on_conf.add(
                    "nginx_wasm_shm_queue",
                    format!(
                        "no shm_queue {} ({s}.observer.queue of {} in {yml_shown}): registering an undeclared queue traps",
                        quoted(&queue),
                        filter.at
                    ),
                ),
                Some(Some(size)) if *size <= link.max_queued_bytes => on_yml.add_in(
                    (
                        format!("{s}.observer.max_queued_bytes"),
                        format!(
                            "{} is not below the {size} bytes kong.conf declares for shm_queue {}: a full queue traps the filter",
                            link.max_queued_bytes,
                            quoted(&queue)
                        ),
                    ),
                    &filter.at,
                ),
                Some(_) => {}
            }
        }
    }
    for (field, var) in stage.secret_vars() {
        if !kong.env.iter().any(|e| e == var) {
            on_conf.add(
                "nginx_main_env",
                format!(
                    "{} is not declared ({field} of {} in {yml_shown}): nginx clears it from the workers' environment",
                    quoted(var),
                    filter.at
                ),
            );
        }
        check_env_var(stage, &field, var, env, &filter.at, on_yml);
    }
    if let StageConfig::Quota(c) = stage
        && let Some(hard) = c
            .policies
            .iter()
            .position(|p| p.stream.unwrap_or(c.defaults.stream) == StreamMode::Hard)
    {
        for route in &filter.buffered_routes {
            on_yml.add(
                format!("{route}.response_buffering"),
                format!(
                    "true (Kong's default) where quota cuts streams ({s}.policies[{hard}].stream \"hard\" of {}): ngx_wasm_module loses a replaced chunk under buffered proxying and the worker spins; set it to false",
                    filter.at
                ),
            );
        }
    }
    if let StageConfig::PostCache(c) = stage
        && let Some(Some(zone)) = kong.kv_zones.get("*")
        && c.memory_bound() > *zone
    {
        on_yml.add_in(
            (
                format!("{s}.max_entries"),
                format!(
                    "{} entries of up to {} bytes ({} bytes) do not fit the `*` zone kong.conf declares ({zone} bytes): entries would be evicted",
                    c.max_entries,
                    c.max_entry_bytes,
                    c.memory_bound()
                ),
            ),
            &filter.at,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kong_conf_directives_chain_with_semicolons() {
        let conf = KongConf::parse(
            "wasm = on\nnginx_main_env = A; env B\nnginx_wasm_shm_kv = * 128m\nnginx_wasm_shm_queue = q1 4m; shm_queue q2 16m\nnginx_wasm_shm_kv_extra = 1m\n",
        )
        .unwrap();
        assert_eq!(conf.env, ["A", "B"]);
        assert_eq!(conf.kv_zones.get("*"), Some(&Some(128 << 20)));
        assert_eq!(conf.kv_zones.get("extra"), Some(&Some(1 << 20)));
        assert_eq!(conf.queues.get("q1"), Some(&Some(4 << 20)));
        assert_eq!(conf.queues.get("q2"), Some(&Some(16 << 20)));
    }

    #[test]
    fn a_section_error_names_the_field_within_the_section() {
        let e = load_stage("quota", br#"{"store":{"cluster":"w","path":"/"},"policies":[{"name":"d","scope":["tenant"],"unit":"tokens","limit":{"budget":{"amount":1,"window":"fortnight"}}}]}"#).unwrap_err();
        assert!(e.0.starts_with("quota.policies[0].limit"), "{e:?}");
        let e = load_document(br#"{"shadow":{}}"#, false).unwrap_err();
        assert_eq!(e[0].0, "shadow");
    }
}
