//! Lease arithmetic (reserve, settle, refund, debt, draws), refills and
//! their sizes, expiry and the fallbacks, window roll-over; the reservation
//! bound; the lease table's bound and eviction.

use proptest::prelude::*;
use zerolayer_core::cache::key::Provider;
use zerolayer_core::quota::config::{Fallback, Rates, Unit, WeightTable};
use zerolayer_core::quota::lease::{Draw, EndedWindow, Lease, LeaseOp, LeaseParams, Shortfall};
use zerolayer_core::quota::reserve::{CostModel, RequestBound, TokenCounts, with_output_cap};
use zerolayer_core::quota::table::{LeaseTable, MAX_SCOPE_PART, ScopeKey, TableFull};
use zerolayer_core::usage::{RequestScan, Usage};

fn params() -> LeaseParams {
    LeaseParams {
        limit: 10_000,
        rate_period_ms: None,
        max_lease: 500,
        low_watermark_percent: 25,
        max_debt: 0,
        expected_gateways: 4,
        ttl_ms: 5000,
        idle_ms: 60_000,
        fallback: Fallback::LocalShare,
    }
}

/// A lease granted `amount` by the store at `now`, the fleet left with `remaining`.
fn granted(amount: u64, remaining: i64, now: u64, p: &LeaseParams) -> Lease {
    let mut lease = Lease::new(now, 0);
    lease.reserve(amount, now, p, false, false); // refused: records the want
    let op = lease.next_op(now, 1, p).unwrap();
    assert!(matches!(op.op, LeaseOp::Grant { .. }));
    assert!(lease.answered(1, amount, remaining, now));
    lease
}

#[test]
fn reserve_settle_and_refund() {
    let p = params();
    let mut lease = granted(100, 9_900, 0, &p);
    assert_eq!(lease.available(), 100);
    let (r, short) = lease.reserve(30, 1, &p, false, false);
    assert_eq!(short, None);
    assert_eq!(
        (r.amount, lease.reserved(), lease.available()),
        (30, 30, 70)
    );
    lease.settle(r, 12);
    assert_eq!(
        (lease.reserved(), lease.spent(), lease.available()),
        (0, 12, 88)
    );
    // A second settle of the same reservation would be the caller's bug; an
    // earlier epoch's is ignored (see roll below).
    let (a, _) = lease.reserve(80, 2, &p, false, false);
    let (b, short) = lease.reserve(9, 2, &p, false, false);
    assert_eq!(b.amount, 0, "not covered: nothing reserved");
    assert_eq!(
        short,
        Some(Shortfall::Refilling),
        "the fleet had 9,900 left"
    );
    lease.settle(a, 80);
    assert_eq!(lease.available(), 8);
}

#[test]
fn an_empty_fleet_is_exhausted_not_refilling() {
    let p = params();
    let mut lease = granted(10, 5, 0, &p);
    let (_, short) = lease.reserve(15, 0, &p, false, false);
    assert_eq!(
        short,
        Some(Shortfall::Refilling),
        "10 held + 5 in the fleet cover it"
    );
    let (_, short) = lease.reserve(16, 0, &p, false, false);
    assert_eq!(
        short,
        Some(Shortfall::Exhausted {
            retry_after_secs: None
        })
    );
    let fresh = &mut Lease::new(0, 0);
    assert_eq!(
        fresh.reserve(1, 0, &p, false, false).1,
        Some(Shortfall::Refilling),
        "before the store's first answer, a new lease waits for its grant"
    );
}

