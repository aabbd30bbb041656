//! The floor probes: what the native chain is measured against, in the
//! same run (`envoy_load`), and the Wasm probe's `trivial` and `chain`
//! roles (`host-sim/probe`) do the same in Wasm:
//! - `probe_trivial` adds two request headers, nothing else;
//! - `probe_chain` makes the host calls the chain needs, with no logic:
//!   every request header, the whole request body, three filter-state
//!   values, every response header, one response header added, the whole
//!   response body.

use crate::abi::{self, BodyKind, Buffer, FilterEnvoy, HeaderMap};

/// What the probes count, as filter state (so a test sees the work done).
pub const REQUEST_HEADERS_STATE: &[u8] = b"zerolayer.probe.request_headers";
/// The request body's length, as filter state.
pub const REQUEST_BODY_STATE: &[u8] = b"zerolayer.probe.request_body";
/// A constant third value, as filter state.
pub const MARK_STATE: &[u8] = b"zerolayer.probe.mark";
/// The response header `probe_chain` adds: `headers=<n>;body=<bytes>`,
/// what it read of the request.
pub const CHAIN_HEADER: &[u8] = b"x-zerolayer-probe";

/// Which probe a filter is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// `probe_trivial`.
    Trivial,
    /// `probe_chain`.
    Chain,
}

/// One request through a probe.
pub struct ProbeStream {
    probe: Probe,
    request_headers: usize,
    request_body: usize,
    /// The request body is being buffered (returned StopIterationAndBuffer).
    request_buffered: bool,
    response_buffered: bool,
    state_set: bool,
}

impl ProbeStream {
    /// A request about to enter `probe`.
    pub fn new(probe: Probe) -> ProbeStream {
        ProbeStream {
            probe,
            request_headers: 0,
            request_body: 0,
            request_buffered: false,
            response_buffered: false,
            state_set: false,
        }
    }

    /// The request headers.
    ///
    /// # Safety
    /// `filter` must be the handle of the hook being run.
    pub unsafe fn request_headers(&mut self, filter: FilterEnvoy, end_of_stream: bool) {
        // SAFETY: the caller's contract; the buffers live for the call.
        unsafe {
            match self.probe {
                Probe::Trivial => {
                    abi::envoy_dynamic_module_callback_http_add_header(
                        filter,
                        HeaderMap::Request,
                        Buffer::of(b"x-trivial-1"),
                        Buffer::of(b"1"),
                    );
                    abi::envoy_dynamic_module_callback_http_add_header(
                        filter,
                        HeaderMap::Request,
                        Buffer::of(b"x-trivial-2"),
                        Buffer::of(b"2"),
                    );
                }
                Probe::Chain => {
                    self.request_headers = touch_headers(filter, HeaderMap::Request);
                    if end_of_stream {
                        self.set_state(filter, 0);
                    }
                }
            }
        }
    }

    /// A request body chunk; returns the hook's status.
    ///
    /// # Safety
    /// As for [`ProbeStream::request_headers`].
    pub unsafe fn request_body(&mut self, filter: FilterEnvoy, end_of_stream: bool) -> u32 {
        if self.probe == Probe::Trivial {
            return abi::BODY_CONTINUE;
        }
        if !end_of_stream {
            self.request_buffered = true;
            return abi::BODY_STOP_AND_BUFFER;
        }
        // SAFETY: the caller's contract.
        unsafe {
            let length = touch_body(
                filter,
                self.request_buffered,
                BodyKind::BufferedRequest,
                BodyKind::ReceivedRequest,
            );
            self.request_body = length;
            self.set_state(filter, length);
        }
        abi::BODY_CONTINUE
    }

    /// The response headers.
    ///
    /// # Safety
    /// As for [`ProbeStream::request_headers`].
    pub unsafe fn response_headers(&mut self, filter: FilterEnvoy) {
        if self.probe == Probe::Chain {
            // SAFETY: the caller's contract.
            let said = format!(
                "headers={};body={}",
                self.request_headers, self.request_body
            );
            unsafe {
                std::hint::black_box(touch_headers(filter, HeaderMap::Response));
                abi::envoy_dynamic_module_callback_http_add_header(
                    filter,
                    HeaderMap::Response,
                    Buffer::of(CHAIN_HEADER),
                    Buffer::of(said.as_bytes()),
                );
            }
        }
    }

    /// A response body chunk; returns the hook's status.
    ///
    /// # Safety
    /// As for [`ProbeStream::request_headers`].
    pub unsafe fn response_body(&mut self, filter: FilterEnvoy, end_of_stream: bool) -> u32 {
        if self.probe == Probe::Trivial {
            return abi::BODY_CONTINUE;
        }
        if !end_of_stream {
            self.response_buffered = true;
            return abi::BODY_STOP_AND_BUFFER;
        }
        // SAFETY: the caller's contract.
        unsafe {
            std::hint::black_box(touch_body(
                filter,
                self.response_buffered,
                BodyKind::BufferedResponse,
                BodyKind::ReceivedResponse,
            ));
        }
        abi::BODY_CONTINUE
    }

    /// The three filter-state values, once per request.
    unsafe fn set_state(&mut self, filter: FilterEnvoy, body_length: usize) {
        if std::mem::replace(&mut self.state_set, true) {
            return;
        }
        let headers = self.request_headers.to_string();
        let body = body_length.to_string();
        // SAFETY: the caller's contract; the buffers live for the calls.
        unsafe {
            for (key, value) in [
                (REQUEST_HEADERS_STATE, headers.as_bytes()),
                (REQUEST_BODY_STATE, body.as_bytes()),
                (MARK_STATE, &b"probe"[..]),
            ] {
                abi::envoy_dynamic_module_callback_http_set_filter_state_bytes(
                    filter,
                    Buffer::of(key),
                    Buffer::of(value),
                );
            }
        }
    }
}

/// Reads every header of `map` and touches its bytes (the read is real
/// work on real bytes); returns how many there are.
unsafe fn touch_headers(filter: FilterEnvoy, map: HeaderMap) -> usize {
    // SAFETY: the caller's contract; the views are read during the hook.
    let headers = unsafe { abi::headers(filter, map) };
    let mut sum = 0usize;
    for header in &headers {
        // SAFETY: Envoy's views of its header map, valid during the hook.
        let (key, value) = unsafe {
            (
                Buffer {
                    ptr: header.key_ptr,
                    len: header.key_len,
                }
                .bytes(),
                Buffer {
                    ptr: header.value_ptr,
                    len: header.value_len,
                }
                .bytes(),
            )
        };
        sum = sum
            .wrapping_add(key.len())
            .wrapping_add(value.first().map_or(0, |b| usize::from(*b)));
    }
    std::hint::black_box(sum);
    headers.len()
}

/// Reads the whole body at its end: what this filter had Envoy buffer (only
/// if it did: reading both would count it twice) and the last chunk.
unsafe fn touch_body(
    filter: FilterEnvoy,
    buffered: bool,
    buffered_kind: BodyKind,
    received_kind: BodyKind,
) -> usize {
    let mut length = 0;
    let mut xor = 0u8;
    let kinds = [buffered_kind, received_kind];
    for kind in &kinds[usize::from(!buffered)..] {
        // SAFETY: the caller's contract; the views are read during the hook.
        for chunk in unsafe { abi::body_chunks(filter, *kind) } {
            // SAFETY: Envoy's view of its buffer, valid during the hook.
            let bytes = unsafe { chunk.bytes() };
            length += bytes.len();
            xor = bytes.iter().fold(xor, |x, b| x ^ b);
        }
    }
    std::hint::black_box(xor);
    length
}
