//! Kong's real Proxy-Wasm host, ngx_wasm_module, started from the project's
//! own Kong files.
//!
//! [`KongConfig`] reads `kong/kong.yml` (or `kong-fused.yml`) and
//! `kong/kong.conf` — the one source of truth for the chain — and translates
//! them the way Kong does into a plain `nginx.conf` for ngx_wasm_module:
//! `nginx_wasm_<d> = v` becomes `<d> v;` in `wasm{}`, `nginx_http_<d>` goes
//! to `http{}`, `nginx_main_<d>` to the main context, every filter of the
//! chain one `proxy_wasm NAME 'CONFIG';` in chain order, each route path a
//! `location`. [`NgxWasm`] runs it on a free loopback port with its own
//! prefix, waits until its worker answers, and stops it by PID when dropped.
//!
//! The binary is `../shared/ngx-wasm/sbin/nginx` beside the repository, or
//! `$ZEROLAYER_NGX_WASM` (any nginx built with ngx_wasm_module, e.g. from
//! Kong's published ngx_wasm_module releases). Without either the Kong tests
//! fail, saying how to get one; they never skip.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde_yaml::Value;

use crate::client::{Client, Reply};
use crate::paths;

/// One filter of the chain: its Kong name and its configuration string.
#[derive(Debug, Clone)]
pub struct KongFilter {
    /// Kong's name for it: the `.wasm` file's stem (`zerolayer_lazy_auth`).
    pub name: String,
    /// The configuration handed to `on_configure`, byte for byte.
    pub config: String,
}

/// `kong.yml` + `kong.conf`, being prepared for a run.
#[derive(Debug, Clone)]
pub struct KongConfig {
    /// The chain, in order.
    pub filters: Vec<KongFilter>,
    /// The route's paths (prefix match, as Kong's default).
    pub paths: Vec<String>,
    /// The route's methods; others get Kong's 404.
    pub methods: Vec<String>,
    /// The route's `response_buffering` (Kong's default: true); false
    /// proxies the response as it comes (`proxy_buffering off`).
    pub response_buffering: bool,
    /// The service's read timeout, milliseconds.
    pub read_timeout_ms: u64,
    /// The service's connect timeout, milliseconds.
    pub connect_timeout_ms: u64,
    /// Directives for the main context, `wasm{}` and `http{}` (from `kong.conf`).
    main: Vec<String>,
    wasm: Vec<String>,
    http: Vec<String>,
    /// Environment for the nginx process.
    env: Vec<(String, String)>,
    /// nginx worker processes.
    pub workers: usize,
    /// Wasmtime's compilation cache directory (`None`: the one every run
    /// shares, under `target/ngx-wasm-cache`).
    pub wasmtime_cache: Option<PathBuf>,
    /// Modules by name that are not zerolayer's (`zerolayer_<stage>.wasm`).
    module_files: Vec<(String, PathBuf)>,
}

/// The Kong declarative files under `kong/`.
pub fn kong_file(name: &str) -> PathBuf {
    paths::root().join("kong").join(name)
}

