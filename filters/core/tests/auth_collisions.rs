//! Adversarially colliding credentials: every credential lands in the same
//! verdict and counter set (one or two slots), requests and off-path
//! verifications interleave in any order, and still no forged credential is
//! admitted unverified more than `max_unverified_per_token` times until it
//! has been silent for the whole retention (`unverified_memory_secs`), also
//! long after its negative verdict expired, none is ever allowed as valid,
//! and no valid credential is refused. The model runs the hot path's steps with the functions
//! lazy-auth calls, over a map standing in for shared data.

use std::collections::HashMap;

use proptest::prelude::*;
use zerolayer_core::auth::credential::TokenHash;
use zerolayer_core::auth::exposure::{self, Bump};
use zerolayer_core::auth::policy::{Admission, Policy, SyncCheck, UnknownPolicy, VerifierDown};
use zerolayer_core::auth::verdict::{self, Verdict};

/// How long an invalid verdict is kept (`negative_ttl_secs`).
const NEGATIVE_TTL: u64 = 60;
/// How long a count outlives its credential's last request
/// (`unverified_memory_secs`).
const RETENTION: u64 = 600;
/// How often a refused credential's way is refreshed at most
/// (`exposure_touch_secs`: an eighth of the memory).
const TOUCH: u64 = RETENTION / 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Allowed,
    Denied,
    Lazy,
}

struct Gateway {
    shared: HashMap<String, Vec<u8>>,
    slots: u32,
    ways: u32,
    policy: Policy,
    /// Lazily admitted, not yet verified: (credential, forged).
    queue: Vec<(TokenHash, bool)>,
}

impl Gateway {
    fn store(&mut self, v: &Verdict, now: u64) {
        let key = verdict::key(&TokenHash(v.hash), self.slots);
        let next = verdict::insert(self.shared.get(&key).map(Vec::as_slice), v, now, self.ways);
        self.shared.insert(key, next);
    }

    fn verify(&mut self, hash: &TokenHash, forged: bool, now: u64) -> Verdict {
        let v = if forged {
            Verdict::invalid(hash, now, NEGATIVE_TTL, "bad_signature")
        } else {
            Verdict::valid(hash, now, None, 300, Some("acme".into()), None)
        };
        self.store(&v, now);
        v
    }

    fn request(&mut self, hash: &TokenHash, forged: bool, now: u64) -> Outcome {
        let vkey = verdict::key(hash, self.slots);
        if let Some(v) = self
            .shared
            .get(&vkey)
            .and_then(|e| verdict::view(e, hash, now))
        {
            if v.valid {
                return Outcome::Allowed;
            }
            // Refused from its verdict: its count's way is kept fresh.
            let ekey = exposure::key(hash, self.slots);
            if let Some(next) =
                exposure::touch(self.shared.get(&ekey).map(Vec::as_slice), hash, now, TOUCH)
            {
                self.shared.insert(ekey, next);
            }
            return Outcome::Denied;
        }
        let ekey = exposure::key(hash, self.slots);
        let count = match exposure::bump(
            self.shared.get(&ekey).map(Vec::as_slice),
            hash,
            now,
            self.ways,
            RETENTION + TOUCH,
        ) {
            Bump::Counted(next, count) => {
                self.shared.insert(ekey, next);
                count
            }
            Bump::Full => u32::MAX,
        };
        match self.policy.admit(count, 0, SyncCheck::Verifier, || true) {
            Admission::Lazy => {
                self.queue.push((*hash, forged));
                Outcome::Lazy
            }
            Admission::Sync(_) => {
                if self.verify(hash, forged, now).valid {
                    Outcome::Allowed
                } else {
                    Outcome::Denied
                }
            }
            Admission::Unavailable => Outcome::Denied,
        }
    }

