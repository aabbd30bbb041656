//! Charges quota's holders gave up on, end to end on a real Redis behind
//! webdis: a holder (quota's core, its store calls sent through webdis as
//! the stage sends them) admits lazily, hears no verdict within 60 s and
//! hands the tenant's charge to the store; `host-sim quota-reconcile`'s run
//! then charges it to the tenant an attribution row names, once however
//! often it runs, and leaves a forged credential's charge alone. Redis and
//! webdis are started per test on free ports (`RedisFleet`, installed by
//! `cargo xtask setup`); the test fails, never skips, when they cannot start.

use std::time::{SystemTime, UNIX_EPOCH};

use host_sim_tools::quota_reconcile::{self, Webdis};
use host_sim_tools::reconcile::read_attributions;
use serde_json::json;
use zerolayer_core::auth::attribution::{AttributionId, AttributionRecord, PendingCredential};
use zerolayer_core::auth::credential::{CredentialKind, TokenHash};
use zerolayer_core::quota::GatewayQuota;
use zerolayer_core::quota::config::QuotaConfig;
use zerolayer_core::quota::gateway::{Identity, Settlement};
use zerolayer_core::quota::late::{LATE_HORIZON_MS, LateScope};
use zerolayer_core::quota::reserve::{RequestBound, TokenCounts};
use zerolayer_core::quota::store::{
    Command, HAND_OFF_SCRIPT, Reply, StoreError, hand_off_command, hand_off_key,
};
use zerolayer_e2e::fleet::RedisFleet;

fn config(prefix: &str) -> QuotaConfig {
    let config = json!({
        "store": {"cluster": "webdis", "path": "/", "key_prefix": prefix,
                  "expected_gateways": 1, "lease": {"max_percent": 100}},
        "unverified": {"unit": "tokens", "limit": {"budget": {"amount": 100_000, "window": "day"}}},
        "policies": [{"name": "daily", "scope": ["tenant"], "unit": "tokens",
                      "limit": {"budget": {"amount": 100_000, "window": "day"}}}]
    });
    QuotaConfig::from_json(config.to_string().as_bytes()).expect("the test's configuration")
}

/// One sync of `q`: its calls sent through webdis, their answers handed back.
fn sync(q: &mut GatewayQuota, webdis: &Webdis, now: u64) {
    let mut calls = Vec::new();
    q.sync(now, &mut calls);
    for call in &calls {
        let reply = webdis
            .call(&call.command)
            .map_err(|e| StoreError::Unreachable(e.to_string()));
        q.on_reply(&call.target, reply, now);
    }
}

fn int(reply: Reply) -> i64 {
    match reply {
        Reply::Integer(n) => n,
        Reply::Bulk(Some(text)) => String::from_utf8_lossy(&text).parse().unwrap(),
        Reply::Bulk(None) => 0,
        other => panic!("not a number: {other:?}"),
    }
}