#[test]
fn debt_beyond_beta_blocks_until_a_grant_charges_it() {
    let mut p = params();
    p.max_debt = 50;
    let mut lease = granted(100, 0, 0, &p);
    let (r, short) = lease.reserve(140, 0, &p, false, false);
    assert_eq!(short, None, "100 held + β 50 cover 140");
    assert_eq!(lease.debt(), 40);
    let (_, short) = lease.reserve(11, 0, &p, false, false);
    assert!(short.is_some(), "40 of β's 50 used: 11 more is past it");
    // Settles above its reservation: more debt.
    lease.settle(r, 160);
    assert_eq!(lease.debt(), 60);
    // The next grant charges the debt unconditionally (force) and grants nothing more.
    let op = lease.next_op(0, 2, &p).unwrap();
    assert!(matches!(op.op, LeaseOp::Grant { force: 60, .. }), "{op:?}");
    lease.answered(2, 0, -60, 1);
    assert_eq!(lease.debt(), 0);
    // β was used up by the charged debt: the lease may not overdraw again
    // in this window (else each cycle would add β past the limit).
    assert_eq!(lease.credit(1, &p), 0);
    assert!(lease.reserve(1, 1, &p, false, false).1.is_some());
}

#[test]
fn a_rate_lease_credits_beta_again_a_period_later() {
    let mut p = params();
    p.rate_period_ms = Some(60_000);
    p.max_debt = 10;
    let mut lease = granted(5, 0, 0, &p);
    let (r, _) = lease.reserve(15, 0, &p, false, false);
    lease.settle(r, 15);
    let op = lease.next_op(0, 2, &p).unwrap();
    assert!(matches!(op.op, LeaseOp::Grant { force: 10, .. }));
    lease.answered(2, 0, -10, 0);
    assert_eq!(lease.credit(59_999, &p), 0);
    assert_eq!(lease.credit(60_000, &p), 10);
}

#[test]
fn a_rate_refusal_says_when_enough_has_refilled() {
    let mut p = params();
    p.limit = 600; // 10 a second
    p.rate_period_ms = Some(60_000);
    let mut lease = granted(0, 20, 0, &p);
    let (_, short) = lease.reserve(50, 0, &p, false, false);
    assert_eq!(
        short,
        Some(Shortfall::Exhausted {
            retry_after_secs: Some(3)
        }),
        "30 missing at 10/s"
    );
    let (_, short) = lease.reserve(50, 2000, &p, false, false);
    assert_eq!(
        short,
        Some(Shortfall::Exhausted {
            retry_after_secs: Some(1)
        }),
        "2 s later"
    );
}

#[test]
fn streams_draw_beyond_their_reservation_from_the_lease() {
    let p = params();
    let mut lease = granted(100, 0, 0, &p);
    let (mut r, _) = lease.reserve(40, 0, &p, false, false); // the input bound
    assert_eq!(lease.draw(&mut r, 40, 20, 0, &p), Draw::Covered);
    assert_eq!((r.amount, lease.available()), (60, 40));
    assert_eq!(lease.draw(&mut r, 60, 40, 0, &p), Draw::Covered);
    assert_eq!(lease.available(), 0);
    // The next chunk is not covered: charged all the same (it was produced).
    assert_eq!(lease.draw(&mut r, 100, 7, 0, &p), Draw::Uncovered);
    assert_eq!(lease.debt(), 7);
    lease.settle(r, 107);
    assert_eq!(lease.debt(), 7);
    // Draws inside the reservation never touch the lease.
    let mut other = granted(100, 0, 0, &p);
    let (mut r, _) = other.reserve(100, 0, &p, false, false);
    assert_eq!(other.draw(&mut r, 10, 80, 0, &p), Draw::Covered);
    assert_eq!(other.reserved(), 100);
}

#[test]
fn leases_shrink_as_the_fleet_nears_its_limit() {
    let p = params(); // max 500, 4 holders
    let at = |remaining: i64| granted(0, remaining, 0, &p).size(&p);
    assert_eq!(at(10_000), 500, "far from the limit: the largest lease");
    assert_eq!(at(2_000), 250, "remaining / (2 × 4)");
    assert_eq!(at(80), 10);
    assert_eq!(at(3), 1);
    assert_eq!(at(0), 1, "still asks, to learn of a top-up");
    assert_eq!(
        Lease::new(0, 0).size(&p),
        500,
        "before any answer: from the limit"
    );
}

