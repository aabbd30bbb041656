//! One Wasm VM: a wasmtime store and instance of a module, its contexts,
//! and typed calls into the module's Proxy-Wasm exports.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use anyhow::{Context as _, Result, anyhow};
use wasmtime::{Engine, Instance, Linker, Memory, Module, Store, TypedFunc};

use crate::abi::Action;
use crate::imports;
use crate::world::{CallResponse, StreamId, VmIndex, World};

/// Epoch ticks a single call into a module may take (~5 s) before it traps.
pub(crate) const CALL_DEADLINE_TICKS: u64 = 50;

/// What a context id stands for.
#[derive(Debug, Clone)]
pub(crate) enum ContextKind {
    /// A plugin's root context.
    Root,
    /// A stream's HTTP context for the filter at `filter` in the chain.
    Http {
        root: u32,
        stream: StreamId,
        filter: usize,
    },
}

/// Per-root-context facts host functions need.
#[derive(Debug, Clone)]
pub(crate) struct RootInfo {
    pub plugin_name: String,
    pub root_id: String,
    pub configuration: Vec<u8>,
    pub vm_configuration: Vec<u8>,
    pub tick_period_ms: u32,
    pub next_tick_ns: u64,
}

/// The store's data: what host functions see through `Caller`.
pub(crate) struct VmState {
    pub world: Rc<RefCell<World>>,
    pub index: VmIndex,
    pub vm_id: String,
    pub contexts: HashMap<u32, ContextKind>,
    pub roots: HashMap<u32, RootInfo>,
    /// The context host calls act on (set before each call into the module,
    /// changed by `proxy_set_effective_context`).
    pub current: u32,
    /// The callout response being delivered, during `on_http_call_response`.
    pub call_response: Option<CallResponse>,
    /// Whether the current callback is a response-phase one (Kong limits).
    pub in_response_phase: bool,
    /// Whether the current callback is `on_vm_start` or `on_configure`
    /// (Kong limits: no callouts).
    pub in_configure: bool,
    pub memory: Option<Memory>,
    pub allocate: Option<TypedFunc<i32, i32>>,
    pub rng: u64,
    /// Environment variables (Envoy `vm_config.environment_variables`).
    pub env: Vec<(String, String)>,
    /// Set by `proc_exit`: the module asked to terminate.
    pub exited: Option<i32>,
}

impl VmState {
    /// The plugin name for log lines from the current context.
    pub fn plugin_name(&self) -> String {
        self.root_of(self.current)
            .and_then(|r| self.roots.get(&r))
            .map(|r| r.plugin_name.clone())
            .unwrap_or_default()
    }

    /// The root context a context belongs to.
    pub fn root_of(&self, context: u32) -> Option<u32> {
        match self.contexts.get(&context)? {
            ContextKind::Root => Some(context),
            ContextKind::Http { root, .. } => Some(*root),
        }
    }

    /// The stream and filter position of the current context, if it is an HTTP one.
    pub fn current_stream(&self) -> Option<(StreamId, usize)> {
        match self.contexts.get(&self.current)? {
            ContextKind::Http { stream, filter, .. } => Some((*stream, *filter)),
            ContextKind::Root => None,
        }
    }
}

type F1 = TypedFunc<i32, ()>;
type F2 = TypedFunc<(i32, i32), ()>;
type F2R = TypedFunc<(i32, i32), i32>;
type F3R = TypedFunc<(i32, i32, i32), i32>;
type F1R = TypedFunc<i32, i32>;
type F5 = TypedFunc<(i32, i32, i32, i32, i32), ()>;

/// The module's Proxy-Wasm exports (absent ones are simply not called).
#[derive(Default)]
struct Exports {
    vm_start: Option<F2R>,
    configure: Option<F2R>,
    context_create: Option<F2>,
    request_headers: Option<F3R>,
    request_body: Option<F3R>,
    response_headers: Option<F3R>,
    response_body: Option<F3R>,
    log: Option<F1>,
    done: Option<F1R>,
    delete: Option<F1>,
    tick: Option<F1>,
    queue_ready: Option<F2>,
    http_call_response: Option<F5>,
}

