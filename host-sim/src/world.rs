//! Process-wide state every VM of a host sees, with Envoy's semantics:
//! shared data per `vm_id` with CAS, shared queues addressed by
//! (`vm_id`, name), metrics by name, the clock, logs, pending callouts and
//! the events host functions defer until the current VM call returns.

use std::collections::{BTreeMap, HashMap, VecDeque};

use crate::abi::{Headers, LogLevel, MetricType, Status};
use crate::metrics::Metrics;

/// Index of a VM in its host.
pub type VmIndex = usize;
/// A stream (one HTTP request through a chain).
pub type StreamId = u64;

/// One line a module logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine {
    /// The plugin's name (empty for output before any root context exists).
    pub plugin: String,
    /// Level.
    pub level: LogLevel,
    /// Message text.
    pub message: String,
}

/// An HTTP callout a module dispatched.
#[derive(Debug, Clone)]
pub struct Callout {
    /// The token the module got back.
    pub token: u32,
    /// The cluster (`upstream`) named in the call.
    pub cluster: String,
    /// Request headers, pseudo-headers included.
    pub headers: Headers,
    /// Request body.
    pub body: Vec<u8>,
    /// Request trailers.
    pub trailers: Headers,
    /// Timeout the module asked for.
    pub timeout_ms: u32,
    /// Host time (ns) at dispatch.
    pub dispatched_at_ns: u64,
    pub(crate) vm: VmIndex,
    pub(crate) context: u32,
}

impl Callout {
    /// The first value of header `name`.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }
}

/// How a callout ended, as delivered to `on_http_call_response`.
#[derive(Debug, Clone, Default)]
pub struct CallResponse {
    /// Response headers (`:status` included); empty on failure or timeout.
    pub headers: Headers,
    /// Body.
    pub body: Vec<u8>,
    /// Trailers.
    pub trailers: Headers,
    /// Why the call got no answer, where the host says so (ngx_wasm_module's
    /// `:dispatch_status`: `timeout`, `broken connection`, `resolver
    /// failure`); `None` for an answer or a silent failure.
    pub failure: Option<String>,
}

impl CallResponse {
    /// A response with `status` and `body`.
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> Self {
        CallResponse {
            headers: vec![(":status".into(), status.to_string().into_bytes())],
            body: body.into(),
            trailers: vec![],
            failure: None,
        }
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers
            .push((name.to_ascii_lowercase(), value.as_bytes().to_vec()));
        self
    }

    /// What Envoy delivers when the call failed (reset, timeout, no host):
    /// no headers, no body.
    pub fn failure() -> Self {
        CallResponse::default()
    }

    /// A failed call with the host's reason for it (under the Kong profile
    /// the module reads it as `:dispatch_status`).
    pub fn failed(reason: &str) -> Self {
        CallResponse {
            failure: Some(reason.to_string()),
            ..CallResponse::default()
        }
    }
}

/// Work a host function defers until the current VM call has returned
/// (Envoy does the same: it posts these to the dispatcher).
#[derive(Debug, Clone)]
pub enum Event {
    /// `on_queue_ready` for the queue's owner.
    QueueReady {
        /// The owning VM.
        vm: VmIndex,
        /// Its root context.
        root_context: u32,
        /// The queue.
        queue: u32,
    },
    /// A filter resumed its stream (`proxy_continue_stream`).
    Resume {
        /// The stream.
        stream: StreamId,
        /// Filter position in the chain.
        filter: usize,
        /// Request (`false`) or response (`true`) direction.
        response: bool,
    },
    /// A filter sent a local response.
    LocalResponse {
        /// The stream.
        stream: StreamId,
        /// Filter position in the chain.
        filter: usize,
    },
    /// A filter closed/reset its stream.
    Reset {
        /// The stream.
        stream: StreamId,
    },
    /// A new callout waits for completion.
    Dispatched {
        /// Its token.
        token: u32,
    },
}

/// A local response a filter sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    /// Status code.
    pub status: u16,
    /// Status code details (Envoy's `response.code_details`).
    pub details: String,
    /// Extra headers.
    pub headers: Headers,
    /// Body.
    pub body: Vec<u8>,
    /// The gRPC status the filter asked for (`proxy_send_local_response`'s
    /// last argument, when not negative). Envoy answers a gRPC request's
    /// local response in gRPC form, with this status or one mapped from
    /// `status`.
    pub grpc_status: Option<u32>,
}

/// Facts about a stream's connection and timing (Envoy attributes).
#[derive(Debug, Clone)]
pub struct StreamInfo {
    /// Downstream peer, `ip:port`.
    pub source: std::net::SocketAddr,
    /// Listener address, `ip:port`.
    pub destination: std::net::SocketAddr,
    /// Request start, ns since the epoch.
    pub start_ns: u64,
    /// Connection id.
    pub connection_id: u64,
}

