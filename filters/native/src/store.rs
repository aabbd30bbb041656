//! Process memory shared by Envoy's worker threads and the observer thread:
//! what Proxy-Wasm calls shared data (values with a compare-and-swap
//! version) and the observer's job queue. Both are bounded: a client that
//! mints a fresh credential or body per request fills neither past its
//! bound (a key past it is refused and counted, never an older key evicted:
//! the stages' counters, such as a token's unverified requests, must not
//! be forgotten by an attacker's churn).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tokio::sync::mpsc;
use zerolayer_host::Status;

/// Shards of [`SharedData`]: workers touching different keys rarely wait
/// on each other.
const SHARDS: usize = 16;

/// Shared data: values by key, each with its CAS version.
pub struct SharedData {
    shards: Vec<Mutex<Shard>>,
    /// Bounds per shard.
    max_entries: usize,
    max_bytes: usize,
    /// The next CAS version (never zero: zero means "no value").
    next_cas: AtomicU32,
    /// New keys refused at a bound.
    refused: AtomicU64,
}

#[derive(Default)]
struct Shard {
    map: HashMap<String, Entry>,
    bytes: usize,
}

struct Entry {
    value: Vec<u8>,
    cas: u32,
}

impl SharedData {
    /// Shared data holding at most `max_entries` keys and `max_bytes` of
    /// keys and values (each shard a sixteenth of both).
    pub fn new(max_entries: usize, max_bytes: usize) -> SharedData {
        SharedData {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            max_entries: max_entries.div_ceil(SHARDS).max(1),
            max_bytes: max_bytes.div_ceil(SHARDS).max(1),
            next_cas: AtomicU32::new(1),
            refused: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, Shard> {
        let index = xxhash_rust::xxh3::xxh3_64(key.as_bytes()) as usize % SHARDS;
        // A poisoned shard (a panic while holding it) still holds
        // consistent entries: every update below is one insert or replace.
        self.shards[index]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `key`'s value and CAS version.
    pub fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        let shard = self.shard(key);
        match shard.map.get(key) {
            Some(entry) => (Some(entry.value.clone()), Some(entry.cas)),
            None => (None, None),
        }
    }

    /// Writes `key` if its version is still `cas` (`None` or zero: whatever
    /// it is, as Proxy-Wasm's shared data). A new key past the bounds is
    /// refused (`Status::InternalFailure`).
    pub fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        let cas = cas.filter(|&cas| cas != 0);
        let mut shard = self.shard(key);
        let shard = &mut *shard;
        let version = self.version();
        match shard.map.get_mut(key) {
            Some(entry) => {
                if cas.is_some_and(|cas| cas != entry.cas) {
                    return Err(Status::CasMismatch);
                }
                let bytes = shard.bytes - entry.value.len() + value.len();
                if bytes > self.max_bytes && value.len() > entry.value.len() {
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(Status::InternalFailure);
                }
                shard.bytes = bytes;
                entry.value.clear();
                entry.value.extend_from_slice(value);
                entry.cas = version;
            }
            None => {
                if cas.is_some() {
                    return Err(Status::CasMismatch);
                }
                let size = key.len() + value.len();
                if shard.map.len() >= self.max_entries || shard.bytes + size > self.max_bytes {
                    self.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(Status::InternalFailure);
                }
                shard.bytes += size;
                shard.map.insert(
                    key.to_string(),
                    Entry {
                        value: value.to_vec(),
                        cas: version,
                    },
                );
            }
        }
        Ok(())
    }

    /// How many keys it holds.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().map(|s| s.map.len()).unwrap_or(0))
            .sum()
    }

    /// Whether it holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// New keys refused at a bound so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    fn version(&self) -> u32 {
        loop {
            let cas = self.next_cas.fetch_add(1, Ordering::Relaxed);
            if cas != 0 {
                return cas;
            }
        }
    }
}