/// Which HTTP callback to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HttpCallback {
    RequestHeaders,
    RequestBody,
    ResponseHeaders,
    ResponseBody,
}

impl HttpCallback {
    /// The callback's name, as the SDK calls it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            HttpCallback::RequestHeaders => "on_request_headers",
            HttpCallback::RequestBody => "on_request_body",
            HttpCallback::ResponseHeaders => "on_response_headers",
            HttpCallback::ResponseBody => "on_response_body",
        }
    }

    pub(crate) fn is_response(self) -> bool {
        matches!(
            self,
            HttpCallback::ResponseHeaders | HttpCallback::ResponseBody
        )
    }
}

/// A module instance.
pub(crate) struct Vm {
    pub store: Store<VmState>,
    exports: Exports,
    next_context: u32,
    /// The module trapped: Envoy stops using a failed VM; so do we.
    pub failed: Option<String>,
}

impl Vm {
    /// Instantiates `module` and runs its start function (`_initialize`).
    pub(crate) fn new(
        engine: &Engine,
        module: &Module,
        world: Rc<RefCell<World>>,
        index: VmIndex,
        vm_id: &str,
        env: Vec<(String, String)>,
    ) -> Result<Vm> {
        let state = VmState {
            world,
            index,
            vm_id: vm_id.to_string(),
            contexts: HashMap::new(),
            roots: HashMap::new(),
            current: 0,
            call_response: None,
            in_response_phase: false,
            in_configure: false,
            memory: None,
            allocate: None,
            rng: 0x9e37_79b9_7f4a_7c15 ^ index as u64,
            env,
            exited: None,
        };
        let mut store = Store::new(engine, state);
        store.set_epoch_deadline(CALL_DEADLINE_TICKS);
        let mut linker: Linker<VmState> = Linker::new(engine);
        imports::define(&mut linker, module)?;
        let instance: Instance = linker
            .instantiate(&mut store, module)
            .map_err(anyhow::Error::from)
            .context("instantiating the module (a missing import fails here)")?;
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or_else(|| anyhow!("the module exports no memory"))?;
        store.data_mut().memory = Some(memory);
        let allocate = instance
            .get_typed_func::<i32, i32>(&mut store, "proxy_on_memory_allocate")
            .or_else(|_| instance.get_typed_func::<i32, i32>(&mut store, "malloc"))
            .map_err(anyhow::Error::from)
            .context("the module exports neither proxy_on_memory_allocate nor malloc")?;
        store.data_mut().allocate = Some(allocate);

        macro_rules! export {
            ($name:literal) => {
                instance.get_typed_func(&mut store, $name).ok()
            };
        }
        let exports = Exports {
            vm_start: export!("proxy_on_vm_start"),
            configure: export!("proxy_on_configure"),
            context_create: export!("proxy_on_context_create"),
            request_headers: export!("proxy_on_request_headers"),
            request_body: export!("proxy_on_request_body"),
            response_headers: export!("proxy_on_response_headers"),
            response_body: export!("proxy_on_response_body"),
            log: export!("proxy_on_log"),
            done: export!("proxy_on_done"),
            delete: export!("proxy_on_delete"),
            tick: export!("proxy_on_tick"),
            queue_ready: export!("proxy_on_queue_ready"),
            http_call_response: export!("proxy_on_http_call_response"),
        };
        let start = instance
            .get_typed_func::<(), ()>(&mut store, "_initialize")
            .or_else(|_| instance.get_typed_func::<(), ()>(&mut store, "_start"));
        let mut vm = Vm {
            store,
            exports,
            next_context: 1,
            failed: None,
        };
        if let Ok(start) = start {
            start
                .call(&mut vm.store, ())
                .map_err(anyhow::Error::from)
                .context("the module's start function trapped")?;
        }
        Ok(vm)
    }

