//! The few host calls whose meaning changes when a filter runs as a stage of
//! the fused `zerolayer.wasm` instead of as its own filter. Stages call these
//! instead of `hostcalls`; outside the fused build they are the host calls.
//!
//! In the fused build one filter instance runs every stage, so a stage must
//! not resume the stream itself (later stages would never see the request),
//! must read its own section of the combined configuration, and must tell the
//! fused root how often it wants its tick. The fused filter switches this
//! module into fused mode and acts on what the stages asked for.
//!
//! What the stages of one stream would each ask the host for again is kept
//! per stream in fused mode and served from the VM: the request and
//! response headers (read once per stream), the hand-off values one stage
//! publishes for the next, and the body of the current body callback (read
//! by the first stage that asks, read again after a stage replaced it).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, Status};
use zerolayer_core::headers::HeaderBlock;

thread_local! {
    static FUSED: Cell<bool> = const { Cell::new(false) };
    /// The configuration section the stage being configured reads.
    static CONFIGURATION: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
    /// The tick period the stage being configured asked for.
    static TICK: Cell<Option<Duration>> = const { Cell::new(None) };
    /// The stream host calls currently act on (fused mode).
    static EFFECTIVE: Cell<u32> = const { Cell::new(0) };
    /// The body the current callback's stages read (which buffer, its
    /// bytes): valid for one host callback only, so kept once, not per
    /// stream.
    static BODY: RefCell<Option<(BufferType, Vec<u8>)>> = const { RefCell::new(None) };
    /// The callbacks the stage running now said it is done with (bits of
    /// [`Callback`]).
    static DONE_WITH: Cell<u8> = const { Cell::new(0) };
    /// Streams a stage asked to resume, in order.
    static RESUMES: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// What the stages share per stream, by stream: found by id, so the
    /// cost of a read does not grow with the streams in flight.
    static STREAMS: RefCell<StreamMap<Shared>> = RefCell::new(StreamMap::default());
}

/// A map by stream (context) id. Every shared header read looks its stream
/// up: ids are the host's small integers, not attacker input, so a
/// multiplicative hash replaces SipHash's cost.
pub type StreamMap<V> = HashMap<u32, V, BuildHasherDefault<StreamIdHasher>>;

/// Fibonacci hashing of a context id (see [`StreamMap`]).
#[derive(Default)]
pub struct StreamIdHasher(u64);

impl Hasher for StreamIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*byte)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, id: u32) {
        self.0 = u64::from(id).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// What the stages of one stream would each ask the host for again.
#[derive(Default)]
struct Shared {
    /// Hand-off values (`wasmx.*` paths) the stages published.
    handoffs: Vec<(String, Vec<u8>)>,
    /// The request headers, once read.
    request_headers: Option<HeaderBlock>,
    /// The response headers, once read.
    response_headers: Option<HeaderBlock>,
    /// A stage answered the request (a local response).
    answered: bool,
}

impl Shared {
    fn headers(&mut self, map: MapType) -> &mut Option<HeaderBlock> {
        match map {
            MapType::HttpResponseHeaders => &mut self.response_headers,
            _ => &mut self.request_headers,
        }
    }
}

/// Runs `f` on the current stream's shared state, if it has any (fused
/// mode only).
fn with_shared<T>(f: impl FnOnce(&mut Shared) -> T) -> Option<T> {
    if !is_fused() {
        return None;
    }
    let id = EFFECTIVE.with(Cell::get);
    STREAMS.with(|s| s.borrow_mut().get_mut(&id).map(f))
}

/// Fused filter: the host is about to call into stream `context_id` for
/// the first time; its stages start sharing from here.
pub fn open_stream(context_id: u32) {
    STREAMS.with(|s| s.borrow_mut().insert(context_id, Shared::default()));
}

/// Fused mode: a stage answered the current stream itself (a local
/// response). The request has nothing left for the stages then; Envoy sends
/// no more request callbacks, ngx_wasm_module may (the body step), which the
/// fused filter lets through.
pub(crate) fn answered() {
    with_shared(|shared| shared.answered = true);
}

/// Fused mode: whether a stage answered the current stream (see [`answered`]).
pub fn was_answered() -> bool {
    with_shared(|shared| shared.answered).unwrap_or(false)
}

/// Fused mode: remembers hand-off `path` = `value` for the current stream.
pub(crate) fn remember_handoff(path: &str, value: &[u8]) {
    if !path.starts_with(zerolayer_core::internal::HANDOFF_PREFIX) {
        return;
    }
    with_shared(
        |shared| match shared.handoffs.iter_mut().find(|(p, _)| p == path) {
            Some(entry) => entry.1 = value.to_vec(),
            None => shared.handoffs.push((path.to_string(), value.to_vec())),
        },
    );
}

/// Fused mode: a hand-off value a stage published for the current stream.
pub(crate) fn handoff(path: &str) -> Option<Vec<u8>> {
    with_shared(|shared| {
        shared
            .handoffs
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, v)| v.clone())
    })
    .flatten()
}