impl KongConfig {
    /// Loads `kong/<yml>` with `kong/kong.conf`.
    pub fn shipped(yml: &str) -> Result<KongConfig> {
        let path = kong_file(yml);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let doc: Value =
            serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let service = doc["services"]
            .get(0)
            .ok_or_else(|| anyhow!("{yml}: no service"))?;
        let route = service["routes"]
            .get(0)
            .ok_or_else(|| anyhow!("{yml}: the service has no route"))?;
        let strings = |v: &Value| -> Vec<String> {
            v.as_sequence()
                .map(|s| {
                    s.iter()
                        .filter_map(|x| x.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        let chain = service["filter_chains"]
            .get(0)
            .ok_or_else(|| anyhow!("{yml}: the service has no filter chain"))?;
        let mut filters = Vec::new();
        for filter in chain["filters"]
            .as_sequence()
            .ok_or_else(|| anyhow!("{yml}: the chain has no filters"))?
        {
            if filter["enabled"].as_bool() == Some(false) {
                continue;
            }
            filters.push(KongFilter {
                name: filter["name"]
                    .as_str()
                    .ok_or_else(|| anyhow!("{yml}: a filter without a name"))?
                    .to_string(),
                config: filter["config"].as_str().unwrap_or_default().to_string(),
            });
        }
        let mut config = KongConfig {
            filters,
            paths: strings(&route["paths"]),
            methods: strings(&route["methods"]),
            response_buffering: route["response_buffering"].as_bool().unwrap_or(true),
            read_timeout_ms: service["read_timeout"].as_u64().unwrap_or(60_000),
            connect_timeout_ms: service["connect_timeout"].as_u64().unwrap_or(60_000),
            main: Vec::new(),
            wasm: Vec::new(),
            http: Vec::new(),
            env: Vec::new(),
            workers: 1,
            wasmtime_cache: None,
            module_files: Vec::new(),
        };
        config.read_kong_conf(&kong_file("kong.conf"))?;
        Ok(config)
    }

    /// A plain ngx_wasm_module configuration, without Kong's files: the
    /// modules (name, `.wasm`), the chain on `paths`, any method, Kong's
    /// default timeouts and body size limit (none), one worker, nothing
    /// declared in `wasm{}`.
    pub fn plain(
        modules: Vec<(String, PathBuf)>,
        filters: Vec<KongFilter>,
        paths: Vec<String>,
    ) -> KongConfig {
        KongConfig {
            filters,
            paths,
            methods: Vec::new(),
            response_buffering: true,
            read_timeout_ms: 60_000,
            connect_timeout_ms: 60_000,
            main: Vec::new(),
            wasm: Vec::new(),
            // Kong's default (`nginx_http_client_max_body_size = 0`): no
            // limit on request bodies (nginx's own is 1 MiB).
            http: vec!["client_max_body_size 0;".into()],
            env: Vec::new(),
            workers: 1,
            wasmtime_cache: None,
            module_files: modules,
        }
    }

    /// The `.wasm` of module `name`: one given to [`KongConfig::plain`], or
    /// zerolayer's `zerolayer_<stage>.wasm`.
    pub fn module_file(&self, name: &str) -> Result<PathBuf> {
        match self.module_files.iter().find(|(n, _)| n == name) {
            Some((_, path)) => Ok(path.clone()),
            None => paths::wasm(name.trim_start_matches("zerolayer_")),
        }
    }

    /// Takes `kong.conf`'s injected nginx directives as Kong renders them.
    fn read_kong_conf(&mut self, path: &Path) -> Result<()> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (key, value) = line
                .split_once('=')
                .ok_or_else(|| anyhow!("kong.conf: not `key = value`: {line}"))?;
            let (key, value) = (key.trim(), value.trim());
            // Kong: `nginx_<block>_<directive> = value` → `<directive> value;`.
            let (block, directive) = if let Some(d) = key.strip_prefix("nginx_main_") {
                (&mut self.main, d)
            } else if let Some(d) = key.strip_prefix("nginx_wasm_") {
                (&mut self.wasm, d)
            } else if let Some(d) = key.strip_prefix("nginx_http_") {
                (&mut self.http, d)
            } else {
                // Kong's own settings (wasm, listeners, paths): the harness
                // provides their nginx equivalents itself.
                continue;
            };
            // `nginx_wasm_shm_kv_<name> = size` (Kong 3.6+) → `shm_kv <name> size;`.
            let rendered = if let Some(zone) = directive.strip_prefix("shm_kv_") {
                format!("shm_kv {zone} {value};")
            } else {
                format!("{directive} {value};")
            };
            block.push(rendered);
        }
        Ok(())
    }

    /// Sets environment variable `key` for nginx (the workers see it where
    /// `kong.conf` declares it with `nginx_main_env`).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// The environment nginx runs with.
    pub fn environment(&self) -> impl Iterator<Item = (&str, &str)> {
        self.env.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// nginx's `client_body_buffer_size` as `kong.conf` sets it (`1m`,
    /// `512k`, bytes), if it does.
    pub fn client_body_buffer_bytes(&self) -> Option<usize> {
        self.http.iter().find_map(|line| {
            let size = line
                .strip_prefix("client_body_buffer_size ")?
                .trim_end_matches(';')
                .trim();
            let (digits, unit) = match size.char_indices().last()? {
                (at, 'k' | 'K') => (&size[..at], 1024),
                (at, 'm' | 'M') => (&size[..at], 1024 * 1024),
                _ => (size, 1),
            };
            digits.parse::<usize>().ok().map(|n| n * unit)
        })
    }

    /// The queues `kong.conf` declares (`shm_queue NAME SIZE`, possibly
    /// chained in one value).
    pub fn queues(&self) -> Vec<String> {
        self.wasm
            .iter()
            .flat_map(|line| line.split(';'))
            .filter_map(|d| {
                let mut words = d.split_whitespace();
                (words.next() == Some("shm_queue"))
                    .then(|| words.next().map(str::to_string))
                    .flatten()
            })
            .collect()
    }

    /// The configuration of filter `name`, parsed.
    pub fn filter_json(&self, name: &str) -> Result<serde_json::Value> {
        let filter = self.filter(name)?;
        serde_json::from_str(&filter.config)
            .with_context(|| format!("filter {name}: config is not JSON"))
    }

    /// Replaces the configuration of filter `name`.
    pub fn set_filter_config(&mut self, name: &str, config: &str) -> Result<()> {
        let filter = self
            .filters
            .iter_mut()
            .find(|f| f.name == name)
            .ok_or_else(|| anyhow!("no filter {name} in the chain"))?;
        filter.config = config.to_string();
        Ok(())
    }

    fn filter(&self, name: &str) -> Result<&KongFilter> {
        self.filters
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| anyhow!("no filter {name} in the chain"))
    }

    /// Points every callout target `from` (an `IP:port` in the filters'
    /// configurations, as `kong.yml` ships them) at `to`.
    pub fn retarget(mut self, from: &str, to: SocketAddr) -> Self {
        let quoted = format!("\"{from}\"");
        let with = format!("\"{to}\"");
        for filter in &mut self.filters {
            filter.config = filter.config.replace(&quoted, &with);
        }
        self
    }

    /// The `nginx.conf` for a run on `listen`, proxying to `upstream`, with
    /// `prefix` holding logs, temp files and Wasmtime's cache config.
    pub fn render(
        &self,
        prefix: &Path,
        listen: SocketAddr,
        upstream: SocketAddr,
    ) -> Result<String> {
        let mut out = String::new();
        let p = prefix.display();
        out.push_str("# Rendered by tests/src/ngx.rs from kong/kong.conf and the chain's .yml\n");
        out.push_str("daemon off;\nmaster_process on;\n");
        out.push_str(&format!("worker_processes {};\n", self.workers));
        // `ZEROLAYER_NGX_LOG_LEVEL=debug` shows the filters' debug lines and
        // the host's step-by-step resumes (no debug build needed for those).
        let level = std::env::var("ZEROLAYER_NGX_LOG_LEVEL").unwrap_or_else(|_| "info".into());
        out.push_str(&format!(
            "pid {p}/nginx.pid;\nerror_log {p}/error.log {level};\n"
        ));
        for line in &self.main {
            out.push_str(line);
            out.push('\n');
        }
        out.push_str("events { worker_connections 1024; }\n\n");
        out.push_str("wasm {\n");
        let mut modules: Vec<&str> = self.filters.iter().map(|f| f.name.as_str()).collect();
        modules.dedup();
        for name in modules {
            let wasm = self.module_file(name)?;
            out.push_str(&format!("    module {name} {};\n", wasm.display()));
        }
        for line in &self.wasm {
            out.push_str(&format!("    {line}\n"));
        }
        out.push_str(&format!(
            "    wasmtime {{ cache_config {}; }}\n",
            wasmtime_cache_config(self.wasmtime_cache.as_deref())?.display()
        ));
        out.push_str("}\n\n");
        out.push_str("http {\n");
        for dir in ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"] {
            out.push_str(&format!("    {dir}_temp_path {p}/{dir}_temp;\n"));
        }
        // The exact per-request usage metering sets in `$zerolayer_usage`
        // (declared per location below), as JSON lines that
        // `host-sim reconcile` reads like Envoy's access log.
        out.push_str(
            "    log_format zerolayer escape=json \
             '{\"request_id\":\"$http_x_request_id\",\"status\":\"$status\",\"usage\":\"$zerolayer_usage\"}';\n",
        );
        out.push_str(&format!(
            "    access_log {p}/access.log zerolayer;\n    proxy_http_version 1.1;\n"
        ));
        for line in &self.http {
            out.push_str(&format!("    {line}\n"));
        }
        out.push_str(&format!(
            "    upstream llm {{ server {upstream}; keepalive 16; }}\n"
        ));
        out.push_str(&format!("    server {{\n        listen {listen};\n"));

        // `$zerolayer_usage` is declared in every location (the access log
        // names it); metering sets it where the chain runs.
        out.push_str(
            "        location / { set $zerolayer_usage \"\"; default_type application/json; \
             return 404 '{\"message\":\"no Route matched with those values\"}'; }\n",
        );
        let methods = self.methods.join("|");
        // One location for the route, as Kong attaches one filter chain per
        // route: each `proxy_wasm` line is a filter of its own (its own
        // configuration, root and observer), so one location per path
        // configured every filter once per path.
        if let Some(location) = route_location(&self.paths) {
            out.push_str(&format!("        location {location} {{\n"));
            if !methods.is_empty() {
                out.push_str(&format!(
                    "            if ($request_method !~ ^({methods})$) {{ return 404; }}\n"
                ));
            }
            out.push_str("            set $zerolayer_usage \"\";\n");
            if !self.response_buffering {
                // Kong proxies such a route from its `@unbuffered_response`
                // location.
                out.push_str("            proxy_buffering off;\n");
            }
            for filter in &self.filters {
                out.push_str(&format!(
                    "            proxy_wasm {} '{}';\n",
                    filter.name,
                    nginx_quote(&filter.config)
                ));
            }
            out.push_str(&format!(
                "            proxy_connect_timeout {}ms;\n            proxy_read_timeout {}ms;\n",
                self.connect_timeout_ms, self.read_timeout_ms
            ));
            out.push_str(
                "            proxy_set_header Connection \"\";\n            proxy_pass http://llm;\n        }\n",
            );
        }
        out.push_str("    }\n}\n");
        Ok(out)
    }
}

/// The `location` argument matching any of a route's `paths` as Kong does
/// (a prefix match; `~` marks a regex, anchored at the path's start): the
/// path itself when it is one prefix, else one regex of them all.
fn route_location(paths: &[String]) -> Option<String> {
    match paths {
        [] => None,
        [path] if !path.starts_with('~') => Some(path.clone()),
        paths => {
            let alternatives: Vec<String> = paths
                .iter()
                .map(|path| match path.strip_prefix('~') {
                    Some(regex) => regex.trim_start_matches('^').to_string(),
                    None => regex::escape(path),
                })
                .collect();
            Some(format!("~ \"^(?:{})\"", alternatives.join("|")))
        }
    }
}

/// Escapes a configuration string for nginx's single-quoted argument.
fn nginx_quote(text: &str) -> String {
    text.replace('\\', "\\\\").replace('\'', "\\'")
}

/// Wasmtime's compilation cache in `dir` (by default one every run shares):
/// each worker compiles every module at start, seconds per module without
/// it. Returns its configuration file.
fn wasmtime_cache_config(dir: Option<&Path>) -> Result<PathBuf> {
    let dir = dir.map_or_else(
        || paths::root().join("target/ngx-wasm-cache"),
        Path::to_path_buf,
    );
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let config = dir.join("wasmtime-cache.toml");
    let text = format!(
        "[cache]\nenabled = true\ndirectory = \"{}\"\n",
        dir.join("compiled").display()
    );
    if std::fs::read_to_string(&config).ok().as_deref() != Some(text.as_str()) {
        std::fs::write(&config, text).with_context(|| format!("writing {}", config.display()))?;
    }
    // The workers compile the modules and write the cache. Started as root,
    // nginx runs them as `nobody` (its default `user`), who cannot write a
    // directory root made: the cache stayed empty and every start and every
    // reload compiled each module again (seconds per module).
    let compiled = dir.join("compiled");
    std::fs::create_dir_all(&compiled)
        .with_context(|| format!("creating {}", compiled.display()))?;
    if running_as_root() {
        let (uid, gid) = worker_user()?;
        std::os::unix::fs::chown(&compiled, Some(uid), Some(gid)).with_context(|| {
            format!(
                "giving {} to nginx's workers (uid {uid})",
                compiled.display()
            )
        })?;
    }
    Ok(config)
}

/// Whether this process runs as root (nginx then runs its workers as
/// `nobody`).
fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// The uid and gid of `nobody`, the user nginx runs its workers as when its
/// configuration names none (`/etc/passwd`).
fn worker_user() -> Result<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").context("reading /etc/passwd")?;
    passwd
        .lines()
        .find_map(|line| {
            let mut fields = line.split(':');
            (fields.next()? == "nobody").then_some(())?;
            let uid = fields.nth(1)?.parse().ok()?;
            let gid = fields.next()?.parse().ok()?;
            Some((uid, gid))
        })
        .context("no user `nobody` in /etc/passwd: nginx's workers run as it")
}

