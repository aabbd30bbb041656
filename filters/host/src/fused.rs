//! [`FusedHost`] and [`FusedRoots`]: the hosts as the stages of the fused
//! `zerolayer.wasm` see them, over the plain Proxy-Wasm host.

use zerolayer_core::headers::HeaderBlock;

use crate::host::Headers;
use crate::pipeline::{Chain, PipelineHost, PipelineRoots, Proxy};
use crate::wasm::WasmHost;

/// The fused filter's host of a stream's stages.
pub type FusedHost = PipelineHost<WasmHost>;

/// The fused filter's host of the stages' roots.
pub type FusedRoots = PipelineRoots<WasmHost>;

/// The fused filter's hosts, as its stages see them.
pub type Fused = Chain<WasmHost, WasmHost>;

impl Proxy for WasmHost {
    fn read_headers(&mut self, map: Headers) -> Option<HeaderBlock> {
        WasmHost::read_headers(self, map)
    }
}
