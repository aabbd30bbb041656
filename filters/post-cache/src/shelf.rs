//! The local tier: entries, index and leases in the VM's shared data, laid
//! out by `zerolayer_core::cache::store` (bounded: shared data has no
//! delete).

use zerolayer_core::cache::control::{age, fresh_enough};
use zerolayer_core::cache::key::{CacheKey, Provider};
use zerolayer_core::cache::lease::{LeaseOutcome, LeaseTable};
use zerolayer_core::cache::store::{
    Layout, MAX_SLOT_OVERHEAD_BYTES, SetIndex, StoredResponse, WayRecord,
};
use zerolayer_core::reply;
use zerolayer_host::{Host, Respond};

/// A stored response found for a request.
pub(crate) struct Hit {
    pub response: StoredResponse,
    /// Seconds since it was stored (the `age` header).
    pub age: u64,
}

/// Access to the local tier.
pub(crate) struct Shelf {
    layout: Layout,
    /// Largest body slot stored (the cache's memory bound counts on it).
    max_slot_bytes: usize,
}

impl Shelf {
    pub(crate) fn new(max_entries: u32, max_entry_bytes: u32) -> Shelf {
        Shelf {
            layout: Layout::new(max_entries),
            max_slot_bytes: max_entry_bytes as usize + MAX_SLOT_OVERHEAD_BYTES,
        }
    }

    /// A fresh entry for `key` at `now` (seconds) no older than `max_age`.
    /// One small read on a miss; a second, of the body, on a match.
    pub(crate) fn lookup(
        &self,
        host: &mut impl Host,
        key: &CacheKey,
        now: u64,
        max_age: Option<u64>,
    ) -> Option<Hit> {
        let set = self.layout.set_of(key);
        let (index, _) = host.shared_get(&self.layout.index_key(set));
        let index = SetIndex::decode(index.as_deref());
        let (way, record) = index.find(key, now)?;
        let stored_at = record.stored_at_ms / 1000;
        if !fresh_enough(stored_at, record.expires_at, now, max_age) {
            return None;
        }
        let (body, _) = host.shared_get(&self.layout.body_key(set, way));
        let response = StoredResponse::decode(&body?)?;
        // A writer may have replaced the slot between the two reads.
        response.belongs_to(key, record).then(|| Hit {
            age: age(stored_at, now),
            response,
        })
    }

    /// Stores `response` for `key` until `expires_at` (seconds). Writes the
    /// body first, then the index, so the index never points at a body that
    /// is not there. Returns whether a fresh entry was evicted, or `None` if
    /// a write failed.
    pub(crate) fn store(
        &self,
        host: &mut impl Host,
        key: &CacheKey,
        response: &StoredResponse,
        expires_at: u64,
        now: u64,
    ) -> Option<bool> {
        let set = self.layout.set_of(key);
        let index_key = self.layout.index_key(set);
        let (index, _) = host.shared_get(&index_key);
        let placement = SetIndex::decode(index.as_deref()).place(key, now);
        let body = response.encode();
        if body.len() > self.max_slot_bytes {
            return None;
        }
        if !host.shared_put(&self.layout.body_key(set, placement.way), &body) {
            return None;
        }
        let record = WayRecord {
            digest: key.0,
            stored_at_ms: response.stored_at_ms,
            expires_at,
            size: u32::try_from(body.len()).unwrap_or(u32::MAX),
        };
        host.shared_update(&index_key, |current| {
            let mut index = SetIndex::decode(current);
            index.put(placement.way, record.clone());
            (index.encode(), ())
        })?;
        Some(placement.evicts)
    }

    /// Asks for `key`'s lease at `now_ms`.
    pub(crate) fn take_lease(
        &self,
        host: &mut impl Host,
        key: &CacheKey,
        now_ms: u64,
        ttl_ms: u64,
    ) -> LeaseOutcome {
        let lease_key = self.layout.lease_key(self.layout.set_of(key));
        host.shared_update(&lease_key, |current| {
            let mut table = LeaseTable::decode(current);
            let outcome = table.take(key, now_ms, ttl_ms);
            (table.encode(), outcome)
        })
        // Lost every CAS race: behave as if the table were full (go
        // upstream without a lease) rather than wait on nobody.
        .unwrap_or(LeaseOutcome::Full)
    }

