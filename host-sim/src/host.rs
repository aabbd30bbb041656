//! The host: plugins placed in VMs (worker VMs per chain, singleton service
//! VMs), streams driven through filter chains with Envoy's iteration rules,
//! deferred events (queue notifications, resumes, local responses),
//! callouts completed by handlers, real loopback HTTP or the test itself,
//! and a clock that tests advance.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow, bail};
use wasmtime::{Config, Engine, Module};

use crate::abi::{Action, Headers, LogLevel};
use crate::vm::{ContextKind, HttpCallback, RootInfo, Vm};
use crate::world::{
    CallResponse, Callout, Clock, Event, LocalResponse, LogLine, Profile, StreamData, StreamId,
    StreamInfo, VmIndex, World,
};

/// A plugin: one `.wasm` with its configuration, as in an Envoy
/// `envoy.filters.http.wasm` (or `envoy.bootstrap.wasm`) entry.
#[derive(Debug, Clone)]
pub struct PluginSpec {
    /// Plugin name (Envoy `config.name`).
    pub name: String,
    /// Root id (Envoy `config.root_id`); defaults to the name.
    pub root_id: String,
    /// VM id: plugins with the same id and code share a VM and shared data.
    pub vm_id: String,
    /// The module.
    pub wasm: PathBuf,
    /// Plugin configuration (`config.configuration`).
    pub configuration: Vec<u8>,
    /// VM configuration (`vm_config.configuration`).
    pub vm_configuration: Vec<u8>,
    /// Envoy's `allow_on_headers_stop_iteration`: `Pause` from the headers
    /// callback stops only the headers (body data still reaches the filter)
    /// instead of all iteration.
    pub allow_on_headers_stop_iteration: bool,
    /// The VM's environment variables (Envoy
    /// `vm_config.environment_variables`): how secrets reach a module without
    /// appearing in its configuration.
    pub env: Vec<(String, String)>,
}

impl PluginSpec {
    /// A plugin named `name` running `wasm`, vm_id and root_id = `name`.
    pub fn new(name: &str, wasm: impl Into<PathBuf>) -> Self {
        PluginSpec {
            name: name.to_string(),
            root_id: name.to_string(),
            vm_id: name.to_string(),
            wasm: wasm.into(),
            configuration: Vec::new(),
            vm_configuration: Vec::new(),
            allow_on_headers_stop_iteration: false,
            env: Vec::new(),
        }
    }

    /// Adds an environment variable to the plugin's VM.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// Sets Envoy's `allow_on_headers_stop_iteration`.
    pub fn allow_on_headers_stop_iteration(mut self, allow: bool) -> Self {
        self.allow_on_headers_stop_iteration = allow;
        self
    }

    /// Sets the plugin configuration.
    pub fn configuration(mut self, config: impl Into<Vec<u8>>) -> Self {
        self.configuration = config.into();
        self
    }

    /// Sets the VM id.
    pub fn vm_id(mut self, vm_id: &str) -> Self {
        self.vm_id = vm_id.to_string();
        self
    }

    /// Sets the root id.
    pub fn root_id(mut self, root_id: &str) -> Self {
        self.root_id = root_id.to_string();
        self
    }
}

/// Where `dispatch_http_call` to a cluster goes.
pub enum ClusterTarget {
    /// The test completes callouts itself ([`Host::respond`]).
    Manual,
    /// An in-process handler answers at once.
    Handler(Box<dyn FnMut(&Callout) -> CallResponse>),
    /// A real HTTP/1.1 server on loopback (blocking call).
    Http(SocketAddr),
}

/// What left one end of a chain: towards the upstream (request) or the
/// client (response).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Output {
    /// Headers, once they passed every filter.
    pub headers: Option<Headers>,
    /// Body passed so far.
    pub body: Vec<u8>,
    /// Whether the end of stream passed.
    pub complete: bool,
}

impl Output {
    /// First value of header `name`, as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .as_ref()?
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    /// The `:status` pseudo-header as a number.
    pub fn status(&self) -> Option<u16> {
        self.header(":status")?.parse().ok()
    }

    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Iteration state of one direction of a stream.
#[derive(Debug, Default)]
struct Direction {
    /// Positions (in this direction's order) whose headers callback let the
    /// headers through; the position equal to this number, if < n, stopped.
    headers_passed: usize,
    headers_started: bool,
    end_with_headers: bool,
    /// Body held (buffered) at each position after it paused on data.
    held: Vec<Vec<u8>>,
    /// Data waiting in front of the position that stopped all iteration on
    /// headers (position `headers_passed`).
    waiting: Vec<u8>,
    waiting_eos: bool,
    waiting_any: bool,
    /// A position paused on data with the end of stream in hand.
    paused_eos_at: Option<usize>,
    out: Output,
}

struct StreamRun {
    filters: Vec<(VmIndex, u32)>,
    /// Per chain position: `Pause` on headers stops only the headers.
    stop_iteration: Vec<bool>,
    /// Per chain position: the plugin's index (for per-callback timings).
    plugins: Vec<usize>,
    request: Direction,
    response: Direction,
    local: Option<LocalResponse>,
    reset: bool,
    finished: bool,
    /// Positions (chain order) whose request headers callback ran.
    decoded: usize,
    /// Kong: ngx_wasm_module runs the response phases in chain order too
    /// (Envoy's encoder filters run in reverse).
    responses_in_chain_order: bool,
    /// Per chain position: time spent inside the module for this stream
    /// (HTTP callbacks and the end-of-stream callbacks).
    wasm: Vec<Duration>,
}

struct PluginInstance {
    name: String,
    stop_iteration: bool,
    vm: VmIndex,
    root: u32,
}

struct Chain {
    /// Per worker: plugin instance indexes in chain order.
    per_worker: Vec<Vec<usize>>,
}

/// What a callback's outcome means for iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Continue,
    Pause,
    Stop,
}

/// Identifies a chain in its host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainId(usize);

/// Host-wide options.
#[derive(Debug, Clone)]
pub struct HostOptions {
    /// Envoy or Kong behaviour.
    pub profile: Profile,
    /// Worker threads: each gets its own VM per chain plugin.
    pub workers: usize,
    /// Virtual time start (ns since the epoch), or `None` for the real clock.
    pub virtual_start_ns: Option<u64>,
    /// Print module logs to stderr as they arrive.
    pub echo_logs: bool,
    /// Kong: the shared queues the operator declared (`shm_queue` in the
    /// `wasm{}` block); registering any other traps.
    pub kong_queues: Vec<String>,
    /// Kong: play Kong Gateway's build of ngx_wasm_module, whose host
    /// properties live under `kong.` (`kong.ctx.shared.*` per request)
    /// instead of `wasmx.`.
    pub kong_gateway: bool,
    /// Kong: each declared queue's capacity, bytes (its `shm_queue` size;
    /// entries take a 4-byte prefix). Enqueueing past it traps, as
    /// ngx_wasm_module does ("could not enqueue (queue is full)").
    pub kong_queue_bytes: usize,
    /// Kong: nginx's `client_body_buffer_size`. A request body larger than
    /// this is buffered to a file, which filters cannot read there
    /// (`proxy_get_buffer_bytes` fails, logged as ngx_wasm_module does);
    /// the upstream still gets it whole. `None`: every body in memory.
    pub kong_body_buffer_bytes: Option<usize>,
    /// Envoy: the per-stream buffer limit ([`ENVOY_BUFFER_LIMIT`] by default,
    /// Envoy's `per_connection_buffer_limit_bytes`). A body a filter buffers
    /// (`Pause` from a body callback) past it ends the stream as Envoy
    /// does: a request with `413 Payload Too Large`; a response with `500`
    /// if its headers have not left yet, else a reset (the client has the
    /// headers and no body). `None`: no limit. Not applied under Kong
    /// (ngx_wasm_module buffered 5 MB).
    pub buffer_limit_bytes: Option<usize>,
}

/// Envoy's default buffer limit: 1 MiB.
pub const ENVOY_BUFFER_LIMIT: usize = 1024 * 1024;