#[test]
fn refills_come_at_the_low_watermark_and_surplus_goes_back() {
    let p = params();
    let mut lease = granted(500, 9_500, 0, &p);
    assert!(!lease.needs_refill(1, &p));
    let (r, _) = lease.reserve(370, 1, &p, false, false);
    assert!(!lease.needs_refill(1, &p), "130 left of 500: above 25 %");
    lease.settle(r, 370);
    let (r, _) = lease.reserve(6, 1, &p, false, false);
    assert!(lease.needs_refill(1, &p), "124 left: below 125");
    let op = lease.next_op(1, 2, &p).unwrap();
    assert_eq!(
        op.op,
        LeaseOp::Grant {
            force: 0,
            asked: 500
        }
    );
    assert!(lease.next_op(1, 3, &p).is_none(), "one operation at a time");
    assert!(
        !lease.answered(99, 500, 0, 2),
        "an answer to another seq changes nothing"
    );
    assert!(lease.answered(2, 500, 9_000, 2));
    lease.settle(r, 0);
    assert_eq!(lease.available(), 630);
    // The fleet is nearly spent: the size drops to 9000/8 = 1125 → 500 cap;
    // with 1,000 left, to 125, and what is held past twice that goes back.
    let mut near = granted(620, 1_000, 0, &p);
    // Kept for the request that asked for it until it comes...
    assert!(near.next_op(1, 5, &p).is_none());
    let (r, _) = near.reserve(620, 1, &p, false, false);
    near.settle(r, 0);
    // ...then what is held past twice the size goes back.
    let op = near.next_op(1, 5, &p).unwrap();
    assert_eq!(op.op, LeaseOp::Return { amount: 370 });
    assert_eq!(near.available(), 250, "taken out at once");
    near.answered(5, 0, 1_370, 2);
    // Idle past idle_return_ms: all of it goes back.
    let op = near.next_op(2 + 60_001, 6, &p).unwrap();
    assert_eq!(op.op, LeaseOp::Return { amount: 250 });
    near.answered(6, 0, 1_620, 70_000);
    assert!(near.settled(), "nothing held: the lease may be forgotten");
}

#[test]
fn a_failed_call_is_sent_again_with_the_same_seq() {
    let p = params();
    let mut lease = Lease::new(0, 0);
    lease.reserve(10, 0, &p, false, false);
    let op = lease.next_op(0, 7, &p).unwrap();
    assert!(lease.resend().is_none(), "still awaiting");
    lease.unanswered(7);
    let again = lease.resend().unwrap();
    assert_eq!((again.seq, again.op), (op.seq, op.op));
    assert!(lease.resend().is_none());
}