    /// Numbers this VM's contexts on from where `old` stopped, so that no
    /// id of a stream still in flight on `old` names a context here.
    pub(crate) fn continue_context_ids(&mut self, old: &Vm) {
        self.next_context = self.next_context.max(old.next_context);
    }

    fn next_id(&mut self) -> u32 {
        let id = self.next_context;
        self.next_context += 1;
        id
    }

    /// Creates a root context for a plugin, runs `on_vm_start` and
    /// `on_configure`. Returns the root context id, or the reason
    /// configuration was refused. `on_vm_start` runs for every root context
    /// a VM starts, as both hosts do (proxy-wasm-cpp-host's
    /// `ContextBase::onStart`; ngx_wasm_module's root start), not once per VM.
    pub(crate) fn add_root(&mut self, info: RootInfo) -> Result<u32> {
        let id = self.next_id();
        let config_size = info.configuration.len() as i32;
        let vm_config_size = info.vm_configuration.len() as i32;
        self.store.data_mut().contexts.insert(id, ContextKind::Root);
        self.store.data_mut().roots.insert(id, info);
        self.call_unit(id, |vm| match &vm.exports.context_create {
            Some(f) => f.call(&mut vm.store, (id as i32, 0)),
            None => Ok(()),
        })?;
        // ngx_wasm_module refuses callouts from both (Kong profile).
        self.store.data_mut().in_configure = true;
        let configured = self.start_and_configure(id, vm_config_size, config_size);
        self.store.data_mut().in_configure = false;
        configured?;
        Ok(id)
    }

    /// `on_vm_start` and `on_configure` of root `id`.
    fn start_and_configure(
        &mut self,
        id: u32,
        vm_config_size: i32,
        config_size: i32,
    ) -> Result<()> {
        let ok = self.call_i32(id, |vm| match &vm.exports.vm_start {
            Some(f) => f.call(&mut vm.store, (id as i32, vm_config_size)),
            None => Ok(1),
        })?;
        if ok == 0 {
            return Err(anyhow!("on_vm_start returned false"));
        }
        let ok = self.call_i32(id, |vm| match &vm.exports.configure {
            Some(f) => f.call(&mut vm.store, (id as i32, config_size)),
            None => Ok(1),
        })?;
        if ok == 0 {
            return Err(anyhow!("on_configure returned false"));
        }
        Ok(())
    }

    /// Creates the HTTP context for filter `filter` of `stream`.
    pub(crate) fn create_http_context(
        &mut self,
        root: u32,
        stream: StreamId,
        filter: usize,
    ) -> Result<u32> {
        let id = self.next_id();
        self.store.data_mut().contexts.insert(
            id,
            ContextKind::Http {
                root,
                stream,
                filter,
            },
        );
        self.call_unit(id, |vm| match &vm.exports.context_create {
            Some(f) => f.call(&mut vm.store, (id as i32, root as i32)),
            None => Ok(()),
        })?;
        Ok(id)
    }

    /// Calls one HTTP callback.
    pub(crate) fn http(
        &mut self,
        context: u32,
        callback: HttpCallback,
        size: usize,
        end_of_stream: bool,
    ) -> Result<Action> {
        self.store.data_mut().in_response_phase = callback.is_response();
        let size = size as i32;
        let eos = i32::from(end_of_stream);
        let raw = self.call_i32(context, |vm| {
            let e = &vm.exports;
            match callback {
                HttpCallback::RequestHeaders => call3(
                    &e.request_headers,
                    &mut vm.store,
                    (context as i32, size, eos),
                ),
                HttpCallback::RequestBody => {
                    call3(&e.request_body, &mut vm.store, (context as i32, size, eos))
                }
                HttpCallback::ResponseHeaders => call3(
                    &e.response_headers,
                    &mut vm.store,
                    (context as i32, size, eos),
                ),
                HttpCallback::ResponseBody => {
                    call3(&e.response_body, &mut vm.store, (context as i32, size, eos))
                }
            }
        });
        self.store.data_mut().in_response_phase = false;
        Ok(Action::from_raw(raw?))
    }

