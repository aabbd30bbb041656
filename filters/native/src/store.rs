//! Process memory shared by Envoy's worker threads and the observer thread:
//! what Proxy-Wasm calls shared data (values with a compare-and-swap
//! version) and the observer's job queue. Both are bounded. Shared data
//! gives each purpose the stages' configurations declare (verdict sets,
//! per-credential counters, lazy-admission buckets, cache sets, a few
//! single keys: [`zerolayer_core::footprint`]) exactly the keys and bytes
//! that purpose may ever need, so a stage's own writes are never refused
//! and one purpose can never take another's room. A write past its
//! purpose's quota (a bug, or a key no stage declares) is refused and
//! counted, never an older key evicted: the stages' counters, such as a
//! token's unverified requests, must not be forgotten by anyone's churn.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tokio::sync::mpsc;
use zerolayer_core::footprint::{KeySpace, OTHER};
use zerolayer_host::Status;

/// Shards of [`SharedData`]: workers touching different keys rarely wait
/// on each other.
const SHARDS: usize = 16;

/// One purpose's quota and what it holds now.
struct Quota {
    space: KeySpace,
    keys: AtomicU64,
    bytes: AtomicU64,
    refused: AtomicU64,
}

impl Quota {
    /// Reserves one more key of `size` bytes, or refuses.
    fn reserve(&self, keys: u64, size: u64) -> bool {
        let ok = |counter: &AtomicU64, add: u64, max: u64| {
            counter
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    n.checked_add(add).filter(|&m| m <= max)
                })
                .is_ok()
        };
        if !ok(&self.keys, keys, self.space.keys) {
            return false;
        }
        if !ok(&self.bytes, size, self.space.bytes) {
            self.keys.fetch_sub(keys, Ordering::Relaxed);
            return false;
        }
        true
    }
}

/// Shared data: values by key, each with its CAS version.
pub struct SharedData {
    shards: Vec<Mutex<Shard>>,
    /// Quotas by purpose, longest prefix first; the last is [`OTHER`].
    quotas: Vec<Quota>,
    /// The next CAS version (never zero: zero means "no value").
    next_cas: AtomicU32,
}

#[derive(Default)]
struct Shard {
    map: HashMap<String, Entry>,
}

struct Entry {
    value: Vec<u8>,
    cas: u32,
}

