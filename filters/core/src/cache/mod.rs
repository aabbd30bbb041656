//! post-cache logic: the canonical request key, `Cache-Control` policy, the
//! stored entry format with its bounded index, the stampede lease, and
//! stream completion.

pub mod config;
pub mod control;
pub mod key;
pub mod lease;
pub mod store;
pub mod stream;