impl Default for HostOptions {
    fn default() -> Self {
        HostOptions {
            profile: Profile::Envoy,
            workers: 1,
            // 2026-11-29 12:00:00 UTC: a fixed, known instant.
            virtual_start_ns: Some(1_795_953_600_000_000_000),
            echo_logs: false,
            kong_queues: Vec::new(),
            kong_gateway: false,
            kong_queue_bytes: 4 * 1024 * 1024,
            kong_body_buffer_bytes: None,
            buffer_limit_bytes: Some(ENVOY_BUFFER_LIMIT),
        }
    }
}

/// Advances the engine's epoch every [`EPOCH_TICK`] so that a call into a
/// module can be given a deadline ([`crate::vm::CALL_DEADLINE_TICKS`]).
struct EpochTicker {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// Epoch granularity.
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(100);

impl EpochTicker {
    fn start(engine: &Engine) -> EpochTicker {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (engine, flag) = (engine.clone(), stop.clone());
        let _ = std::thread::Builder::new()
            .name("host-sim-epoch".into())
            .spawn(move || {
                while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    engine.increment_epoch();
                }
            });
        EpochTicker { stop }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A Proxy-Wasm host. No global state: make one per test.
pub struct Host {
    _epochs: EpochTicker,
    engine: Engine,
    world: Rc<RefCell<World>>,
    modules: HashMap<PathBuf, Module>,
    vms: Vec<Vm>,
    /// (placement, vm_id, code) → VM. Placement: worker index, or `usize::MAX` for the main thread.
    vm_keys: HashMap<(usize, String, PathBuf), VmIndex>,
    plugins: Vec<PluginInstance>,
    chains: Vec<Chain>,
    workers: usize,
    next_worker: usize,
    streams: HashMap<StreamId, StreamRun>,
    next_stream: StreamId,
    clusters: HashMap<String, ClusterTarget>,
    /// (plugin, callback) → (calls, time spent in the module).
    timings: HashMap<(usize, &'static str), (u64, Duration)>,
    /// Per VM: what it was made from, to make it again (Kong replaces a
    /// trapped instance).
    vm_origins: Vec<VmOrigin>,
    /// Envoy: the plugins whose configuration canary ran.
    canaries: std::collections::HashSet<(String, String, String, PathBuf, Vec<u8>)>,
}

/// What a VM was instantiated from.
#[derive(Clone)]
struct VmOrigin {
    wasm: PathBuf,
    vm_id: String,
    env: Vec<(String, String)>,
}

const MAIN_THREAD: usize = usize::MAX;

/// The VM index a configuration canary runs under (never in `Host::vms`).
const CANARY_VM: VmIndex = usize::MAX;

/// nginx's `Server` header (the build of `../shared/ngx-wasm`).
pub const NGINX_SERVER: &str = "nginx/1.27.4";

/// nginx 1.27.4's own `500 Internal Server Error` page: what a request
/// whose filter trapped gets from ngx_wasm_module.
pub const NGINX_500_PAGE: &str = "<html>\r\n<head><title>500 Internal Server Error</title></head>\r\n\
<body>\r\n<center><h1>500 Internal Server Error</h1></center>\r\n\
<hr><center>nginx/1.27.4</center>\r\n</body>\r\n</html>\r\n";

impl Host {
    /// A host with default options (Envoy profile, one worker, virtual time).
    pub fn new() -> Result<Host> {
        Host::with_options(HostOptions::default())
    }

    /// A host with `options`.
    pub fn with_options(options: HostOptions) -> Result<Host> {
        let mut config = Config::new();
        config.cranelift_opt_level(wasmtime::OptLevel::Speed);
        // A module stuck in a loop traps instead of hanging the host.
        config.epoch_interruption(true);
        let engine = Engine::new(&config)?;
        let epochs = EpochTicker::start(&engine);
        let clock = match options.virtual_start_ns {
            Some(ns) => Clock::Virtual(ns),
            None => Clock::Real,
        };
        let mut world = World::new(options.profile, clock);
        world.echo_logs = options.echo_logs;
        world.kong_queues = options.kong_queues.clone();
        world.kong_gateway = options.kong_gateway;
        world.kong_queue_bytes = options.kong_queue_bytes;
        world.kong_body_buffer_bytes = options.kong_body_buffer_bytes;
        world.buffer_limit = match options.profile {
            Profile::Envoy => options.buffer_limit_bytes,
            Profile::Kong => None,
        };
        Ok(Host {
            _epochs: epochs,
            engine,
            world: Rc::new(RefCell::new(world)),
            modules: HashMap::new(),
            vms: Vec::new(),
            vm_keys: HashMap::new(),
            plugins: Vec::new(),
            chains: Vec::new(),
            workers: options.workers.max(1),
            next_worker: 0,
            streams: HashMap::new(),
            next_stream: 1,
            clusters: HashMap::new(),
            timings: HashMap::new(),
            vm_origins: Vec::new(),
            canaries: std::collections::HashSet::new(),
        })
    }

    fn module(&mut self, path: &Path) -> Result<Module> {
        if let Some(m) = self.modules.get(path) {
            return Ok(m.clone());
        }
        let module = Module::from_file(&self.engine, path)
            .map_err(anyhow::Error::from)
            .with_context(|| format!("loading {}", path.display()))?;
        self.modules.insert(path.to_path_buf(), module.clone());
        Ok(module)
    }

    /// Envoy's configuration canary (proxy-wasm-cpp-host's
    /// `WasmHandleBase::canary`): once per plugin, a throwaway clone of the
    /// VM runs `on_vm_start` and `on_configure`, and a refusal refuses the
    /// plugin; then it is killed (no `on_done`, its timers and callouts
    /// gone). What it logged and wrote to shared data stays, as in Envoy.
    fn canary(&mut self, spec: &PluginSpec) -> Result<()> {
        let key = (
            spec.name.clone(),
            spec.root_id.clone(),
            spec.vm_id.clone(),
            spec.wasm.clone(),
            spec.configuration.clone(),
        );
        if self.world.borrow().profile != Profile::Envoy || self.canaries.contains(&key) {
            return Ok(());
        }
        let module = self.module(&spec.wasm)?;
        let mut vm = Vm::new(
            &self.engine,
            &module,
            self.world.clone(),
            CANARY_VM,
            &spec.vm_id,
            spec.env.clone(),
        )
        .with_context(|| format!("starting the configuration canary of plugin {}", spec.name))?;
        let logged_before = self.world.borrow().logs.len();
        let result = vm.add_root(RootInfo {
            plugin_name: spec.name.clone(),
            root_id: spec.root_id.clone(),
            configuration: spec.configuration.clone(),
            vm_configuration: spec.vm_configuration.clone(),
            tick_period_ms: 0,
            next_tick_ns: 0,
        });
        {
            let mut world = self.world.borrow_mut();
            world.callouts.retain(|_, c| c.vm != CANARY_VM);
            world
                .events
                .retain(|e| !matches!(e, Event::QueueReady { vm, .. } if *vm == CANARY_VM));
        }
        result.with_context(|| self.refusal(spec, logged_before))?;
        self.canaries.insert(key);
        Ok(())
    }

    /// Why plugin `spec` refused its configuration, as Envoy's log would
    /// say: the module's own error lines since `logged_before`.
    fn refusal(&self, spec: &PluginSpec, logged_before: usize) -> String {
        let why: Vec<String> = self.world.borrow().logs[logged_before..]
            .iter()
            .filter(|l| l.level >= LogLevel::Error)
            .map(|l| l.message.clone())
            .collect();
        if why.is_empty() {
            format!("plugin {} refused its configuration", spec.name)
        } else {
            format!(
                "plugin {} refused its configuration: {}",
                spec.name,
                why.join("; ")
            )
        }
    }

