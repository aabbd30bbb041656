//! SSE framing, usage extraction and the usage-chunk stripper on chunked bodies.
//! Invariants: `zerolayer_fuzz::checks::sse_usage`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zerolayer_fuzz::checks::sse_usage(data));
