//! The cache key of request bodies, and the include_usage rewrite.
//! Invariants: `zerolayer_fuzz::checks::cache_key`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zerolayer_fuzz::checks::cache_key(data));
