//! The invariant checks of the fuzz targets, shared with the stable-Rust
//! regression test that replays every committed input
//! (`filters/core/tests/fuzz_regressions.rs`): one source, compiled here
//! and there.

#[path = "../../filters/core/tests/fuzz_checks/mod.rs"]
pub mod checks;
