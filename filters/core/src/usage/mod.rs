//! Token usage for the metering filter: read from a response body as its
//! chunks pass ([`UsageExtractor`], constant memory, JSON parsed only for the
//! few events that can carry usage), and, for OpenAI streams, asked for when
//! the client did not ([`inject_include_usage`]) and hidden from that client
//! again ([`UsageChunkStripper`]).

pub mod extract;
pub mod include;
pub(crate) mod needle;
pub mod request;
pub mod scan;

pub use extract::{
    Extracted, MAX_MODEL_LEN, MAX_USAGE_JSON, Missing, PartialUsage, ResponseFormat, Usage,
    UsageExtractor,
};
pub use include::{Injection, MAX_HELD_EVENT, UsageChunkStripper, inject_include_usage};
pub use request::{INCLUDE_USAGE_MEMBER, RequestScan, SkipReason, StreamedInjection};
pub use scan::{TopLevelScanner, TopLevelValue, Wanted};