#[test]
fn a_charge_handed_off_is_made_once_on_the_tenant_an_attribution_names() {
    let fleet = RedisFleet::start_for_quota().expect("Redis and webdis");
    let webdis = Webdis::new(&format!("http://{}", fleet.webdis()));
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let prefix = format!("zl:reconcile:{now}:");
    let config = config(&prefix);
    let mut holder = GatewayQuota::new(&config, 0x0123_4567_89ab_cdef, 7).unwrap();

    // Two requests admitted before verification: a valid credential's and
    // a forged one's; the verifier is down, no verdict comes.
    let claimed = Identity {
        tenant: Some("acme"),
        model: Some("m"),
        ..Identity::default()
    };
    let bound = RequestBound::new(100, Some(10));
    assert!(
        holder.reserve(&claimed, &bound, false, now).is_err(),
        "no lease yet"
    );
    sync(&mut holder, &webdis, now);
    let valid = TokenHash::credential(CredentialKind::ApiKey, b"sk-valid");
    let forged = TokenHash::credential(CredentialKind::ApiKey, b"sk-forged");
    for (hash, output) in [(valid, 5), (forged, 9)] {
        let ticket = holder
            .reserve(&claimed, &bound, false, now + 1)
            .expect("the unverified lease covers it");
        let usage = Settlement::Usage(TokenCounts {
            input: 50,
            output,
            ..TokenCounts::default()
        });
        let scope = LateScope {
            model: Some("m".into()),
            ..LateScope::default()
        };
        let credential = PendingCredential { hash, slots: 16 };
        holder.settle_lazily(ticket, usage, credential, scope, None, now + 2);
    }
    let later = now + 2 + LATE_HORIZON_MS;
    assert_eq!(holder.settle_late(later, |_| None), 2, "both gave up on");
    assert_eq!(
        holder.stats(0).settled,
        0,
        "no tenant charged by the holder"
    );
    sync(&mut holder, &webdis, later + 1);
    assert_eq!(holder.late().counts().handed_off, 2);
    let key = hand_off_key(&prefix);
    assert_eq!(int(fleet.command(&["HLEN", &key]).unwrap()), 2);
    let ttl = int(fleet.command(&["TTL", &key]).unwrap());
    assert!(
        ttl > 30 * 86_400,
        "kept for a month past its last write: {ttl}"
    );

    // Lazy-auth's observer found the valid credential valid for acme.
    let mut rows = Vec::new();
    AttributionRecord {
        credential: AttributionId::of(&valid).render(),
        tenant: Some("acme".into()),
        subject: Some("alice".into()),
        at_ms: now + 3,
    }
    .write_sink_row(&mut rows);
    let attributions = read_attributions(rows.as_slice()).unwrap();

    // A dry run changes nothing.
    let reconciler = GatewayQuota::new(&config, 0, 0).unwrap();
    let dry = quota_reconcile::run(&webdis, &reconciler, &attributions, later + 10, true).unwrap();
    assert_eq!(dry.made.len(), 1);
    assert_eq!(int(fleet.command(&["HLEN", &key]).unwrap()), 2);

    let handed_off = webdis.hash(&key).unwrap();
    let report =
        quota_reconcile::run(&webdis, &reconciler, &attributions, later + 10, false).unwrap();
    assert_eq!(
        (report.made.len(), report.unattributed),
        (1, 1),
        "{report:?}"
    );
    let made = &report.made[0];
    assert_eq!(made.tenant.as_deref(), Some("acme"));
    let [counted] = made.counters.as_slice() else {
        panic!("one counter: {made:?}");
    };
    assert_eq!((counted.policy.as_str(), counted.amount), ("daily", 55));
    assert!(counted.added_now);
    let acme = || int(fleet.command(&["GET", &counted.counter]).unwrap());
    assert_eq!(acme(), 55, "acme's counter holds the charge");
    assert_eq!(
        int(fleet.command(&["HLEN", &key]).unwrap()),
        1,
        "the forged credential's charge stays"
    );

    // A run stopped between the delta and the delete finds the charge
    // again: it adds nothing more.
    let field = &made.field;
    let value = match fleet.command(&["HGET", &key, field]).unwrap() {
        Reply::Bulk(None) => None,
        other => Some(other),
    };
    assert_eq!(value, None, "deleted once made");
    let (_, stored) = handed_off
        .iter()
        .find(|(f, _)| f == field)
        .expect("the field was in the hash");
    webdis
        .call(&hand_off_command(&prefix, field, stored))
        .unwrap();
    let again = quota_reconcile::run(&webdis, &reconciler, &attributions, later + 20, false)
        .expect("a second run");
    assert_eq!(again.made.len(), 1);
    assert!(!again.made[0].counters[0].added_now, "{again:?}");
    assert_eq!(acme(), 55, "still once");
    assert_eq!(int(fleet.command(&["HLEN", &key]).unwrap()), 1);
}

/// The hand-off script on Redis itself: bounded, each field once.
#[test]
fn the_hand_off_hash_is_bounded_on_redis() {
    let fleet = RedisFleet::start_for_quota().expect("Redis and webdis");
    let key = format!("zl:handoff:{}", std::process::id());
    let put = |field: &str| {
        let command = Command::new(["EVAL", HAND_OFF_SCRIPT, "1", &key, field, "{}", "2", "60"]);
        let args: Vec<String> = command
            .args
            .iter()
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        int(fleet.command(&args).unwrap())
    };
    assert_eq!(put("a"), 1);
    assert_eq!(put("b"), 1);
    assert_eq!(put("a"), 1, "already there");
    assert_eq!(put("c"), 0, "full at 2");
    assert_eq!(int(fleet.command(&["HLEN", &key]).unwrap()), 2);
    let ttl = int(fleet.command(&["TTL", &key]).unwrap());
    assert!((1..=60).contains(&ttl), "{ttl}");
}
