//! The filters' configuration parsers, activation rules evaluated.
//! Invariants: `zerolayer_fuzz::checks::rules_config`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| zerolayer_fuzz::checks::rules_config(data));