    fn place(&mut self, spec: &PluginSpec, placement: usize) -> Result<usize> {
        self.canary(spec)?;
        let key = (placement, spec.vm_id.clone(), spec.wasm.clone());
        let vm = match self.vm_keys.get(&key) {
            Some(vm) => *vm,
            None => {
                let module = self.module(&spec.wasm)?;
                let index = self.vms.len();
                let vm = Vm::new(
                    &self.engine,
                    &module,
                    self.world.clone(),
                    index,
                    &spec.vm_id,
                    spec.env.clone(),
                )
                .with_context(|| format!("starting a VM for plugin {}", spec.name))?;
                self.vms.push(vm);
                self.vm_origins.push(VmOrigin {
                    wasm: spec.wasm.clone(),
                    vm_id: spec.vm_id.clone(),
                    env: spec.env.clone(),
                });
                self.vm_keys.insert(key, index);
                index
            }
        };
        let info = RootInfo {
            plugin_name: spec.name.clone(),
            root_id: spec.root_id.clone(),
            configuration: spec.configuration.clone(),
            vm_configuration: spec.vm_configuration.clone(),
            tick_period_ms: 0,
            next_tick_ns: 0,
        };
        let plugin = self.plugins.len();
        let logged_before = self.world.borrow().logs.len();
        let root = self.vms[vm]
            .add_root(info)
            .with_context(|| self.refusal(spec, logged_before))?;
        self.plugins.push(PluginInstance {
            name: spec.name.clone(),
            stop_iteration: spec.allow_on_headers_stop_iteration,
            vm,
            root,
        });
        self.run_events();
        Ok(plugin)
    }

    /// Starts a singleton service plugin (Envoy `bootstrap_extensions` with
    /// `envoy.bootstrap.wasm`, `singleton: true`) on the main thread.
    pub fn add_singleton(&mut self, spec: PluginSpec) -> Result<()> {
        self.place(&spec, MAIN_THREAD)?;
        Ok(())
    }

    /// Adds a filter chain (like an `http_filters` list); every worker gets
    /// its own VM per plugin. Fails if any plugin refuses its configuration.
    pub fn add_chain(&mut self, filters: Vec<PluginSpec>) -> Result<ChainId> {
        let mut per_worker = Vec::with_capacity(self.workers);
        for worker in 0..self.workers {
            let mut list = Vec::with_capacity(filters.len());
            for spec in &filters {
                list.push(self.place(spec, worker)?);
            }
            per_worker.push(list);
        }
        self.chains.push(Chain { per_worker });
        Ok(ChainId(self.chains.len() - 1))
    }

    /// Routes `dispatch_http_call` to cluster `name`.
    pub fn set_cluster(&mut self, name: &str, target: ClusterTarget) {
        self.world.borrow_mut().clusters.insert(name.to_string());
        self.clusters.insert(name.to_string(), target);
    }

    // ---- streams ----

    /// Starts a stream through `chain` on the next worker (round robin).
    /// Streams that finished before are forgotten (no handle can still point
    /// at them), so long runs stay bounded in memory.
    pub fn stream(&mut self, chain: ChainId) -> Result<StreamHandle<'_>> {
        self.stream_from(chain, StreamInfo::default().source)
    }

    /// [`Host::stream`] from the downstream peer `source` (Envoy's
    /// `source.address`).
    pub fn stream_from(
        &mut self,
        chain: ChainId,
        source: std::net::SocketAddr,
    ) -> Result<StreamHandle<'_>> {
        let finished: Vec<StreamId> = self
            .streams
            .iter()
            .filter(|(_, r)| r.finished)
            .map(|(id, _)| *id)
            .collect();
        for id in finished {
            self.drop_stream(id);
        }
        let info = StreamInfo {
            source,
            ..StreamInfo::default()
        };
        let id = self.open_stream(chain, info)?;
        Ok(StreamHandle { host: self, id })
    }

    /// A handle on stream `id`, opened earlier with [`Host::stream`]: drives
    /// several streams in flight at once (until a later `stream()` call
    /// collects it once finished).
    pub fn stream_by_id(&mut self, id: StreamId) -> Result<StreamHandle<'_>> {
        if !self.streams.contains_key(&id) {
            bail!("no stream {id} (finished streams are collected by the next `stream()`)");
        }
        Ok(StreamHandle { host: self, id })
    }

    /// Opens a stream on `chain` described by `info` (addresses, TLS, …)
    /// without a handle: for a front end that drives many streams by id
    /// ([`Host::deliver_headers`], [`Host::deliver_data`]), as `host-sim
    /// serve` does.
    pub fn open_stream(&mut self, chain: ChainId, mut info: StreamInfo) -> Result<StreamId> {
        let worker = self.next_worker % self.workers;
        self.next_worker += 1;
        let plugins = self
            .chains
            .get(chain.0)
            .ok_or_else(|| anyhow!("no such chain"))?
            .per_worker[worker]
            .clone();
        let id = self.next_stream;
        self.next_stream += 1;
        info.start_ns = self.now_ns();
        info.connection_id = id;
        self.world.borrow_mut().streams.insert(
            id,
            StreamData {
                info,
                ..Default::default()
            },
        );
        if self.world.borrow().profile == Profile::Kong {
            for plugin in &plugins {
                let vm = self.plugins[*plugin].vm;
                if self.vms[vm].failed.is_some() {
                    self.revive(vm);
                }
            }
        }
        let mut filters = Vec::with_capacity(plugins.len());
        let stop_iteration = plugins
            .iter()
            .map(|p| self.plugins[*p].stop_iteration)
            .collect();
        for (position, plugin) in plugins.iter().enumerate() {
            let (vm, root) = (self.plugins[*plugin].vm, self.plugins[*plugin].root);
            // A failed VM gets no context (0): its callbacks fail, and the
            // stream is answered with a 503 like Envoy's fail-closed filter.
            let context = self.vms[vm]
                .create_http_context(root, id, position)
                .unwrap_or(0);
            filters.push((vm, context));
        }
        let n = filters.len();
        let fresh = || Direction {
            held: vec![Vec::new(); n],
            ..Default::default()
        };
        self.streams.insert(
            id,
            StreamRun {
                filters,
                stop_iteration,
                plugins: plugins.clone(),
                request: fresh(),
                response: fresh(),
                local: None,
                reset: false,
                finished: false,
                decoded: 0,
                responses_in_chain_order: self.world.borrow().profile == Profile::Kong,
                wasm: vec![Duration::ZERO; plugins.len()],
            },
        );
        Ok(id)
    }

    /// Kong: ngx_wasm_module replaces a trapped instance at its next use
    /// with a fresh one whose root contexts start again (`on_vm_start`,
    /// `on_configure`; their tick periods unset until they set them). The
    /// old instance's callouts are dropped; context ids go on from where
    /// the old instance stopped.
    fn revive(&mut self, index: VmIndex) {
        let origin = self.vm_origins[index].clone();
        let Ok(module) = self.module(&origin.wasm) else {
            return;
        };
        let mut roots: Vec<(u32, RootInfo)> = self.vms[index]
            .store
            .data()
            .roots
            .iter()
            .map(|(id, info)| (*id, info.clone()))
            .collect();
        roots.sort_by_key(|(id, _)| *id);
        let vm = Vm::new(
            &self.engine,
            &module,
            self.world.clone(),
            index,
            &origin.vm_id,
            origin.env,
        );
        let mut vm = match vm {
            Ok(vm) => vm,
            Err(err) => {
                self.log_host(&format!("replacing a trapped instance failed: {err:#}"));
                return;
            }
        };
        vm.continue_context_ids(&self.vms[index]);
        self.world
            .borrow_mut()
            .callouts
            .retain(|_, c| c.vm != index);
        let mut renamed = HashMap::new();
        for (old, mut info) in roots {
            info.tick_period_ms = 0;
            info.next_tick_ns = 0;
            match vm.add_root(info) {
                Ok(new) => {
                    renamed.insert(old, new);
                }
                Err(err) => self.log_host(&format!(
                    "a replaced instance's root context refused to start: {err:#}"
                )),
            }
        }
        self.vms[index] = vm;
        for plugin in &mut self.plugins {
            if plugin.vm == index
                && let Some(root) = renamed.get(&plugin.root)
            {
                plugin.root = *root;
            }
        }
        self.run_events();
    }

    /// Whether new data for a direction is moot: the stream ended, or a
    /// local response already answered it (the upstream's answer is dropped).
    fn ignores(&self, id: StreamId) -> bool {
        self.streams
            .get(&id)
            .is_none_or(|r| r.finished || r.reset || r.local.is_some())
    }

    /// Position → chain index for a direction (and back: it is its own
    /// inverse).
    fn filter_at(run: &StreamRun, response: bool, position: usize) -> usize {
        if response && !run.responses_in_chain_order {
            run.filters.len() - 1 - position
        } else {
            position
        }
    }

    fn dir(run: &mut StreamRun, response: bool) -> &mut Direction {
        if response {
            &mut run.response
        } else {
            &mut run.request
        }
    }

