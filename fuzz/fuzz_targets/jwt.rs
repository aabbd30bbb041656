//! JWT parsing and verification against the RFC 7515 example keys.
//! Invariants: `zerolayer_fuzz::checks::jwt`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zerolayer_fuzz::checks::jwt(data));