impl Default for StreamInfo {
    fn default() -> Self {
        StreamInfo {
            source: std::net::SocketAddr::from(([127, 0, 0, 1], 40000)),
            destination: std::net::SocketAddr::from(([127, 0, 0, 1], 10000)),
            start_ns: 0,
            connection_id: 1,
        }
    }
}

/// A stream's data, shared by all the filters of its chain (which may live
/// in different VMs): header maps, the body buffer of the callback in
/// progress, filter state, and a local response if one was sent.
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamData {
    pub request_headers: Headers,
    pub request_trailers: Headers,
    pub response_headers: Option<Headers>,
    pub response_trailers: Headers,
    pub request_body: Vec<u8>,
    pub response_body: Vec<u8>,
    /// Filter state by key (Envoy: `wasm.<path>`; Kong: `wasmx.*`).
    pub filter_state: BTreeMap<String, Vec<u8>>,
    pub local_response: Option<LocalResponse>,
    pub info: StreamInfo,
    /// (filter index, response?) whose headers map the filter may still
    /// touch: Envoy keeps a filter's map only while its headers callback
    /// runs, or after it stopped iteration; `Continue` drops it.
    pub held_headers: std::collections::BTreeSet<(usize, bool)>,
    /// The stream is in its access-log phase (`on_log`): Envoy hands every
    /// filter both header maps again.
    pub logging: bool,
}

/// A registered shared queue.
#[derive(Debug, Clone)]
pub(crate) struct Queue {
    pub vm_id: String,
    pub name: String,
    /// The VM and root context that registered it last (they get `on_queue_ready`).
    pub owner: (VmIndex, u32),
    pub items: VecDeque<Vec<u8>>,
}

/// Host behaviour that differs between proxies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Profile {
    /// Envoy 1.40's behaviour (the reference).
    #[default]
    Envoy,
    /// ngx_wasm_module's limits (Kong): no `resolve_shared_queue`, no
    /// `on_queue_ready`, no callouts from response phases, CAS required to
    /// overwrite shared data.
    Kong,
}

/// The clock: virtual (tests advance it) or the machine's.
#[derive(Debug, Clone, Copy)]
pub enum Clock {
    /// Nanoseconds since the epoch, moved only by the host.
    Virtual(u64),
    /// The system clock.
    Real,
}

impl Clock {
    /// Current time, ns since the Unix epoch.
    pub fn now_ns(&self) -> u64 {
        match self {
            Clock::Virtual(ns) => *ns,
            Clock::Real => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0),
        }
    }
}

/// Everything process-wide.
#[derive(Debug)]
pub struct World {
    pub(crate) profile: Profile,
    pub(crate) clock: Clock,
    /// vm_id → key → (value, cas).
    pub(crate) shared_data: HashMap<String, BTreeMap<String, (Vec<u8>, u32)>>,
    next_cas: u32,
    pub(crate) queues: Vec<Queue>,
    pub(crate) metrics: Metrics,
    pub(crate) logs: Vec<LogLine>,
    pub(crate) callouts: BTreeMap<u32, Callout>,
    next_token: u32,
    pub(crate) events: VecDeque<Event>,
    /// Echo module log lines to stderr as they arrive.
    pub(crate) echo_logs: bool,
    pub(crate) streams: HashMap<StreamId, StreamData>,
    /// Cluster names `dispatch_http_call` may target.
    pub(crate) clusters: std::collections::HashSet<String>,
    /// Kong: the queues the operator declared (`shm_queue`).
    pub(crate) kong_queues: Vec<String>,
    /// Kong: Kong Gateway's build (host properties under `kong.`).
    pub(crate) kong_gateway: bool,
    /// Kong: capacity of each declared queue, bytes.
    pub(crate) kong_queue_bytes: usize,
    /// Kong: larger request bodies are in a file filters cannot read.
    pub(crate) kong_body_buffer_bytes: Option<usize>,
    /// Host calls by plugin and function, while counting is on.
    pub(crate) host_calls: Option<BTreeMap<(String, &'static str), u64>>,
    /// Envoy: the per-stream buffer limit a filter's buffered body may not
    /// exceed (`HostOptions::buffer_limit_bytes`).
    pub(crate) buffer_limit: Option<usize>,
}

impl World {
    pub(crate) fn new(profile: Profile, clock: Clock) -> Self {
        World {
            profile,
            clock,
            shared_data: HashMap::new(),
            next_cas: 1,
            queues: Vec::new(),
            metrics: Metrics::default(),
            logs: Vec::new(),
            callouts: BTreeMap::new(),
            next_token: 1,
            events: VecDeque::new(),
            echo_logs: false,
            streams: HashMap::new(),
            clusters: std::collections::HashSet::new(),
            kong_queues: Vec::new(),
            kong_gateway: false,
            kong_queue_bytes: usize::MAX,
            kong_body_buffer_bytes: None,
            host_calls: None,
            buffer_limit: None,
        }
    }

