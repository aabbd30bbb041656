//! A lease holder end to end against the Rust model of Redis: the first
//! request of a scope waits for its grant, reservations settle exactly,
//! unverified requests spend only the unverified budget, shadow policies
//! never refuse, the store going away and coming back, script reloads,
//! window roll-over, hard streams cut, and the counter coming back to what
//! was spent.

use serde_json::json;
use zerolayer_core::auth::attribution::{AttributionId, PendingCredential};
use zerolayer_core::auth::credential::{CredentialKind, TokenHash};
use zerolayer_core::auth::verdict::Verdict;
use zerolayer_core::quota::config::QuotaConfig;
use zerolayer_core::quota::gateway::{
    CallTarget, GatewayQuota, Identity, RefusalKind, Settlement, StoreCall, StreamVerdict,
};
use zerolayer_core::quota::late::{
    LATE_HORIZON_MS, LateCounts, LateScope, MAX_AWAITING, MAX_HANDING_OFF, UnsettledCharge,
};
use zerolayer_core::quota::reserve::{RequestBound, TokenCounts};
use zerolayer_core::quota::store::{
    CounterKeys, MAX_HANDED_OFF, ModelStore, Reply, StoreError, hand_off_command, hand_off_key,
};

const DAY_MS: u64 = 86_400_000;
/// 2026-12-03T00:00:00Z.
const T0: u64 = 1_796_256_000_000;

fn quota(config: serde_json::Value) -> GatewayQuota {
    let config = QuotaConfig::from_json(config.to_string().as_bytes()).unwrap();
    GatewayQuota::new(&config, 0xfeed, 0x5eed).unwrap()
}

fn daily(amount: u64) -> serde_json::Value {
    json!({
        "store": {"cluster": "webdis", "path": "/", "expected_gateways": 2},
        "unverified": {"unit": "requests", "limit": {"budget": {"amount": 3, "window": "day"}}},
        "policies": [{"name": "daily", "scope": ["tenant"], "unit": "tokens",
                      "limit": {"budget": {"amount": amount, "window": "day"}}}]
    })
}

fn tenant(name: &str) -> Identity<'_> {
    Identity {
        verified: true,
        tenant: Some(name),
        model: Some("m"),
        ..Identity::default()
    }
}

/// Runs one sync: every call answered by `store`; returns the calls made.
fn sync(q: &mut GatewayQuota, store: &mut ModelStore, now: u64) -> Vec<StoreCall> {
    let mut calls = Vec::new();
    q.sync(now, &mut calls);
    for call in &calls {
        let reply = store.execute(&call.command, now);
        q.on_reply(&call.target, Ok(reply), now);
    }
    calls
}

fn usage(input: u64, output: u64) -> Settlement {
    Settlement::Usage(TokenCounts {
        input,
        output,
        ..TokenCounts::default()
    })
}

fn counter(store: &ModelStore, policy: &str, q: &GatewayQuota, scope: &[u8], label: u64) -> i64 {
    let digest = zerolayer_core::quota::store::scope_digest(policy, scope);
    let _ = q;
    store.counter(&CounterKeys::new("zl:quota:", policy, &digest, Some(label), 0).counter)
}

#[test]
fn the_first_request_waits_for_a_grant_then_settles_exactly() {
    let mut q = quota(daily(100_000));
    let mut store = ModelStore::new();
    let bound = RequestBound::new(800, Some(200));
    let refused = q.reserve(&tenant("acme"), &bound, false, T0).unwrap_err();
    assert_eq!(
        refused.kind,
        RefusalKind::Refilling {
            retry_after_secs: 1
        }
    );
    assert_eq!(q.policy(refused.policy).unwrap().name, "daily");
    let calls = sync(&mut q, &mut store, T0);
    assert!(
        calls
            .iter()
            .any(|c| matches!(c.target, CallTarget::Load(_)))
    );
    // min(5 % of 100,000, 100,000 / (2 × 2)) = 5,000.
    let ticket = q.reserve(&tenant("acme"), &bound, false, T0 + 1).unwrap();
    assert_eq!(
        ticket.reserved(0),
        Some(1000),
        "800 body bytes + 200 max_tokens"
    );
    let shown = q.shown(&ticket, T0 + 1);
    let tokens = shown.tokens.unwrap();
    // Nothing is spent yet: the reservation in flight is not subtracted.
    assert_eq!((tokens.limit, tokens.remaining), (100_000, 100_000));
    q.settle(ticket, Some("m"), usage(150, 40), T0 + 2);
    let stats = q.stats(0);
    assert_eq!(
        (
            stats.admitted,
            stats.reserved,
            stats.settled,
            stats.refunded
        ),
        (1, 1000, 190, 810)
    );
    assert_eq!(
        counter(&store, "daily", &q, b"\x01\x04acme", 20_261_203),
        5000,
        "the lease, debited"
    );
    // Idle past idle_return_ms, the lease gives back all but what was spent.
    sync(&mut q, &mut store, T0 + 61_000);
    assert_eq!(
        counter(&store, "daily", &q, b"\x01\x04acme", 20_261_203),
        190,
        "the counter is what was spent"
    );
}

