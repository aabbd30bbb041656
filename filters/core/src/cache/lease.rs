//! Stampede protection: the first miss for a key takes a lease, so identical
//! concurrent requests wait for its response instead of all reaching the GPU.
//!
//! Leases live in one shared-data record per cache set (bounded, like the
//! cache: shared data has no delete) and are updated with CAS. A lease
//! expires on its own, so a holder that dies (VM restart, client gone)
//! blocks its followers for at most the lease TTL.

use serde::{Deserialize, Serialize};

use super::key::CacheKey;

/// Leases one set's record holds at most: beyond that, misses go upstream
/// without a lease rather than growing the record.
pub const MAX_LEASES_PER_SET: usize = 8;
/// Format version (first byte).
const VERSION: u8 = 1;

/// One lease: whose request is being computed, until when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The leased request's digest.
    pub digest: [u8; 32],
    /// Unix milliseconds from which the lease no longer counts.
    pub expires_at_ms: u64,
}

/// The leases of one cache set.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseTable {
    /// Leases, expired ones included until the next update drops them.
    pub leases: Vec<Lease>,
}

/// What asking for a lease found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseOutcome {
    /// The caller holds the lease now (write the table back with CAS).
    Taken,
    /// Another request holds it until this time (Unix ms): the caller is a follower.
    HeldUntil(u64),
    /// The set's table is full of live leases: go upstream without one.
    Full,
}

impl LeaseTable {
    /// Parses a lease record; anything unreadable is an empty table.
    pub fn decode(bytes: Option<&[u8]>) -> LeaseTable {
        match bytes.and_then(|b| b.split_first()) {
            Some((&VERSION, body)) => postcard::from_bytes(body).unwrap_or_default(),
            _ => LeaseTable::default(),
        }
    }

    /// Serializes for shared data.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![VERSION];
        // Serializing plain owned data into a Vec cannot fail.
        if let Ok(body) = postcard::to_allocvec(self) {
            out.extend(body);
        }
        out
    }

    /// Takes the lease for `key` at `now_ms` for `ttl_ms`, unless a live one
    /// exists. Drops expired leases on the way.
    pub fn take(&mut self, key: &CacheKey, now_ms: u64, ttl_ms: u64) -> LeaseOutcome {
        self.leases.retain(|l| l.expires_at_ms > now_ms);
        if let Some(held) = self.leases.iter().find(|l| key.matches(&l.digest)) {
            return LeaseOutcome::HeldUntil(held.expires_at_ms);
        }
        if self.leases.len() >= MAX_LEASES_PER_SET {
            return LeaseOutcome::Full;
        }
        self.leases.push(Lease {
            digest: key.0,
            expires_at_ms: now_ms.saturating_add(ttl_ms),
        });
        LeaseOutcome::Taken
    }

    /// The live lease for `key` at `now_ms`, if any (a follower checks it is still held).
    pub fn held_until(&self, key: &CacheKey, now_ms: u64) -> Option<u64> {
        self.leases
            .iter()
            .find(|l| l.expires_at_ms > now_ms && key.matches(&l.digest))
            .map(|l| l.expires_at_ms)
    }

    /// Releases the lease for `key`; returns whether there was one.
    pub fn release(&mut self, key: &CacheKey) -> bool {
        let before = self.leases.len();
        self.leases.retain(|l| !key.matches(&l.digest));
        self.leases.len() != before
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> CacheKey {
        CacheKey([n; 32])
    }

    #[test]
    fn first_takes_second_follows_until_release_or_expiry() {
        let mut table = LeaseTable::default();
        assert_eq!(table.take(&key(1), 1000, 500), LeaseOutcome::Taken);
        assert_eq!(
            table.take(&key(1), 1200, 500),
            LeaseOutcome::HeldUntil(1500)
        );
        assert_eq!(table.held_until(&key(1), 1499), Some(1500));
        assert_eq!(table.held_until(&key(1), 1500), None);
        // A dead holder's lease expires: the next miss takes it.
        assert_eq!(table.take(&key(1), 1500, 500), LeaseOutcome::Taken);
        assert!(table.release(&key(1)));
        assert!(!table.release(&key(1)));
        assert_eq!(table.take(&key(1), 1600, 500), LeaseOutcome::Taken);
    }

    #[test]
    fn a_full_table_refuses_instead_of_growing() {
        let mut table = LeaseTable::default();
        for n in 0..MAX_LEASES_PER_SET as u8 {
            assert_eq!(table.take(&key(n), 0, 100), LeaseOutcome::Taken);
        }
        assert_eq!(table.take(&key(200), 50, 100), LeaseOutcome::Full);
        // Expired leases make room.
        assert_eq!(table.take(&key(200), 100, 100), LeaseOutcome::Taken);
        assert_eq!(table.leases.len(), 1);
    }

    #[test]
    fn round_trips_and_garbage_is_empty() {
        let mut table = LeaseTable::default();
        table.take(&key(3), 0, 10);
        assert_eq!(LeaseTable::decode(Some(&table.encode())), table);
        assert_eq!(LeaseTable::decode(Some(b"\x07xx")), LeaseTable::default());
        assert_eq!(LeaseTable::decode(None), LeaseTable::default());
    }
}
