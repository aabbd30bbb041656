//! [`EnvoyStream`]: what the native chain asks of Envoy for one stream —
//! headers, body chunks, filter state, a local response, continuing, a
//! callout, a scheduler — as a small trait, the seam between the chain and
//! Envoy's dynamic-module ABI. [`StreamHandle`] implements it over the ABI,
//! with every `unsafe` of a stream's calls in one place; the recording fake
//! (tests) implements it for native tests of the host and the stream.

use std::time::Duration;

use zerolayer_core::headers::HeaderBlock;
use zerolayer_host::Status;

use crate::abi::{self, BodyKind, FilterEnvoy, HeaderMap};
use crate::ticker::{self, Ticking};

/// Envoy as one stream's hooks reach it.
pub trait EnvoyStream {
    /// Header map `map`, copied once.
    fn header_block(&self, map: HeaderMap) -> HeaderBlock;
    /// Sets header `name` of `map` (`None`: removes it); whether Envoy did.
    fn set_header(&self, map: HeaderMap, name: &[u8], value: Option<&[u8]>) -> bool;
    /// Adds a value to header `name` of `map`.
    fn add_header(&self, map: HeaderMap, name: &[u8], value: &[u8]) -> bool;
    /// The size of body `kind`.
    fn body_size(&self, kind: BodyKind) -> usize;
    /// Appends body `kind`'s bytes to `out`.
    fn append_body(&self, kind: BodyKind, out: &mut Vec<u8>);
    /// Replaces body `kind` with `bytes`; whether Envoy did.
    fn replace_body(&self, kind: BodyKind, bytes: &[u8]) -> bool;
    /// The downstream's address (`ip:port`).
    fn source_address(&self) -> Option<Vec<u8>>;
    /// Sets filter state `key` (bytes), which the access log reads.
    fn set_filter_state(&self, key: &[u8], value: &[u8]) -> bool;
    /// A callout on Envoy's cluster `cluster`; returns its token.
    fn callout(
        &self,
        cluster: &[u8],
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u32, Status>;
    /// Sends a local response (Envoy runs the filter's response hooks
    /// inside: call it only once no reference to the stream is alive).
    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]);
    /// Continues the request an earlier hook stopped (may run the rest of
    /// the chain inside: as `send_response`).
    fn continue_request(&self);
    /// Scheduled events every `period` while the stream waits.
    fn start_ticking(&self, period: Duration) -> Option<Ticking>;
}

/// A stream's handle on Envoy, over the ABI.
#[derive(Debug, Clone, Copy)]
pub struct StreamHandle(FilterEnvoy);

impl StreamHandle {
    /// The stream behind `filter`.
    ///
    /// # Safety
    /// `filter` must be Envoy's handle of a live stream, and the handle's
    /// methods be called only inside that stream's hooks, on its worker
    /// (Envoy's contract for every `envoy_dynamic_module_callback_http_*`).
    pub unsafe fn new(filter: FilterEnvoy) -> StreamHandle {
        StreamHandle(filter)
    }
}

// SAFETY (every method below): `self.0` is the handle of a live stream,
// called inside its hooks on its worker (`StreamHandle::new`'s contract).
#[allow(unsafe_code)]
impl EnvoyStream for StreamHandle {
    fn header_block(&self, map: HeaderMap) -> HeaderBlock {
        // SAFETY: see above.
        unsafe { abi::header_block(self.0, map) }
    }

    fn set_header(&self, map: HeaderMap, name: &[u8], value: Option<&[u8]>) -> bool {
        // SAFETY: see above.
        unsafe { abi::set_header(self.0, map, name, value) }
    }

    fn add_header(&self, map: HeaderMap, name: &[u8], value: &[u8]) -> bool {
        // SAFETY: see above.
        unsafe { abi::add_header(self.0, map, name, value) }
    }

    fn body_size(&self, kind: BodyKind) -> usize {
        // SAFETY: see above.
        unsafe { abi::body_size(self.0, kind) }
    }

    fn append_body(&self, kind: BodyKind, out: &mut Vec<u8>) {
        // SAFETY: see above.
        unsafe { abi::append_body(self.0, kind, out) }
    }

    fn replace_body(&self, kind: BodyKind, bytes: &[u8]) -> bool {
        // SAFETY: see above.
        unsafe { abi::replace_body(self.0, kind, bytes) }
    }

    fn source_address(&self) -> Option<Vec<u8>> {
        // SAFETY: see above.
        unsafe { abi::source_address(self.0) }
    }

    fn set_filter_state(&self, key: &[u8], value: &[u8]) -> bool {
        // SAFETY: see above.
        unsafe { abi::set_filter_state(self.0, key, value) }
    }

    fn callout(
        &self,
        cluster: &[u8],
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u32, Status> {
        // SAFETY: see above.
        unsafe { abi::callout(self.0, cluster, headers, body, timeout_ms) }
    }

    fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
        // SAFETY: see above.
        unsafe { abi::send_response(self.0, status, headers, body) }
    }

    fn continue_request(&self) {
        // SAFETY: see above.
        unsafe { abi::continue_request(self.0) }
    }

    fn start_ticking(&self, period: Duration) -> Option<Ticking> {
        // SAFETY: see above.
        unsafe { ticker::start(self.0, period) }
    }
}

/// The Envoy a native stream holds: the ABI in the module, the recording
/// fake in tests. An enum rather than a boxed trait object: no allocation
/// per stream.
pub enum StreamEnvoy {
    /// Envoy itself.
    Abi(StreamHandle),
    /// The recording fake.
    #[cfg(test)]
    Recording(recording::RecordingEnvoy),
}

