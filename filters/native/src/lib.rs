//! zerolayer native: the Envoy dynamic module (`libzerolayer_native.so`).
//! The Wasm filters stay the portable form (Envoy and Kong, sandboxed);
//! this is the form for Envoy operators who want the layer to cost as
//! little as it can, tied to Envoy's dynamic-module ABI (1.40: `v0.2.0`).
//!
//! Filters (`filter_name`): `zerolayer`, the fused chain's stages on a
//! `zerolayer_host::Host` over this ABI ([`chain`]: configuration and
//! workers, [`stream`]: a request's hooks, [`host`]), the observer
//! on a thread of its own ([`observer`]); and, in a build with feature
//! `probes` only (the `envoy_load` bench's, `cargo xtask build-native
//! --probes`), the floor probes (`probe_trivial`, `probe_chain`, see
//! `probe`) it is measured against. The shipped module neither contains
//! nor branches on them.
//!
//! Lifecycle, top to bottom, as Envoy calls it: program init (the ABI
//! version) → filter config (`filter_name`, `filter_config`; refused with
//! one line naming the field) → a filter per request → request headers,
//! body → callout answers and scheduled events → response headers, body →
//! stream complete (the stages' log step) → destroy. Every hook Envoy 1.40 resolves
//! is exported, used or not (a missing one fails the configuration), and
//! none lets a panic cross into Envoy: a panic is logged and the request
//! goes on untouched.
// FFI: Envoy calls the exported hooks with its pointers and the module
// calls Envoy's callbacks (`abi`); every unsafe block says why it holds.
#![allow(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

pub mod abi;
pub mod chain;
mod config;
pub mod envoy;
#[cfg(test)]
mod fake_envoy;
pub mod host;
mod logger;
pub mod metrics;
pub mod observer;
#[cfg(feature = "probes")]
pub mod probe;
pub mod process;
pub mod quota;
pub mod store;
pub mod stream;
mod ticker;

use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use abi::{Buffer, ConfigEnvoy, FilterEnvoy, Header};
use chain::ChainConfig;
use envoy::{StreamEnvoy, StreamHandle};
#[cfg(feature = "probes")]
use probe::{Probe, ProbeStream};
use stream::{ChainStream, Outcome, Verdict};

/// A filter configuration: which filter `filter_name` chose.
enum FilterConfig {
    /// A floor probe (feature `probes`).
    #[cfg(feature = "probes")]
    Probe(Probe),
    /// The chain (`zerolayer`).
    Chain(Arc<ChainConfig>),
}

/// The filter names this module serves.
#[cfg(feature = "probes")]
const FILTER_NAMES: &str = "zerolayer, probe_trivial or probe_chain";
/// The filter names this module serves (the probes are in a build with
/// feature `probes` only).
#[cfg(not(feature = "probes"))]
const FILTER_NAMES: &str = "zerolayer; probe_trivial and probe_chain exist only in a build with feature `probes`: cargo xtask build-native --probes";

impl FilterConfig {
    /// The configuration for `filter_name`, or the line saying why not.
    fn new(config_envoy: ConfigEnvoy, name: &[u8], config: &[u8]) -> Result<FilterConfig, String> {
        match name {
            // SAFETY: `config_envoy` is null (tests) or `config_new`'s handle.
            b"zerolayer" => unsafe { ChainConfig::new(config_envoy, config) }
                .map(FilterConfig::Chain)
                .map_err(|e| format!("zerolayer: {e}")),
            #[cfg(feature = "probes")]
            b"probe_trivial" => Ok(FilterConfig::Probe(Probe::Trivial)),
            #[cfg(feature = "probes")]
            b"probe_chain" => Ok(FilterConfig::Probe(Probe::Chain)),
            other => Err(format!(
                "filter_name: unknown filter {:?} (expected {FILTER_NAMES})",
                String::from_utf8_lossy(other)
            )),
        }
    }
}

/// One request through a filter.
enum Filter {
    #[cfg(feature = "probes")]
    Probe(ProbeStream),
    Chain(Box<ChainStream>),
}

/// Runs `hook`, turning a panic into `fallback` (and a log line): a panic
/// must never unwind into Envoy.
fn guarded<T>(name: &str, fallback: T, hook: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(hook)) {
        Ok(value) => value,
        Err(_) => {
            log::error!("zerolayer-native: {name} panicked; the request goes on untouched");
            fallback
        }
    }
}

/// The filter a hook's `filter_module` pointer is.
///
/// # Safety
/// `filter` must be a pointer `envoy_dynamic_module_on_http_filter_new`
/// returned and `…_destroy` has not freed yet.
unsafe fn filter<'a>(filter: *mut c_void) -> Option<&'a mut Filter> {
    // SAFETY: the caller's contract; Envoy calls a filter's hooks on one
    // worker thread, one at a time (the module never calls into Envoy in a
    // way that re-enters a filter while it is borrowed: see `host`).
    unsafe { (filter as *mut Filter).as_mut() }
}