    /// Reads shared data: value and CAS, or `NotFound`.
    pub(crate) fn get_shared(&self, vm_id: &str, key: &str) -> Result<(Vec<u8>, u32), Status> {
        self.shared_data
            .get(self.kv_namespace(vm_id))
            .and_then(|m| m.get(key))
            .cloned()
            .ok_or(Status::NotFound)
    }

    /// Writes shared data. `cas == 0` overwrites (Envoy) or, under the Kong
    /// profile, only creates; a non-zero CAS must match the key's current one
    /// (a missing key is created whatever the CAS, as proxy-wasm-cpp-host does).
    pub(crate) fn set_shared(&mut self, vm_id: &str, key: &str, value: &[u8], cas: u32) -> Status {
        let namespace = self.kv_namespace(vm_id).to_string();
        let map = self.shared_data.entry(namespace).or_default();
        let current = map.get(key).map(|(_, c)| *c);
        match (cas, current) {
            (0, Some(_)) if self.profile == Profile::Kong => return Status::CasMismatch,
            (0, _) | (_, None) => {}
            (want, Some(have)) if want == have => {}
            _ => return Status::CasMismatch,
        }
        let cas = self.next_cas;
        self.next_cas = self.next_cas.wrapping_add(1).max(1);
        map.insert(key.to_string(), (value.to_vec(), cas));
        Status::Ok
    }

    /// Shared data's namespace: Envoy keeps one per `vm_id`; Kong has one
    /// key/value zone for the whole gateway (keys without `ns/`).
    fn kv_namespace<'a>(&self, vm_id: &'a str) -> &'a str {
        match self.profile {
            Profile::Envoy => vm_id,
            Profile::Kong => "",
        }
    }

    /// Registers (or re-owns) queue (`vm_id`, `name`); returns its id. Kong
    /// addresses queues by name alone, and only those the operator declared
    /// (`shm_queue`): anything else is an error (ngx_wasm_module traps).
    pub(crate) fn register_queue(
        &mut self,
        vm_id: &str,
        name: &str,
        owner: (VmIndex, u32),
    ) -> Result<u32, String> {
        let vm_id = match self.profile {
            Profile::Envoy => vm_id,
            Profile::Kong => {
                if !self.kong_queues.iter().any(|q| q == name) {
                    return Err(format!(
                        "shared queue \"{name}\" is not declared (Kong: `shm_queue {name} <size>;` in the wasm{{}} block)"
                    ));
                }
                ""
            }
        };
        if let Some(i) = self
            .queues
            .iter()
            .position(|q| q.vm_id == vm_id && q.name == name)
        {
            self.queues[i].owner = owner;
            return Ok(queue_id(i));
        }
        self.queues.push(Queue {
            vm_id: vm_id.to_string(),
            name: name.to_string(),
            owner,
            items: VecDeque::new(),
        });
        Ok(queue_id(self.queues.len() - 1))
    }

    pub(crate) fn resolve_queue(&self, vm_id: &str, name: &str) -> Option<u32> {
        self.queues
            .iter()
            .position(|q| q.vm_id == vm_id && q.name == name)
            .map(queue_id)
    }

    pub(crate) fn queue_mut(&mut self, id: u32) -> Option<&mut Queue> {
        let index = (id as usize).checked_sub(1)?;
        self.queues.get_mut(index)
    }

    /// Enqueues and, on Envoy, schedules `on_queue_ready` for the owner.
    /// `Err` on Kong when the queue is full: ngx_wasm_module traps.
    pub(crate) fn enqueue(&mut self, id: u32, item: &[u8]) -> Result<Status, String> {
        let profile = self.profile;
        let capacity = self.kong_queue_bytes;
        let Some(queue) = self.queue_mut(id) else {
            return Ok(Status::NotFound);
        };
        if profile == Profile::Kong {
            let occupied: usize = queue.items.iter().map(|i| 4 + i.len()).sum();
            if occupied + 4 + item.len() > capacity {
                return Err(format!(
                    "could not enqueue (queue is full): shared queue \"{}\" holds {occupied} of {capacity} bytes",
                    queue.name
                ));
            }
        }
        queue.items.push_back(item.to_vec());
        let (vm, root_context) = queue.owner;
        if profile == Profile::Envoy {
            self.events.push_back(Event::QueueReady {
                vm,
                root_context,
                queue: id,
            });
        }
        Ok(Status::Ok)
    }

    pub(crate) fn dispatch(&mut self, mut callout: Callout) -> u32 {
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(1);
        callout.token = token;
        self.callouts.insert(token, callout);
        self.events.push_back(Event::Dispatched { token });
        token
    }

    pub(crate) fn log(&mut self, plugin: &str, level: LogLevel, message: String) {
        if self.echo_logs {
            eprintln!("[{}] wasm log {plugin}: {message}", level.name());
        }
        self.logs.push(LogLine {
            plugin: plugin.to_string(),
            level,
            message,
        });
    }

    /// Defines (or finds) metric `name`; the id encodes nothing but an index.
    pub(crate) fn define_metric(&mut self, kind: MetricType, name: &str) -> u32 {
        self.metrics.define(kind, name)
    }
}