/// Fused filter: stream `context_id` is gone; forgets what its stages shared.
pub fn leave_stream(context_id: u32) {
    STREAMS.with(|s| s.borrow_mut().remove(&context_id));
    forget_body();
}

/// Fused filter: reads the current stream's `map` (request or response
/// headers) once, for every stage's header reads.
pub fn read_headers(map: MapType) {
    // Unreadable: the stages ask the host header by header instead.
    let headers = crate::host_map::read(map).ok();
    with_shared(|shared| *shared.headers(map) = headers);
}

/// Runs `f` on the current stream's copy of `map`, if read.
pub(crate) fn with_headers<T>(map: MapType, f: impl FnOnce(&mut HeaderBlock) -> T) -> Option<T> {
    with_headers_or(map, f).ok()
}

/// Runs `f` on the current stream's copy of `map` if there is one; gives
/// `f` back otherwise, so the caller can run it on the host's headers.
/// `f` must not call back into this module (the shared state is borrowed).
pub(crate) fn with_headers_or<T, F: FnOnce(&mut HeaderBlock) -> T>(
    map: MapType,
    f: F,
) -> Result<T, F> {
    if !is_fused() {
        return Err(f);
    }
    let id = EFFECTIVE.with(Cell::get);
    STREAMS.with(|s| {
        let mut streams = s.borrow_mut();
        match streams
            .get_mut(&id)
            .and_then(|shared| shared.headers(map).as_mut())
        {
            Some(headers) => Ok(f(headers)),
            None => Err(f),
        }
    })
}

/// Runs `f` on the first `size` bytes of body `buffer`. In fused mode the
/// body is read from the host by the first stage that asks in a callback
/// and served from the VM to the others.
pub(crate) fn with_body<T>(buffer: BufferType, size: usize, f: impl FnOnce(&[u8]) -> T) -> T {
    let read = || {
        hostcalls::get_buffer(buffer, 0, size)
            .ok()
            .flatten()
            .unwrap_or_default()
    };
    if !is_fused() {
        return f(&read());
    }
    BODY.with(|slot| {
        // Held while `f` runs: a body read from inside `f` goes to the host.
        let Ok(mut slot) = slot.try_borrow_mut() else {
            return f(&read());
        };
        if !matches!(&*slot, Some((kept, _)) if *kept == buffer) {
            *slot = Some((buffer, read()));
        }
        let body = slot.as_ref().map_or(&[][..], |(_, bytes)| bytes.as_slice());
        f(body.get(..size).unwrap_or(body))
    })
}

/// Fused mode: a stage replaced (part of) a body; the stages after it read
/// the host's new body (rare: a rewritten request, a stripped usage chunk).
pub(crate) fn body_replaced() {
    forget_body();
}

/// Forgets the body read in the last callback: the host's may have changed
/// (a new chunk arrived, more was buffered) since.
fn forget_body() {
    BODY.with(|slot| {
        if let Ok(mut slot) = slot.try_borrow_mut() {
            *slot = None;
        }
    });
}

/// Callbacks a stage can be done with before its stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Callback {
    /// `on_http_request_body`.
    RequestBody,
    /// `on_http_response_body`.
    ResponseBody,
}

