//! zerolayer native: the Envoy dynamic module (`libzerolayer_native.so`).
//! The Wasm filters stay the portable form (Envoy and Kong, sandboxed);
//! this is the form for Envoy operators who want the layer to cost as
//! little as it can, tied to Envoy's dynamic-module ABI (1.40: `v0.2.0`).
//!
//! For now it holds the floor probes (`probe_trivial`, `probe_chain`, see
//! [`probe`]) the native chain will be measured against; the chain's stages
//! come next, on a `zerolayer_host::Host` over this ABI.
//!
//! Lifecycle, top to bottom, as Envoy calls it: program init (the ABI
//! version) → filter config (`filter_name`, `filter_config`; refused with
//! one line naming the field) → a filter per request → request headers,
//! body → response headers, body → destroy. Every hook Envoy 1.40 resolves
//! is exported, used or not (a missing one fails the configuration), and
//! none lets a panic cross into Envoy: a panic is logged and the request
//! goes on untouched.
// FFI: Envoy calls the exported hooks with its pointers and the module
// calls Envoy's callbacks (`abi`); every unsafe block says why it holds.
#![allow(unsafe_code)]

pub mod abi;
pub mod probe;

use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};

use abi::{Buffer, FilterEnvoy, Header};
use probe::{Probe, ProbeStream};

/// A filter configuration: which filter `filter_name` chose.
struct FilterConfig {
    probe: Probe,
}

impl FilterConfig {
    /// The configuration for `filter_name`, or the line saying why not.
    fn new(name: &[u8], _config: &[u8]) -> Result<FilterConfig, String> {
        match name {
            b"probe_trivial" => Ok(FilterConfig {
                probe: Probe::Trivial,
            }),
            b"probe_chain" => Ok(FilterConfig {
                probe: Probe::Chain,
            }),
            other => Err(format!(
                "filter_name: unknown filter {:?} (expected probe_trivial or probe_chain)",
                String::from_utf8_lossy(other)
            )),
        }
    }
}

/// Runs `hook`, turning a panic into `fallback` (and a line on stderr,
/// which Envoy keeps): a panic must never unwind into Envoy.
fn guarded<T>(name: &str, fallback: T, hook: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(hook)) {
        Ok(value) => value,
        Err(_) => {
            eprintln!("zerolayer-native: {name} panicked; the request goes on untouched");
            fallback
        }
    }
}

/// The filter a hook's `filter_module` pointer is.
///
/// # Safety
/// `filter` must be a pointer `envoy_dynamic_module_on_http_filter_new`
/// returned and `…_destroy` has not freed yet.
unsafe fn stream<'a>(filter: *mut c_void) -> Option<&'a mut ProbeStream> {
    // SAFETY: the caller's contract; Envoy calls a filter's hooks on one
    // worker thread, one at a time.
    unsafe { (filter as *mut ProbeStream).as_mut() }
}

/// Envoy asks which ABI the module speaks.
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    abi::ABI_VERSION.as_ptr()
}

/// A filter configuration: `filter_name` picks the filter; null refuses it.
///
/// # Safety
/// Envoy passes buffers valid for the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _config_envoy: *mut c_void,
    name: Buffer,
    config: Buffer,
) -> *const c_void {
    guarded("config_new", std::ptr::null(), || {
        // SAFETY: Envoy's buffers, valid during the call.
        let (name, config) = unsafe { (name.bytes(), config.bytes()) };
        match FilterConfig::new(name, config) {
            Ok(config) => Box::into_raw(Box::new(config)) as *const c_void,
            Err(why) => {
                eprintln!("zerolayer-native: invalid configuration: {why}");
                std::ptr::null()
            }
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
        drop(unsafe { Box::from_raw(config as *mut FilterConfig) });
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
    _filter: FilterEnvoy,
) -> *mut c_void {
    guarded("filter_new", std::ptr::null_mut(), || {
        // SAFETY: a live configuration (Envoy destroys it after its filters).
        let Some(config) = (unsafe { (config as *const FilterConfig).as_ref() }) else {
            return std::ptr::null_mut();
        };
        Box::into_raw(Box::new(ProbeStream::new(config.probe))) as *mut c_void
    })
}

/// The request headers.
///
/// # Safety
/// Envoy's handles of this hook.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    filter_envoy: FilterEnvoy,
    filter: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    guarded("request_headers", abi::HEADERS_CONTINUE, || {
        // SAFETY: Envoy's handles of this hook.
        if let Some(stream) = unsafe { stream(filter) } {
            unsafe { stream.request_headers(filter_envoy, end_of_stream) };
        }
        abi::HEADERS_CONTINUE
    })
}

/// A request body chunk.
///
/// # Safety
/// Envoy's handles of this hook.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    filter_envoy: FilterEnvoy,
    filter: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    guarded("request_body", abi::BODY_CONTINUE, || {
        // SAFETY: Envoy's handles of this hook.
        match unsafe { stream(filter) } {
            Some(stream) => unsafe { stream.request_body(filter_envoy, end_of_stream) },
            None => abi::BODY_CONTINUE,
        }
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
    filter: *mut c_void,
    _end_of_stream: bool,
) -> u32 {
    guarded("response_headers", abi::HEADERS_CONTINUE, || {
        // SAFETY: Envoy's handles of this hook.
        if let Some(stream) = unsafe { stream(filter) } {
            unsafe { stream.response_headers(filter_envoy) };
        }
        abi::HEADERS_CONTINUE
    })
}

/// A response body chunk.
///
/// # Safety
/// Envoy's handles of this hook.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    filter_envoy: FilterEnvoy,
    filter: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    guarded("response_body", abi::BODY_CONTINUE, || {
        // SAFETY: Envoy's handles of this hook.
        match unsafe { stream(filter) } {
            Some(stream) => unsafe { stream.response_body(filter_envoy, end_of_stream) },
            None => abi::BODY_CONTINUE,
        }
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

/// The request is over (nothing to do yet; the chain's log step goes here).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
) {
}

/// The filter is gone.
///
/// # Safety
/// `filter` is what `…_filter_new` returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(filter: *mut c_void) {
    if !filter.is_null() {
        // SAFETY: made by `Box::into_raw` in `…_filter_new`, freed once.
        drop(unsafe { Box::from_raw(filter as *mut ProbeStream) });
    }
}

// Hooks Envoy 1.40 resolves when it loads a filter configuration, which
// the probes never trigger (no callouts, no scheduler, no watermarks).

/// A one-shot callout's answer (unused).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
    _callout_id: u64,
    _result: u32,
    _headers: *const Header,
    _headers_len: usize,
    _body: *const Buffer,
    _body_len: usize,
) {
}

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

/// A scheduled event for this filter (unused).
#[unsafe(no_mangle)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    _filter_envoy: FilterEnvoy,
    _filter: *mut c_void,
    _event_id: u64,
) {
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

    #[test]
    fn a_filter_name_picks_the_probe_and_an_unknown_one_is_refused_naming_the_field() {
        assert_eq!(
            FilterConfig::new(b"probe_chain", b"").map(|c| c.probe),
            Ok(Probe::Chain)
        );
        assert_eq!(
            FilterConfig::new(b"probe_trivial", b"").map(|c| c.probe),
            Ok(Probe::Trivial)
        );
        let refused = FilterConfig::new(b"zerolayer", b"")
            .err()
            .unwrap_or_default();
        assert!(
            refused.starts_with("filter_name: unknown filter \"zerolayer\""),
            "{refused}"
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