    /// Calls one callback. `Stop` means the stream left normal iteration
    /// during it (local response sent, reset, VM failure): the caller must
    /// not touch the direction's state any more.
    fn call(
        &mut self,
        id: StreamId,
        response: bool,
        position: usize,
        callback: HttpCallback,
        size: usize,
        eos: bool,
    ) -> Step {
        let Some(run) = self.streams.get(&id) else {
            return Step::Stop;
        };
        let chain_index = Self::filter_at(run, response, position);
        let (vm, context) = run.filters[chain_index];
        let plugin = run.plugins[chain_index];
        if !response
            && matches!(callback, HttpCallback::RequestHeaders)
            && let Some(run) = self.streams.get_mut(&id)
        {
            run.decoded = run.decoded.max(chain_index + 1);
        }
        let headers_callback = matches!(
            callback,
            HttpCallback::RequestHeaders | HttpCallback::ResponseHeaders
        );
        if headers_callback && let Some(data) = self.world.borrow_mut().streams.get_mut(&id) {
            data.held_headers.insert((chain_index, response));
        }
        let started = std::time::Instant::now();
        let result = self.vms[vm].http(context, callback, size, eos);
        if headers_callback
            && matches!(result, Ok(Action::Continue))
            && let Some(data) = self.world.borrow_mut().streams.get_mut(&id)
        {
            data.held_headers.remove(&(chain_index, response));
        }
        let spent = started.elapsed();
        if let Some(run) = self.streams.get_mut(&id)
            && let Some(total) = run.wasm.get_mut(chain_index)
        {
            *total += spent;
        }
        let entry = self.timings.entry((plugin, callback.name())).or_default();
        entry.0 += 1;
        entry.1 += spent;
        let action = match result {
            Ok(action) => Some(action),
            Err(_) if self.streams.get(&id).is_some_and(|r| r.local.is_some()) => {
                // Already answering with a local response (perhaps because
                // this very VM failed): a failed filter is skipped.
                return Step::Continue;
            }
            Err(err) => {
                // A trapped VM fails its streams closed: Envoy answers 503
                // (and keeps the VM failed), ngx_wasm_module its 500 page
                // (and replaces the instance at its next use, `revive`).
                self.log_host(&format!(
                    "stream {id}: filter {chain_index} failed: {err:#}"
                ));
                let local = match self.world.borrow().profile {
                    Profile::Envoy => LocalResponse {
                        status: 503,
                        details: "wasm_fail_stream".into(),
                        headers: vec![],
                        body: Vec::new(),
                        grpc_status: None,
                    },
                    Profile::Kong => LocalResponse {
                        status: 500,
                        details: "instance trapped".into(),
                        headers: vec![("content-type".into(), b"text/html".to_vec())],
                        body: NGINX_500_PAGE.as_bytes().to_vec(),
                        grpc_status: None,
                    },
                };
                if let Some(data) = self.world.borrow_mut().streams.get_mut(&id) {
                    data.local_response = Some(local);
                }
                None
            }
        };
        // A local response sent during the callback wins over its return
        // value (Envoy turns it into a stop as well).
        let local = self
            .world
            .borrow_mut()
            .streams
            .get_mut(&id)
            .and_then(|d| d.local_response.take());
        if let Some(local) = local {
            self.send_local(id, local, response);
            return Step::Stop;
        }
        if self.streams.get(&id).is_none_or(|r| r.reset || r.finished) {
            return Step::Stop;
        }
        match action {
            Some(Action::Continue) => Step::Continue,
            Some(Action::Pause) => Step::Pause,
            None => Step::Stop,
        }
    }

    fn log_host(&self, message: &str) {
        self.world
            .borrow_mut()
            .log("host-sim", crate::abi::LogLevel::Error, message.to_string());
    }

    fn headers_map(&self, id: StreamId, response: bool) -> Headers {
        let world = self.world.borrow();
        let Some(data) = world.streams.get(&id) else {
            return vec![];
        };
        if response {
            data.response_headers.clone().unwrap_or_default()
        } else {
            data.request_headers.clone()
        }
    }

    /// Delivers headers to a direction (`response`: the upstream's answer,
    /// else the client's request).
    pub fn deliver_headers(&mut self, id: StreamId, response: bool, headers: Headers, eos: bool) {
        if self.ignores(id) {
            return;
        }
        {
            let mut world = self.world.borrow_mut();
            if let Some(data) = world.streams.get_mut(&id) {
                if response {
                    data.response_headers = Some(headers);
                } else {
                    data.request_headers = headers;
                }
            }
        }
        if let Some(run) = self.streams.get_mut(&id) {
            let d = Self::dir(run, response);
            d.headers_started = true;
            d.end_with_headers = eos;
        }
        self.run_headers(id, response, 0);
        self.run_events();
    }

    /// Runs the headers callbacks from `from` on; when every filter let
    /// them through, they leave this end of the chain.
    fn run_headers(&mut self, id: StreamId, response: bool, from: usize) {
        let Some(n) = self.streams.get(&id).map(|r| r.filters.len()) else {
            return;
        };
        let eos = self
            .streams
            .get_mut(&id)
            .is_some_and(|r| Self::dir(r, response).end_with_headers);
        let callback = if response {
            HttpCallback::ResponseHeaders
        } else {
            HttpCallback::RequestHeaders
        };
        // ngx_wasm_module calls the request headers step with
        // `end_of_stream` false, always (the body is not read yet).
        let kong_request = !response && self.is_kong();
        let callback_eos = eos && !kong_request;
        for position in from..n {
            let count = self.headers_map(id, response).len();
            match self.call(id, response, position, callback, count, callback_eos) {
                Step::Stop => return,
                Step::Pause => {
                    if let Some(run) = self.streams.get_mut(&id) {
                        Self::dir(run, response).headers_passed = position;
                    }
                    if kong_request && !eos {
                        self.log_host(&format!(
                            "stream {id}: filter {position} paused the request headers; \
                             ngx_wasm_module reads the body only after every filter let them \
                             through, so this request hangs unless the filter resumes it itself"
                        ));
                    }
                    return;
                }
                Step::Continue => {
                    if let Some(run) = self.streams.get_mut(&id) {
                        Self::dir(run, response).headers_passed = position + 1;
                    }
                }
            }
        }
        if kong_request && !eos {
            // nginx contacts the upstream only once it has read the body:
            // the headers leave with it (`run_data`).
            return;
        }
        let headers = self.headers_map(id, response);
        if let Some(run) = self.streams.get_mut(&id) {
            let d = Self::dir(run, response);
            d.out.headers = Some(headers);
            if eos {
                d.out.complete = true;
            }
        }
        self.maybe_finish(id);
    }

    /// Delivers body data to a direction (`response` as in
    /// [`Host::deliver_headers`]).
    pub fn deliver_data(&mut self, id: StreamId, response: bool, data: Vec<u8>, eos: bool) {
        if self.ignores(id) {
            return;
        }
        if !response && self.is_kong() {
            // ngx_wasm_module: nginx reads the whole body (content phase)
            // after every filter's request headers let them through, then
            // calls each filter's request body step once, with all of it.
            if let Some(run) = self.streams.get_mut(&id) {
                let d = &mut run.request;
                d.waiting.extend_from_slice(&data);
                d.waiting_eos |= eos;
                d.waiting_any = true;
            }
            self.kong_read_body(id);
            self.run_events();
            return;
        }
        self.run_data(id, response, 0, data, eos);
        self.run_events();
    }

    /// Kong: hands the whole request body to the filters once it has
    /// arrived and every filter let the request headers through.
    fn kong_read_body(&mut self, id: StreamId) {
        let Some(run) = self.streams.get_mut(&id) else {
            return;
        };
        let n = run.filters.len();
        let d = &mut run.request;
        if d.headers_passed < n || !d.waiting_eos {
            return;
        }
        let body = std::mem::take(&mut d.waiting);
        d.waiting_eos = false;
        d.waiting_any = false;
        self.run_data(id, false, 0, body, true);
    }

    fn is_kong(&self) -> bool {
        self.world.borrow().profile == Profile::Kong
    }

