//! The store protocol: commands as RESP and as webdis bodies, replies
//! parsed (malformed ones are errors, never panics), and the scripts'
//! idempotency: replayed, duplicated and reordered operations against the
//! Rust model of Redis count exactly once.

use proptest::prelude::*;
use zerolayer_core::quota::store::{
    Applied, Command, CounterKeys, CounterKind, DeltaBuffer, DeltaReply, GrantReply, ModelStore,
    PendingDelta, Reply, ScriptShas, StoreError, delta_command, grant_command, parse_resp,
    parse_webdis, scope_digest, sha_from_reply,
};

const BUDGET: CounterKind = CounterKind::Budget {
    limit: 1_000,
    expire_at: 1_800_000_000,
};

fn keys(instance: u64) -> CounterKeys {
    CounterKeys::new(
        "zl:quota:",
        "daily",
        &[0xab; 16],
        Some(20_261_203),
        instance,
    )
}

#[test]
fn keys_carry_the_window_and_share_a_hash_slot() {
    let k = keys(0x1234);
    assert_eq!(
        k.counter,
        "zl:quota:{daily:abababababababababababababababab:20261203}"
    );
    assert_eq!(k.record, format!("{}:i:0000000000001234", k.counter));
    let rate = CounterKeys::new("p:", "rpm", &[0; 16], None, 1);
    assert_eq!(rate.counter, "p:{rpm:00000000000000000000000000000000}");
    // The digest is the same on every gateway and never the raw value.
    assert_eq!(
        scope_digest("daily", b"\x01\x04acme"),
        scope_digest("daily", b"\x01\x04acme")
    );
    assert_ne!(scope_digest("daily", b"k"), scope_digest("other", b"k"));
}

#[test]
fn commands_encode_as_resp_and_as_webdis_bodies() {
    let cmd = Command::new(["SET", "k", "a/b c\n"]);
    assert_eq!(
        cmd.resp(),
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$6\r\na/b c\n\r\n".to_vec()
    );
    assert_eq!(cmd.webdis_body(), b"SET/k/a%2Fb%20c%0A".to_vec());
    assert_eq!(cmd.verb(), "SET");
    // Without a known SHA, the script goes whole; with one, EVALSHA.
    let mut shas = ScriptShas::default();
    let eval = grant_command(&shas, &keys(1), BUDGET, 7, 3, 50);
    assert_eq!(eval.verb(), "EVAL");
    let args: Vec<String> = eval.args[2..]
        .iter()
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    assert_eq!(
        args,
        [
            "2",
            &keys(1).counter,
            &keys(1).record,
            "b",
            "1000",
            "1800000000",
            "7",
            "3",
            "50",
            "0"
        ]
    );
    shas.learn(zerolayer_core::quota::store::Script::Grant, &"A".repeat(40));
    shas.learn(zerolayer_core::quota::store::Script::Delta, "not-a-sha");
    let evalsha = grant_command(&shas, &keys(1), BUDGET, 7, 3, 50);
    assert_eq!(evalsha.verb(), "EVALSHA");
    assert_eq!(evalsha.args[1], "a".repeat(40).into_bytes());
    assert_eq!(
        delta_command(&shas, &keys(1), BUDGET, 8, -5).verb(),
        "EVAL",
        "an invalid SHA is not learned"
    );
    let rate = CounterKind::Rate {
        limit: 60,
        period_ms: 60_000,
    };
    let d = delta_command(&shas, &keys(1), rate, 9, -5);
    let tail: Vec<String> = d.args[5..]
        .iter()
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    assert_eq!(tail, ["r", "60", "60000", "9", "-5", "0", "86460000"]);
}

