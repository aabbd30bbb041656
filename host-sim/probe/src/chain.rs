//! The `chain` role: the host calls the zerolayer chain needs, with no
//! logic, made as the stages make them (through `zerolayer_host::WasmHost`:
//! one read per header map, the body read once at its end): every request
//! header, the whole request body, three filter-state values, every
//! response header, one response header added, the whole response body.
//! `zerolayer-native`'s `probe_chain` does the same in an Envoy dynamic
//! module, so the two forms' floors are measured in the same run.

use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use zerolayer_host::{Body, Headers, StreamHost, WasmHost};

/// The filter-state values set, as the access log reads them
/// (`%FILTER_STATE(wasm.<path>:PLAIN)%`).
pub(crate) const REQUEST_HEADERS_STATE: &str = "wasmx.zerolayer_probe_request_headers";
/// The request body's length.
pub(crate) const REQUEST_BODY_STATE: &str = "wasmx.zerolayer_probe_request_body";
/// A constant third value.
pub(crate) const MARK_STATE: &str = "wasmx.zerolayer_probe_mark";
/// The response header added: `headers=<n>;body=<bytes>`, what the probe
/// read of the request.
pub(crate) const CHAIN_HEADER: &str = "x-zerolayer-probe";

/// One request through the chain role.
#[derive(Default)]
pub(crate) struct ChainStream {
    request_headers: usize,
    request_body: usize,
    state_set: bool,
}

impl ChainStream {
    /// The three filter-state values, once per request.
    fn set_state(&mut self, body_length: usize) {
        if std::mem::replace(&mut self.state_set, true) {
            return;
        }
        let mut host = WasmHost;
        let headers = self.request_headers.to_string();
        let body = body_length.to_string();
        for (path, value) in [
            (REQUEST_HEADERS_STATE, headers.as_bytes()),
            (REQUEST_BODY_STATE, body.as_bytes()),
            (MARK_STATE, &b"probe"[..]),
        ] {
            let _ = host.set_property(path, value);
        }
    }
}

/// Every header of `map`, touched (real work on real bytes); their count.
fn touch_headers(map: Headers) -> usize {
    let Some(headers) = WasmHost.read_headers(map) else {
        return 0;
    };
    let mut count = 0;
    let mut sum = 0usize;
    for (name, value) in headers.iter() {
        count += 1;
        sum = sum
            .wrapping_add(name.len())
            .wrapping_add(value.first().map_or(0, |b| usize::from(*b)));
    }
    std::hint::black_box(sum);
    count
}

/// The whole body, touched; its length.
fn touch_body(body: Body, size: usize) -> usize {
    WasmHost.with_body(body, size, |bytes| {
        std::hint::black_box(bytes.iter().fold(0u8, |x, b| x ^ b));
        bytes.len()
    })
}

impl Context for ChainStream {}

impl HttpContext for ChainStream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.request_headers = touch_headers(Headers::Request);
        if end_of_stream {
            self.set_state(0);
        }
        Action::Continue
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            // Envoy buffers the body until its end.
            return Action::Pause;
        }
        let length = touch_body(Body::Request, body_size);
        self.request_body = length;
        self.set_state(length);
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        std::hint::black_box(touch_headers(Headers::Response));
        let said = format!(
            "headers={};body={}",
            self.request_headers, self.request_body
        );
        WasmHost.add_header(Headers::Response, CHAIN_HEADER, said.as_bytes());
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        std::hint::black_box(touch_body(Body::Response, body_size));
        Action::Continue
    }
}