    /// Runs body callbacks from `from` on.
    ///
    /// `Pause` from a headers callback stops *all* iteration: proxy-wasm-cpp-host
    /// turns the ABI's `StopIteration` into `StopAllIterationAndWatermark`, so
    /// body data waits in front of that filter (it does not see it) until the
    /// filter resumes. `Pause` from a body callback is
    /// `StopIterationAndBuffer`: the filter sees the accumulated body on its
    /// next call, and nothing passes on.
    fn run_data(
        &mut self,
        id: StreamId,
        response: bool,
        from: usize,
        mut data: Vec<u8>,
        eos: bool,
    ) {
        let Some(n) = self.streams.get(&id).map(|r| r.filters.len()) else {
            return;
        };
        let callback = if response {
            HttpCallback::ResponseBody
        } else {
            HttpCallback::RequestBody
        };
        for position in from..n {
            let passed = self
                .streams
                .get_mut(&id)
                .map(|r| Self::dir(r, response).headers_passed)
                .unwrap_or(0);
            let stops_headers_only = self
                .streams
                .get(&id)
                .is_some_and(|r| r.stop_iteration[Self::filter_at(r, response, position)]);
            if position > passed || (position == passed && !stops_headers_only) {
                // Headers stopped all iteration here: the data waits in front
                // of this filter.
                if let Some(run) = self.streams.get_mut(&id) {
                    let d = Self::dir(run, response);
                    d.waiting.extend_from_slice(&data);
                    d.waiting_eos |= eos;
                    d.waiting_any = true;
                }
                return;
            }
            let mut buffer = self
                .streams
                .get_mut(&id)
                .map(|r| std::mem::take(&mut Self::dir(r, response).held[position]))
                .unwrap_or_default();
            let buffering = !buffer.is_empty();
            buffer.extend_from_slice(&data);
            if buffering && self.over_buffer_limit(buffer.len()) {
                // Envoy adds the data to the filter's buffer and fails the
                // stream without calling the filter again.
                self.buffer_limit_exceeded(id, response);
                return;
            }
            let size = buffer.len();
            self.set_body(id, response, buffer);
            let step = self.call(id, response, position, callback, size, eos);
            let buffer = self.take_body(id, response);
            match step {
                Step::Stop => return,
                Step::Pause if self.over_buffer_limit(buffer.len()) => {
                    self.buffer_limit_exceeded(id, response);
                    return;
                }
                Step::Pause => {
                    if let Some(run) = self.streams.get_mut(&id) {
                        let d = Self::dir(run, response);
                        d.held[position] = buffer;
                        if eos {
                            d.paused_eos_at = Some(position);
                        }
                    }
                    return;
                }
                Step::Continue => {
                    if position == passed {
                        // This filter held only the headers: its `Continue`
                        // releases them first, then the data follows.
                        self.run_headers(id, response, position + 1);
                        if self.streams.get(&id).is_none_or(|r| r.reset || r.finished) {
                            return;
                        }
                    }
                    data = buffer;
                }
            }
        }
        let kong_request = !response && eos && self.is_kong();
        let headers = kong_request.then(|| self.headers_map(id, false));
        if let Some(run) = self.streams.get_mut(&id) {
            let d = Self::dir(run, response);
            d.out.body.extend_from_slice(&data);
            if eos {
                d.out.complete = true;
            }
            if let Some(mut headers) = headers {
                // nginx proxies once the body is read: the upstream gets the
                // headers as the filters left them by then, with the
                // body's own length (ngx_wasm_module updates it on a
                // rewrite).
                let length = d.out.body.len().to_string().into_bytes();
                for (name, value) in &mut headers {
                    if name == "content-length" {
                        *value = length.clone();
                    }
                }
                d.out.headers = Some(headers);
            }
        }
        self.maybe_finish(id);
    }

    /// Whether a filter's buffered body of `len` bytes is past Envoy's
    /// buffer limit.
    fn over_buffer_limit(&self, len: usize) -> bool {
        self.world
            .borrow()
            .buffer_limit
            .is_some_and(|limit| len > limit)
    }

    /// A filter buffered past the limit: Envoy answers a request `413
    /// Payload Too Large`; a response `500` while its headers have not
    /// left, else it resets the stream (the client has the headers, no body).
    fn buffer_limit_exceeded(&mut self, id: StreamId, response: bool) {
        self.log_host(&format!(
            "stream {id}: a filter buffered a {} body past the buffer limit",
            if response { "response" } else { "request" }
        ));
        let (status, text, details) = if response {
            (500, "Internal Server Error", "response_payload_too_large")
        } else {
            (413, "Payload Too Large", "request_payload_too_large")
        };
        let local = LocalResponse {
            status,
            details: details.into(),
            headers: vec![],
            body: text.as_bytes().to_vec(),
            grpc_status: None,
        };
        self.send_local(id, local, response);
    }

    fn set_body(&self, id: StreamId, response: bool, body: Vec<u8>) {
        if let Some(data) = self.world.borrow_mut().streams.get_mut(&id) {
            if response {
                data.response_body = body;
            } else {
                data.request_body = body;
            }
        }
    }

    fn take_body(&self, id: StreamId, response: bool) -> Vec<u8> {
        self.world
            .borrow_mut()
            .streams
            .get_mut(&id)
            .map(|d| {
                if response {
                    std::mem::take(&mut d.response_body)
                } else {
                    std::mem::take(&mut d.request_body)
                }
            })
            .unwrap_or_default()
    }

    /// A filter resumed its direction.
    fn resume(&mut self, id: StreamId, filter: usize, response: bool) {
        let Some(run) = self.streams.get_mut(&id) else {
            return;
        };
        if run.reset || run.finished || run.local.is_some() {
            return;
        }
        // Envoy 1.40 drops the filter's headers map once it continues, by
        // return value or by resuming (the differential suite checks both).
        if let Some(data) = self.world.borrow_mut().streams.get_mut(&id) {
            data.held_headers.remove(&(filter, response));
        }
        let Some(run) = self.streams.get_mut(&id) else {
            return;
        };
        let n = run.filters.len();
        let position = Self::filter_at(run, response, filter);
        let d = Self::dir(run, response);
        if !response
            && d.headers_started
            && d.headers_passed == position
            && position < n
            && self.world.borrow().profile == Profile::Kong
        {
            // Kong: the headers go on; the body is read once they passed all.
            d.headers_passed = position + 1;
            self.run_headers(id, response, position + 1);
            self.kong_read_body(id);
            return;
        }
        let Some(run) = self.streams.get_mut(&id) else {
            return;
        };
        let d = Self::dir(run, response);
        if d.headers_started && d.headers_passed == position && position < n {
            // Stopped on headers: they continue past this filter, then the
            // data that waited in front of it starts at this filter
            // (Envoy iterates from the current filter after a stop-all).
            let waiting = std::mem::take(&mut d.waiting);
            let waiting_eos = std::mem::replace(&mut d.waiting_eos, false);
            let waiting_any = std::mem::replace(&mut d.waiting_any, false);
            let held = std::mem::take(&mut d.held[position]);
            let held_eos = std::mem::take(&mut d.paused_eos_at) == Some(position);
            d.headers_passed = position + 1;
            self.run_headers(id, response, position + 1);
            if !held.is_empty() || held_eos {
                // Body this filter buffered while holding only the headers.
                self.run_data(id, response, position + 1, held, held_eos);
            }
            if waiting_any {
                self.run_data(id, response, position, waiting, waiting_eos);
            }
            return;
        }
        let held = std::mem::take(&mut d.held[position]);
        let held_eos = d.paused_eos_at == Some(position);
        if held_eos {
            d.paused_eos_at = None;
        }
        if !held.is_empty() || held_eos {
            self.run_data(id, response, position + 1, held, held_eos);
        }
    }

