//! Cache-Control parsing and the cache's store/serve policy.
//! Invariants: `zerolayer_fuzz::checks::cache_control`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zerolayer_fuzz::checks::cache_control(data));