fn headers_status(verdict: Verdict) -> u32 {
    match verdict {
        Verdict::Continue => abi::HEADERS_CONTINUE,
        Verdict::Pause | Verdict::Answered => abi::HEADERS_STOP,
    }
}

fn body_status(verdict: Verdict) -> u32 {
    match verdict {
        Verdict::Continue => abi::BODY_CONTINUE,
        Verdict::Pause => abi::BODY_STOP_AND_BUFFER,
        Verdict::Answered => abi::BODY_STOP_NO_BUFFER,
    }
}

/// Runs `step` on the chain stream behind `filter_module` and carries out
/// its outcome once the stream is no longer borrowed.
///
/// # Safety
/// Envoy's handles of the hook being run.
unsafe fn chain_step(
    filter_envoy: FilterEnvoy,
    filter_module: *mut c_void,
    step: impl FnOnce(&mut ChainStream) -> Outcome,
) -> Option<Verdict> {
    // SAFETY: the caller's contract; the reference ends with this block.
    let outcome = match unsafe { filter(filter_module) } {
        Some(Filter::Chain(chain)) => step(chain),
        _ => return None,
    };
    // SAFETY: the caller's contract; no reference to the stream is alive
    // any more, so Envoy may re-enter its hooks.
    Some(outcome.finish(&unsafe { StreamHandle::new(filter_envoy) }))
}

/// Envoy asks which ABI the module speaks.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    logger::install();
    abi::ABI_VERSION.as_ptr()
}

/// A filter configuration: `filter_name` picks the filter; null refuses it.
///
/// # Safety
/// Envoy passes buffers valid for the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy: ConfigEnvoy,
    name: Buffer,
    config: Buffer,
) -> *const c_void {
    guarded("config_new", std::ptr::null(), || {
        // SAFETY: Envoy's buffers, valid during the call.
        let (name, config) = unsafe { (name.bytes(), config.bytes()) };
        match FilterConfig::new(config_envoy, name, config) {
            Ok(config) => Box::into_raw(Box::new(config)) as *const c_void,
            Err(why) => {
                log::error!("zerolayer-native: invalid configuration: {why}");
                std::ptr::null()
            }
        }
    })
}

/// The configuration's scheduled event, on Envoy's main thread: the
/// metrics report.
///
/// # Safety
/// `config` is what `…_config_new` returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _config_envoy: ConfigEnvoy,
    config: *const c_void,
    _event: u64,
) {
    guarded("config_scheduled", (), || {
        // SAFETY: a live configuration (its scheduler is deleted before it).
        if let Some(FilterConfig::Chain(chain)) =
            unsafe { (config as *const FilterConfig).as_ref() }
        {
            chain.scheduled();
        }
    })
}

/// The configuration is gone.
///
/// # Safety
/// `config` is what `…_config_new` returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    if !config.is_null() {
        // SAFETY: made by `Box::into_raw` in `…_config_new`, freed once.
        let config = unsafe { Box::from_raw(config as *mut FilterConfig) };
        guarded("config_destroy", (), || {
            match *config {
                FilterConfig::Chain(chain) => {
                    // The observer thread stops now, whoever holds the rest.
                    if let Ok(mut chain) = Arc::try_unwrap(chain) {
                        chain.shut_down();
                    }
                }
                #[cfg(feature = "probes")]
                FilterConfig::Probe(_) => {}
            }
        });
    }
}

/// Per-route configurations are not used: one static value for all.
static NO_PER_ROUTE_CONFIG: u8 = 0;

/// A per-route configuration (unused).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: Buffer,
    _config: Buffer,
) -> *const c_void {
    &NO_PER_ROUTE_CONFIG as *const u8 as *const c_void
}

/// A per-route configuration is gone (nothing to free).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(
    _config: *const c_void,
) {
}

/// A new request through the filter.
///
/// # Safety
/// `config` is what `…_config_new` returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    filter_envoy: FilterEnvoy,
) -> *mut c_void {
    guarded("filter_new", std::ptr::null_mut(), || {
        // SAFETY: a live configuration (Envoy destroys it after its filters).
        let Some(config) = (unsafe { (config as *const FilterConfig).as_ref() }) else {
            return std::ptr::null_mut();
        };
        let filter = match config {
            #[cfg(feature = "probes")]
            FilterConfig::Probe(probe) => Filter::Probe(ProbeStream::new(*probe)),
            FilterConfig::Chain(chain) => {
                // SAFETY: Envoy's handle of this new stream; the chain calls
                // it only inside the stream's hooks.
                let envoy = unsafe { StreamHandle::new(filter_envoy) };
                Filter::Chain(Box::new(chain.stream(StreamEnvoy::Abi(envoy))))
            }
        };
        Box::into_raw(Box::new(filter)) as *mut c_void
    })
}

