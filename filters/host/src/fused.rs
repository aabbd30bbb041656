//! [`FusedHost`]: the host as the stages of the fused `zerolayer.wasm` see
//! it, a [`PipelineHost`] over the plain Proxy-Wasm host.

use zerolayer_core::headers::HeaderBlock;

use crate::host::Headers;
use crate::pipeline::{PipelineHost, Proxy};
use crate::wasm::WasmHost;

/// The fused filter's host: per stream, or for the stages' roots.
pub type FusedHost = PipelineHost<WasmHost>;

impl Proxy for WasmHost {
    fn read_headers(&mut self, map: Headers) -> Option<HeaderBlock> {
        WasmHost::read_headers(self, map)
    }
}