/// The observer's job queue as the request path posts to it: bounded,
/// never blocking (a full queue refuses the job; the stage counts it).
#[derive(Clone)]
pub struct JobQueue {
    name: String,
    sender: mpsc::Sender<Vec<u8>>,
}

impl JobQueue {
    /// A queue named `name` holding at most `capacity` jobs, and the
    /// receiving end the observer drains.
    pub fn new(name: &str, capacity: usize) -> (JobQueue, mpsc::Receiver<Vec<u8>>) {
        let (sender, receiver) = mpsc::channel(capacity.max(1));
        (
            JobQueue {
                name: name.to_string(),
                sender,
            },
            receiver,
        )
    }

    /// The queue's name (what the stages' `observer.queue` names).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Posts `job` without waiting; `Err` when the queue is full or the
    /// observer has stopped.
    pub fn post(&self, job: &[u8]) -> Result<(), Status> {
        self.sender
            .try_send(job.to_vec())
            .map_err(|_| Status::InternalFailure)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_with_a_stale_version_is_refused_and_a_current_one_lands() {
        let data = SharedData::new(100, 10_000);
        assert_eq!(data.get("k"), (None, None));
        data.set("k", b"one", None).unwrap();
        let (value, cas) = data.get("k");
        assert_eq!(value.as_deref(), Some(&b"one"[..]));
        data.set("k", b"two", cas).unwrap();
        assert_eq!(data.set("k", b"three", cas), Err(Status::CasMismatch));
        assert_eq!(data.get("k").0.as_deref(), Some(&b"two"[..]));
        assert_eq!(data.set("new", b"x", Some(7)), Err(Status::CasMismatch));
    }

    #[test]
    fn fresh_keys_past_the_bound_are_refused_and_old_ones_kept() {
        let data = SharedData::new(SHARDS * 2, 1 << 20);
        let mut stored = 0;
        for i in 0..1000 {
            if data.set(&format!("token-{i}"), b"1", None).is_ok() {
                stored += 1;
            }
        }
        assert!(stored <= SHARDS * 2, "{stored} keys stored");
        assert_eq!(data.len(), stored);
        assert_eq!(data.refused(), 1000 - stored as u64);
        // What is there stays there, and can still be updated.
        assert_eq!(data.get("token-0").0.as_deref(), Some(&b"1"[..]));
        data.set("token-0", b"2", None).unwrap();
    }

    #[test]
    fn bytes_are_bounded_too() {
        let data = SharedData::new(10_000, SHARDS * 100);
        let big = vec![7u8; 60];
        let stored = (0..100)
            .filter(|i| data.set(&format!("k{i}"), &big, None).is_ok())
            .count();
        assert!(stored <= SHARDS, "{stored} values of 60 bytes stored");
        assert!(data.refused() > 0);
    }

    #[test]
    fn workers_racing_on_one_counter_lose_no_increment() {
        let data = std::sync::Arc::new(SharedData::new(100, 10_000));
        data.set("n", &0u64.to_le_bytes(), None).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let data = data.clone();
                std::thread::spawn(move || {
                    for _ in 0..500 {
                        loop {
                            let (value, cas) = data.get("n");
                            let n = u64::from_le_bytes(value.unwrap().try_into().unwrap());
                            if data.set("n", &(n + 1).to_le_bytes(), cas).is_ok() {
                                break;
                            }
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let n = u64::from_le_bytes(data.get("n").0.unwrap().try_into().unwrap());
        assert_eq!(n, 2000);
    }

    #[test]
    fn a_full_queue_refuses_without_waiting() {
        let (queue, mut receiver) = JobQueue::new("jobs", 2);
        assert!(queue.post(b"a").is_ok());
        assert!(queue.post(b"b").is_ok());
        assert_eq!(queue.post(b"c"), Err(Status::InternalFailure));
        assert_eq!(receiver.try_recv().ok().as_deref(), Some(&b"a"[..]));
        assert!(queue.post(b"c").is_ok());
    }
}