/// The request headers.
///
/// # Safety
/// Envoy's handles of this hook.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    filter_envoy: FilterEnvoy,
    filter_module: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    guarded("request_headers", abi::HEADERS_CONTINUE, || {
        #[cfg(feature = "probes")]
        // SAFETY: Envoy's handles of this hook.
        if let Some(Filter::Probe(probe)) = unsafe { filter(filter_module) } {
            unsafe { probe.request_headers(filter_envoy, end_of_stream) };
            return abi::HEADERS_CONTINUE;
        }
        // SAFETY: Envoy's handles of this hook.
        unsafe {
            chain_step(filter_envoy, filter_module, |c| {
                c.request_headers(end_of_stream)
            })
        }
        .map_or(abi::HEADERS_CONTINUE, headers_status)
    })
}

/// A request body chunk.
///
/// # Safety
/// Envoy's handles of this hook.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    filter_envoy: FilterEnvoy,
    filter_module: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    guarded("request_body", abi::BODY_CONTINUE, || {
        #[cfg(feature = "probes")]
        // SAFETY: Envoy's handles of this hook.
        if let Some(Filter::Probe(probe)) = unsafe { filter(filter_module) } {
            return unsafe { probe.request_body(filter_envoy, end_of_stream) };
        }
        // SAFETY: Envoy's handles of this hook.
        unsafe {
            chain_step(filter_envoy, filter_module, |c| {
                c.request_body(end_of_stream)
            })
        }
        .map_or(abi::BODY_CONTINUE, body_status)
    })
}

/// Request trailers (unused).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
) -> u32 {
    abi::TRAILERS_CONTINUE
}

/// The response headers.
///
/// # Safety
/// Envoy's handles of this hook.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    filter_envoy: FilterEnvoy,
    filter_module: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    guarded("response_headers", abi::HEADERS_CONTINUE, || {
        #[cfg(feature = "probes")]
        // SAFETY: Envoy's handles of this hook.
        if let Some(Filter::Probe(probe)) = unsafe { filter(filter_module) } {
            unsafe { probe.response_headers(filter_envoy) };
            return abi::HEADERS_CONTINUE;
        }
        // SAFETY: Envoy's handles of this hook.
        unsafe {
            chain_step(filter_envoy, filter_module, |c| {
                c.response_headers(end_of_stream)
            })
        }
        .map_or(abi::HEADERS_CONTINUE, headers_status)
    })
}

/// A response body chunk.
///
/// # Safety
/// Envoy's handles of this hook.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    filter_envoy: FilterEnvoy,
    filter_module: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    guarded("response_body", abi::BODY_CONTINUE, || {
        #[cfg(feature = "probes")]
        // SAFETY: Envoy's handles of this hook.
        if let Some(Filter::Probe(probe)) = unsafe { filter(filter_module) } {
            return unsafe { probe.response_body(filter_envoy, end_of_stream) };
        }
        // SAFETY: Envoy's handles of this hook.
        unsafe {
            chain_step(filter_envoy, filter_module, |c| {
                c.response_body(end_of_stream)
            })
        }
        .map_or(abi::BODY_CONTINUE, body_status)
    })
}

/// Response trailers (unused).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
) -> u32 {
    abi::TRAILERS_CONTINUE
}

/// The request is over, before the access log is written: the chain's log
/// step (usage and identity reach the access log's filter state).
///
/// # Safety
/// Envoy's handles of this hook.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _filter_envoy: FilterEnvoy,
    filter_module: *mut c_void,
) {
    guarded("stream_complete", (), || {
        // SAFETY: Envoy's handles of this hook.
        if let Some(Filter::Chain(chain)) = unsafe { filter(filter_module) } {
            chain.complete();
        }
    })
}

/// The filter is gone.
///
/// # Safety
/// `filter` is what `…_filter_new` returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter: *mut c_void) {
    if !filter.is_null() {
        // SAFETY: made by `Box::into_raw` in `…_filter_new`, freed once.
        let filter = unsafe { Box::from_raw(filter as *mut Filter) };
        guarded("destroy", (), || drop(filter));
    }
}

