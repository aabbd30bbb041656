//! The host calls the SDK has no safe form of (used by [`crate::WasmHost`]). A whole header map as the
//! host serializes it, kept as one buffer
//! ([`zerolayer_core::headers::HeaderBlock`]): the SDK's `get_map_bytes`
//! makes a `String` and a `Vec` per header (most of the cost of a read
//! inside a Wasm VM) and panics on a status other than `Ok`. And setting a
//! property the host may refuse: the SDK's `set_property` panics then.
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
    fn proxy_set_property(
        path_data: *const u8,
        path_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
}

/// Sets the one-segment property `path` to `value`; the host's refusal is
/// a status, not a panic.
pub fn set_property(path: &str, value: &[u8]) -> Result<(), Status> {
    // SAFETY: both pointers and lengths describe live slices for the
    // duration of the call; the host only reads them. A one-segment path
    // is its bytes, as the SDK serializes it.
    let status =
        unsafe { proxy_set_property(path.as_ptr(), path.len(), value.as_ptr(), value.len()) };
    match status {
        0 => Ok(()),
        1 => Err(Status::NotFound),
        2 => Err(Status::BadArgument),
        _ => Err(Status::InternalFailure),
    }
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
