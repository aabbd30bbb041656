//! The cache's layout in shared data, which has no delete: a fixed number of
//! sets, each with a small index record and two body slots. Memory is bounded
//! by construction (`sets × (index + 2 × max_entry_bytes)`); a new entry
//! replaces the matching, empty or expired way, else evicts the way that
//! expires first.
//!
//! A lookup reads the set's index (a few dozen bytes) and, only on a match,
//! the body slot. The body repeats the digest and store time, so a reader
//! that raced a writer replacing that slot sees a mismatch and reports a
//! miss, never another request's response.

use serde::{Deserialize, Serialize};

use super::key::CacheKey;

/// Shared-data key prefix of everything the cache stores.
pub const CACHE_PREFIX: &str = "zl:cache:";
/// What a body slot may hold beyond `max_entry_bytes` of body: the kept
/// headers, digest and times. A larger slot is not stored.
pub const MAX_SLOT_OVERHEAD_BYTES: usize = 16 << 10;
/// Ways per set: two keeps a hot entry from being evicted by one colliding key.
pub const WAYS: usize = 2;
/// Format version, first byte of every record: an entry written by another
/// version reads as empty instead of being misread.
const VERSION: u8 = 1;

/// Where a key lives: its set, and the shared-data keys of that set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    sets: u32,
}

impl Layout {
    /// A layout holding up to `max_entries` entries (rounded up to whole sets).
    pub fn new(max_entries: u32) -> Layout {
        Layout {
            sets: max_entries.div_ceil(WAYS as u32).max(1),
        }
    }

    /// Number of sets.
    pub fn sets(&self) -> u32 {
        self.sets
    }

    /// Entries the layout can hold.
    pub fn capacity(&self) -> u64 {
        u64::from(self.sets) * WAYS as u64
    }

    /// The set `key` belongs to.
    pub fn set_of(&self, key: &CacheKey) -> u32 {
        (key.slot_hash() % u64::from(self.sets)) as u32
    }

    /// Shared-data key of a set's index record.
    pub fn index_key(&self, set: u32) -> String {
        format!("{CACHE_PREFIX}i:{set}")
    }

    /// Shared-data key of one way's body.
    pub fn body_key(&self, set: u32, way: usize) -> String {
        format!("{CACHE_PREFIX}b:{set}:{way}")
    }

    /// Shared-data key of a set's leases.
    pub fn lease_key(&self, set: u32) -> String {
        format!("{CACHE_PREFIX}l:{set}")
    }
}

/// What the index knows of one stored entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WayRecord {
    /// The entry's full keyed digest.
    pub digest: [u8; 32],
    /// Unix milliseconds when it was stored (also tells a replaced body apart).
    pub stored_at_ms: u64,
    /// Unix seconds from which it is stale.
    pub expires_at: u64,
    /// Encoded body size, bytes.
    pub size: u32,
}

impl WayRecord {
    /// Whether the entry may still be served at `now` (seconds).
    pub fn fresh(&self, now: u64) -> bool {
        now < self.expires_at
    }
}

/// A set's index record: one optional record per way.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetIndex {
    /// The ways, in slot order.
    pub ways: [Option<WayRecord>; WAYS],
}

/// Where a new entry goes, and what it displaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The way to write.
    pub way: usize,
    /// Whether a fresh entry of another request is evicted.
    pub evicts: bool,
}

impl SetIndex {
    /// Parses an index record; anything unreadable is an empty set.
    pub fn decode(bytes: Option<&[u8]>) -> SetIndex {
        match bytes.and_then(|b| b.split_first()) {
            Some((&VERSION, body)) => postcard::from_bytes(body).unwrap_or_default(),
            _ => SetIndex::default(),
        }
    }

    /// Serializes for shared data.
    pub fn encode(&self) -> Vec<u8> {
        encode(self)
    }

    /// The way holding a fresh entry for `key` at `now`.
    pub fn find(&self, key: &CacheKey, now: u64) -> Option<(usize, &WayRecord)> {
        self.ways.iter().enumerate().find_map(|(way, record)| {
            let record = record.as_ref()?;
            (key.matches(&record.digest) && record.fresh(now)).then_some((way, record))
        })
    }

    /// Where an entry for `key` goes at `now`: its own way, else an empty or
    /// expired one, else the one expiring first (an eviction).
    pub fn place(&self, key: &CacheKey, now: u64) -> Placement {
        let own = self
            .ways
            .iter()
            .position(|r| r.as_ref().is_some_and(|record| key.matches(&record.digest)));
        if let Some(way) = own {
            return Placement { way, evicts: false };
        }
        let free = self
            .ways
            .iter()
            .position(|r| r.as_ref().is_none_or(|record| !record.fresh(now)));
        if let Some(way) = free {
            return Placement { way, evicts: false };
        }
        let way = (0..WAYS)
            .min_by_key(|&w| {
                self.ways
                    .get(w)
                    .and_then(|r| r.as_ref())
                    .map_or(0, |record| record.expires_at)
            })
            .unwrap_or(0);
        Placement { way, evicts: true }
    }

    /// Records `record` in `way` (ignored if `way` is out of range).
    pub fn put(&mut self, way: usize, record: WayRecord) {
        if let Some(slot) = self.ways.get_mut(way) {
            *slot = Some(record);
        }
    }
}