#[test]
fn past_expiry_without_the_store_the_fallback_applies() {
    let p = params();
    // local_share: the last known remainder (2,000) over 4 holders.
    let mut lease = granted(100, 2_000, 0, &p);
    assert_eq!(
        lease.reserve(100, 1000, &p, true, false).1,
        None,
        "held leases are spent until they expire"
    );
    assert!(!lease.degraded());
    assert_eq!(
        lease.reserve(500, 5001, &p, true, false).1,
        None,
        "expired: + 2000/4"
    );
    assert!(lease.degraded());
    assert_eq!(
        lease.reserve(1, 5001, &p, true, false).1,
        Some(Shortfall::Exhausted {
            retry_after_secs: None
        })
    );
    assert_eq!(
        lease.debt(),
        500,
        "spent without a grant: debt, charged when the store is back"
    );
    let op = lease.next_op(6000, 2, &p).unwrap();
    assert!(matches!(op.op, LeaseOp::Grant { force: 500, .. }));
    lease.answered(2, 100, 1_400, 6000);
    assert!(!lease.degraded() && lease.debt() == 0);

    for (fallback, admitted) in [(Fallback::FailOpen, true), (Fallback::FailClosed, false)] {
        let p = LeaseParams {
            fallback,
            ..params()
        };
        let mut lease = granted(10, 2_000, 0, &p);
        let short = lease.reserve(1000, 6000, &p, true, false).1;
        assert_eq!(short.is_none(), admitted, "{fallback:?}");
        if !admitted {
            assert_eq!(short, Some(Shortfall::Unavailable));
        }
    }
    // A brand-new lease with the store down falls back at once (no grant can come).
    let mut fresh = Lease::new(0, 0);
    assert_eq!(fresh.reserve(100, 0, &params(), true, false).1, None);
    // A rate's share refills locally at amount / N.
    let mut rp = params();
    rp.rate_period_ms = Some(1000);
    rp.limit = 40; // 10 a second each for 4 holders
    let mut rate = Lease::new(0, 0);
    assert_eq!(rate.reserve(10, 0, &rp, true, false).1, None);
    assert_eq!(
        rate.reserve(1, 0, &rp, true, false).1,
        Some(Shortfall::Exhausted {
            retry_after_secs: Some(1)
        })
    );
    assert_eq!(rate.reserve(5, 500, &rp, true, false).1, None);
}

#[test]
fn a_new_window_starts_empty_and_hands_back_the_old_debt() {
    let p = params();
    let mut lease = granted(100, 0, 0, &p);
    let (r, _) = lease.reserve(100, 0, &p, false, false);
    assert_eq!(lease.roll(0, 1), None, "same window: nothing");
    lease.settle(r, 130); // 30 over
    assert_eq!(lease.roll(20_261_204, 2), None);
    assert_eq!(
        lease.take_ended(),
        Some(EndedWindow {
            window: 0,
            reserved: 0,
            delta: 30
        }),
        "the old window's debt, for its counter"
    );
    assert_eq!(
        (lease.granted(), lease.available(), lease.window()),
        (0, 0, 20_261_204)
    );
    assert!(lease.settled());
}

#[test]
fn an_ended_window_gets_its_unspent_grant_back_once_its_requests_settle() {
    let p = params();
    let mut lease = granted(100, 0, 0, &p);
    let (first, _) = lease.reserve(40, 0, &p, false, false);
    lease.settle(first, 30);
    let (straddling, _) = lease.reserve(50, 0, &p, false, false);
    assert_eq!(lease.roll(20_261_204, 1), None);
    assert_eq!(
        lease.take_ended(),
        None,
        "a request of the old window in flight"
    );
    assert!(!lease.settled(), "not to be forgotten before it is sent");
    lease.settle(straddling, 10);
    assert_eq!(
        lease.spent(),
        0,
        "an old window's request settles nothing in the new one"
    );
    // Granted 100, used 30 + 10: 60 goes back to the old counter.
    assert_eq!(
        lease.take_ended(),
        Some(EndedWindow {
            window: 0,
            reserved: 0,
            delta: -60
        })
    );
    assert_eq!(lease.take_ended(), None, "sent once");
    // A window ended before its requests settled: when the next one ends
    // its delta goes as it stands (the request counted whole), and the
    // request settles nowhere.
    let mut lease = granted(100, 0, 0, &p);
    let (slow, _) = lease.reserve(50, 0, &p, false, false);
    assert_eq!(lease.roll(1, 1), None);
    assert_eq!(
        lease.roll(2, 2),
        Some(EndedWindow {
            window: 0,
            reserved: 50,
            delta: -50
        })
    );
    lease.settle(slow, 10);
    assert_eq!(
        lease.take_ended(),
        Some(EndedWindow {
            window: 1,
            reserved: 0,
            delta: 0
        })
    );
    assert_eq!(lease.spent(), 0);
}