    /// The observer verifies the oldest `n` queued credentials.
    fn drain(&mut self, n: usize, now: u64) {
        let n = n.min(self.queue.len());
        for (hash, forged) in self.queue.drain(..n).collect::<Vec<_>>() {
            self.verify(&hash, forged, now);
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A request with credential `i` after `dt` seconds.
    Request { i: usize, dt: u64 },
    /// The observer verifies `n` queued jobs.
    Drain { n: usize },
}

fn op(credentials: usize) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..credentials, 0u64..3).prop_map(|(i, dt)| Op::Request { i, dt }),
        // Silences past the negative verdict's TTL, and now and then past
        // the retention.
        1 => (0..credentials, 50u64..700).prop_map(|(i, dt)| Op::Request { i, dt }),
        1 => (0usize..4).prop_map(|n| Op::Drain { n }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn collisions_never_reset_a_credentials_bound(
        slots in 1u32..3,
        ways in 1u32..5,
        max_unverified in 1u32..3,
        forged_count in 1usize..10,
        valid_count in 0usize..4,
        ops in proptest::collection::vec(op(13), 1..300),
    ) {
        let credentials: Vec<(TokenHash, bool)> = (0..forged_count)
            .map(|i| (TokenHash::of(format!("forged-{i}").as_bytes()), true))
            .chain((0..valid_count).map(|i| (TokenHash::of(format!("valid-{i}").as_bytes()), false)))
            .collect();
        let mut gw = Gateway {
            shared: HashMap::new(),
            slots,
            ways,
            policy: Policy {
                unknown: UnknownPolicy::Lazy,
                max_unverified_per_token: max_unverified,
                max_pending: u64::MAX,
                on_verifier_down: VerifierDown::AllowLazy,
            },
            queue: Vec::new(),
        };
        let mut now = 1_000;
        // Per credential: its last request and its unverified requests
        // since it was last silent for the whole retention.
        let mut last: HashMap<usize, u64> = HashMap::new();
        let mut lazy: HashMap<usize, u32> = HashMap::new();
        for op in ops {
            match op {
                Op::Request { i, dt } => {
                    let i = i % credentials.len();
                    now += dt;
                    if last.get(&i).is_some_and(|&t| now - t >= RETENTION) {
                        lazy.remove(&i);
                    }
                    last.insert(i, now);
                    let (hash, forged) = credentials[i];
                    let outcome = gw.request(&hash, forged, now);
                    if forged {
                        prop_assert_ne!(outcome, Outcome::Allowed, "forged {} allowed", i);
                    } else {
                        prop_assert_ne!(outcome, Outcome::Denied, "valid {} refused", i);
                    }
                    if outcome == Outcome::Lazy {
                        let n = lazy.entry(i).or_default();
                        *n += 1;
                        prop_assert!(
                            !forged || *n <= max_unverified,
                            "forged credential {} admitted unverified {} times", i, n
                        );
                    }
                }
                Op::Drain { n } => gw.drain(n, now),
            }
        }
    }
}

/// The attack the issue reports: two forged credentials in one slot, sent
/// alternately, each verified between its requests. Each gets its one
/// unverified request (or none, when the set has no way left for it), then
/// 401s, whatever the number of ways.
#[test]
fn two_colliding_forged_credentials_sent_alternately() {
    for ways in 1..=4 {
        let mut gw = Gateway {
            shared: HashMap::new(),
            slots: 1,
            ways,
            policy: Policy {
                unknown: UnknownPolicy::Lazy,
                max_unverified_per_token: 1,
                max_pending: 1000,
                on_verifier_down: VerifierDown::AllowLazy,
            },
            queue: Vec::new(),
        };
        let a = TokenHash::of(b"forged-a");
        let b = TokenHash::of(b"forged-b");
        let mut lazy = 0;
        for round in 0..8 {
            for h in [a, b] {
                if gw.request(&h, true, 1_000 + round) == Outcome::Lazy {
                    lazy += 1;
                }
                gw.drain(1, 1_000 + round);
            }
        }
        // One way: b finds the set held by a and is verified at once.
        let want = if ways == 1 { 1 } else { 2 };
        assert_eq!(lazy, want, "ways={ways}");
    }
}
