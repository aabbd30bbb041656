//! Bounding the observer's job queue. A host queue has no depth query, and
//! Kong's (a fixed-size shared-memory ring) traps the filter that enqueues
//! into it when full, which fails the request. So producers account the bytes
//! they enqueue in a shared-data counter and refuse (counted as lost) a job
//! that would take the backlog past the configured bound; the observer takes
//! off what it drains, and resets the count whenever it finds the queue empty
//! so a producer that died between its count and its enqueue cannot wedge it.

/// Bytes a job of `len` bytes occupies in a host queue (ngx_wasm_module
/// stores a 4-byte length before each entry).
pub fn queued_size(len: usize) -> u64 {
    4 + len as u64
}

/// Shared-data key of the backlog count of queue `name`.
pub fn backlog_key(name: &str) -> String {
    format!("zl:queue:{name}:bytes")
}

/// The count stored in shared data (absent or malformed: 0).
pub fn decode_backlog(value: Option<&[u8]>) -> u64 {
    value
        .and_then(|v| <[u8; 8]>::try_from(v).ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

/// The count as stored.
pub fn encode_backlog(bytes: u64) -> [u8; 8] {
    bytes.to_le_bytes()
}

/// The backlog after admitting a job of `len` bytes, or `None` when it
/// would exceed `max_bytes`.
pub fn admit(backlog: u64, len: usize, max_bytes: u64) -> Option<u64> {
    backlog
        .checked_add(queued_size(len))
        .filter(|next| *next <= max_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_are_admitted_up_to_the_bound_counting_the_length_prefix() {
        assert_eq!(admit(0, 96, 100), Some(100));
        assert_eq!(admit(0, 97, 100), None);
        assert_eq!(admit(50, 46, 100), Some(100));
        assert_eq!(admit(u64::MAX, 1, u64::MAX), None);
    }

    #[test]
    fn counts_round_trip_and_garbage_reads_as_empty() {
        assert_eq!(decode_backlog(Some(&encode_backlog(12345))), 12345);
        assert_eq!(decode_backlog(None), 0);
        assert_eq!(decode_backlog(Some(b"short")), 0);
        assert_eq!(
            backlog_key("zerolayer.jobs.metering"),
            "zl:queue:zerolayer.jobs.metering:bytes"
        );
    }
}