/// An HTTP date (`Sat, 05 Dec 2026 09:08:51 GMT`) for `ns` since the epoch.
pub fn http_date(ns: u64) -> String {
    httpdate::fmt_http_date(std::time::UNIX_EPOCH + std::time::Duration::from_nanos(ns))
}

/// Queue ids start at 1 so that 0 never names a queue.
fn queue_id(index: usize) -> u32 {
    (index + 1) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_dates() {
        assert_eq!(http_date(0), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(
            http_date(1_796_461_731_000_000_000),
            "Sat, 05 Dec 2026 09:08:51 GMT"
        );
    }

    #[test]
    fn shared_data_cas_follows_envoy() {
        let mut w = World::new(Profile::Envoy, Clock::Virtual(0));
        assert_eq!(w.get_shared("vm", "k"), Err(Status::NotFound));
        assert_eq!(w.set_shared("vm", "k", b"1", 0), Status::Ok);
        let (v, cas) = w.get_shared("vm", "k").unwrap();
        assert_eq!(v, b"1");
        assert_eq!(w.set_shared("vm", "k", b"2", cas + 7), Status::CasMismatch);
        assert_eq!(w.set_shared("vm", "k", b"2", cas), Status::Ok);
        assert_eq!(w.set_shared("vm", "k", b"3", cas), Status::CasMismatch);
        assert_eq!(w.set_shared("vm", "k", b"3", 0), Status::Ok);
        // Keys are per vm_id.
        assert_eq!(w.get_shared("other", "k"), Err(Status::NotFound));
        assert_eq!(w.set_shared("vm", "new", b"x", 5), Status::Ok);
    }

    #[test]
    fn kong_needs_the_cas_to_overwrite() {
        let mut w = World::new(Profile::Kong, Clock::Virtual(0));
        assert_eq!(w.set_shared("vm", "k", b"1", 0), Status::Ok);
        assert_eq!(w.set_shared("vm", "k", b"2", 0), Status::CasMismatch);
        let (_, cas) = w.get_shared("vm", "k").unwrap();
        assert_eq!(w.set_shared("vm", "k", b"2", cas), Status::Ok);
        // One key/value zone for the gateway: vm_ids do not separate keys.
        assert_eq!(
            w.get_shared("other", "k").map(|(v, _)| v),
            Ok(b"2".to_vec())
        );
    }

    #[test]
    fn kong_queues_are_declared_and_named_alone() {
        let mut w = World::new(Profile::Kong, Clock::Virtual(0));
        assert!(w.register_queue("vm", "jobs", (0, 1)).is_err());
        w.kong_queues.push("jobs".into());
        let q = w.register_queue("vm", "jobs", (0, 1)).unwrap();
        assert_eq!(w.register_queue("other-vm", "jobs", (1, 1)), Ok(q));
    }

    #[test]
    fn queues_are_addressed_by_vm_id_and_name_and_notify_the_last_owner() {
        let mut w = World::new(Profile::Envoy, Clock::Virtual(0));
        let q = w.register_queue("observer", "jobs", (0, 1)).unwrap();
        assert_eq!(w.register_queue("observer", "jobs", (3, 7)), Ok(q));
        assert_eq!(w.resolve_queue("observer", "jobs"), Some(q));
        assert_eq!(w.resolve_queue("observer", "other"), None);
        assert_eq!(w.enqueue(q, b"a"), Ok(Status::Ok));
        assert!(matches!(
            w.events.pop_front(),
            Some(Event::QueueReady {
                vm: 3,
                root_context: 7,
                ..
            })
        ));
        assert_eq!(w.enqueue(99, b"a"), Ok(Status::NotFound));
    }
}