    /// Whether someone holds `key`'s lease at `now_ms`.
    pub(crate) fn lease_held(&self, host: &mut impl Host, key: &CacheKey, now_ms: u64) -> bool {
        let lease_key = self.layout.lease_key(self.layout.set_of(key));
        let (current, _) = host.shared_get(&lease_key);
        LeaseTable::decode(current.as_deref())
            .held_until(key, now_ms)
            .is_some()
    }

    /// Releases `key`'s lease.
    pub(crate) fn release_lease(&self, host: &mut impl Host, key: &CacheKey) {
        let lease_key = self.layout.lease_key(self.layout.set_of(key));
        let _ = host.shared_update(&lease_key, |current| {
            let mut table = LeaseTable::decode(current);
            table.release(key);
            (table.encode(), ())
        });
    }
}

/// The response header a hit carries the stored response's own request id
/// in (the id of the request that reached the backend).
pub(crate) const ORIGIN_REQUEST_ID: &str = "x-cache-origin-request-id";

/// Answers the current request (of `provider`'s API) with a stored
/// response: its stored headers, `x-cache: HIT`, `age`, and this request's
/// own id in the header its client reads (the stored response's id is in
/// [`ORIGIN_REQUEST_ID`]): `request_id`, read by the stream (a root that
/// serves a waiting request has no stream headers to read it from).
pub(crate) fn serve(
    host: &mut impl Respond,
    hit: &Hit,
    provider: Provider,
    request_id: Option<&[u8]>,
) {
    let age = hit.age.to_string();
    let id_header = reply::request_id_header(Some(provider));
    let mut headers: Vec<(&str, &str)> = hit
        .response
        .headers
        .iter()
        .filter(|(n, _)| !n.eq_ignore_ascii_case(id_header))
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    headers.push(("x-cache", "HIT"));
    headers.push(("age", &age));
    if let Some(id) = request_id.and_then(|id| std::str::from_utf8(id).ok()) {
        headers.push((id_header, id));
    }
    if let Err(status) =
        host.send_response(u32::from(hit.response.status), &headers, &hit.response.body)
    {
        log::warn!("post-cache: could not send a cached response: {status:?}");
    }
}

#[cfg(test)]
mod tests {
    use zerolayer_core::cache::key::{CacheKey, Provider};
    use zerolayer_core::cache::lease::LeaseOutcome;
    use zerolayer_core::cache::store::{Layout, StoredResponse};
    use zerolayer_host::{FakeHost, Host, StreamHost};

    use super::{Hit, Shelf, serve};

    const NOW: u64 = 1_700_000_000;

    fn response(key: &CacheKey, stored_at: u64, body: &[u8]) -> StoredResponse {
        StoredResponse {
            digest: key.0,
            stored_at_ms: stored_at * 1000,
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
            body: body.to_vec(),
            streamed: false,
        }
    }

    /// One set of two ways: every key lands in it.
    fn one_set() -> Shelf {
        Shelf::new(2, 1 << 20)
    }

    #[test]
    fn a_stored_entry_is_found_with_its_age() {
        let (mut host, shelf, key) = (FakeHost::default(), one_set(), CacheKey([1; 32]));
        assert!(shelf.lookup(&mut host, &key, NOW, None).is_none());
        let stored = shelf.store(&mut host, &key, &response(&key, NOW, b"one"), NOW + 60, NOW);
        assert_eq!(stored, Some(false));
        let hit = shelf.lookup(&mut host, &key, NOW + 7, None).expect("a hit");
        assert_eq!(hit.age, 7);
        assert_eq!(hit.response.body, b"one");
        assert!(
            shelf
                .lookup(&mut host, &CacheKey([2; 32]), NOW, None)
                .is_none()
        );
    }