    /// A filter sent a local response: the request stops; the response goes
    /// back through the encoder side of the filters that saw the request.
    fn send_local(&mut self, id: StreamId, local: LocalResponse, during_response: bool) {
        let Some(run) = self.streams.get_mut(&id) else {
            return;
        };
        if during_response && run.response.out.headers.is_some() {
            // Headers already went to the client: all Envoy can do is reset.
            run.reset = true;
            self.finish(id);
            return;
        }
        let grpc = self.world.borrow().profile == Profile::Envoy && self.is_grpc_request(id);
        let local = if grpc { grpc_local_reply(local) } else { local };
        let Some(run) = self.streams.get_mut(&id) else {
            return;
        };
        run.local = Some(local.clone());
        let n = run.filters.len();
        let headers = if run.responses_in_chain_order {
            self.kong_local_headers(id, &local)
        } else {
            let mut headers: Headers =
                vec![(":status".into(), local.status.to_string().into_bytes())];
            headers.extend(local.headers.iter().cloned());
            if !local.body.is_empty() {
                headers.push((
                    "content-length".into(),
                    local.body.len().to_string().into_bytes(),
                ));
                if !local.headers.iter().any(|(k, _)| k == "content-type") {
                    headers.push(("content-type".into(), b"text/plain".to_vec()));
                }
            }
            headers
        };
        let Some(run) = self.streams.get_mut(&id) else {
            return;
        };
        // Encoder filters that never saw the request are skipped (Envoy;
        // ngx_wasm_module runs the response phases of the whole chain, in
        // order: a filter that saw only the request headers sees the
        // gateway's answer too).
        let skip = if run.responses_in_chain_order {
            0
        } else {
            n - run.decoded.min(n)
        };
        run.response = Direction {
            held: vec![Vec::new(); n],
            headers_passed: skip,
            headers_started: true,
            end_with_headers: local.body.is_empty(),
            ..Default::default()
        };
        {
            let mut world = self.world.borrow_mut();
            if let Some(data) = world.streams.get_mut(&id) {
                data.response_headers = Some(headers);
                data.response_body.clear();
            }
        }
        self.run_headers(id, true, skip);
        if !local.body.is_empty() && self.streams.get(&id).is_some_and(|r| !r.reset) {
            self.run_data(id, true, skip, local.body, true);
        }
    }

    /// Answers stream `id` before any filter saw it, as Envoy's connection
    /// manager answers a request it refuses (HTTP/1.1 without `Host`: 400;
    /// HTTP/1.0: 426): the client gets `local` as it is (`content-length`
    /// added, and `content-type: text/plain` for a body without one), and
    /// the filters see only `on_log` (then `on_done`, `on_delete`).
    pub fn refuse(&mut self, id: StreamId, local: LocalResponse) {
        let Some(run) = self.streams.get_mut(&id) else {
            return;
        };
        let mut headers: Headers = vec![(":status".into(), local.status.to_string().into_bytes())];
        headers.extend(local.headers.iter().cloned());
        headers.push((
            "content-length".into(),
            local.body.len().to_string().into_bytes(),
        ));
        if !local.body.is_empty() && !local.headers.iter().any(|(k, _)| k == "content-type") {
            headers.push(("content-type".into(), b"text/plain".to_vec()));
        }
        run.response.out = Output {
            headers: Some(headers),
            body: local.body.clone(),
            complete: true,
        };
        run.local = Some(local);
        self.maybe_finish(id);
        self.run_events();
    }

    /// The headers of a local response as ngx_wasm_module shows them to
    /// the filters: `:status`, `Content-Type` (`text/plain` for a body
    /// without one) and `Connection` (its "shim" headers), the filter's
    /// own, then `Content-Length`, `Server` and `Date` as nginx sends them.
    fn kong_local_headers(&self, id: StreamId, local: &LocalResponse) -> Headers {
        let world = self.world.borrow();
        let close = world.streams.get(&id).is_some_and(|d| {
            d.request_headers.iter().any(|(k, v)| {
                k.eq_ignore_ascii_case("connection") && v.eq_ignore_ascii_case(b"close")
            })
        });
        let mut headers: Headers = vec![(":status".into(), local.status.to_string().into_bytes())];
        match local.headers.iter().find(|(k, _)| k == "content-type") {
            Some((_, v)) => headers.push(("content-type".into(), v.clone())),
            None if !local.body.is_empty() => {
                headers.push(("content-type".into(), b"text/plain".to_vec()));
            }
            None => {}
        }
        let connection: &[u8] = if close { b"close" } else { b"keep-alive" };
        headers.push(("connection".into(), connection.to_vec()));
        headers.extend(
            local
                .headers
                .iter()
                .filter(|(k, _)| k != "content-type")
                .cloned(),
        );
        headers.push((
            "content-length".into(),
            local.body.len().to_string().into_bytes(),
        ));
        headers.push(("server".into(), NGINX_SERVER.as_bytes().to_vec()));
        headers.push((
            "date".into(),
            crate::world::http_date(world.clock.now_ns()).into_bytes(),
        ));
        headers
    }

    /// Whether stream `id`'s request is gRPC as Envoy tells it: its
    /// `content-type` is `application/grpc` or `application/grpc+…`
    /// (`application/grpc-web` is not).
    fn is_grpc_request(&self, id: StreamId) -> bool {
        let world = self.world.borrow();
        let Some(data) = world.streams.get(&id) else {
            return false;
        };
        data.request_headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
            .and_then(|(_, v)| v.strip_prefix(b"application/grpc"))
            .is_some_and(|rest| rest.is_empty() || rest[0] == b'+')
    }

    fn maybe_finish(&mut self, id: StreamId) {
        let Some(run) = self.streams.get(&id) else {
            return;
        };
        if run.finished {
            return;
        }
        let request_done = run.request.out.complete || run.local.is_some();
        if request_done && run.response.out.complete {
            self.finish(id);
        }
    }

    /// The stream ended: `on_log`, `on_done`, `on_delete` for every filter.
    fn finish(&mut self, id: StreamId) {
        let Some(run) = self.streams.get_mut(&id) else {
            return;
        };
        if run.finished {
            return;
        }
        run.finished = true;
        let filters = run.filters.clone();
        if let Some(data) = self.world.borrow_mut().streams.get_mut(&id) {
            data.logging = true;
        }
        for (index, (vm, context)) in filters.into_iter().enumerate() {
            let started = std::time::Instant::now();
            self.vms[vm].finish_context(context);
            if let Some(total) = self
                .streams
                .get_mut(&id)
                .and_then(|run| run.wasm.get_mut(index))
            {
                *total += started.elapsed();
            }
        }
    }

    /// Time spent inside each filter of the chain for one stream, in chain
    /// order: (plugin name, total over its HTTP and end-of-stream callbacks).
    pub fn stream_wasm_times(&self, id: StreamId) -> Vec<(String, Duration)> {
        let Some(run) = self.streams.get(&id) else {
            return Vec::new();
        };
        run.plugins
            .iter()
            .zip(&run.wasm)
            .map(|(plugin, spent)| (self.plugins[*plugin].name.clone(), *spent))
            .collect()
    }

    /// Resets a stream (client went away, upstream reset, or a filter closed it).
    pub fn reset(&mut self, id: StreamId) {
        if let Some(run) = self.streams.get_mut(&id) {
            run.reset = true;
        }
        self.finish(id);
        self.run_events();
    }

    /// What of stream `id` has left the chain towards the upstream.
    pub fn upstream_output(&self, id: StreamId) -> Option<&Output> {
        self.streams.get(&id).map(|r| &r.request.out)
    }

    /// What of stream `id` has left the chain towards the client.
    pub fn client_output(&self, id: StreamId) -> Option<&Output> {
        self.streams.get(&id).map(|r| &r.response.out)
    }

    /// The local response a filter sent on stream `id`, if any.
    pub fn local_of(&self, id: StreamId) -> Option<&LocalResponse> {
        self.streams.get(&id).and_then(|r| r.local.as_ref())
    }

    /// Filter state `key` of stream `id` (Envoy's per-request filter state).
    pub fn filter_state(&self, id: StreamId, key: &str) -> Option<Vec<u8>> {
        self.world
            .borrow()
            .streams
            .get(&id)
            .and_then(|d| d.filter_state.get(key).cloned())
    }

    /// A value published for later filters as one-segment property `path`
    /// (`wasmx.<name>`), wherever this host keeps it: Envoy's
    /// filter state `wasm.<path>`, ngx_wasm_module's `wasmx.*` property, or
    /// Kong Gateway's `kong.ctx.shared.*`.
    pub fn published(&self, id: StreamId, path: &str) -> Option<Vec<u8>> {
        self.filter_state(id, &format!("wasm.{path}"))
            .or_else(|| self.filter_state(id, path))
            .or_else(|| {
                let name = path.strip_prefix("wasmx.")?;
                self.filter_state(id, &format!("kong.ctx.shared.{name}"))
            })
    }