impl SharedData {
    /// Shared data holding, for each purpose of `spaces` and for
    /// [`OTHER`], at most its keys and bytes.
    pub fn new(spaces: &[KeySpace]) -> SharedData {
        let mut spaces: Vec<KeySpace> = spaces.to_vec();
        spaces.sort_by_key(|s| std::cmp::Reverse(s.prefix.len()));
        spaces.push(OTHER);
        SharedData {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            quotas: spaces
                .into_iter()
                .map(|space| Quota {
                    space,
                    keys: AtomicU64::new(0),
                    bytes: AtomicU64::new(0),
                    refused: AtomicU64::new(0),
                })
                .collect(),
            next_cas: AtomicU32::new(1),
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

    /// The quota `key` counts against: its purpose's, else [`OTHER`].
    fn quota(&self, key: &str) -> &Quota {
        self.quotas
            .iter()
            .find(|q| key.starts_with(q.space.prefix))
            .unwrap_or(&self.quotas[self.quotas.len() - 1])
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
    /// it is, as Proxy-Wasm's shared data). A write past its purpose's
    /// quota is refused (`Status::InternalFailure`).
    pub fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), Status> {
        let cas = cas.filter(|&cas| cas != 0);
        let quota = self.quota(key);
        let mut shard = self.shard(key);
        let shard = &mut *shard;
        match shard.map.get_mut(key) {
            Some(entry) => {
                if cas.is_some_and(|cas| cas != entry.cas) {
                    return Err(Status::CasMismatch);
                }
                let (old, new) = (entry.value.len() as u64, value.len() as u64);
                if new > old && !quota.reserve(0, new - old) {
                    quota.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(Status::InternalFailure);
                }
                if old > new {
                    quota.bytes.fetch_sub(old - new, Ordering::Relaxed);
                }
                entry.value.clear();
                entry.value.extend_from_slice(value);
                entry.cas = self.version();
            }
            None => {
                if cas.is_some() {
                    return Err(Status::CasMismatch);
                }
                let size = (key.len() + value.len()) as u64;
                if !quota.reserve(1, size) {
                    quota.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(Status::InternalFailure);
                }
                let version = self.version();
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

    /// Writes refused at a quota so far.
    pub fn refused(&self) -> u64 {
        self.refused_by_purpose().iter().map(|(_, n)| n).sum()
    }

    /// Writes refused at a quota so far, by purpose.
    pub fn refused_by_purpose(&self) -> Vec<(&'static str, u64)> {
        self.quotas
            .iter()
            .map(|q| (q.space.purpose, q.refused.load(Ordering::Relaxed)))
            .collect()
    }

    /// Bytes held now under `purpose`'s quota.
    #[cfg(test)]
    fn bytes_held(&self, purpose: &str) -> u64 {
        self.quotas
            .iter()
            .find(|q| q.space.purpose == purpose)
            .map_or(0, |q| q.bytes.load(Ordering::Relaxed))
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

    fn space(purpose: &'static str, prefix: &'static str, keys: u64, bytes: u64) -> KeySpace {
        KeySpace {
            purpose,
            prefix,
            keys,
            bytes,
        }
    }

    fn plain() -> SharedData {
        SharedData::new(&[])
    }

    #[test]
    fn a_write_with_a_stale_version_is_refused_and_a_current_one_lands() {
        let data = plain();
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
    fn each_purpose_fills_only_its_own_quota_and_old_keys_are_kept() {
        let data = SharedData::new(&[
            space("verdicts", "v:", 10, 1 << 20),
            space("cache", "c:", 5, 1 << 20),
        ]);
        // A purpose's churn past its quota is refused and counted...
        let stored = (0..1000)
            .filter(|i| data.set(&format!("v:{i}"), b"1", None).is_ok())
            .count();
        assert_eq!(stored, 10);
        // ...and takes nothing from another purpose, nor from the rest.
        let cache = (0..5)
            .filter(|i| data.set(&format!("c:{i}"), b"1", None).is_ok())
            .count();
        assert_eq!(cache, 5);
        assert!(data.set("zl:auth:jwks", b"{}", None).is_ok());
        let refused: HashMap<_, _> = data.refused_by_purpose().into_iter().collect();
        assert_eq!(
            (refused["verdicts"], refused["cache"], refused["other"]),
            (990, 0, 0)
        );
        // What is there stays there, and can still be updated.
        assert_eq!(data.get("v:0").0.as_deref(), Some(&b"1"[..]));
        data.set("v:0", b"2", None).unwrap();
    }

    /// What stopped the native form (issue 28): ~92,000 fresh tokens filled
    /// a store of 100,000 keys for good. Now every key lazy-auth's shipped
    /// configuration can write, each value at its largest, fits.
    #[test]
    fn every_key_the_shipped_lazy_auth_may_write_fits_at_its_largest() {
        use zerolayer_core::auth::config::LazyAuthConfig;
        use zerolayer_core::auth::verdict::MAX_VERDICT_BYTES;
        let config = LazyAuthConfig::from_json(
            br#"{"credentials":[{"header":"authorization","scheme":"Bearer","kind":"jwt"}]}"#,
        )
        .unwrap();
        let data = SharedData::new(&config.key_spaces());
        let verdict_set = vec![2u8; 1 + 4 * (2 + MAX_VERDICT_BYTES)];
        let counter_set =
            vec![2u8; zerolayer_core::auth::exposure::max_set_bytes(config.verdict_ways)];
        for slot in 0..config.verdict_slots {
            data.set(&format!("zl:auth:verdict:{slot}"), &verdict_set, None)
                .unwrap();
            data.set(&format!("zl:auth:unverified:{slot}"), &counter_set, None)
                .unwrap();
        }
        for slot in 0..zerolayer_core::auth::budget::BUCKET_SLOTS {
            for scope in ["tenant", "client"] {
                data.set(&format!("zl:auth:budget:{scope}:{slot}"), &[1u8; 17], None)
                    .unwrap();
            }
        }
        assert_eq!(data.refused(), 0);
        assert_eq!(data.len(), 2 * 65_536 + 2 * 4096);
    }

    #[test]
    fn bytes_are_bounded_too_and_shrinking_gives_them_back() {
        let data = SharedData::new(&[space("verdicts", "v:", 10_000, 1000)]);
        let big = vec![7u8; 60];
        let stored = (0..100)
            .filter(|i| data.set(&format!("v:{i:02}"), &big, None).is_ok())
            .count();
        // 64 bytes each (key and value).
        assert_eq!(stored, 1000 / 64);
        // Growing an entry past the quota is refused; shrinking frees room.
        assert!(data.set("v:00", &[0u8; 200], None).is_err());
        data.set("v:00", b"", None).unwrap();
        assert!(data.set("v:99", &big, None).is_ok());
        assert!(data.bytes_held("verdicts") <= 1000);
    }

    #[test]
    fn workers_racing_on_one_counter_lose_no_increment() {
        let data = std::sync::Arc::new(plain());
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