/// A callout a stream made has its answer (`result` 0: success; the
/// arrays are valid during the hook only, and may be null).
///
/// # Safety
/// Envoy's handles and arrays of this hook.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    filter_envoy: FilterEnvoy,
    filter_module: *mut c_void,
    callout_id: u64,
    result: u32,
    headers: *const Header,
    headers_len: usize,
    body: *const Buffer,
    body_len: usize,
) {
    guarded("http_callout_done", (), || {
        // SAFETY: Envoy's arrays, valid during the hook (null when empty).
        let answer = unsafe { abi::callout_answer(result, headers, headers_len, body, body_len) };
        // SAFETY: Envoy's handles of this hook.
        unsafe {
            chain_step(filter_envoy, filter_module, |c| {
                c.callout_done(callout_id as u32, answer)
            })
        };
    })
}

// Hooks Envoy 1.40 resolves when it loads a filter configuration, which
// the module never triggers (no streamed callouts, no watermarks).

/// A streaming callout's headers (unused).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
    _stream_id: u64,
    _headers: *const Header,
    _headers_len: usize,
    _end_of_stream: bool,
) {
}

/// A streaming callout's data (unused).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
    _stream_id: u64,
    _data: *const Buffer,
    _data_len: usize,
    _end_of_stream: bool,
) {
}

/// A streaming callout's trailers (unused).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
    _stream_id: u64,
    _trailers: *const Header,
    _trailers_len: usize,
) {
}

/// A streaming callout completed (unused).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
    _stream_id: u64,
) {
}

/// A streaming callout was reset (unused).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
    _stream_id: u64,
    _reason: u32,
) {
}

/// A scheduled event for a waiting stream: its worker's root ticks, and
/// what they did to it.
///
/// # Safety
/// Envoy's handles of this hook.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    filter_envoy: FilterEnvoy,
    filter_module: *mut c_void,
    _event_id: u64,
) {
    guarded("scheduled", (), || {
        // SAFETY: Envoy's handles of this hook.
        unsafe { chain_step(filter_envoy, filter_module, ChainStream::scheduled) };
    })
}

/// The downstream's write buffer is above its high watermark (unused).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
) {
}

/// The downstream's write buffer is below its low watermark (unused).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
) {
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(name: &[u8]) -> String {
        FilterConfig::new(std::ptr::null_mut(), name, b"")
            .err()
            .unwrap_or_default()
    }

    #[cfg(feature = "probes")]
    #[test]
    fn a_filter_name_picks_the_filter_and_an_unknown_one_is_refused_naming_the_field() {
        let probe = |name: &[u8]| match FilterConfig::new(std::ptr::null_mut(), name, b"") {
            Ok(FilterConfig::Probe(probe)) => Some(probe),
            _ => None,
        };
        assert_eq!(probe(b"probe_chain"), Some(Probe::Chain));
        assert_eq!(probe(b"probe_trivial"), Some(Probe::Trivial));
        assert_eq!(
            refused(b"zerolayer_fused"),
            "filter_name: unknown filter \"zerolayer_fused\" (expected zerolayer, probe_trivial or probe_chain)"
        );
    }

    #[cfg(not(feature = "probes"))]
    #[test]
    fn the_shipped_module_refuses_the_probes_as_unknown_filters_naming_the_field() {
        for name in ["probe_trivial", "probe_chain", "zerolayer_fused"] {
            assert_eq!(
                refused(name.as_bytes()),
                format!(
                    "filter_name: unknown filter {name:?} (expected zerolayer; probe_trivial and probe_chain \
                     exist only in a build with feature `probes`: cargo xtask build-native --probes)"
                )
            );
        }
    }

    #[test]
    fn the_chain_refuses_a_bad_section_naming_the_field() {
        let refused = |config: &str| {
            FilterConfig::new(std::ptr::null_mut(), b"zerolayer", config.as_bytes())
                .err()
                .unwrap_or_default()
        };
        assert!(
            refused("{}").starts_with("zerolayer: no stage configured"),
            "{}",
            refused("{}")
        );
        assert!(
            refused(r#"{"shadow":{}}"#).starts_with("zerolayer: shadow: unknown stage"),
            "{}",
            refused(r#"{"shadow":{}}"#)
        );
        assert!(
            refused(r#"{"activation":{},"native":{"threads":2}}"#)
                .starts_with("zerolayer: native.threads: unknown field `threads`"),
            "{}",
            refused(r#"{"activation":{},"native":{"threads":2}}"#)
        );
    }

    #[test]
    fn a_panicking_hook_gives_its_fallback() {
        assert_eq!(guarded("test", 7, || panic!("boom")), 7);
        assert_eq!(guarded("test", 7, || 1), 1);
    }

    #[test]
    fn the_abi_version_is_a_c_string() {
        assert_eq!(abi::ABI_VERSION.last(), Some(&0));
        assert_eq!(&abi::ABI_VERSION[..abi::ABI_VERSION.len() - 1], b"v0.2.0");
    }
}