    /// Whether stream `id` is done (both directions complete, or reset); an
    /// unknown stream counts as done.
    pub fn is_finished(&self, id: StreamId) -> bool {
        self.streams.get(&id).is_none_or(|r| r.finished)
    }

    /// Whether stream `id` was reset; an unknown stream counts as reset.
    pub fn is_reset(&self, id: StreamId) -> bool {
        self.streams.get(&id).is_none_or(|r| r.reset)
    }

    /// Forgets a finished stream's bookkeeping.
    pub fn drop_stream(&mut self, id: StreamId) {
        if !self.is_finished(id) {
            self.reset(id);
        }
        self.streams.remove(&id);
        self.world.borrow_mut().streams.remove(&id);
    }

    // ---- events, callouts, time ----

    /// Processes deferred events until none are left.
    pub fn run_events(&mut self) {
        // Bounded: a module that re-enqueues forever must not hang the host.
        for _ in 0..100_000 {
            let event = self.world.borrow_mut().events.pop_front();
            let Some(event) = event else {
                return;
            };
            match event {
                Event::QueueReady {
                    vm,
                    root_context,
                    queue,
                } => {
                    if let Some(vm) = self.vms.get_mut(vm) {
                        let _ = vm.queue_ready(root_context, queue);
                    }
                }
                Event::Resume {
                    stream,
                    filter,
                    response,
                } => self.resume(stream, filter, response),
                Event::LocalResponse { stream, .. } => {
                    // Sent outside the stream's own callbacks (a root's tick
                    // or callout answer after `set_effective_context`);
                    // those callbacks take theirs on return.
                    let local = self
                        .world
                        .borrow_mut()
                        .streams
                        .get_mut(&stream)
                        .and_then(|d| d.local_response.take());
                    if let Some(local) = local {
                        let during_response = self
                            .streams
                            .get(&stream)
                            .is_some_and(|r| r.response.headers_started);
                        self.send_local(stream, local, during_response);
                    }
                }
                Event::Reset { stream } => {
                    if let Some(run) = self.streams.get_mut(&stream) {
                        run.reset = true;
                    }
                    self.finish(stream);
                }
                Event::Dispatched { token } => self.auto_complete(token),
            }
        }
        self.log_host("event loop stopped after 100000 events in a row");
    }

    fn auto_complete(&mut self, token: u32) {
        let Some(callout) = self.world.borrow().callouts.get(&token).cloned() else {
            return;
        };
        let profile = self.world.borrow().profile;
        let response = match self.clusters.get_mut(&callout.cluster) {
            Some(ClusterTarget::Handler(handler)) => Some(handler(&callout)),
            Some(ClusterTarget::Http(addr)) => {
                Some(crate::callout::blocking_http(*addr, &callout, profile))
            }
            Some(ClusterTarget::Manual) => None,
            // Only Kong dispatches to a target it was not given: ngx_wasm_module
            // connects to an `IP:port` and resolves anything else (with no
            // resolver configured here, that fails).
            None => Some(match callout.cluster.parse::<SocketAddr>() {
                Ok(addr) => crate::callout::blocking_http(addr, &callout, profile),
                Err(_) => CallResponse::failed("resolver failure"),
            }),
        };
        if let Some(response) = response {
            self.deliver_callout(token, response);
        }
    }

    /// Callouts waiting for [`Host::respond`], oldest first.
    pub fn callouts(&self) -> Vec<Callout> {
        self.world.borrow().callouts.values().cloned().collect()
    }

    /// Completes callout `token` with `response` (a [`CallResponse::failure`]
    /// is what a reset or timeout looks like).
    pub fn respond(&mut self, token: u32, response: CallResponse) -> Result<()> {
        if !self.world.borrow().callouts.contains_key(&token) {
            bail!("no pending callout {token}");
        }
        self.deliver_callout(token, response);
        Ok(())
    }

    /// Completes callout `token` with `response`; an unknown token is
    /// ignored (the callout was cancelled or already answered), unlike
    /// [`Host::respond`].
    pub fn deliver_callout(&mut self, token: u32, mut response: CallResponse) {
        let callout = self.world.borrow_mut().callouts.remove(&token);
        let Some(callout) = callout else {
            return;
        };
        let kong = self.world.borrow().profile == Profile::Kong;
        if kong
            && !response
                .headers
                .iter()
                .any(|(k, _)| k == ":dispatch_status")
        {
            // ngx_wasm_module says how the call went in `:dispatch_status`:
            // after `:status` for an answer, alone for a failure.
            let answered = response.headers.iter().any(|(k, _)| k == ":status");
            let status = match (&response.failure, answered) {
                (_, true) => "ok".to_string(),
                (Some(reason), false) => reason.clone(),
                (None, false) => "timeout".to_string(),
            };
            let at = usize::from(answered);
            response
                .headers
                .insert(at, (":dispatch_status".into(), status.into_bytes()));
        }
        let mut resume = None;
        if let Some(vm) = self.vms.get_mut(callout.vm) {
            // Envoy cancels a stream's callouts when the stream ends.
            if vm.has_context(callout.context) {
                if kong
                    && let Some(ContextKind::Http { stream, filter, .. }) =
                        vm.store.data().contexts.get(&callout.context)
                {
                    resume = Some((*stream, *filter));
                }
                let _ = vm.http_call_response(callout.context, token, response);
            }
        }
        if let Some((stream, filter)) = resume {
            // ngx_wasm_module resumes the paused request step itself once
            // the last callout its filter made has answered.
            let pending = self
                .world
                .borrow()
                .callouts
                .values()
                .any(|c| c.vm == callout.vm && c.context == callout.context);
            if !pending {
                self.world.borrow_mut().events.push_back(Event::Resume {
                    stream,
                    filter,
                    response: false,
                });
            }
        }
        self.run_events();
    }

    /// Current host time, ns since the epoch.
    pub fn now_ns(&self) -> u64 {
        self.world.borrow().clock.now_ns()
    }

    /// Advances virtual time by `by`, firing ticks and callout timeouts in
    /// time order. (No effect on the real clock.)
    pub fn advance(&mut self, by: Duration) {
        let target = self.now_ns() + by.as_nanos() as u64;
        loop {
            let next = self.next_timer().filter(|t| *t <= target);
            let Some(at) = next else {
                break;
            };
            self.set_time(at);
            self.fire_due(at);
        }
        self.set_time(target);
    }

    fn set_time(&mut self, ns: u64) {
        let mut world = self.world.borrow_mut();
        if let Clock::Virtual(now) = &mut world.clock {
            *now = (*now).max(ns);
        }
    }

    fn next_timer(&self) -> Option<u64> {
        let ticks = self
            .vms
            .iter()
            .flat_map(|vm| vm.store.data().roots.values())
            .filter(|r| r.tick_period_ms > 0)
            .map(|r| r.next_tick_ns);
        let world = self.world.borrow();
        let timeouts = world
            .callouts
            .values()
            .filter(|c| c.timeout_ms > 0)
            .map(|c| c.dispatched_at_ns + u64::from(c.timeout_ms) * 1_000_000);
        ticks.chain(timeouts).min()
    }

    /// Fires every tick and timeout due at `now` (also used by serve mode
    /// with the real clock).
    pub fn fire_due(&mut self, now: u64) {
        let expired: Vec<u32> = self
            .world
            .borrow()
            .callouts
            .values()
            .filter(|c| {
                c.timeout_ms > 0 && c.dispatched_at_ns + u64::from(c.timeout_ms) * 1_000_000 <= now
            })
            .map(|c| c.token)
            .collect();
        for token in expired {
            self.deliver_callout(token, CallResponse::failure());
        }
        for index in 0..self.vms.len() {
            let due: Vec<u32> = self.vms[index]
                .store
                .data()
                .roots
                .iter()
                .filter(|(_, r)| r.tick_period_ms > 0 && r.next_tick_ns <= now)
                .map(|(id, _)| *id)
                .collect();
            for root in due {
                if let Some(info) = self.vms[index].store.data_mut().roots.get_mut(&root) {
                    info.next_tick_ns = now + u64::from(info.tick_period_ms) * 1_000_000;
                }
                let _ = self.vms[index].tick(root);
                self.run_events();
            }
        }
    }

