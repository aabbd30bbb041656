//! Bounded exposure: how many requests a credential nobody has verified yet
//! may make before verification becomes synchronous for it, and how many
//! verifications may be pending at once.
//!
//! Both counters live in shared data and are updated with compare-and-swap
//! by every worker. Per-credential counters share bounded keys ("sets",
//! chosen by the hash, as verdicts are) of a few ways each, and every way
//! carries its credential's hash. A collision can never reset a count: a
//! credential finds its own way or takes a free one, and when every way of
//! its set is held by a credential admitted within the retention (the
//! negative-verdict TTL) it is counted as over the bound — verified
//! synchronously — instead of evicting anyone. An attacker who fills a set
//! with colliding credentials therefore gets each of them its one
//! admission and every further newcomer of that set a synchronous check.

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

/// Version 2: a set of ways (version 1 held one counter and restarted it
/// for a colliding credential).
const VERSION: u8 = 2;

/// Largest encoded set of `ways` counters: version, length, and per way a
/// hash and two varints.
pub fn max_set_bytes(ways: u32) -> usize {
    2 + ways as usize * (32 + 5 + 10)
}

/// Requests a credential made while unverified: one way of a set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unverified {
    /// The credential's hash.
    pub hash: [u8; 32],
    /// Requests admitted while unverified.
    pub count: u32,
    /// Unix seconds of its latest request.
    pub last_seen: u64,
}

/// The shared-data key of `hash`'s counter set among `slots`.
pub fn key(hash: &TokenHash, slots: u32) -> String {
    format!("{UNVERIFIED_PREFIX}{}", hash.slot(slots))
}

/// The counters of one set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExposureSet(pub Vec<Unverified>);

/// What one more unverified request of a credential did to its set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bump {
    /// Counted: the set to write back and the credential's count now.
    Counted(Vec<u8>, u32),
    /// Every way is held by a credential seen within the retention: this
    /// one gets no counter and must be treated as over the bound.
    Full,
}

impl ExposureSet {
    /// Serializes for shared data.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        if let Ok(body) = postcard::to_allocvec(self) {
            out.extend(body);
        }
        out
    }

    /// Parses an entry (anything unreadable is an empty set).
    pub fn decode(bytes: Option<&[u8]>) -> ExposureSet {
        match bytes.and_then(<[u8]>::split_first) {
            Some((&VERSION, body)) => postcard::from_bytes(body).unwrap_or_default(),
            _ => ExposureSet::default(),
        }
    }

    /// The count of `hash` in this set (0: none).
    pub fn count(&self, hash: &TokenHash) -> u32 {
        self.0
            .iter()
            .find(|u| u.hash == hash.0)
            .map_or(0, |u| u.count)
    }
}

/// One more unverified request of `hash` at `now`, given its set's entry:
/// at most `ways` credentials per set; a way may be taken over only from a
/// credential not seen for `retention` seconds (the longest any of its
/// verdicts may still be held), the stalest first.
pub fn bump(entry: Option<&[u8]>, hash: &TokenHash, now: u64, ways: u32, retention: u64) -> Bump {
    let mut set = ExposureSet::decode(entry);
    let ways = ways.max(1) as usize;
    if let Some(own) = set.0.iter_mut().find(|u| u.hash == hash.0) {
        own.count = own.count.saturating_add(1);
        own.last_seen = own.last_seen.max(now);
        let count = own.count;
        return Bump::Counted(set.encode(), count);
    }
    let fresh = Unverified {
        hash: hash.0,
        count: 1,
        last_seen: now,
    };
    if set.0.len() >= ways {
        // A set shrunk by configuration keeps its oldest `ways` entries' place.
        let stale = set
            .0
            .iter()
            .enumerate()
            .filter(|(_, u)| u.last_seen.saturating_add(retention) <= now)
            .min_by_key(|(_, u)| u.last_seen)
            .map(|(i, _)| i);
        let Some(i) = stale else {
            return Bump::Full;
        };
        set.0.remove(i);
        set.0.truncate(ways - 1);
    }
    set.0.push(fresh);
    Bump::Counted(set.encode(), 1)
}

/// A request of `hash` that was refused without being counted (a cached
/// negative verdict, a synchronous check): its way, if it holds one, is
/// kept fresh, so a credential that keeps coming never loses its count.
/// Written at most once per `every` seconds per credential; `None`: nothing
/// to write.
pub fn touch(entry: Option<&[u8]>, hash: &TokenHash, now: u64, every: u64) -> Option<Vec<u8>> {
    let mut set = ExposureSet::decode(entry);
    let own = set.0.iter_mut().find(|u| u.hash == hash.0)?;
    if own.last_seen.saturating_add(every) > now {
        return None;
    }
    own.last_seen = now;
    Some(set.encode())
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

    fn counted(b: Bump) -> (Vec<u8>, u32) {
        match b {
            Bump::Counted(entry, count) => (entry, count),
            Bump::Full => panic!("full"),
        }
    }

    #[test]
    fn counts_per_credential_and_collisions_never_reset_a_count() {
        let a = TokenHash::of(b"a");
        let b = TokenHash::of(b"b");
        let (e, n) = counted(bump(None, &a, 10, 2, 60));
        assert_eq!(n, 1);
        let (e, n) = counted(bump(Some(&e), &a, 11, 2, 60));
        assert_eq!(n, 2);
        // Another credential in the same set takes its own way.
        let (e, n) = counted(bump(Some(&e), &b, 12, 2, 60));
        assert_eq!(n, 1);
        // a's count survived it.
        assert_eq!(ExposureSet::decode(Some(&e)).count(&a), 2);
        // A third finds the set full: over the bound, nothing evicted.
        let c = TokenHash::of(b"c");
        assert_eq!(bump(Some(&e), &c, 13, 2, 60), Bump::Full);
        // After the retention the stalest way is taken over.
        let (e2, n) = counted(bump(Some(&e), &c, 71, 2, 60));
        assert_eq!(n, 1);
        let set = ExposureSet::decode(Some(&e2));
        assert_eq!((set.count(&a), set.count(&b), set.count(&c)), (0, 1, 1));
        // A refused request keeps c's way fresh, at most once per interval.
        assert_eq!(touch(Some(&e2), &c, 75, 10), None);
        let e3 = touch(Some(&e2), &c, 81, 10).unwrap();
        assert_eq!(ExposureSet::decode(Some(&e3)).0[1].last_seen, 81);
        assert_eq!(touch(Some(&e3), &TokenHash::of(b"z"), 200, 10), None);
        // Junk and old versions read as empty.
        assert_eq!(counted(bump(Some(b"junk"), &a, 0, 2, 60)).1, 1);
        assert_eq!(counted(bump(Some(b"\x01abc"), &a, 0, 2, 60)).1, 1);
    }
}