/// A stored response, as replayed on a hit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The request's full keyed digest (checked against the index and the request).
    pub digest: [u8; 32],
    /// Unix milliseconds when it was stored (must equal the index record's).
    pub stored_at_ms: u64,
    /// Upstream status (200: nothing else is stored).
    pub status: u16,
    /// The response headers kept for replay (`content-type`, …).
    pub headers: Vec<(String, String)>,
    /// The body as received: for a stream, the raw SSE bytes, framing included.
    pub body: Vec<u8>,
    /// Whether the response was an SSE stream.
    pub streamed: bool,
}

impl StoredResponse {
    /// Serializes for shared data.
    pub fn encode(&self) -> Vec<u8> {
        encode(self)
    }

    /// Parses a body slot; `None` when unreadable or of another version.
    pub fn decode(bytes: &[u8]) -> Option<StoredResponse> {
        match bytes.split_first() {
            Some((&VERSION, body)) => postcard::from_bytes(body).ok(),
            _ => None,
        }
    }

    /// Whether this body is the one `record` indexes for `key` (a writer may
    /// have replaced the slot between the two reads).
    pub fn belongs_to(&self, key: &CacheKey, record: &WayRecord) -> bool {
        key.matches(&self.digest) && self.stored_at_ms == record.stored_at_ms
    }
}

/// An entry as the fleet tier (Redis) holds it: the response and when it
/// goes stale, so a gateway that reads it can serve and re-index it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetEntry {
    /// Unix seconds from which it is stale.
    pub expires_at: u64,
    /// The response.
    pub response: StoredResponse,
}

impl FleetEntry {
    /// Serializes for Redis.
    pub fn encode(&self) -> Vec<u8> {
        encode(self)
    }

    /// Parses what Redis returned; `None` when unreadable or of another version.
    pub fn decode(bytes: &[u8]) -> Option<FleetEntry> {
        match bytes.split_first() {
            Some((&VERSION, body)) => postcard::from_bytes(body).ok(),
            _ => None,
        }
    }
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = vec![VERSION];
    // Serializing plain owned data into a Vec cannot fail.
    if let Ok(body) = postcard::to_allocvec(value) {
        out.extend(body);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> CacheKey {
        CacheKey([n; 32])
    }

    fn record(n: u8, expires_at: u64) -> WayRecord {
        WayRecord {
            digest: [n; 32],
            stored_at_ms: 1,
            expires_at,
            size: 10,
        }
    }

    #[test]
    fn layout_rounds_up_to_whole_sets_and_names_keys() {
        let layout = Layout::new(5);
        assert_eq!(layout.sets(), 3);
        assert_eq!(layout.capacity(), 6);
        assert_eq!(Layout::new(0).sets(), 1);
        assert_eq!(layout.index_key(2), "zl:cache:i:2");
        assert_eq!(layout.body_key(2, 1), "zl:cache:b:2:1");
        assert_eq!(layout.lease_key(0), "zl:cache:l:0");
        assert!(layout.set_of(&key(7)) < 3);
    }

    #[test]
    fn find_needs_the_same_digest_and_a_fresh_entry() {
        let mut set = SetIndex::default();
        set.put(1, record(7, 100));
        assert_eq!(set.find(&key(7), 99).map(|(w, _)| w), Some(1));
        assert_eq!(set.find(&key(7), 100), None, "stale at expires_at");
        assert_eq!(set.find(&key(8), 50), None);
    }

    #[test]
    fn placement_prefers_own_then_free_then_evicts_the_first_to_expire() {
        let mut set = SetIndex::default();
        assert_eq!(
            set.place(&key(1), 0),
            Placement {
                way: 0,
                evicts: false
            }
        );
        set.put(0, record(1, 100));
        assert_eq!(
            set.place(&key(2), 0),
            Placement {
                way: 1,
                evicts: false
            }
        );
        set.put(1, record(2, 50));
        assert_eq!(
            set.place(&key(1), 0),
            Placement {
                way: 0,
                evicts: false
            }
        );
        assert_eq!(
            set.place(&key(3), 0),
            Placement {
                way: 1,
                evicts: true
            }
        );
        // Way 1 expired: reused without evicting anything fresh.
        assert_eq!(
            set.place(&key(3), 60),
            Placement {
                way: 1,
                evicts: false
            }
        );
    }

    #[test]
    fn records_round_trip_and_garbage_reads_as_empty() {
        let mut set = SetIndex::default();
        set.put(0, record(1, 100));
        assert_eq!(SetIndex::decode(Some(&set.encode())), set);
        assert_eq!(SetIndex::decode(Some(b"\x09junk")), SetIndex::default());
        assert_eq!(SetIndex::decode(None), SetIndex::default());
        let stored = StoredResponse {
            digest: [1; 32],
            stored_at_ms: 1,
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream".into())],
            body: b"event: message_stop\ndata: {}\n\n".to_vec(),
            streamed: true,
        };
        assert_eq!(
            StoredResponse::decode(&stored.encode()),
            Some(stored.clone())
        );
        assert_eq!(StoredResponse::decode(b""), None);
        assert!(stored.belongs_to(&key(1), &record(1, 100)));
        let replaced = WayRecord {
            stored_at_ms: 2,
            ..record(1, 100)
        };
        assert!(!stored.belongs_to(&key(1), &replaced));
        assert!(!stored.belongs_to(&key(2), &record(1, 100)));
        let fleet = FleetEntry {
            expires_at: 100,
            response: stored,
        };
        assert_eq!(FleetEntry::decode(&fleet.encode()), Some(fleet));
        assert_eq!(FleetEntry::decode(b"\x01"), None);
    }
}