#[test]
fn replies_parse_from_resp_and_webdis() {
    let grant = parse_resp(b"*3\r\n:-5\r\n:10\r\n:0\r\n").unwrap();
    assert_eq!(
        GrantReply::from_reply(&grant).unwrap(),
        GrantReply {
            remaining: -5,
            granted: 10,
            status: Applied::Now
        }
    );
    let same = parse_webdis(br#"{"EVALSHA":[-5,10,0]}"#, "EVALSHA").unwrap();
    assert_eq!(same, grant);
    let delta = parse_webdis(br#"{"EVAL":[990,1]}"#, "EVAL").unwrap();
    assert_eq!(
        DeltaReply::from_reply(&delta).unwrap(),
        DeltaReply {
            remaining: 990,
            status: Applied::Replay
        }
    );
    let sha = "0123456789abcdef0123456789abcdef01234567";
    assert_eq!(
        sha_from_reply(
            &parse_webdis(format!(r#"{{"SCRIPT":"{sha}"}}"#).as_bytes(), "SCRIPT").unwrap()
        )
        .unwrap(),
        sha
    );
    assert_eq!(
        sha_from_reply(&parse_resp(format!("$40\r\n{sha}\r\n").as_bytes()).unwrap()).unwrap(),
        sha
    );
    // Errors: NOSCRIPT is its own (the observer sends EVAL again).
    let noscript = parse_webdis(
        br#"{"EVALSHA":[false,"NOSCRIPT No matching script."]}"#,
        "EVALSHA",
    )
    .unwrap();
    assert_eq!(GrantReply::from_reply(&noscript), Err(StoreError::NoScript));
    let err = parse_resp(b"-ERR wrong number of arguments\r\n").unwrap();
    assert_eq!(
        DeltaReply::from_reply(&err),
        Err(StoreError::Redis("ERR wrong number of arguments".into()))
    );
    assert_eq!(parse_resp(b"$-1\r\n").unwrap(), Reply::Bulk(None));
    assert_eq!(parse_resp(b"*-1\r\n").unwrap(), Reply::Array(None));
    assert_eq!(parse_resp(b"+OK\r\n").unwrap(), Reply::Status("OK".into()));
}

#[test]
fn malformed_replies_are_errors() {
    let resp: &[&[u8]] = &[
        b"",
        b":12",
        b":1x\r\n",
        b"$5\r\nabc\r\n",
        b"$3\r\nabcde\r\n",
        b"$-2\r\n",
        b"*2\r\n:1\r\n",
        b"*1000\r\n",
        b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n",
        b"?\r\n",
        b":1\r\n:2\r\n",
    ];
    for bytes in resp {
        assert!(
            matches!(parse_resp(bytes), Err(StoreError::Malformed(_))),
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
    }
    let webdis: &[&[u8]] = &[
        b"",
        b"not json",
        br#"{"GET":1}"#,
        br#"{"EVAL":1.5}"#,
        br#"{"EVAL":{}}"#,
        br#"[1]"#,
    ];
    for bytes in webdis {
        assert!(
            matches!(parse_webdis(bytes, "EVAL"), Err(StoreError::Malformed(_))),
            "{:?}",
            String::from_utf8_lossy(bytes)
        );
    }
    // Well-formed but not the script's shape.
    for reply in [
        Reply::Integer(3),
        Reply::Array(Some(vec![Reply::Integer(1)])),
        Reply::Array(Some(vec![
            Reply::Integer(1),
            Reply::Integer(-1),
            Reply::Integer(0),
        ])),
        Reply::Array(Some(vec![
            Reply::Integer(1),
            Reply::Integer(1),
            Reply::Integer(9),
        ])),
        Reply::Array(Some(vec![
            Reply::Integer(1),
            Reply::Bulk(None),
            Reply::Integer(0),
        ])),
    ] {
        assert!(
            matches!(
                GrantReply::from_reply(&reply),
                Err(StoreError::Malformed(_))
            ),
            "{reply:?}"
        );
    }
    assert!(sha_from_reply(&Reply::Bulk(Some(b"short".to_vec()))).is_err());
}

proptest! {
    #[test]
    fn no_bytes_make_the_parsers_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = parse_resp(&bytes);
        let _ = parse_webdis(&bytes, "EVAL");
        if let Ok(reply) = parse_resp(&bytes) {
            let _ = GrantReply::from_reply(&reply);
            let _ = DeltaReply::from_reply(&reply);
            let _ = sha_from_reply(&reply);
        }
    }

    #[test]
    fn resp_like_input_never_panics(parts in proptest::collection::vec(
        prop_oneof![Just("*".to_string()), Just(":".to_string()), Just("$".to_string()), Just("\r\n".to_string()),
                    Just("-".to_string()), (-3i64..50).prop_map(|n| n.to_string()), "[a-z]{0,4}"], 0..40)) {
        let bytes = parts.concat().into_bytes();
        let _ = parse_resp(&bytes);
    }
}

/// What the network does with a call.
#[derive(Debug, Clone)]
enum Fate {
    /// Lost on the way: not applied, no answer.
    Lost,
    /// Applied, the answer lost.
    AnswerLost,
    /// Applied and answered.
    Answered,
    /// Applied and answered, and a copy is delivered again `n` steps later.
    Duplicated(usize),
}

fn fate() -> impl Strategy<Value = Fate> {
    prop_oneof![
        1 => Just(Fate::Lost),
        1 => Just(Fate::AnswerLost),
        2 => Just(Fate::Answered),
        1 => (0usize..10).prop_map(Fate::Duplicated),
    ]
}

proptest! {
    /// A holder following the protocol (one operation per counter at a
    /// time, repeated with the same seq until answered) over a network that
    /// loses calls, loses answers, duplicates calls and delivers stale
    /// copies late (reordering them after newer ones): every delta counts
    /// exactly once.
    #[test]
    fn deltas_count_exactly_once_whatever_the_network_does(
        deltas in proptest::collection::vec(-20i64..100, 1..30),
        gaps in proptest::collection::vec(1u64..5, 30),
        fates in proptest::collection::vec(fate(), 200),
    ) {
        let mut store = ModelStore::new();
        let k = keys(77);
        let mut fates = fates.into_iter().cycle();
        let mut late: Vec<(usize, u64, i64)> = Vec::new(); // (due step, seq, delta)
        let mut seq = 1000; // seqs of other counters interleave: gaps
        let mut step = 0;
        // Start high enough that no prefix goes below 0 (a budget's floor).
        let mut expected = 10_000i64;
        store.delta(&k, BUDGET, seq, expected, 0);
        for (i, d) in deltas.iter().enumerate() {
            seq += gaps[i % gaps.len()];
            expected += d;
            loop {
                step += 1;
                // Late copies due now arrive first.
                for (_, s, dd) in late.iter().filter(|(due, ..)| *due <= step) {
                    let r = store.delta(&k, BUDGET, *s, *dd, 0);
                    prop_assert_eq!(r.status, Applied::Replay);
                }
                late.retain(|(due, ..)| *due > step);
                match fates.next().unwrap() {
                    Fate::Lost => continue,
                    Fate::AnswerLost => { store.delta(&k, BUDGET, seq, *d, 0); continue; }
                    Fate::Answered => { store.delta(&k, BUDGET, seq, *d, 0); break; }
                    Fate::Duplicated(n) => {
                        store.delta(&k, BUDGET, seq, *d, 0);
                        late.push((step + n, seq, *d));
                        break;
                    }
                }
            }
        }
        for (_, s, dd) in late {
            store.delta(&k, BUDGET, s, dd, 0);
        }
        prop_assert_eq!(store.counter(&k.counter), expected);
    }
}

#[test]
fn a_replayed_grant_repeats_its_answer() {
    let mut store = ModelStore::new();
    let k = keys(5);
    let first = store.grant(&k, BUDGET, 10, 0, 400, 0);
    assert_eq!(
        first,
        GrantReply {
            remaining: 600,
            granted: 400,
            status: Applied::Now
        }
    );
    // The answer was lost; the same seq again: the same grant, not a second one.
    let again = store.grant(&k, BUDGET, 10, 0, 400, 0);
    assert_eq!(
        again,
        GrantReply {
            remaining: 600,
            granted: 400,
            status: Applied::Replay
        }
    );
    assert_eq!(store.counter(&k.counter), 400);
    // Grants never pass the limit; a debt is charged past it.
    assert_eq!(store.grant(&k, BUDGET, 11, 0, 1_000, 0).granted, 600);
    let debt = store.grant(&k, BUDGET, 12, 25, 100, 0);
    assert_eq!(
        debt,
        GrantReply {
            remaining: -25,
            granted: 0,
            status: Applied::Now
        }
    );
    // An older seq than the last: not applied.
    assert_eq!(store.grant(&k, BUDGET, 9, 0, 10, 0).status, Applied::Stale);
    assert_eq!(store.counter(&k.counter), 1_025);
}

#[test]
fn a_restarted_holder_gets_a_fresh_instance_and_its_seqs_apply() {
    let mut store = ModelStore::new();
    let old = keys(1);
    store.delta(&old, BUDGET, 50, 30, 0);
    // Restarted with a new instance id: seq 1 is not mistaken for an old one.
    let new = keys(2);
    assert_eq!(new.counter, old.counter);
    assert_eq!(store.delta(&new, BUDGET, 1, 12, 0).status, Applied::Now);
    assert_eq!(store.counter(&old.counter), 42);
    // Many holders at once on an empty key: each counts once.
    for instance in 10..20 {
        let k = keys(instance);
        for _ in 0..3 {
            store.delta(&k, BUDGET, 1, 1, 0);
        }
    }
    assert_eq!(store.counter(&old.counter), 52);
}

#[test]
fn a_rate_counter_drains_and_grants_what_has_refilled() {
    let mut store = ModelStore::new();
    let k = CounterKeys::new("p:", "rpm", &[1; 16], None, 1);
    let rate = CounterKind::Rate {
        limit: 60,
        period_ms: 60_000,
    };
    assert_eq!(store.grant(&k, rate, 1, 0, 100, 0).granted, 60);
    assert_eq!(
        store.grant(&k, rate, 2, 0, 100, 10_000).granted,
        10,
        "10 s at 1/s"
    );
    assert_eq!(
        store.delta(&k, rate, 3, -5, 10_000).remaining,
        5,
        "a return"
    );
    let g = store.grant(&k, rate, 4, 20, 1, 10_000);
    assert_eq!(
        (g.granted, g.remaining),
        (0, -15),
        "a debt past the capacity"
    );
}

fn pending(seq: u64, delta: i64) -> PendingDelta {
    PendingDelta {
        keys: keys(1),
        kind: BUDGET,
        seq,
        delta,
    }
}

#[test]
fn the_delta_buffer_is_bounded_and_counts_what_it_drops() {
    let mut buffer = DeltaBuffer::new(3);
    for seq in 1..=5 {
        buffer.push(pending(seq, seq as i64));
    }
    assert_eq!(buffer.len(), 3);
    assert_eq!(buffer.dropped(), (2, 3), "seqs 1 and 2, amounts 1 + 2");
    assert_eq!(
        buffer.pending().map(|d| d.seq).collect::<Vec<_>>(),
        [3, 4, 5]
    );
    buffer.answered(4);
    assert_eq!(buffer.pending().map(|d| d.seq).collect::<Vec<_>>(), [3, 5]);
}

#[test]
fn a_full_delta_buffer_gives_up_returns_before_any_amount_a_counter_is_owed() {
    let mut buffer = DeltaBuffer::new(3);
    buffer.push(pending(1, 10));
    buffer.push(pending(2, -20));
    buffer.push(pending(3, 30));
    // Full: a new return is not taken.
    buffer.push(pending(4, -40));
    assert_eq!(buffer.returns_not_sent(), 1);
    // Full: a new debt takes the place of the waiting return, not of the
    // oldest debt.
    buffer.push(pending(5, 50));
    assert_eq!(
        buffer.pending().map(|d| d.seq).collect::<Vec<_>>(),
        [1, 3, 5]
    );
    assert_eq!((buffer.returns_not_sent(), buffer.dropped()), (2, (0, 0)));
    // No return left: the oldest debt goes, counted.
    buffer.push(pending(6, 60));
    assert_eq!(buffer.dropped(), (1, 10));
    assert_eq!(
        buffer.pending().map(|d| d.seq).collect::<Vec<_>>(),
        [3, 5, 6]
    );
}