#[test]
fn unverified_requests_never_spend_the_tenant_they_claim() {
    let mut q = quota(daily(100_000));
    let mut store = ModelStore::new();
    let forged = Identity {
        verified: false,
        tenant: Some("victim"),
        ..Identity::default()
    };
    let bound = RequestBound::new(100, Some(10));
    assert!(
        q.reserve(&forged, &bound, false, T0).is_err(),
        "first: refilling"
    );
    sync(&mut q, &mut store, T0);
    let mut admitted = 0;
    for i in 0..10 {
        match q.reserve(&forged, &bound, false, T0 + 1 + i) {
            Ok(t) => {
                assert_eq!(t.policies().collect::<Vec<_>>(), [1], "only `unverified`");
                q.settle(t, None, Settlement::Unknown, T0 + 1 + i);
                admitted += 1;
            }
            Err(r) => {
                assert_eq!(q.policy(r.policy).unwrap().name, "unverified");
                // Refilling while the lease is small, exhausted once the fleet is.
                if let RefusalKind::BudgetExhausted { reset_at, .. } = r.kind {
                    assert_eq!(reset_at, ((T0 + DAY_MS) / 1000) as i64);
                }
            }
        }
        sync(&mut q, &mut store, T0 + 1 + i);
    }
    assert_eq!(admitted, 3, "the unverified budget: 3 a day, fleet-wide");
    assert_eq!(q.stats(0).admitted, 0, "the victim's budget untouched");
    // Verified, the tenant's own policy only.
    let t = q.reserve(&tenant("victim"), &bound, false, T0 + 100);
    assert!(
        matches!(t, Err(ref r) if r.policy == 0),
        "the tenant's lease: refilling"
    );
}

/// A credential lazy-auth admitted before verifying it, and its verdict
/// entry when valid for tenant `acme` (`Some(true)`) or invalid.
fn lazy_credential(valid: Option<bool>, now_ms: u64) -> (PendingCredential, Option<Vec<u8>>) {
    let hash = TokenHash::credential(CredentialKind::ApiKey, b"sk-late");
    let pending = PendingCredential { hash, slots: 16 };
    let now = now_ms / 1000;
    let entry = valid.map(|valid| match valid {
        true => Verdict::valid(&hash, now, None, 300, Some("acme".into()), None).encode(),
        false => Verdict::invalid(&hash, now, 60, "inactive").encode(),
    });
    (pending, entry)
}

/// `daily` with a 100,000-token unverified budget, both leases filled at
/// `T0` (as large as the fleet allows: no test here waits for a refill).
fn late_quota(store: &mut ModelStore) -> GatewayQuota {
    let mut q = quota(json!({
        "store": {"cluster": "webdis", "path": "/", "expected_gateways": 1,
                  "lease": {"max_percent": 100}},
        "unverified": {"unit": "tokens", "limit": {"budget": {"amount": 100_000, "window": "day"}}},
        "policies": [{"name": "daily", "scope": ["tenant"], "unit": "tokens",
                      "limit": {"budget": {"amount": 100_000, "window": "day"}}}]
    }));
    let bound = RequestBound::new(100, Some(10));
    let _ = q.reserve(&tenant("acme"), &bound, false, T0);
    let _ = q.reserve(&Identity::default(), &bound, false, T0);
    sync(&mut q, store, T0);
    q
}

fn lazily_admitted(q: &mut GatewayQuota, now: u64) -> zerolayer_core::quota::Ticket {
    let claimed = Identity {
        tenant: Some("mallory"),
        model: Some("m"),
        ..Identity::default()
    };
    let ticket = q
        .reserve(&claimed, &RequestBound::new(100, Some(10)), false, now)
        .expect("the unverified lease covers it");
    assert_eq!(
        ticket.policies().collect::<Vec<_>>(),
        [1],
        "only `unverified`"
    );
    ticket
}

fn late_scope() -> LateScope {
    LateScope {
        model: Some("m".into()),
        ..LateScope::default()
    }
}

#[test]
fn a_lazily_admitted_request_settles_to_the_tenant_its_credential_turns_out_to_have() {
    let mut store = ModelStore::new();
    let mut q = late_quota(&mut store);
    // Verified by the time its response ends: acme's too (never mallory's
    // claim); `unverified` keeps it, as it bounds what passes before
    // verification.
    let ticket = lazily_admitted(&mut q, T0 + 1);
    let (credential, entry) = lazy_credential(Some(true), T0);
    q.settle_lazily(
        ticket,
        usage(50, 5),
        credential,
        late_scope(),
        entry.as_deref(),
        T0 + 2,
    );
    assert_eq!(q.stats(0).settled, 55, "acme's budget charged");
    assert_eq!(q.stats(1).settled, 55, "and unverified's");
    assert_eq!(q.stats(1).refunded, 55);
    assert_eq!(q.late().counts().verified, 1);
    // Invalid: `unverified`'s for good.
    let ticket = lazily_admitted(&mut q, T0 + 3);
    let (credential, entry) = lazy_credential(Some(false), T0);
    q.settle_lazily(
        ticket,
        usage(50, 5),
        credential,
        late_scope(),
        entry.as_deref(),
        T0 + 4,
    );
    assert_eq!((q.stats(0).settled, q.stats(1).settled), (55, 110));
    // Not verified yet: it waits, its reservation held, until a sync reads
    // the verdict.
    let ticket = lazily_admitted(&mut q, T0 + 5);
    let (credential, entry) = lazy_credential(Some(true), T0);
    q.settle_lazily(ticket, usage(20, 2), credential, late_scope(), None, T0 + 6);
    assert_eq!(q.late().len(), 1);
    q.settle_late(T0 + 100, |_| None);
    assert_eq!(q.late().len(), 1, "still pending");
    let mut asked = Vec::new();
    q.settle_late(T0 + 200, |key| {
        asked.push(key.to_string());
        entry.clone()
    });
    assert_eq!(asked, [credential.verdict_key()]);
    assert!(q.late().is_empty());
    assert_eq!((q.stats(0).settled, q.stats(1).settled), (77, 132));
    assert_eq!(
        q.late().counts(),
        LateCounts {
            verified: 2,
            unverified: 1,
            ..LateCounts::default()
        }
    );
    // The store's counters come to exactly that once idle leases return.
    for t in [T0 + 1_000, T0 + 400_000] {
        sync(&mut q, &mut store, t);
    }
    assert_eq!(
        counter(&store, "daily", &q, b"\x01\x04acme", 20_261_203),
        77
    );
    assert_eq!(counter(&store, "unverified", &q, b"", 20_261_203), 132);
}

