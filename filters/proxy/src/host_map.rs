//! The one host call the SDK has no allocation-free form of: a whole header
//! map as the host serializes it, kept as one buffer
//! ([`zerolayer_core::headers::HeaderBlock`]). The SDK's `get_map_bytes`
//! makes a `String` and a `Vec` per header (most of the cost of a read
//! inside a Wasm VM) and panics on a status other than `Ok`.
#![allow(unsafe_code)]

use proxy_wasm::types::{MapType, Status};
use zerolayer_core::headers::HeaderBlock;

#[link(wasm_import_module = "env")]
unsafe extern "C" {
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
}

/// Header map `map` of the current stream, read with one host call.
pub fn read(map: MapType) -> Result<HeaderBlock, Status> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the host writes a pointer and size of a buffer it allocated
    // through this module's `proxy_on_memory_allocate` (the SDK's: a boxed
    // `[u8]` of exactly `size` bytes), which we now own; this is how the
    // SDK's own `get_map_bytes` takes it.
    let bytes = unsafe {
        let status = proxy_get_header_map_pairs(map, &mut data, &mut size);
        if status != Status::Ok as u32 {
            return Err(match status {
                1 => Status::NotFound,
                2 => Status::BadArgument,
                _ => Status::InternalFailure,
            });
        }
        if data.is_null() {
            return Ok(HeaderBlock::default());
        }
        Vec::from_raw_parts(data, size, size)
    };
    HeaderBlock::parse(bytes).map_err(|err| {
        log::warn!("the host's header map was malformed: {err}");
        Status::InternalFailure
    })
}
