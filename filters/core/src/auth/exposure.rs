//! Bounded exposure: how many requests a credential nobody has verified yet
//! may make before verification becomes synchronous for it, and how many
//! verifications may be pending at once.
//!
//! Both counters live in shared data and are updated with compare-and-swap
//! by every worker. Per-credential counters use the same bounded slots as
//! verdicts and carry the hash, so a colliding credential starts its own
//! count (it can never inherit someone else's).

use serde::{Deserialize, Serialize};

use super::credential::TokenHash;

/// Shared-data key prefix of per-credential counters.
pub const UNVERIFIED_PREFIX: &str = "zl:auth:unverified:";
/// Shared-data key of the number of verification jobs ever enqueued
/// (written by filters with CAS).
pub const ENQUEUED_KEY: &str = "zl:auth:jobs_enqueued";
/// Shared-data key of the number of verification jobs finished (written only
/// by the observer, so it needs no CAS).
pub const FINISHED_KEY: &str = "zl:auth:jobs_finished";

const VERSION: u8 = 1;

/// Requests a credential made while unverified.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unverified {
    /// The credential's hash.
    pub hash: [u8; 32],
    /// Requests admitted while unverified.
    pub count: u32,
}

/// The shared-data key of `hash`'s counter among `slots`.
pub fn key(hash: &TokenHash, slots: u32) -> String {
    format!("{UNVERIFIED_PREFIX}{}", hash.slot(slots))
}

impl Unverified {
    /// Serializes for shared data.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        if let Ok(body) = postcard::to_allocvec(self) {
            out.extend(body);
        }
        out
    }

    /// Parses an entry.
    pub fn decode(bytes: &[u8]) -> Option<Unverified> {
        match bytes.split_first() {
            Some((&VERSION, body)) => postcard::from_bytes(body).ok(),
            _ => None,
        }
    }

    /// The counter after one more request with `hash`, given the slot's
    /// current entry (another credential's entry restarts the count).
    pub fn bump(entry: Option<&[u8]>, hash: &TokenHash) -> Unverified {
        let count = entry
            .and_then(Unverified::decode)
            .filter(|u| u.hash == hash.0)
            .map_or(0, |u| u.count);
        Unverified {
            hash: hash.0,
            count: count.saturating_add(1),
        }
    }
}

/// A non-negative counter stored as decimal ASCII (readable with any tool).
pub fn decode_count(bytes: Option<&[u8]>) -> u64 {
    bytes
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Verifications enqueued but not finished.
pub fn pending(enqueued: u64, finished: u64) -> u64 {
    enqueued.saturating_sub(finished)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_credential_and_restarts_on_collision() {
        let a = TokenHash::of(b"a");
        let first = Unverified::bump(None, &a);
        assert_eq!(first.count, 1);
        let second = Unverified::bump(Some(&first.encode()), &a);
        assert_eq!(second.count, 2);
        let other = Unverified::bump(Some(&second.encode()), &TokenHash::of(b"b"));
        assert_eq!(other.count, 1);
        assert_eq!(Unverified::bump(Some(b"junk"), &a).count, 1);
    }

    #[test]
    fn counters() {
        assert_eq!(decode_count(Some(b"42")), 42);
        assert_eq!(decode_count(Some(b"x")), 0);
        assert_eq!(decode_count(None), 0);
        assert_eq!(pending(10, 7), 3);
        assert_eq!(pending(3, 7), 0);
    }
}