    #[test]
    fn an_expired_entry_or_one_older_than_max_age_is_not_served() {
        let (mut host, shelf, key) = (FakeHost::default(), one_set(), CacheKey([1; 32]));
        shelf.store(&mut host, &key, &response(&key, NOW, b"one"), NOW + 60, NOW);
        assert!(shelf.lookup(&mut host, &key, NOW + 10, Some(10)).is_some());
        assert!(shelf.lookup(&mut host, &key, NOW + 11, Some(10)).is_none());
        assert!(shelf.lookup(&mut host, &key, NOW + 59, None).is_some());
        assert!(shelf.lookup(&mut host, &key, NOW + 60, None).is_none());
    }

    #[test]
    fn a_body_slot_another_entry_replaced_is_a_miss() {
        let (mut host, shelf, key) = (FakeHost::default(), one_set(), CacheKey([1; 32]));
        shelf.store(&mut host, &key, &response(&key, NOW, b"one"), NOW + 60, NOW);
        // A writer raced the index: the slot now holds another key's body.
        let layout = Layout::new(2);
        let slot = layout.body_key(layout.set_of(&key), 0);
        let other = CacheKey([2; 32]);
        assert!(host.shared_put(&slot, &response(&other, NOW, b"two").encode()));
        assert!(shelf.lookup(&mut host, &key, NOW, None).is_none());
    }

    #[test]
    fn a_full_set_evicts_the_entry_that_expires_first() {
        let (mut host, shelf) = (FakeHost::default(), one_set());
        let keys = [CacheKey([1; 32]), CacheKey([2; 32]), CacheKey([3; 32])];
        let ttl = [30, 60, 60];
        for (i, key) in keys.iter().enumerate() {
            let evicted = shelf.store(&mut host, key, &response(key, NOW, b"x"), NOW + ttl[i], NOW);
            assert_eq!(evicted, Some(i == 2), "store {i}");
        }
        assert!(shelf.lookup(&mut host, &keys[0], NOW, None).is_none());
        assert!(shelf.lookup(&mut host, &keys[1], NOW, None).is_some());
        assert!(shelf.lookup(&mut host, &keys[2], NOW, None).is_some());
    }

    #[test]
    fn a_lease_is_exclusive_until_released_or_expired() {
        let (mut host, shelf, key) = (FakeHost::default(), one_set(), CacheKey([1; 32]));
        let now_ms = NOW * 1000;
        assert_eq!(
            shelf.take_lease(&mut host, &key, now_ms, 100),
            LeaseOutcome::Taken
        );
        assert_eq!(
            shelf.take_lease(&mut host, &key, now_ms + 1, 100),
            LeaseOutcome::HeldUntil(now_ms + 100)
        );
        assert!(shelf.lease_held(&mut host, &key, now_ms + 99));
        assert!(!shelf.lease_held(&mut host, &key, now_ms + 100), "expired");
        assert!(!shelf.lease_held(&mut host, &CacheKey([2; 32]), now_ms));
        shelf.release_lease(&mut host, &key);
        assert!(!shelf.lease_held(&mut host, &key, now_ms));
        assert_eq!(
            shelf.take_lease(&mut host, &key, now_ms, 100),
            LeaseOutcome::Taken
        );
    }

    #[test]
    fn a_hit_is_served_with_its_stored_headers_x_cache_and_age() {
        let mut host = FakeHost::default();
        let key = CacheKey([1; 32]);
        let hit = Hit {
            response: response(&key, NOW, b"{}\n"),
            age: 12,
        };
        host.set_request_header("x-request-id", b"this-request");
        let id = host.request_id();
        serve(&mut host, &hit, Provider::OpenAi, id.as_deref());
        let sent = &host.sent[0];
        assert_eq!(sent.status, 200);
        assert_eq!(
            sent.headers,
            [
                ("content-type".to_string(), "application/json".to_string()),
                ("x-cache".into(), "HIT".into()),
                ("age".into(), "12".into()),
                ("x-request-id".into(), "this-request".into()),
            ]
        );
        assert_eq!(sent.body, b"{}\n");
    }
}