#[test]
fn a_tenant_minting_fresh_credentials_gets_at_most_the_unverified_budget_past_its_own() {
    // acme's budget: 10 tokens a day; `unverified`: 3 requests a day.
    let mut q = quota(daily(10));
    let mut store = ModelStore::new();
    let bound = RequestBound::new(100, Some(10));
    let claimed = Identity::default();
    let _ = q.reserve(&claimed, &bound, false, T0);
    sync(&mut q, &mut store, T0);
    let mut admitted = 0;
    for n in 0..10u64 {
        let now = T0 + 1 + n;
        if let Ok(ticket) = q.reserve(&claimed, &bound, false, now) {
            admitted += 1;
            // A fresh credential each time, each found valid for acme.
            let hash = TokenHash::credential(CredentialKind::ApiKey, format!("sk-{n}").as_bytes());
            let credential = PendingCredential { hash, slots: 16 };
            let entry = Verdict::valid(&hash, now / 1000, None, 300, Some("acme".into()), None);
            let scope = LateScope {
                model: Some("m".into()),
                ..LateScope::default()
            };
            q.settle_lazily(
                ticket,
                usage(50, 5),
                credential,
                scope,
                Some(&entry.encode()),
                now,
            );
        }
        sync(&mut q, &mut store, now);
    }
    assert_eq!(
        admitted, 3,
        "the unverified budget, not released by the moves"
    );
    assert_eq!(q.stats(0).settled, 3 * 55, "each charged to acme (as debt)");
}

#[test]
fn a_verdict_that_never_comes_leaves_the_usage_unverified_and_the_wait_is_bounded() {
    let mut store = ModelStore::new();
    let mut q = late_quota(&mut store);
    let (credential, _) = lazy_credential(None, T0);
    let ticket = lazily_admitted(&mut q, T0 + 1);
    q.settle_lazily(ticket, usage(50, 5), credential, late_scope(), None, T0 + 1);
    assert_eq!(q.settle_late(T0 + 1 + LATE_HORIZON_MS - 1, |_| None), 0);
    assert_eq!(q.late().len(), 1);
    assert_eq!(q.settle_late(T0 + 1 + LATE_HORIZON_MS, |_| None), 1);
    assert!(q.late().is_empty(), "settled past the horizon");
    assert_eq!((q.stats(0).settled, q.stats(1).settled), (0, 55));
    // A spray of fresh credentials: never more than MAX_AWAITING wait; the
    // oldest settle to `unverified` as new ones come.
    let spray = MAX_AWAITING + 50;
    for n in 0..spray {
        let ticket = lazily_admitted(&mut q, T0 + 10);
        let hash = TokenHash::credential(CredentialKind::ApiKey, format!("sk-{n}").as_bytes());
        let credential = PendingCredential { hash, slots: 16 };
        q.settle_lazily(ticket, usage(1, 0), credential, late_scope(), None, T0 + 10);
        assert!(q.late().len() <= MAX_AWAITING);
    }
    assert_eq!(q.late().len(), MAX_AWAITING);
    assert_eq!(
        q.late().counts().expired,
        1 + 50,
        "the horizon's and the spray's"
    );
    assert_eq!(
        q.stats(1).settled,
        55 + spray as u64,
        "each settled at once"
    );
    // Unknown usage is not moved: charged as reserved, to `unverified`.
    let ticket = lazily_admitted(&mut q, T0 + 20);
    let (credential, entry) = lazy_credential(Some(true), T0);
    q.settle_lazily(
        ticket,
        Settlement::Unknown,
        credential,
        late_scope(),
        entry.as_deref(),
        T0 + 20,
    );
    assert_eq!(
        (q.stats(0).settled, q.stats(1).settled),
        (0, 55 + spray as u64 + 110)
    );
    // Retiring the table gives up on the charges still waiting, counted.
    q.retire(T0 + 30);
    assert!(q.late().is_empty());
    let given_up = 1 + 50 + MAX_AWAITING as u64;
    assert_eq!(q.late().counts().expired, given_up);
    assert_eq!(q.stats(0).settled, 0);
    // Each was queued for the store's hand-off hash, at most
    // MAX_HANDING_OFF at once (no sync ran since): the oldest are lost.
    assert_eq!(q.late().handing_off(), MAX_HANDING_OFF);
    let lost = given_up - MAX_HANDING_OFF as u64;
    assert_eq!(q.late().counts().lost, lost);
    // The syncs store the rest, a few calls each.
    let mut syncs = 0;
    while q.late().handing_off() > 0 && syncs < 1_000 {
        sync(&mut q, &mut store, T0 + 40 + syncs);
        syncs += 1;
    }
    assert_eq!(q.late().handing_off(), 0);
    assert_eq!(q.late().counts().handed_off, MAX_HANDING_OFF as u64);
    assert_eq!(
        store.hash(&hand_off_key("zl:quota:")).map(|h| h.len()),
        Some(MAX_HANDING_OFF)
    );
}