#[test]
fn shadow_reservations_are_taken_and_recorded() {
    let p = params();
    let mut lease = granted(10, 0, 0, &p);
    let (r, short) = lease.reserve(50, 0, &p, false, true);
    assert!(short.is_some());
    assert_eq!(r.amount, 50, "shadow: taken anyway, counted as debt");
    assert_eq!(lease.debt(), 40);
}

// The reservation bound.

/// A toy byte-level BPE: starts from one token per byte and merges pairs,
/// so every token covers at least one byte.
fn toy_bpe(text: &[u8], merges: &[(u8, u8)]) -> usize {
    let mut tokens: Vec<Vec<u8>> = text.iter().map(|b| vec![*b]).collect();
    for &(a, b) in merges {
        let mut out: Vec<Vec<u8>> = Vec::new();
        for t in tokens {
            match out.last_mut() {
                Some(last) if last.last() == Some(&a) && t.first() == Some(&b) => last.extend(t),
                _ => out.push(t),
            }
        }
        tokens = out;
    }
    assert!(tokens.iter().all(|t| !t.is_empty()));
    tokens.len()
}

proptest! {
    /// Input tokens ≤ body bytes: the prompt's bytes are in the body (JSON
    /// escapes only lengthen them), and a byte-level token covers ≥ 1 byte.
    #[test]
    fn input_tokens_are_at_most_the_body_bytes(text in "\\PC{0,200}", merges in proptest::collection::vec((any::<u8>(), any::<u8>()), 0..20)) {
        let body = serde_json::to_vec(&serde_json::json!({
            "model": "m", "messages": [{"role": "user", "content": text}]
        })).unwrap();
        let bound = RequestBound::new(body.len() as u64, None);
        prop_assert!(text.len() as u64 <= bound.input_tokens());
        prop_assert!(toy_bpe(text.as_bytes(), &merges) as u64 <= bound.input_tokens());
    }
}

