//! The metering filter's logic: which requests get a full usage record
//! (consistent hash sampling with per-environment and per-tenant rates),
//! the record itself and its two renderings (the sink's JSON row, the
//! access log's ground truth), and bounded metric labels.

pub mod config;
pub mod labels;
pub mod record;

pub use config::MeteringConfig;
pub use labels::{LabelLimits, Series, SeriesTable};
pub use record::{UsageRecord, logged_usage};
