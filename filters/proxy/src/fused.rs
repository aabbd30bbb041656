//! The few host calls whose meaning changes when a filter runs as a stage of
//! the fused `zerolayer.wasm` instead of as its own filter. Stages call these
//! instead of `hostcalls`; outside the fused build they are the host calls.
//!
//! In the fused build one filter instance runs every stage, so a stage must
//! not resume the stream itself (later stages would never see the request),
//! must read its own section of the combined configuration, and must tell the
//! fused root how often it wants its tick. The fused filter switches this
//! module into fused mode and acts on what the stages asked for.

use std::cell::{Cell, RefCell};
use std::time::Duration;

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, Status};

thread_local! {
    static FUSED: Cell<bool> = const { Cell::new(false) };
    /// The configuration section the stage being configured reads.
    static CONFIGURATION: RefCell<Option<Vec<u8>>> = const { RefCell::new(None) };
    /// The tick period the stage being configured asked for.
    static TICK: Cell<Option<Duration>> = const { Cell::new(None) };
    /// The stream host calls currently act on (fused mode).
    static EFFECTIVE: Cell<u32> = const { Cell::new(0) };
    /// Streams a stage asked to resume, in order.
    static RESUMES: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// Hand-off values the stages published, by stream: later stages read
    /// them here instead of asking the host (a property read per hand-off
    /// per stage is a host call each).
    static HANDOFFS: RefCell<Vec<(u32, String, Vec<u8>)>> = const { RefCell::new(Vec::new()) };
}

/// Fused mode: remembers hand-off `path` = `value` for the current stream.
pub(crate) fn remember_handoff(path: &str, value: &[u8]) {
    if !is_fused() || !path.starts_with(zerolayer_core::internal::HANDOFF_PREFIX) {
        return;
    }
    let id = EFFECTIVE.with(Cell::get);
    HANDOFFS.with(|h| {
        let mut h = h.borrow_mut();
        match h.iter_mut().find(|(i, p, _)| *i == id && p == path) {
            Some(entry) => entry.2 = value.to_vec(),
            None => h.push((id, path.to_string(), value.to_vec())),
        }
    });
}

/// Fused mode: a hand-off value a stage published for the current stream.
pub(crate) fn handoff(path: &str) -> Option<Vec<u8>> {
    if !is_fused() {
        return None;
    }
    let id = EFFECTIVE.with(Cell::get);
    HANDOFFS.with(|h| {
        h.borrow()
            .iter()
            .find(|(i, p, _)| *i == id && p == path)
            .map(|(_, _, v)| v.clone())
    })
}

/// Fused filter: stream `context_id` is gone; forgets its hand-offs and
/// headers.
pub fn leave_stream(context_id: u32) {
    HANDOFFS.with(|h| h.borrow_mut().retain(|(i, _, _)| *i != context_id));
    HEADERS.with(|h| h.borrow_mut().retain(|(i, _, _)| *i != context_id));
}

/// Header pairs, as the host gives them.
type Headers = Vec<(String, Vec<u8>)>;

thread_local! {
    /// The request and response headers, each read once per stream for
    /// all stages: (stream, map, pairs).
    static HEADERS: RefCell<Vec<(u32, MapType, Headers)>> = const { RefCell::new(Vec::new()) };
}

/// Fused filter: reads the current stream's `map` (request or response
/// headers) once, for every stage's header reads.
pub fn read_headers(map: MapType) {
    let id = EFFECTIVE.with(Cell::get);
    let headers = hostcalls::get_map_bytes(map).unwrap_or_default();
    HEADERS.with(|h| {
        let mut h = h.borrow_mut();
        h.retain(|(i, m, _)| !(*i == id && *m == map));
        h.push((id, map, headers));
    });
}

/// Runs `f` on the current stream's copy of `map`, if read.
pub(crate) fn with_headers<T>(map: MapType, f: impl FnOnce(&mut Headers) -> T) -> Option<T> {
    if !is_fused() {
        return None;
    }
    let id = EFFECTIVE.with(Cell::get);
    HEADERS.with(|h| {
        h.borrow_mut()
            .iter_mut()
            .find(|(i, m, _)| *i == id && *m == map)
            .map(|(_, _, headers)| f(headers))
    })
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
    hostcalls::resume_http_request()
}

/// Makes `context_id` the stream later host calls act on (and, in fused
/// mode, the one a [`resume_request`] resumes).
pub fn set_effective_context(context_id: u32) -> Result<(), Status> {
    EFFECTIVE.with(|e| e.set(context_id));
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
}

/// Fused filter: the streams stages asked to resume since the last call.
pub fn take_resumes() -> Vec<u32> {
    RESUMES.with(|r| std::mem::take(&mut *r.borrow_mut()))
}