/// The hand-off hash's entries: (field, charge).
fn handed_off(store: &ModelStore) -> Vec<(String, UnsettledCharge)> {
    let mut out: Vec<(String, UnsettledCharge)> = store
        .hash(&hand_off_key("zl:quota:"))
        .into_iter()
        .flatten()
        .map(|(field, value)| (field.clone(), serde_json::from_str(value).unwrap()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn a_charge_given_up_is_handed_off_and_reconciliation_makes_it_as_the_holder_would_have() {
    // Holder `late` never hears its verdict; holder `timely` (another
    // store: the same fleet's history) hears it at once.
    let (mut late_store, mut timely_store) = (ModelStore::new(), ModelStore::new());
    let mut late = late_quota(&mut late_store);
    let mut timely = late_quota(&mut timely_store);
    let (credential, entry) = lazy_credential(Some(true), T0);
    let scope = LateScope {
        credential: Some([7; 32]),
        model: Some("m".into()),
        ..LateScope::default()
    };
    for (q, verdict) in [(&mut late, None), (&mut timely, entry.as_deref())] {
        let ticket = lazily_admitted(q, T0 + 1);
        q.settle_lazily(
            ticket,
            usage(50, 5),
            credential,
            scope.clone(),
            verdict,
            T0 + 2,
        );
    }
    assert_eq!(timely.stats(0).settled, 55, "acme charged in time");
    assert_eq!(late.settle_late(T0 + 2 + LATE_HORIZON_MS, |_| None), 1);
    assert_eq!(late.stats(0).settled, 0, "acme not charged by the holder");
    sync(&mut late, &mut late_store, T0 + 3 + LATE_HORIZON_MS);
    assert_eq!(late.late().counts().handed_off, 1);
    let stored = handed_off(&late_store);
    let [(field, charge)] = stored.as_slice() else {
        panic!("one charge handed off: {stored:?}");
    };
    assert_eq!(
        charge,
        &UnsettledCharge {
            credential: AttributionId::of(&credential.hash).render(),
            at_ms: T0 + 2,
            settlement: usage(50, 5),
            input_bound: 100,
            credential_sha256: Some("07".repeat(32)),
            model: Some("m".into()),
            route: None,
            headers: Vec::new(),
        }
    );
    // Reconciliation, once an attribution row names acme: acme's counter
    // (the same key as the timely holder's), the same amount.
    let now = T0 + 3_600_000;
    let corrections = late.reconciliation(field, charge, Some("acme"), None, now);
    let acme = CounterKeys::new(
        "zl:quota:",
        "daily",
        &zerolayer_core::quota::store::scope_digest("daily", b"\x01\x04acme"),
        Some(20_261_203),
        0,
    );
    assert_eq!(
        corrections
            .iter()
            .map(|c| (c.policy.as_str(), c.counter.as_str(), c.amount))
            .collect::<Vec<_>>(),
        [("daily", acme.counter.as_str(), 55)]
    );
    for t in [T0 + 1_000, T0 + 400_000] {
        sync(&mut late, &mut late_store, t);
        sync(&mut timely, &mut timely_store, t);
    }
    let acme_counter = |store: &ModelStore| store.counter(&acme.counter);
    assert_eq!(acme_counter(&late_store), 0);
    assert_eq!(acme_counter(&timely_store), 55);
    // Applied twice (a run repeated, an answer lost): counted once.
    for _ in 0..2 {
        for c in &corrections {
            let reply = late_store.execute(&c.command, now);
            assert!(
                matches!(&reply, Reply::Array(Some(items)) if items.len() == 2),
                "{reply:?}"
            );
        }
    }
    assert_eq!(acme_counter(&late_store), acme_counter(&timely_store));
    // Charged to another tenant, it is that tenant's counter.
    let other = late.reconciliation(field, charge, Some("globex"), None, now);
    assert_eq!(other.len(), 1);
    assert_ne!(other[0].counter, acme.counter);
    // A malformed credential hash is charged nowhere rather than wrongly.
    let mut bad = charge.clone();
    bad.credential_sha256 = Some("zz".into());
    assert!(
        late.reconciliation(field, &bad, Some("acme"), None, now)
            .is_empty()
    );
}

#[test]
fn the_hand_off_hash_is_bounded_and_stores_a_field_once() {
    let mut store = ModelStore::new();
    let put = |store: &mut ModelStore, field: &str| {
        store.execute(&hand_off_command("zl:quota:", field, "{}"), T0)
    };
    for n in 0..MAX_HANDED_OFF {
        assert_eq!(put(&mut store, &n.to_string()), Reply::Integer(1));
    }
    assert_eq!(put(&mut store, "0"), Reply::Integer(1), "already there");
    assert_eq!(put(&mut store, "new"), Reply::Integer(0), "full");
}

#[test]
fn a_request_is_reserved_against_all_its_policies_or_none() {
    let mut q = quota(json!({
        "store": {"cluster": "webdis", "path": "/"},
        "policies": [
            {"name": "big", "unit": "tokens", "limit": {"budget": {"amount": 1_000_000, "window": "month"}}},
            {"name": "rpm", "scope": ["tenant"], "unit": "requests", "limit": {"rate": {"amount": 2, "per": "minute"}}}
        ]
    }));
    let mut store = ModelStore::new();
    let bound = RequestBound::new(10, Some(10));
    let _ = q.reserve(&tenant("a"), &bound, false, T0);
    sync(&mut q, &mut store, T0);
    let mut admitted = 0;
    let mut last = None;
    for i in 0..5 {
        match q.reserve(&tenant("a"), &bound, false, T0 + 10 + i) {
            Ok(t) => {
                admitted += 1;
                q.settle(t, None, usage(5, 5), T0 + 10 + i);
            }
            Err(r) => last = Some(r),
        }
        sync(&mut q, &mut store, T0 + 10 + i);
    }
    assert_eq!(admitted, 2, "2 a minute");
    let refusal = last.unwrap();
    assert_eq!(q.policy(refusal.policy).unwrap().name, "rpm");
    assert!(
        matches!(refusal.kind, RefusalKind::RateLimited { retry_after_secs } if (29..=30).contains(&retry_after_secs)),
        "{refusal:?}"
    );
    // The refused requests' reservations on `big` were released.
    assert_eq!(q.stats(0).admitted, 2);
    assert_eq!(q.stats(0).settled, 20);
}

#[test]
fn shadow_policies_count_but_never_refuse() {
    let mut q = quota(json!({
        "store": {"cluster": "webdis", "path": "/"},
        "policies": [{"name": "s", "scope": ["tenant"], "unit": "tokens", "mode": "shadow",
                      "limit": {"budget": {"amount": 100, "window": "day"}}}]
    }));
    let mut store = ModelStore::new();
    for i in 0..10 {
        let t = q
            .reserve(
                &tenant("a"),
                &RequestBound::new(30, Some(20)),
                false,
                T0 + i,
            )
            .unwrap();
        q.settle(t, None, usage(20, 10), T0 + i);
        sync(&mut q, &mut store, T0 + i);
    }
    let s = q.stats(0);
    assert_eq!((s.admitted, s.refused, s.settled), (10, 0, 300));
    assert!(s.shadow_refused >= 7, "{s:?}");
    // What it spent reaches the store as debt.
    sync(&mut q, &mut store, T0 + 100);
    assert_eq!(counter(&store, "s", &q, b"\x01\x01a", 20_261_203), 300);
}

#[test]
fn the_store_going_away_falls_back_then_catches_up() {
    let mut q = quota(daily(10_000));
    let mut store = ModelStore::new();
    let bound = RequestBound::new(50, Some(50));
    let _ = q.reserve(&tenant("a"), &bound, false, T0);
    sync(&mut q, &mut store, T0);
    // The store blackholed: every call times out.
    let fail = |q: &mut GatewayQuota, now| {
        let mut calls = Vec::new();
        q.sync(now, &mut calls);
        for c in &calls {
            q.on_reply(
                &c.target,
                Err(StoreError::Unreachable("timeout".into())),
                now,
            );
        }
    };
    let mut spent = 0;
    let mut now = T0 + 1;
    while now < T0 + 20_000 {
        if let Ok(t) = q.reserve(&tenant("a"), &bound, false, now) {
            q.settle(t, Some("m"), usage(50, 30), now);
            spent += 80;
        }
        fail(&mut q, now);
        now += 100;
    }
    assert!(q.store_down(now));
    // The held lease (500) and then the local share of the last known
    // remainder (9,500 / 2) were spent, no more.
    assert!(spent > 500 && spent <= 500 + 4_750, "{spent}");
    // The store is back: the debt is charged, the counter is what was spent
    // once idle leases are returned.
    sync(&mut q, &mut store, now);
    assert!(!q.store_down(now));
    sync(&mut q, &mut store, now + 61_000);
    assert_eq!(
        counter(&store, "daily", &q, b"\x01\x01a", 20_261_203),
        spent as i64
    );
}

#[test]
fn a_restarted_redis_gets_the_scripts_again() {
    let mut q = quota(daily(10_000));
    let mut store = ModelStore::new();
    let _ = q.reserve(&tenant("a"), &RequestBound::new(10, Some(10)), false, T0);
    sync(&mut q, &mut store, T0);
    let t = q
        .reserve(
            &tenant("a"),
            &RequestBound::new(10, Some(10)),
            false,
            T0 + 1,
        )
        .unwrap();
    q.settle(t, None, usage(4000, 400), T0 + 1); // past the lease: debt to charge
    store.flush_scripts();
    let calls = sync(&mut q, &mut store, T0 + 2);
    assert!(calls.iter().all(|c| c.command.verb() == "EVALSHA"));
    assert_eq!(q.store_errors(), 0, "NOSCRIPT is not an error, a reload");
    let calls = sync(&mut q, &mut store, T0 + 3);
    let verbs: Vec<String> = calls.iter().map(|c| c.command.verb()).collect();
    assert!(
        verbs.contains(&"SCRIPT".to_string()) && verbs.contains(&"EVAL".to_string()),
        "{verbs:?}"
    );
    sync(&mut q, &mut store, T0 + 61_000);
    assert_eq!(counter(&store, "daily", &q, b"\x01\x01a", 20_261_203), 4400);
}

#[test]
fn a_new_window_starts_at_zero_and_late_debt_lands_in_the_old_one() {
    let mut q = quota(daily(1_000));
    let mut store = ModelStore::new();
    let end = T0 + DAY_MS;
    let _ = q.reserve(
        &tenant("a"),
        &RequestBound::new(10, Some(10)),
        false,
        end - 10_000,
    );
    sync(&mut q, &mut store, end - 10_000);
    let t = q
        .reserve(
            &tenant("a"),
            &RequestBound::new(10, Some(10)),
            false,
            end - 5_000,
        )
        .unwrap();
    q.settle(t, None, usage(60, 10), end - 1); // 50 past the 20 reserved and the 50 lease
    // The day ends before the debt is sent: it goes to the old day's counter.
    sync(&mut q, &mut store, end);
    sync(&mut q, &mut store, end + 1);
    assert_eq!(counter(&store, "daily", &q, b"\x01\x01a", 20_261_203), 70);
    assert!(q.orphans().is_empty());
    // The tenant was active a moment ago: its lease is refilled at once in
    // the new day, from a counter that starts at 0.
    assert_eq!(
        counter(&store, "daily", &q, b"\x01\x01a", 20_261_204),
        50,
        "one fresh lease"
    );
    let t = q
        .reserve(
            &tenant("a"),
            &RequestBound::new(10, Some(10)),
            false,
            end + 2,
        )
        .unwrap();
    q.settle(t, None, usage(5, 5), end + 3);
    sync(&mut q, &mut store, end + 3);
    assert_eq!(counter(&store, "daily", &q, b"\x01\x01a", 20_261_204), 50);
}

#[test]
fn an_ended_day_keeps_only_what_was_used_even_by_a_request_that_straddles_midnight() {
    let mut q = quota(daily(100_000));
    let mut store = ModelStore::new();
    let end = T0 + DAY_MS;
    let bound = RequestBound::new(800, Some(200));
    let _ = q.reserve(&tenant("a"), &bound, false, end - 10_000);
    sync(&mut q, &mut store, end - 10_000);
    let before = q.reserve(&tenant("a"), &bound, false, end - 5_000).unwrap();
    q.settle(before, Some("m"), usage(150, 40), end - 4_000);
    let straddling = q.reserve(&tenant("a"), &bound, false, end - 1_000).unwrap();
    sync(&mut q, &mut store, end + 1);
    assert_eq!(
        counter(&store, "daily", &q, b"\x01\x01a", 20_261_203),
        5_000,
        "the lease as granted while a request of the day is in flight"
    );
    q.settle(straddling, Some("m"), usage(100, 50), end + 2_000);
    sync(&mut q, &mut store, end + 2_001);
    assert_eq!(
        counter(&store, "daily", &q, b"\x01\x01a", 20_261_203),
        190 + 150,
        "the unspent grant back once the last request settled: what was used"
    );
    assert!(q.orphans().is_empty());
    // The new day: a lease granted at once, given back when idle.
    sync(&mut q, &mut store, end + 70_000);
    assert_eq!(counter(&store, "daily", &q, b"\x01\x01a", 20_261_204), 0);
    // Retired, a lease still in a day that ended sends what it owes that
    // day, not the new one.
    let _ = q.reserve(&tenant("b"), &bound, false, end + 80_000);
    sync(&mut q, &mut store, end + 80_000);
    let t = q
        .reserve(&tenant("b"), &bound, false, end + 80_001)
        .unwrap();
    q.settle(t, Some("m"), usage(10, 10), end + 80_002);
    q.retire(end + DAY_MS + 1);
    sync(&mut q, &mut store, end + DAY_MS + 2);
    assert_eq!(counter(&store, "daily", &q, b"\x01\x01b", 20_261_204), 20);
    assert_eq!(counter(&store, "daily", &q, b"\x01\x01b", 20_261_205), 0);
}

#[test]
fn returns_at_a_window_end_never_push_a_debt_out_of_a_full_delta_buffer() {
    // Both orders of the two leases in the table: one rolls first.
    for (debtor, saver) in [("a", "b"), ("b", "a")] {
        let mut config = daily(1_000);
        config["store"]["max_buffered_deltas"] = json!(1);
        let mut q = quota(config);
        let mut store = ModelStore::new();
        let end = T0 + DAY_MS;
        let bound = RequestBound::new(10, Some(10));
        for who in [debtor, saver] {
            let _ = q.reserve(&tenant(who), &bound, false, end - 10_000);
        }
        sync(&mut q, &mut store, end - 10_000);
        let t = q
            .reserve(&tenant(debtor), &bound, false, end - 5_000)
            .unwrap();
        q.settle(t, None, usage(60, 10), end - 1); // 20 past its lease of 50
        let t = q
            .reserve(&tenant(saver), &bound, false, end - 5_000)
            .unwrap();
        q.settle(t, None, usage(5, 5), end - 1); // 40 of its 50 unspent
        sync(&mut q, &mut store, end);
        sync(&mut q, &mut store, end + 1);
        let day = |who: &str| {
            let key = [b"\x01\x01".as_slice(), who.as_bytes()].concat();
            counter(&store, "daily", &q, &key, 20_261_203)
        };
        assert_eq!(day(debtor), 70, "{debtor}'s debt reached its day");
        assert!(day(saver) >= 10, "{saver}'s day never under what it used");
    }
}

#[test]
fn a_hard_stream_is_cut_when_its_lease_cannot_cover_the_next_chunk() {
    let mut q = quota(json!({
        "store": {"cluster": "webdis", "path": "/", "lease": {"max_percent": 100}},
        "defaults": {"stream": "hard"},
        "policies": [{"name": "d", "scope": ["tenant"], "unit": "tokens",
                      "limit": {"budget": {"amount": 400, "window": "day"}}}]
    }));
    let mut store = ModelStore::new();
    let bound = RequestBound::new(100, Some(10_000));
    let _ = q.reserve(&tenant("a"), &bound, true, T0);
    sync(&mut q, &mut store, T0);
    // Reserves only its input bound (100), though max_tokens is 10,000.
    let mut t = q.reserve(&tenant("a"), &bound, true, T0 + 1).unwrap();
    assert_eq!(t.reserved(0), Some(100));
    let mut output = 0;
    let verdict = loop {
        output += 16;
        match q.draw(&mut t, None, output, T0 + 2) {
            StreamVerdict::Continue => continue,
            StreamVerdict::Cut => break output,
        }
    };
    // The lease is 100 (the fleet's 400 over 2 × 2 holders by default);
    // the first draw past it is charged and cuts the stream.
    assert!(verdict > 0 && verdict <= 16 + 400, "{verdict}");
    q.settle(
        t,
        None,
        Settlement::Partial {
            input: Some(40),
            delivered_output: verdict,
        },
        T0 + 3,
    );
    assert_eq!(q.stats(0).cuts, 1);
    // Not streamed, the same request reserves its whole bound: too large.
    let r = q.reserve(&tenant("b"), &bound, false, T0 + 4).unwrap_err();
    assert_eq!(
        r.kind,
        RefusalKind::TooLarge {
            amount: 10_100,
            limit: 400
        }
    );
}

#[test]
fn a_hard_stream_refilled_when_due_is_cut_at_the_budget_not_at_its_lease() {
    // One holder, a 10,000-token budget, leases of at most 5 % (500): a
    // stream drawing 16 tokens an event, with the holder syncing whenever
    // the stream's lease says a refill is due (the stage does so from the
    // response), runs to the budget; without those syncs it is cut where
    // its first lease runs dry.
    let config = json!({
        "store": {"cluster": "webdis", "path": "/", "expected_gateways": 1},
        "defaults": {"stream": "hard"},
        "policies": [{"name": "d", "scope": ["tenant"], "unit": "tokens",
                      "limit": {"budget": {"amount": 10_000, "window": "day"}}}]
    });
    let run = |refill: bool| {
        let mut q = quota(config.clone());
        let mut store = ModelStore::new();
        let bound = RequestBound::new(100, Some(100_000));
        let _ = q.reserve(&tenant("a"), &bound, true, T0);
        sync(&mut q, &mut store, T0);
        let mut t = q.reserve(&tenant("a"), &bound, true, T0 + 1).unwrap();
        let (mut output, mut syncs) = (0u64, 0);
        loop {
            output += 16;
            if q.draw(&mut t, None, output, T0 + 2) == StreamVerdict::Cut {
                break;
            }
            if refill && q.refill_due(&t, T0 + 2) {
                syncs += 1;
                sync(&mut q, &mut store, T0 + 2);
            }
            assert!(!q.refill_due(&t, T0 + 2) || !refill, "due after its sync");
        }
        (100 + output, syncs)
    };
    let (alone, _) = run(false);
    assert!(alone <= 500 + 16, "cut at its first lease: {alone}");
    let (refilled, syncs) = run(true);
    assert!(syncs > 5, "{syncs} refills");
    // Cut within one event of the budget (the last leases shrink to half
    // what the fleet has left, down to one token).
    assert!(
        (10_000 - 500..=10_000 + 16).contains(&refilled),
        "billed {refilled} of 10,000"
    );
}

#[test]
fn trusted_headers_scope_but_are_never_shared_across_values() {
    let mut q = quota(json!({
        "trusted_headers": ["x-team"],
        "store": {"cluster": "webdis", "path": "/"},
        "policies": [{"name": "team", "scope": [{"header": "x-team"}], "unit": "requests",
                      "limit": {"budget": {"amount": 1000, "window": "day"}}}]
    }));
    let mut store = ModelStore::new();
    const RED: &[Option<&str>] = &[Some("red")];
    const BLUE: &[Option<&str>] = &[Some("blue")];
    let who = |h: &'static [Option<&'static str>]| Identity {
        verified: true,
        headers: h,
        ..Identity::default()
    };
    let _ = q.reserve(&who(RED), &RequestBound::default(), false, T0);
    let _ = q.reserve(&who(BLUE), &RequestBound::default(), false, T0);
    sync(&mut q, &mut store, T0);
    assert_eq!(q.table().len(), 2);
    let t = q
        .reserve(&who(RED), &RequestBound::default(), false, T0 + 1)
        .unwrap();
    q.settle(t, None, Settlement::Unknown, T0 + 1);
}

#[test]
fn made_up_model_names_share_one_key_so_a_client_mints_no_budget_or_lease() {
    let mut q = quota(json!({
        "store": {"cluster": "webdis", "path": "/", "max_leases": 16},
        "policies": [{"name": "per-model", "scope": ["tenant", "model"], "models": ["gpt-4o"],
                      "unit": "requests", "limit": {"budget": {"amount": 5, "window": "day"}}}]
    }));
    let mut store = ModelStore::new();
    let who = |model: Option<&'static str>| Identity {
        verified: true,
        tenant: Some("acme"),
        model,
        ..Identity::default()
    };
    let names: Vec<&'static str> = (0..200).map(|i| &*format!("made-up-{i}").leak()).collect();
    // Each request names a fresh model (a backend that ignores the name,
    // such as llama.cpp's server, serves them all); syncs in between give
    // every key the refills it asks for.
    let mut admitted = 0;
    let mut now = T0;
    for name in names.iter().copied().map(Some).chain([None]) {
        for _ in 0..2 {
            if let Ok(t) = q.reserve(&who(name), &RequestBound::default(), false, now) {
                q.settle(t, name, usage(10, 10), now);
                admitted += 1;
                break;
            }
            sync(&mut q, &mut store, now);
            now += 1;
        }
    }
    assert_eq!(
        admitted, 5,
        "200 made-up names and a request naming none share one budget of 5"
    );
    assert_eq!(q.table().len(), 1, "one lease for every unlisted model");
    // A listed model keeps its own budget.
    let mut listed = 0;
    for _ in 0..10 {
        match q.reserve(&who(Some("gpt-4o")), &RequestBound::default(), false, now) {
            Ok(t) => {
                q.settle(t, Some("gpt-4o"), usage(10, 10), now);
                listed += 1;
            }
            Err(_) => {
                sync(&mut q, &mut store, now);
            }
        }
        now += 1;
    }
    assert_eq!(listed, 5);
    assert_eq!(q.table().len(), 2);
    sync(&mut q, &mut store, now + 61_000);
    let other = counter(&store, "per-model", &q, b"\x01\x04acme\x06\xff", 20_261_203);
    let own = counter(
        &store,
        "per-model",
        &q,
        b"\x01\x04acme\x04\x06gpt-4o",
        20_261_203,
    );
    assert_eq!((other, own), (5, 5), "each counter is what was spent");
}

#[test]
fn webdis_answers_drive_the_same_protocol() {
    let mut q = quota(daily(10_000));
    let mut store = ModelStore::new();
    let _ = q.reserve(&tenant("a"), &RequestBound::new(10, Some(10)), false, T0);
    let mut calls = Vec::new();
    q.sync(T0, &mut calls);
    for call in &calls {
        let reply = store.execute(&call.command, T0);
        let body = json!({ call.command.verb(): webdis_json(&reply) }).to_string();
        q.on_webdis_response(call, Some(200), body.as_bytes(), T0);
    }
    assert!(
        q.reserve(
            &tenant("a"),
            &RequestBound::new(10, Some(10)),
            false,
            T0 + 1
        )
        .is_ok()
    );
    // An HTTP failure is the store being unreachable; garbage is an error.
    let mut calls = Vec::new();
    q.sync(T0 + 10_000, &mut calls);
    let call = calls
        .iter()
        .find(|c| matches!(c.target, CallTarget::Lease { .. }))
        .unwrap();
    q.on_webdis_response(call, Some(502), b"", T0 + 10_000);
    assert_eq!((q.store_unreachable(), q.store_errors()), (1, 0));
    assert!(
        !q.store_down(T0 + 10_999),
        "failing, not yet for two sync intervals"
    );
    assert!(q.store_down(T0 + 11_000));
    q.on_webdis_response(call, Some(200), b"{\"EVALSHA\":", T0 + 10_001);
    assert_eq!(q.store_errors(), 1);
}

fn webdis_json(reply: &Reply) -> serde_json::Value {
    match reply {
        Reply::Integer(n) => json!(n),
        Reply::Bulk(Some(b)) => json!(String::from_utf8_lossy(b)),
        Reply::Bulk(None) | Reply::Array(None) => serde_json::Value::Null,
        Reply::Status(s) => json!([true, s]),
        Reply::Error(s) => json!([false, s]),
        Reply::Array(Some(items)) => items.iter().map(webdis_json).collect(),
    }
}

#[test]
fn a_request_larger_than_twice_the_lease_is_not_given_back_before_its_retry() {
    // 200 tokens: leases of 10 (5 %), a request of ~180 needs a grant of its
    // own; the syncs between its refusal and its retry must not return it.
    let mut q = quota(daily(200));
    let mut store = ModelStore::new();
    let bound = RequestBound::new(80, Some(100));
    let who = tenant("acme");
    assert!(matches!(
        q.reserve(&who, &bound, false, T0),
        Err(e) if matches!(e.kind, RefusalKind::Refilling { .. })
    ));
    for i in 1..=3 {
        sync(&mut q, &mut store, T0 + i * 500);
    }
    let ticket = q
        .reserve(&who, &bound, false, T0 + 2000)
        .expect("the grant it asked for is still there");
    q.settle(ticket, Some("m"), usage(7, 5), T0 + 2100);
    // Idle, everything is given back: the counter is what was used.
    sync(&mut q, &mut store, T0 + 2100 + 61_000);
    sync(&mut q, &mut store, T0 + 2100 + 62_000);
    let total: i64 = store
        .counters()
        .filter(|(k, _)| !k.contains(":i:"))
        .map(|(_, v)| v)
        .sum();
    assert_eq!(total, 12);
}

#[test]
fn remaining_does_not_dip_while_a_surplus_return_is_on_its_way() {
    let mut q = quota(daily(100_000));
    let mut store = ModelStore::new();
    let bound = RequestBound::new(80, Some(100));
    let who = tenant("acme");
    let _ = q.reserve(&who, &bound, false, T0);
    sync(&mut q, &mut store, T0 + 500);
    let ticket = q.reserve(&who, &bound, false, T0 + 600).unwrap();
    let before = q.shown(&ticket, T0 + 600).tokens.unwrap().remaining;
    q.settle(ticket, Some("m"), usage(7, 5), T0 + 700);
    // Idle: the next sync sends everything back; its answer is not in yet.
    let mut calls = Vec::new();
    q.sync(T0 + 700 + 61_000, &mut calls);
    assert!(!calls.is_empty(), "a return is sent");
    let ticket = q
        .reserve(&who, &RequestBound::new(0, Some(0)), false, T0 + 61_800)
        .expect("a request of no tokens fits");
    let during = q.shown(&ticket, T0 + 61_800).tokens.unwrap().remaining;
    assert_eq!(during, before - 12, "only what was used is gone");
}

#[test]
fn a_budget_too_short_for_the_request_says_what_is_left_and_what_it_may_cost() {
    let mut q = quota(daily(10_000));
    let mut store = ModelStore::new();
    // 100 body bytes + 150 max_tokens: 250 reserved; each spends 230.
    let bound = RequestBound::new(100, Some(150));
    let who = tenant("acme");
    let mut spent = 0;
    let mut now = T0;
    let refusal = loop {
        now += 10;
        match q.reserve(&who, &bound, false, now) {
            Ok(ticket) => {
                q.settle(ticket, Some("m"), usage(100, 130), now);
                spent += 230;
            }
            Err(r) if matches!(r.kind, RefusalKind::Refilling { .. }) => {}
            Err(r) => break r,
        }
        sync(&mut q, &mut store, now);
        assert!(spent <= 10_000, "never past the budget");
    };
    assert_eq!(spent, 43 * 230, "admitted while 250 fit");
    assert_eq!(
        refusal.kind,
        RefusalKind::BudgetExhausted {
            reset_at: ((T0 + DAY_MS) / 1000) as i64,
            remaining: 10_000 - 43 * 230,
            amount: 250,
        }
    );
}

#[test]
fn the_injected_cap_is_the_smallest_enforcing_token_policys_default() {
    let mut q = quota(json!({
        "store": {"cluster": "webdis", "path": "/"},
        "defaults": {"default_max_output_tokens": 2048},
        "inject_max_tokens": true,
        "policies": [
            {"name": "month", "unit": "tokens", "limit": {"budget": {"amount": 1_000_000, "window": "month"}}},
            {"name": "team", "scope": ["tenant"], "unit": "tokens", "default_max_output_tokens": 300,
             "limit": {"budget": {"amount": 1_000_000, "window": "day"}}},
            {"name": "watch", "scope": ["tenant"], "unit": "tokens", "mode": "shadow",
             "default_max_output_tokens": 10, "limit": {"budget": {"amount": 1_000_000, "window": "day"}}},
            {"name": "rpm", "scope": ["tenant"], "unit": "requests", "default_max_output_tokens": 20,
             "limit": {"rate": {"amount": 100, "per": "minute"}}}
        ]
    }));
    let mut store = ModelStore::new();
    let bound = RequestBound::new(10, None);
    let _ = q.reserve(&tenant("a"), &bound, false, T0);
    sync(&mut q, &mut store, T0);
    let ticket = q.reserve(&tenant("a"), &bound, false, T0 + 1).unwrap();
    // `team` (300) wins; `month` (2048) is covered by it; the shadow
    // policy and the requests policy limit nothing.
    assert_eq!(q.output_cap(&ticket), Some(300));
    // Its reservation covers what the backend will then produce.
    assert_eq!(ticket.reserved(1), Some(10 + 300));
    q.settle(ticket, None, usage(5, 5), T0 + 2);
}
