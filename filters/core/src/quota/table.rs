//! The leases one holder keeps, bounded whatever keys reach it: however
//! many scopes are active (no key part is the client's to mint: a model
//! counts on its own only if its policy lists it), the table fills at most
//! `max_leases` entries (4096 by default), never more memory.
//!
//! The table is set-associative ([`WAYS`] entries a set). A key's set is
//! chosen by xxh3 keyed with the holder's random seed, so a client cannot
//! aim its keys at a victim's set; within a set an entry is found by its
//! full key bytes, so two keys never share a lease, whatever their hashes.
//! A new key takes an empty way, else the least recently used way whose
//! lease is settled (nothing held, reserved, owed or in flight: forgetting
//! it leaves the store's counter right); when every way holds something,
//! the new key is refused ([`TableFull`]) until an idle lease has given
//! its amount back (`idle_return_ms`). Eviction is deterministic: the
//! same sequence of keys and times evicts the same entries.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::config::MAX_SCOPE_FIELDS;
use super::lease::Lease;
use super::store::scope_digest;

/// Entries per set.
pub const WAYS: usize = 4;
/// Longest scope key part kept as it is; a longer one is replaced by its
/// SHA-256 (still exact: no two values share a lease).
pub const MAX_SCOPE_PART: usize = 64;
/// The largest scope key in bytes: each part is a tag byte, a length byte
/// and at most [`MAX_SCOPE_PART`] bytes.
pub const MAX_SCOPE_KEY: usize = MAX_SCOPE_FIELDS * (2 + MAX_SCOPE_PART);

/// A scope key built on the stack (no allocation on the request path):
/// each part tagged and length-prefixed, so `("ab","c")` and `("a","bc")`
/// differ, and an absent value differs from an empty one.
#[derive(Clone)]
pub struct ScopeKey {
    len: usize,
    bytes: [u8; MAX_SCOPE_KEY],
}

impl std::fmt::Debug for ScopeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ScopeKey({} bytes)", self.len)
    }
}

impl Default for ScopeKey {
    fn default() -> Self {
        ScopeKey::new()
    }
}

/// Length byte of an absent part.
const ABSENT: u8 = 0xFF;
/// Length byte of a part replaced by its SHA-256.
const DIGESTED: u8 = 0xFE;

impl ScopeKey {
    /// An empty key (the one key of a policy with no scope).
    pub fn new() -> ScopeKey {
        ScopeKey {
            len: 0,
            bytes: [0; MAX_SCOPE_KEY],
        }
    }

    /// Appends part `tag` with `value` (`None`: absent). Parts beyond
    /// [`MAX_SCOPE_FIELDS`] are ignored (configuration refuses them).
    pub fn push(&mut self, tag: u8, value: Option<&[u8]>) {
        let digest;
        let (len, bytes): (u8, &[u8]) = match value {
            None => (ABSENT, &[]),
            Some(v) if v.len() <= MAX_SCOPE_PART => (v.len() as u8, v),
            Some(v) => {
                use sha2::{Digest, Sha256};
                digest = Sha256::digest(v);
                (DIGESTED, digest.as_slice())
            }
        };
        let end = self.len + 2 + bytes.len();
        // Written in place (no part built aside): this runs per policy per
        // request.
        if let Some(part) = self.bytes.get_mut(self.len..end) {
            part[0] = tag;
            part[1] = len;
            part[2..].copy_from_slice(bytes);
            self.len = end;
        }
    }

    /// Empties the key, to build another in its place.
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// A lease's place in the table: stale once the entry is evicted (its
/// generation changes), so a late settlement never lands on another key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotRef {
    /// The entry's index.
    pub index: u32,
    /// The entry's generation.
    pub generation: u32,
}

/// Every way of the key's set holds a lease that cannot be forgotten yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lease table set full")]
pub struct TableFull;

/// One entry.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The policy's index.
    pub policy: u8,
    /// The scope key's bytes.
    pub key: Box<[u8]>,
    /// The scope's store digest (names its counter fleet-wide).
    pub digest: [u8; 16],
    /// The lease.
    pub lease: Lease,
    generation: u32,
}