impl StreamEnvoy {
    /// The Envoy behind it.
    pub fn get(&self) -> &dyn EnvoyStream {
        match self {
            StreamEnvoy::Abi(envoy) => envoy,
            #[cfg(test)]
            StreamEnvoy::Recording(envoy) => envoy,
        }
    }
}

/// A recording Envoy for native tests: what a test gives the stream
/// (headers, body chunks, an address) and what the chain did with it.
#[cfg(test)]
pub mod recording {
    use std::cell::RefCell;
    use std::rc::Rc;

    use zerolayer_host::LocalResponse;

    use super::*;

    /// What the fake holds and records (shared with the test).
    #[derive(Debug, Default)]
    pub struct Recorded {
        /// Request headers.
        pub request_headers: Vec<(String, Vec<u8>)>,
        /// Response headers.
        pub response_headers: Vec<(String, Vec<u8>)>,
        /// Body chunks by kind.
        pub bodies: Vec<(BodyKind, Vec<u8>)>,
        /// The downstream address.
        pub source: Option<Vec<u8>>,
        /// Whole header maps read.
        pub map_reads: usize,
        /// Filter state set.
        pub filter_state: Vec<(Vec<u8>, Vec<u8>)>,
        /// Local responses sent.
        pub sent: Vec<LocalResponse>,
        /// Requests continued.
        pub continued: usize,
        /// Callouts: cluster, `:path` and body.
        pub callouts: Vec<(Vec<u8>, String, Vec<u8>)>,
    }

    /// The recording Envoy (cheap to clone: one shared record).
    #[derive(Debug, Clone, Default)]
    pub struct RecordingEnvoy(pub Rc<RefCell<Recorded>>);

    impl RecordingEnvoy {
        /// A stream with these request headers.
        pub fn with_request(headers: &[(&str, &str)]) -> RecordingEnvoy {
            let envoy = RecordingEnvoy::default();
            envoy.0.borrow_mut().request_headers = headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
                .collect();
            envoy
        }

        fn map(recorded: &mut Recorded, map: HeaderMap) -> &mut Vec<(String, Vec<u8>)> {
            match map {
                HeaderMap::Request => &mut recorded.request_headers,
                HeaderMap::Response => &mut recorded.response_headers,
            }
        }
    }

    impl EnvoyStream for RecordingEnvoy {
        fn header_block(&self, map: HeaderMap) -> HeaderBlock {
            let mut recorded = self.0.borrow_mut();
            recorded.map_reads += 1;
            let pairs: Vec<(&[u8], &[u8])> = RecordingEnvoy::map(&mut recorded, map)
                .iter()
                .map(|(n, v)| (n.as_bytes(), v.as_slice()))
                .collect();
            HeaderBlock::from_pairs(&pairs)
        }

        fn set_header(&self, map: HeaderMap, name: &[u8], value: Option<&[u8]>) -> bool {
            let mut recorded = self.0.borrow_mut();
            let headers = RecordingEnvoy::map(&mut recorded, map);
            let name = String::from_utf8_lossy(name).to_ascii_lowercase();
            let had = headers.iter().any(|(n, _)| *n == name);
            headers.retain(|(n, _)| *n != name);
            match value {
                Some(value) => {
                    headers.push((name, value.to_vec()));
                    true
                }
                None => had,
            }
        }

        fn add_header(&self, map: HeaderMap, name: &[u8], value: &[u8]) -> bool {
            let mut recorded = self.0.borrow_mut();
            let name = String::from_utf8_lossy(name).to_ascii_lowercase();
            RecordingEnvoy::map(&mut recorded, map).push((name, value.to_vec()));
            true
        }

        fn body_size(&self, kind: BodyKind) -> usize {
            let recorded = self.0.borrow();
            recorded
                .bodies
                .iter()
                .filter(|(k, _)| *k == kind)
                .map(|(_, b)| b.len())
                .sum()
        }

        fn append_body(&self, kind: BodyKind, out: &mut Vec<u8>) {
            for (k, chunk) in &self.0.borrow().bodies {
                if *k == kind {
                    out.extend_from_slice(chunk);
                }
            }
        }

        fn replace_body(&self, kind: BodyKind, bytes: &[u8]) -> bool {
            let mut recorded = self.0.borrow_mut();
            recorded.bodies.retain(|(k, _)| *k != kind);
            recorded.bodies.push((kind, bytes.to_vec()));
            true
        }

        fn source_address(&self) -> Option<Vec<u8>> {
            self.0.borrow().source.clone()
        }

        fn set_filter_state(&self, key: &[u8], value: &[u8]) -> bool {
            let mut recorded = self.0.borrow_mut();
            recorded.filter_state.push((key.to_vec(), value.to_vec()));
            true
        }

        fn callout(
            &self,
            cluster: &[u8],
            headers: &[(&str, &str)],
            body: &[u8],
            _timeout_ms: u64,
        ) -> Result<u32, Status> {
            let mut recorded = self.0.borrow_mut();
            let path = headers
                .iter()
                .find(|(name, _)| *name == ":path")
                .map_or_else(String::new, |(_, value)| (*value).to_string());
            recorded
                .callouts
                .push((cluster.to_vec(), path, body.to_vec()));
            Ok(recorded.callouts.len() as u32)
        }

        fn send_response(&self, status: u32, headers: &[(&str, &str)], body: &[u8]) {
            let response = LocalResponse::new(status, headers, body);
            self.0.borrow_mut().sent.push(response);
        }

        fn continue_request(&self) {
            self.0.borrow_mut().continued += 1;
        }

        fn start_ticking(&self, _period: Duration) -> Option<Ticking> {
            None
        }
    }
}