    /// `on_log`, `on_done`, `on_delete` for a finished stream's context.
    pub(crate) fn finish_context(&mut self, context: u32) {
        // `on_log` is a response phase for Kong's limits (no callouts).
        self.store.data_mut().in_response_phase = true;
        let _ = self.call_unit(context, |vm| match &vm.exports.log {
            Some(f) => f.call(&mut vm.store, context as i32),
            None => Ok(()),
        });
        self.store.data_mut().in_response_phase = false;
        let _ = self.call_i32(context, |vm| match &vm.exports.done {
            Some(f) => f.call(&mut vm.store, context as i32),
            None => Ok(1),
        });
        let _ = self.call_unit(context, |vm| match &vm.exports.delete {
            Some(f) => f.call(&mut vm.store, context as i32),
            None => Ok(()),
        });
        self.store.data_mut().contexts.remove(&context);
    }

    /// `on_done` for a root context (host shutdown).
    pub(crate) fn done_root(&mut self, root: u32) {
        let _ = self.call_i32(root, |vm| match &vm.exports.done {
            Some(f) => f.call(&mut vm.store, root as i32),
            None => Ok(1),
        });
    }

    pub(crate) fn tick(&mut self, root: u32) -> Result<()> {
        self.call_unit(root, |vm| match &vm.exports.tick {
            Some(f) => f.call(&mut vm.store, root as i32),
            None => Ok(()),
        })
    }

    pub(crate) fn queue_ready(&mut self, root: u32, queue: u32) -> Result<()> {
        self.call_unit(root, |vm| match &vm.exports.queue_ready {
            Some(f) => f.call(&mut vm.store, (root as i32, queue as i32)),
            None => Ok(()),
        })
    }

    pub(crate) fn http_call_response(
        &mut self,
        context: u32,
        token: u32,
        response: CallResponse,
    ) -> Result<()> {
        let counts = (
            response.headers.len() as i32,
            response.body.len() as i32,
            response.trailers.len() as i32,
        );
        self.store.data_mut().call_response = Some(response);
        let result = self.call_unit(context, |vm| match &vm.exports.http_call_response {
            Some(f) => f.call(
                &mut vm.store,
                (context as i32, token as i32, counts.0, counts.1, counts.2),
            ),
            None => Ok(()),
        });
        self.store.data_mut().call_response = None;
        result
    }

    /// Whether `context` still exists (streams end; callouts may outlive them).
    pub(crate) fn has_context(&self, context: u32) -> bool {
        self.store.data().contexts.contains_key(&context)
    }

    fn enter(&mut self, context: u32) -> Result<()> {
        if let Some(reason) = &self.failed {
            return Err(anyhow!("VM failed earlier: {reason}"));
        }
        self.store.data_mut().current = context;
        self.store.set_epoch_deadline(CALL_DEADLINE_TICKS);
        Ok(())
    }

    fn call_i32(
        &mut self,
        context: u32,
        f: impl FnOnce(&mut Vm) -> wasmtime::Result<i32>,
    ) -> Result<i32> {
        self.enter(context)?;
        f(self).map_err(|trap| self.fail(trap))
    }

    fn call_unit(
        &mut self,
        context: u32,
        f: impl FnOnce(&mut Vm) -> wasmtime::Result<()>,
    ) -> Result<()> {
        self.enter(context)?;
        f(self).map_err(|trap| self.fail(trap))
    }

    fn fail(&mut self, trap: wasmtime::Error) -> anyhow::Error {
        let reason = format!("{trap:#}");
        let plugin = self.store.data().plugin_name();
        self.store.data().world.borrow_mut().log(
            &plugin,
            crate::abi::LogLevel::Critical,
            format!("VM trapped and is now failed: {reason}"),
        );
        self.failed = Some(reason.clone());
        anyhow!("the module trapped: {reason}")
    }
}

fn call3(
    f: &Option<F3R>,
    store: &mut Store<VmState>,
    args: (i32, i32, i32),
) -> wasmtime::Result<i32> {
    match f {
        Some(f) => f.call(store, args),
        None => Ok(0),
    }
}