/// The table; see the module documentation.
#[derive(Debug, Clone)]
pub struct LeaseTable {
    entries: Vec<Option<Entry>>,
    sets: usize,
    seed: u64,
    next_generation: u32,
}

impl LeaseTable {
    /// A table of at least `max_leases` entries (rounded up to whole sets),
    /// its sets chosen with `seed` (random per holder).
    pub fn new(max_leases: usize, seed: u64) -> LeaseTable {
        let sets = max_leases.div_ceil(WAYS).max(1);
        LeaseTable {
            entries: vec![None; sets * WAYS],
            sets,
            seed,
            next_generation: 1,
        }
    }

    /// Entries the table can hold.
    pub fn capacity(&self) -> usize {
        self.entries.len()
    }

    /// Entries in use.
    pub fn len(&self) -> usize {
        self.entries.iter().filter(|e| e.is_some()).count()
    }

    /// Whether no entry is in use.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn set_of(&self, policy: u8, key: &[u8]) -> usize {
        // The policy tweaks the seed: one scope key in two policies lands
        // in unrelated sets.
        let seed = self.seed ^ u64::from(policy).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (xxh3_64_with_seed(key, seed) % self.sets as u64) as usize
    }

    /// The lease of (`policy`, `key`), made at `now_ms` (for budget window
    /// `window`) when absent; `policy_name` names its counter.
    pub fn find_or_insert(
        &mut self,
        policy: u8,
        policy_name: &str,
        key: &[u8],
        now_ms: u64,
        window: u64,
    ) -> Result<SlotRef, TableFull> {
        let base = self.set_of(policy, key) * WAYS;
        let ways = base..base + WAYS;
        for i in ways.clone() {
            if let Some(Some(e)) = self.entries.get(i)
                && e.policy == policy
                && *e.key == *key
            {
                return Ok(SlotRef {
                    index: i as u32,
                    generation: e.generation,
                });
            }
        }
        // An empty way, else the least recently used settled one (ties:
        // the lowest way), so eviction depends only on what happened.
        let victim = ways
            .clone()
            .find(|&i| matches!(self.entries.get(i), Some(None)))
            .or_else(|| {
                ways.filter_map(|i| match self.entries.get(i) {
                    Some(Some(e)) if e.lease.settled() => Some((e.lease.last_used_ms(), i)),
                    _ => None,
                })
                .min()
                .map(|(_, i)| i)
            })
            .ok_or(TableFull)?;
        let generation = self.next_generation;
        self.next_generation = self.next_generation.wrapping_add(1).max(1);
        let slot = self.entries.get_mut(victim).ok_or(TableFull)?;
        *slot = Some(Entry {
            policy,
            key: key.into(),
            digest: scope_digest(policy_name, key),
            lease: Lease::new(now_ms, window),
            generation,
        });
        Ok(SlotRef {
            index: victim as u32,
            generation,
        })
    }

    /// The entry at `slot`, if it is still the same lease.
    pub fn get_mut(&mut self, slot: SlotRef) -> Option<&mut Entry> {
        match self.entries.get_mut(slot.index as usize) {
            Some(Some(e)) if e.generation == slot.generation => Some(e),
            _ => None,
        }
    }

    /// The entry at `slot`, if it is still the same lease.
    pub fn get(&self, slot: SlotRef) -> Option<&Entry> {
        match self.entries.get(slot.index as usize) {
            Some(Some(e)) if e.generation == slot.generation => Some(e),
            _ => None,
        }
    }

    /// Every entry in use, in index order.
    pub fn iter(&self) -> impl Iterator<Item = &Entry> {
        self.entries.iter().flatten()
    }

    /// Every entry in use, in index order, with its place.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (SlotRef, &mut Entry)> {
        self.entries.iter_mut().enumerate().filter_map(|(i, e)| {
            let e = e.as_mut()?;
            Some((
                SlotRef {
                    index: i as u32,
                    generation: e.generation,
                },
                e,
            ))
        })
    }
}