#[test]
fn the_output_bound_is_the_clients_cap_or_the_default() {
    let scan = |body: &[u8]| {
        let mut s = RequestScan::new();
        s.push(body);
        RequestBound::scanned(body.len() as u64, &s)
    };
    assert_eq!(scan(br#"{"max_tokens":100}"#).output_tokens(4096), 100);
    assert_eq!(
        scan(br#"{"messages":[]}"#).output_tokens(4096),
        4096,
        "no cap: the default"
    );
    assert_eq!(
        scan(br#"{"max_tokens":100000}"#).output_tokens(4096),
        100_000,
        "larger: its own value"
    );
    assert_eq!(scan(br#"{"max_tokens":"lots"}"#).output_tokens(512), 512);
    // Written to slip past a scan (escaped, a string) or beside an unread
    // one: the larger of what the backend may read.
    assert_eq!(
        scan(br#"{"max_t\u006fkens":9000}"#).output_tokens(512),
        9000
    );
    assert_eq!(scan(br#"{"max_tokens":"9000"}"#).output_tokens(512), 9000);
    assert_eq!(
        scan(br#"{"max_tokens":"9"}"#).output_tokens(512),
        512,
        "a backend ignoring a string would apply its own default"
    );
    assert_eq!(
        scan(br#"{"max_tokens":100,"max_completion_tokens":-1}"#).output_tokens(512),
        512
    );
}

#[test]
fn a_body_without_a_cap_gets_the_reserved_one_and_nothing_else_changes() {
    let cases = [
        (
            Provider::OpenAi,
            "{\"model\":\"m\",\"messages\":[{\"content\":\"}\"}]} \n",
            "{\"model\":\"m\",\"messages\":[{\"content\":\"}\"}],\"max_completion_tokens\":512} \n",
        ),
        (Provider::Anthropic, "{ }", "{ \"max_tokens\":512}"),
    ];
    for (provider, body, want) in cases {
        let mut scan = RequestScan::new();
        scan.push(body.as_bytes());
        let out =
            with_output_cap(provider, body.as_bytes(), scan.root_end().unwrap(), 512).unwrap();
        assert_eq!(std::str::from_utf8(&out).unwrap(), want);
        // Read back, it names exactly the reserved cap.
        let mut again = RequestScan::new();
        again.push(&out);
        assert_eq!(again.max_output_tokens(), Some(512));
        assert!(!again.backend_default_applies());
        let parsed: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert!(parsed.is_object());
    }
    // Not the closing brace: nothing.
    assert_eq!(with_output_cap(Provider::OpenAi, b"{}", 0, 5), None);
    assert_eq!(with_output_cap(Provider::OpenAi, b"{}", 9, 5), None);
}

#[test]
fn units_convert_with_integers_rounding_up() {
    let counts = TokenCounts {
        input: 1000,
        output: 333,
        cache_read: 500,
        cache_write: 10,
    };
    assert_eq!(CostModel::new(&Unit::Requests).cost(None, &counts, true), 1);
    assert_eq!(
        CostModel::new(&Unit::Requests).bound(None, 10_000, 10_000),
        1
    );
    assert_eq!(
        CostModel::new(&Unit::Tokens).cost(None, &counts, true),
        1843
    );
    assert_eq!(CostModel::new(&Unit::Tokens).bound(None, 1000, 200), 1200);
    let big = Rates {
        input: 3000,
        output: 15000,
        cache_read: 300,
        cache_write: Some(3750),
    };
    let weighted = CostModel::new(&Unit::WeightedTokens(WeightTable {
        models: [("big".to_string(), big)].into_iter().collect(),
        default: Rates {
            input: 1000,
            output: 1000,
            cache_read: 1000,
            cache_write: None,
        },
    }));
    // 1000×3 + 333×15 + 500×0.3 + 10×3.75 = 3000 + 4995 + 150 + 37.5 → 8183 (rounded up once).
    assert_eq!(weighted.cost(Some("big"), &counts, true), 8183);
    assert_eq!(
        weighted.cost(Some("other"), &counts, true),
        1843,
        "unknown model: the default"
    );
    // The bound charges every input token at the dearest input rate (3.75).
    assert_eq!(weighted.bound(Some("big"), 100, 10), 525);
    // Currency: micro-units per million tokens.
    let prices = zerolayer_core::quota::config::PriceTable {
        models: Default::default(),
        default: Rates {
            input: 2_500_000,
            output: 10_000_000,
            cache_read: 1_250_000,
            cache_write: None,
        },
    };
    let money = CostModel::new(&Unit::Currency(prices));
    // 1000 × 2.5 + 333 × 10 + 500 × 1.25 + 10 × 2.5 = 2500 + 3330 + 625 + 25 = 6480 µ.
    assert_eq!(money.cost(Some("x"), &counts, true), 6480);
    assert_eq!(
        money.cost(None, &TokenCounts::output(1), true),
        10,
        "one token is 10 µ"
    );
    assert_eq!(
        money.cost(
            None,
            &TokenCounts {
                input: 1,
                ..Default::default()
            },
            true
        ),
        3,
        "2.5 µ rounds up: the ledger never undercounts"
    );
    assert_eq!(
        money.cost(
            None,
            &TokenCounts {
                output: u64::MAX,
                ..Default::default()
            },
            true
        ),
        u64::MAX,
        "saturates, never wraps"
    );
}

#[test]
fn usage_counts_mean_the_same_for_both_providers() {
    let usage = Usage {
        input_tokens: 1200,
        output_tokens: 50,
        cache_read_tokens: 1000,
        cache_creation_tokens: 0,
    };
    let openai = TokenCounts::from_usage(&usage, Provider::OpenAi);
    assert_eq!(
        (openai.input, openai.cache_read),
        (200, 1000),
        "OpenAI's prompt_tokens include the cached"
    );
    let anthropic = TokenCounts::from_usage(&usage, Provider::Anthropic);
    assert_eq!((anthropic.input, anthropic.cache_read), (1200, 1000));
}

// The lease table.

fn key(parts: &[Option<&[u8]>]) -> ScopeKey {
    let mut k = ScopeKey::new();
    for (i, p) in parts.iter().enumerate() {
        k.push(i as u8 + 1, *p);
    }
    k
}

#[test]
fn scope_keys_are_exact() {
    let a = key(&[Some(b"ab"), Some(b"c")]);
    let b = key(&[Some(b"a"), Some(b"bc")]);
    assert_ne!(a.as_bytes(), b.as_bytes());
    assert_ne!(
        key(&[None]).as_bytes(),
        key(&[Some(b"")]).as_bytes(),
        "absent is not empty"
    );
    let long1 = vec![b'x'; MAX_SCOPE_PART + 1];
    let mut long2 = long1.clone();
    long2[MAX_SCOPE_PART] = b'y';
    assert_ne!(
        key(&[Some(&long1)]).as_bytes(),
        key(&[Some(&long2)]).as_bytes(),
        "long parts by SHA-256"
    );
    assert_eq!(key(&[Some(&long1)]).as_bytes().len(), 34);
}

#[test]
fn the_table_never_holds_more_than_its_bound() {
    let mut table = LeaseTable::new(4096, 42);
    assert_eq!(table.capacity(), 4096);
    // A spray of 100,000 fresh keys, each used once and settled.
    for i in 0..100_000u32 {
        let slot = table
            .find_or_insert(0, "p", &i.to_le_bytes(), u64::from(i), 0)
            .unwrap();
        assert!(table.get(slot).is_some());
    }
    assert_eq!(table.len(), 4096);
}

#[test]
fn busy_leases_are_never_evicted() {
    let p = params();
    let mut table = LeaseTable::new(16, 7);
    let mut busy = Vec::new();
    let mut refused = 0;
    for i in 0..200u32 {
        match table.find_or_insert(0, "p", &i.to_le_bytes(), u64::from(i), 0) {
            Ok(slot) => {
                // Each lease holds a grant: it cannot be forgotten.
                let e = table.get_mut(slot).unwrap();
                e.lease.reserve(1, 0, &p, false, false);
                e.lease.next_op(0, u64::from(i) + 1, &p);
                busy.push(slot);
            }
            Err(TableFull) => refused += 1,
        }
    }
    assert_eq!(busy.len(), 16);
    assert_eq!(refused, 184);
    assert!(busy.iter().all(|s| table.get(*s).is_some()), "none evicted");
}

#[test]
fn eviction_is_deterministic_and_least_recently_used() {
    let run = || {
        let mut table = LeaseTable::new(16, 99);
        let mut slots = Vec::new();
        for i in 0..64u32 {
            let slot = table
                .find_or_insert(0, "p", &i.to_le_bytes(), u64::from(i % 7), 0)
                .unwrap();
            slots.push((slot.index, slot.generation));
        }
        slots
    };
    assert_eq!(run(), run());
    // Same key, same lease; two policies never share a lease for one key.
    let mut table = LeaseTable::new(16, 1);
    let a = table.find_or_insert(0, "p", b"k", 0, 0).unwrap();
    assert_eq!(table.find_or_insert(0, "p", b"k", 5, 0).unwrap(), a);
    let b = table.find_or_insert(1, "q", b"k", 5, 0).unwrap();
    assert_ne!(a, b);
}

#[test]
fn the_tables_memory_is_bounded_by_its_entries() {
    // Each entry: the lease and its key (boxed, at most MAX_SCOPE_KEY bytes).
    let entry = std::mem::size_of::<Option<zerolayer_core::quota::table::Entry>>();
    eprintln!("entry {entry} bytes");
    assert!(entry <= 256, "{entry}");
    let worst = 4096 * (entry + zerolayer_core::quota::table::MAX_SCOPE_KEY);
    assert!(worst <= 3 << 20, "{worst}");
}