    /// Calls `on_done` on every root context (shutdown), e.g. to flush counters.
    pub fn shutdown(&mut self) {
        for plugin in 0..self.plugins.len() {
            let (vm, root) = (self.plugins[plugin].vm, self.plugins[plugin].root);
            self.vms[vm].done_root(root);
        }
        self.run_events();
    }

    // ---- observation ----

    /// Everything modules logged so far.
    pub fn logs(&self) -> Vec<LogLine> {
        self.world.borrow().logs.clone()
    }

    /// Log messages containing `needle`.
    pub fn logs_containing(&self, needle: &str) -> Vec<String> {
        self.world
            .borrow()
            .logs
            .iter()
            .filter(|l| l.message.contains(needle))
            .map(|l| l.message.clone())
            .collect()
    }

    /// Value of counter or gauge `name`.
    pub fn metric(&self, name: &str) -> Option<u64> {
        self.world.borrow().metrics.value(name)
    }

    /// Samples of histogram `name`.
    pub fn histogram(&self, name: &str) -> Vec<u64> {
        self.world
            .borrow()
            .metrics
            .samples(name)
            .map(<[u64]>::to_vec)
            .unwrap_or_default()
    }

    /// All metrics in Prometheus text format.
    pub fn prometheus(&self) -> String {
        self.world.borrow().metrics.prometheus()
    }

    /// Shared data `key` of `vm_id`: value and CAS.
    pub fn shared_data(&self, vm_id: &str, key: &str) -> Option<(Vec<u8>, u32)> {
        self.world.borrow().get_shared(vm_id, key).ok()
    }

    /// Number of shared data keys of `vm_id`.
    pub fn shared_data_len(&self, vm_id: &str) -> usize {
        self.world
            .borrow()
            .shared_data
            .get(vm_id)
            .map_or(0, |m| m.len())
    }

    /// Total bytes of `vm_id`'s shared data (keys and values): what a
    /// soak test watches to show memory stays bounded.
    pub fn shared_data_bytes(&self, vm_id: &str) -> usize {
        self.world
            .borrow()
            .shared_data
            .get(vm_id)
            .map_or(0, |m| m.iter().map(|(k, v)| k.len() + v.0.len()).sum())
    }

    /// Items waiting in queue (`vm_id`, `name`).
    pub fn queue_items(&self, vm_id: &str, name: &str) -> Vec<Vec<u8>> {
        let world = self.world.borrow();
        world
            .queues
            .iter()
            .find(|q| q.vm_id == vm_id && q.name == name)
            .map(|q| q.items.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Time spent inside each filter's HTTP callbacks: (plugin name,
    /// callback, calls, total), sorted. Host calls the module makes are
    /// included; the host's own chain bookkeeping is not.
    pub fn callback_times(&self) -> Vec<(String, &'static str, u64, Duration)> {
        let mut out: Vec<_> = self
            .timings
            .iter()
            .map(|((p, cb), (n, t))| (self.plugins[*p].name.clone(), *cb, *n, *t))
            .collect();
        out.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        out
    }

    /// Starts counting host calls afresh (`on`), or stops counting.
    pub fn count_host_calls(&mut self, on: bool) {
        self.world.borrow_mut().host_calls = on.then(BTreeMap::new);
    }

    /// Host calls made since counting started: (plugin, host function,
    /// calls), by plugin then function.
    pub fn host_calls(&self) -> Vec<(String, &'static str, u64)> {
        self.world
            .borrow()
            .host_calls
            .iter()
            .flatten()
            .map(|((plugin, name), n)| (plugin.clone(), *name, *n))
            .collect()
    }

    /// Forgets the callback timings (e.g. after a warm-up).
    pub fn reset_callback_times(&mut self) {
        self.timings.clear();
    }

    /// Whether any VM trapped.
    pub fn failed_vms(&self) -> Vec<String> {
        self.vms.iter().filter_map(|vm| vm.failed.clone()).collect()
    }
}

/// Envoy's local reply to a gRPC request (`Utility::sendLocalReply`): HTTP
/// 200, headers only, the status in `grpc-status` (the filter's, or mapped
/// from the HTTP status) and the body, percent-encoded, in `grpc-message`.
fn grpc_local_reply(local: LocalResponse) -> LocalResponse {
    let code = local.grpc_status.unwrap_or(match local.status {
        400 => 13,
        401 => 16,
        403 => 7,
        404 => 12,
        429 | 502..=504 => 14,
        _ => 2,
    });
    let mut headers: Headers = local
        .headers
        .into_iter()
        .filter(|(k, _)| k != "content-type" && k != "grpc-status" && k != "grpc-message")
        .collect();
    headers.push(("content-type".into(), b"application/grpc".to_vec()));
    headers.push(("grpc-status".into(), code.to_string().into_bytes()));
    if !local.body.is_empty() {
        let mut message = String::new();
        for byte in &local.body {
            if (b' '..=b'~').contains(byte) && *byte != b'%' {
                message.push(char::from(*byte));
            } else {
                message.push_str(&format!("%{byte:02X}"));
            }
        }
        headers.push(("grpc-message".into(), message.into_bytes()));
    }
    LocalResponse {
        status: 200,
        details: local.details,
        headers,
        body: Vec::new(),
        grpc_status: Some(code),
    }
}

/// Drives one stream step by step; every step runs the callbacks it
/// triggers and the deferred events they cause.
pub struct StreamHandle<'h> {
    host: &'h mut Host,
    id: StreamId,
}

fn to_headers(pairs: &[(&str, &str)]) -> Headers {
    pairs
        .iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v.as_bytes().to_vec()))
        .collect()
}

impl StreamHandle<'_> {
    /// The stream's id.
    pub fn id(&self) -> StreamId {
        self.id
    }

    /// The host (to complete callouts, advance time, read metrics).
    pub fn host(&mut self) -> &mut Host {
        self.host
    }

    /// Client sends request headers.
    pub fn request_headers(&mut self, headers: &[(&str, &str)], end_of_stream: bool) -> &mut Self {
        self.host
            .deliver_headers(self.id, false, to_headers(headers), end_of_stream);
        self
    }

    /// Client sends a request body chunk.
    pub fn request_body(&mut self, chunk: &[u8], end_of_stream: bool) -> &mut Self {
        self.host
            .deliver_data(self.id, false, chunk.to_vec(), end_of_stream);
        self
    }

    /// Upstream sends response headers (`:status` included).
    pub fn response_headers(&mut self, headers: &[(&str, &str)], end_of_stream: bool) -> &mut Self {
        self.host
            .deliver_headers(self.id, true, to_headers(headers), end_of_stream);
        self
    }

    /// Upstream sends a response body chunk.
    pub fn response_body(&mut self, chunk: &[u8], end_of_stream: bool) -> &mut Self {
        self.host
            .deliver_data(self.id, true, chunk.to_vec(), end_of_stream);
        self
    }

    /// The connection resets (client gone, upstream reset).
    pub fn reset(&mut self) -> &mut Self {
        self.host.reset(self.id);
        self
    }

    /// What has reached the upstream so far.
    pub fn upstream(&self) -> Output {
        self.host
            .upstream_output(self.id)
            .cloned()
            .unwrap_or_default()
    }

    /// What has reached the client so far.
    pub fn client(&self) -> Output {
        self.host
            .client_output(self.id)
            .cloned()
            .unwrap_or_default()
    }

    /// The local response a filter sent, if any.
    pub fn local_response(&self) -> Option<LocalResponse> {
        self.host.local_of(self.id).cloned()
    }

    /// Whether the stream completed (every filter saw `on_done`).
    pub fn finished(&self) -> bool {
        self.host.is_finished(self.id)
    }

    /// A value this stream's filters published as property `path`, in
    /// whichever place the host profile keeps it (see `Host::published`).
    pub fn published(&self, path: &str) -> Option<Vec<u8>> {
        self.host.published(self.id, path)
    }

    /// Filter state (property) of this stream by Envoy key (`wasm.…`).
    pub fn filter_state(&self, key: &str) -> Option<Vec<u8>> {
        self.host
            .world
            .borrow()
            .streams
            .get(&self.id)
            .and_then(|d| d.filter_state.get(key).cloned())
    }
}