/// nginx with ngx_wasm_module: `$ZEROLAYER_NGX_WASM`, else
/// `../shared/ngx-wasm/sbin/nginx` beside the repository.
pub fn binary() -> Result<PathBuf> {
    let path = std::env::var_os("ZEROLAYER_NGX_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| paths::root().join("../shared/ngx-wasm/sbin/nginx"));
    if !path.is_file() {
        bail!(
            "ngx_wasm_module (Kong's Proxy-Wasm host) not found at {}: the Kong tests need an nginx \
             built with it. Put the project's copy at ../shared/ngx-wasm/ beside the repository, or \
             set ZEROLAYER_NGX_WASM to an nginx binary from Kong's ngx_wasm_module releases \
             (github.com/Kong/ngx_wasm_module, 'wasmx-*' assets, wasmtime runtime)",
            path.display()
        );
    }
    Ok(path)
}

/// How long a worker may take to answer its first request (it compiles
/// every module first; the cache makes later starts fast).
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// A running nginx with ngx_wasm_module; stopped by PID when dropped.
pub struct NgxWasm {
    child: Child,
    /// Bytes of the error log written before the first request (module
    /// compilation, configuration): failures show what came after.
    ready_at: usize,
    /// How long after it was spawned the first request was answered.
    started_in: Duration,
    listen: SocketAddr,
    dir: tempfile::TempDir,
    client: Client,
}

impl NgxWasm {
    /// Starts `config` in front of `upstream` on a free loopback port and
    /// waits until a worker answers.
    pub fn start(config: &KongConfig, upstream: SocketAddr) -> Result<NgxWasm> {
        let binary = binary()?;
        // `ZEROLAYER_KEEP_NGX=1` keeps the prefix (config, logs) for a look.
        let keep = std::env::var_os("ZEROLAYER_KEEP_NGX").is_some();
        let dir = tempfile::Builder::new()
            .prefix("zerolayer-ngx-")
            .disable_cleanup(keep)
            .tempdir()?;
        if keep {
            eprintln!("ngx_wasm_module's prefix kept: {}", dir.path().display());
        }
        let listen = free_port()?;
        let conf = dir.path().join("nginx.conf");
        std::fs::write(&conf, config.render(dir.path(), listen, upstream)?)?;
        let stderr = std::fs::File::create(dir.path().join("stderr.log"))?;
        let spawned = std::time::Instant::now();
        let child = Command::new(&binary)
            .arg("-p")
            .arg(dir.path())
            .arg("-c")
            .arg(&conf)
            .envs(config.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let mut ngx = NgxWasm {
            child,
            ready_at: 0,
            started_in: Duration::ZERO,
            listen,
            dir,
            client: Client::with_timeout(Duration::from_secs(5)),
        };
        ngx.wait_ready().map_err(|err| {
            anyhow!(
                "ngx_wasm_module did not become ready: {err:#}\n--- error.log (tail) ---\n{}",
                ngx.log_tail(40)
            )
        })?;
        ngx.started_in = spawned.elapsed();
        Ok(ngx)
    }

    /// How long after nginx was spawned its first request was answered
    /// (the workers compile or load every module first).
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// Polls until a request is answered: any answer means the worker
    /// compiled the modules and configured the filters.
    fn wait_ready(&mut self) -> Result<()> {
        self.wait_answering("nginx answering", |_| true)?;
        self.ready_at = self.log().len();
        Ok(())
    }

    /// Polls until a request is answered while `workers_ready` (given the
    /// master's workers) holds; fails if nginx exits meanwhile.
    fn wait_answering(
        &mut self,
        what: &str,
        mut workers_ready: impl FnMut(&[u32]) -> bool,
    ) -> Result<()> {
        let (pid, client, child) = (self.child.id(), &self.client, &mut self.child);
        let url = format!("http://{}/__zerolayer_ready", self.listen);
        crate::wait::until(what, READY_TIMEOUT, || {
            if let Some(status) = child.try_wait()? {
                bail!("nginx exited with {status}");
            }
            if !workers_ready(&children(pid)) {
                return Ok(None);
            }
            Ok(client.get(&url, &[]).is_ok().then_some(()))
        })
    }

    /// URL of `path` on the listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.listen, path)
    }

    /// The listener's address.
    pub fn listener(&self) -> SocketAddr {
        self.listen
    }

    /// The nginx master's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// nginx's error log (the filters' `proxy_log` lines land here).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }

    /// nginx's access log: one JSON line per request with metering's usage
    /// entry (`$zerolayer_usage`), as Envoy's access log carries it.
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }

    /// The last `lines` lines of the error log written since start-up (all
    /// of it while starting).
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let since = log.get(self.ready_at..).unwrap_or(&log);
        let all: Vec<&str> = since.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Reloads the configuration as `nginx -s reload` does (`SIGHUP` to the
    /// master), then waits until the old workers have exited and a new one
    /// answers; returns how long after the signal that first answer came.
    pub fn reload(&mut self) -> Result<Duration> {
        let old = children(self.child.id());
        let signalled = std::time::Instant::now();
        let status = Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .context("running kill -HUP")?;
        if !status.success() {
            bail!("kill -HUP {} failed: {status}", self.child.id());
        }
        // The old workers gone, a new one answers.
        self.wait_answering("nginx answering after a reload", |now| {
            !now.is_empty() && !now.iter().any(|p| old.contains(p))
        })
        .map_err(|err| anyhow!("{err:#}\n--- error.log (tail) ---\n{}", self.log_tail(40)))?;
        Ok(signalled.elapsed())
    }

    /// Whether the master is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for NgxWasm {
    fn drop(&mut self) {
        // The workers first (once the master is gone they are init's), then
        // a fast shutdown (SIGTERM), and SIGKILL for whatever is left.
        let workers = children(self.child.id());
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let child = &mut self.child;
        let _ = crate::wait::until("nginx stopped", Duration::from_secs(3), || {
            Ok(child.try_wait()?.map(|_| ()))
        });
        let _ = self.child.kill();
        let _ = self.child.wait();
        for worker in workers {
            let _ = Command::new("kill")
                .args(["-KILL", &worker.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The processes whose parent is `pid` (an nginx master's workers).
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|child| {
            let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
            // Field 4 of /proc/PID/stat is the parent's pid (after "(comm)").
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok())
                == Some(pid)
        })
        .collect()
}

/// A loopback port nothing listens on now.
fn free_port() -> Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?)
}

/// A request through `ngx` with a deadline: a hang fails with the request
/// and the chain named, and the error log's tail.
pub fn send(
    ngx: &NgxWasm,
    client: &Client,
    what: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Reply> {
    client
        .send(method, &ngx.url(path), headers, body)
        .map_err(|err| {
            anyhow!(
                "{what}: {method} {path} through ngx_wasm_module got no answer ({err:#}); \
                 error.log tail:\n{}",
                ngx.log_tail(20)
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A route's paths become one location (its filters configured once):
    /// one prefix as itself, several as one anchored regex, literal but for
    /// Kong's `~` regex paths.
    #[test]
    fn a_routes_paths_make_one_location() {
        assert_eq!(route_location(&[]), None);
        assert_eq!(
            route_location(&["/v1/messages".into()]).as_deref(),
            Some("/v1/messages")
        );
        assert_eq!(
            route_location(&["/v1/messages".into(), "/v1/chat.completions".into()]).as_deref(),
            Some(r#"~ "^(?:/v1/messages|/v1/chat\.completions)""#)
        );
        assert_eq!(
            route_location(&["~^/v1/models/[a-z]+$".into()]).as_deref(),
            Some(r#"~ "^(?:/v1/models/[a-z]+$)""#)
        );
    }
}