impl Callback {
    fn bit(self) -> u8 {
        match self {
            Callback::RequestBody => 1,
            Callback::ResponseBody => 2,
        }
    }
}

/// The current stream's stage says it will do nothing in `callback` from
/// now on (it would return `Continue` and touch nothing): in the fused
/// filter that stage is no longer called for it, so a long response's
/// chunks skip the stages that no longer look at them. As its own filter
/// the stage is still called (Envoy has no such signal); nothing changes.
pub fn done_with(callback: Callback) {
    if is_fused() {
        DONE_WITH.with(|d| d.set(d.get() | callback.bit()));
    }
}

/// The callbacks one stage of one stream is done with.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DoneWith(u8);

impl DoneWith {
    /// Whether the stage said it is done with `callback`.
    pub fn contains(self, callback: Callback) -> bool {
        self.0 & callback.bit() != 0
    }
}

/// Fused filter: runs one stage's callback `f` and adds what it said it is
/// done with (see [`done_with`]) to `done`.
pub fn run_stage<T>(done: &mut DoneWith, f: impl FnOnce() -> T) -> T {
    // Said outside any stage's callback: nobody's.
    DONE_WITH.with(|d| d.set(0));
    let result = f();
    done.0 |= DONE_WITH.with(|d| d.replace(0));
    result
}

/// Switches this VM into fused mode (the fused filter's entry point).
pub fn enable() {
    FUSED.with(|f| f.set(true));
}

/// Whether this VM runs the fused filter.
pub fn is_fused() -> bool {
    FUSED.with(Cell::get)
}

/// The plugin configuration: the host's, or in fused mode the section of
/// the stage being configured.
pub fn plugin_configuration() -> Vec<u8> {
    if let Some(section) = CONFIGURATION.with(|c| c.borrow().clone()) {
        return section;
    }
    match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
        Ok(Some(bytes)) => bytes,
        _ => Vec::new(),
    }
}

/// Asks for the root's tick every `period`; in fused mode the fused root
/// records it and ticks the stage that often.
pub fn set_tick_period(period: Duration) -> Result<(), Status> {
    if is_fused() {
        TICK.with(|t| t.set(Some(period)));
        return Ok(());
    }
    hostcalls::set_tick_period(period)
}

/// Lets the stream continue after a pause; in fused mode the fused filter
/// first runs the stages after the one that paused.
pub fn resume_request() -> Result<(), Status> {
    if is_fused() {
        let id = EFFECTIVE.with(Cell::get);
        RESUMES.with(|r| r.borrow_mut().push(id));
        return Ok(());
    }
    if crate::resumes_after_callouts() {
        // The host continues the request itself once the answer returns.
        return Ok(());
    }
    hostcalls::resume_http_request()
}

/// Makes `context_id` the stream later host calls act on (and, in fused
/// mode, the one a [`resume_request`] resumes).
pub fn set_effective_context(context_id: u32) -> Result<(), Status> {
    EFFECTIVE.with(|e| e.set(context_id));
    // Entered from a root callback: what was read in an earlier one is stale.
    forget_body();
    hostcalls::set_effective_context(context_id)
}

/// Fused root: configures a stage with `section` as its configuration and
/// returns what it returned and the tick period it asked for.
pub fn configure_stage(
    section: Vec<u8>,
    configure: impl FnOnce() -> bool,
) -> (bool, Option<Duration>) {
    CONFIGURATION.with(|c| *c.borrow_mut() = Some(section));
    TICK.with(|t| t.set(None));
    let ok = configure();
    CONFIGURATION.with(|c| *c.borrow_mut() = None);
    (ok, TICK.with(Cell::take))
}

/// Fused filter: the host is about to call into stream `context_id`.
pub fn enter_stream(context_id: u32) {
    EFFECTIVE.with(|e| e.set(context_id));
    // Bodies are read per callback: the next one may carry a new chunk.
    forget_body();
}

/// Fused filter: the streams stages asked to resume since the last call.
pub fn take_resumes() -> Vec<u32> {
    RESUMES.with(|r| std::mem::take(&mut *r.borrow_mut()))
}
