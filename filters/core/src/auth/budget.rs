//! The gateway-wide bound on unverified admissions: token buckets of lazy
//! admissions per gateway, per claimed tenant (one bucket for "no tenant")
//! and per client address. The per-credential bound
//! ([`super::exposure`]) limits what one credential gets; an attacker who
//! mints a new credential per request is limited by these instead: past
//! any empty bucket an unknown credential is verified synchronously, so no
//! spray gets more than the gateway bucket's `burst + per_sec × seconds`
//! requests to the backend without a valid credential.
//!
//! Buckets live in shared data (one key each, updated by compare-and-swap:
//! one read and at most one write per bucket, only for unknown
//! credentials). Tenants and addresses share a bounded set of bucket keys;
//! two that land on one key share its bucket, which can only make the
//! bound stricter, never looser. Which key is chosen by a hash keyed with
//! the gateway's own random seed ([`SEED_KEY`]): an attacker who picks its
//! addresses (a /48 holds 65,536 /64s) or its claimed tenant cannot aim at
//! a victim's bucket to drain it.

use std::net::IpAddr;

use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::config::ConfigError;

/// Shared-data key prefix of the buckets.
pub const BUDGET_PREFIX: &str = "zl:auth:budget:";
/// Shared-data key of the seed (8 random bytes, written once by the first
/// worker that needs it) keying the choice of bucket.
pub const SEED_KEY: &str = "zl:auth:bucket_seed";
/// Shared-data key prefix of the synchronous-verification buckets.
pub const VERIFY_PREFIX: &str = "zl:auth:verify:";
/// Shared-data key of the time (Unix ms, decimal) before which no
/// synchronous check calls the verifier: set from a 429's `retry-after`.
pub const THROTTLED_KEY: &str = "zl:auth:verifier_throttled_until_ms";
/// Longest back-off a verifier's `retry-after` can impose, seconds.
pub const MAX_THROTTLE_SECS: u64 = 60;
/// Bucket keys per scope for tenants and for client addresses.
pub const BUCKET_SLOTS: u64 = 4096;
const VERSION: u8 = 1;
/// Size of an encoded bucket.
pub const BUCKET_BYTES: usize = 17;
/// Tokens are kept in thousandths, so slow rates refill between requests.
const MILLI: u64 = 1000;

/// One bucket's size: `burst` admissions at once, `per_sec` more each second.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct Rate {
    /// Admissions regained per second.
    pub per_sec: u32,
    /// Admissions available at once (the bucket's capacity; at least 1).
    pub burst: u32,
}

/// The three buckets' sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct LazyBudget {
    /// Every lazy admission of this gateway (Envoy process: shared data
    /// is per process).
    #[serde(default = "default_gateway")]
    pub gateway: Rate,
    /// Lazy admissions per claimed tenant; credentials claiming none share
    /// one bucket.
    #[serde(default = "default_per_tenant")]
    pub per_tenant: Rate,
    /// Lazy admissions per client address (IPv6 per /64): the address
    /// Envoy resolved, as its connection manager's `use_remote_address` /
    /// `xff_num_trusted_hops` say (never a header the filter reads).
    #[serde(default = "default_per_client")]
    pub per_client: Rate,
}

fn default_gateway() -> Rate {
    Rate {
        per_sec: 20,
        burst: 40,
    }
}
fn default_per_tenant() -> Rate {
    Rate {
        per_sec: 5,
        burst: 20,
    }
}
fn default_per_client() -> Rate {
    Rate {
        per_sec: 5,
        burst: 20,
    }
}

impl Default for LazyBudget {
    fn default() -> Self {
        LazyBudget {
            gateway: default_gateway(),
            per_tenant: default_per_tenant(),
            per_client: default_per_client(),
        }
    }
}

impl Rate {
    /// Checks the sizes; `at` is the field path, `empty` what to say of a
    /// burst of 0.
    fn check(&self, at: &str, empty: &str) -> Result<(), ConfigError> {
        if self.burst == 0 {
            return Err(ConfigError::new(format!("{at}.burst"), empty));
        }
        if self.per_sec > 1_000_000 || self.burst > 1_000_000 {
            return Err(ConfigError::new(
                at,
                "per_sec and burst must be at most 1000000",
            ));
        }
        Ok(())
    }

    /// How long a bucket of this rate takes to regain one token, ms (a
    /// minute for a rate of 0): the `retry-after` of a refusal.
    pub fn ms_per_token(&self) -> u64 {
        match self.per_sec {
            0 => 60_000,
            n => 1000u64.div_ceil(u64::from(n)),
        }
    }
}

impl LazyBudget {
    /// Checks the sizes; `at` is the field path (`lazy_budget`).
    pub fn check(&self, at: &str) -> Result<(), ConfigError> {
        for (name, rate) in [
            ("gateway", self.gateway),
            ("per_tenant", self.per_tenant),
            ("per_client", self.per_client),
        ] {
            rate.check(
                &format!("{at}.{name}"),
                "must be at least 1 (`unknown: sync` turns lazy admission off)",
            )?;
        }
        Ok(())
    }
}

/// What synchronous introspection (an API key checked with the request
/// paused) may spend: a bucket per client address and one for the gateway,
/// of which `reserve` calls are kept for clients that have not spent their
/// own bucket. Past either, the request gets 429 without any call. API keys
/// claim no tenant, so there is no per-tenant bucket; JWTs verify inline
/// and spend none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct VerifyBudget {
    /// Synchronous introspection calls of this gateway (Envoy process).
    #[serde(default = "default_verify_gateway")]
    pub gateway: Rate,
    /// Synchronous introspection calls per client address (IPv6 per /64;
    /// the address as for `lazy_budget.per_client`).
    #[serde(default = "default_verify_per_client")]
    pub per_client: Rate,
    /// Calls of the gateway bucket only a client whose own bucket is full
    /// may take: a client spraying keys empties its own bucket first and
    /// then cannot take these (at most `gateway.burst`).
    #[serde(default = "default_verify_reserve")]
    pub reserve: u32,
}

fn default_verify_gateway() -> Rate {
    Rate {
        per_sec: 10,
        burst: 20,
    }
}
fn default_verify_per_client() -> Rate {
    Rate {
        per_sec: 1,
        burst: 5,
    }
}
fn default_verify_reserve() -> u32 {
    5
}

impl Default for VerifyBudget {
    fn default() -> Self {
        VerifyBudget {
            gateway: default_verify_gateway(),
            per_client: default_verify_per_client(),
            reserve: default_verify_reserve(),
        }
    }
}

impl VerifyBudget {
    /// Checks the sizes; `at` is the field path (`verify_budget`).
    pub fn check(&self, at: &str) -> Result<(), ConfigError> {
        for (name, rate) in [("gateway", self.gateway), ("per_client", self.per_client)] {
            rate.check(&format!("{at}.{name}"), "must be at least 1")?;
        }
        if self.reserve >= self.gateway.burst {
            return Err(ConfigError::new(
                format!("{at}.reserve"),
                format!(
                    "{} must be less than gateway.burst ({})",
                    self.reserve, self.gateway.burst
                ),
            ));
        }
        Ok(())
    }
}

/// The shared-data key of a client's synchronous-verification bucket, or
/// the gateway's (`None`).
pub fn verify_key(client: Option<&[u8]>, seed: u64) -> String {
    match client {
        None => format!("{VERIFY_PREFIX}gateway"),
        Some(address) => format!(
            "{VERIFY_PREFIX}client:{}",
            xxh3_64_with_seed(&client_id(address), seed) % BUCKET_SLOTS
        ),
    }
}

/// Whether the bucket stored as `entry` is full at `now_ms` (a client that
/// has not spent any of it recently).
pub fn is_full(entry: Option<&[u8]>, rate: Rate, now_ms: u64) -> bool {
    level(entry, rate, now_ms).0 >= u64::from(rate.burst) * MILLI
}

/// The tokens (thousandths) of the bucket stored as `entry` at `now_ms`,
/// and the time they were last computed: a missing or unreadable entry is
/// a full bucket; a clock behind the entry's (another worker's) refills
/// nothing.
fn level(entry: Option<&[u8]>, rate: Rate, now_ms: u64) -> (u64, u64) {
    let capacity = u64::from(rate.burst) * MILLI;
    let bucket = entry.and_then(Bucket::decode).unwrap_or(Bucket {
        milli_tokens: capacity,
        at_ms: now_ms,
    });
    let elapsed = now_ms.saturating_sub(bucket.at_ms);
    // per_sec tokens per 1000 ms = per_sec milli-tokens per ms.
    let refill = elapsed.saturating_mul(u64::from(rate.per_sec));
    let level = bucket.milli_tokens.saturating_add(refill).min(capacity);
    (level, bucket.at_ms)
}

/// Which bucket a key is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope<'a> {
    /// The whole gateway.
    Gateway,
    /// A claimed tenant (`None`: the credential claims none).
    Tenant(Option<&'a str>),
    /// A client address, as the host renders it (`ip:port`, `[ip]:port` or `ip`).
    Client(&'a [u8]),
}

/// The shared-data key of a scope's bucket, its slot chosen with `seed`.
pub fn key(scope: Scope<'_>, seed: u64) -> String {
    match scope {
        Scope::Gateway => format!("{BUDGET_PREFIX}gateway"),
        Scope::Tenant(None | Some("")) => format!("{BUDGET_PREFIX}no_tenant"),
        Scope::Tenant(Some(t)) => {
            format!(
                "{BUDGET_PREFIX}tenant:{}",
                xxh3_64_with_seed(t.as_bytes(), seed) % BUCKET_SLOTS
            )
        }
        Scope::Client(address) => format!(
            "{BUDGET_PREFIX}client:{}",
            xxh3_64_with_seed(&client_id(address), seed) % BUCKET_SLOTS
        ),
    }
}

/// The seed stored as `entry`, or `fresh` (random bytes) when there is
/// none yet: (the seed, what to write: `None` when one was there).
pub fn seed(entry: Option<&[u8]>, fresh: [u8; 8]) -> (u64, Option<Vec<u8>>) {
    match entry.and_then(|e| <[u8; 8]>::try_from(e).ok()) {
        Some(stored) => (u64::from_le_bytes(stored), None),
        None => (u64::from_le_bytes(fresh), Some(fresh.to_vec())),
    }
}

/// What identifies a client: its IP without the port; an IPv6 address by
/// its /64 (one host usually controls a whole /64). Anything unparsable is
/// taken as it is.
pub fn client_id(address: &[u8]) -> Vec<u8> {
    let Ok(text) = std::str::from_utf8(address) else {
        return address.to_vec();
    };
    let host = match text.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => match text.rsplit_once(':') {
            // `ip:port` (IPv4); a bare IPv6 has more than one colon.
            Some((ip, _)) if !ip.contains(':') => ip,
            _ => text,
        },
    };
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(ip)) => ip.octets().to_vec(),
        Ok(IpAddr::V6(ip)) => match ip.to_ipv4_mapped() {
            Some(v4) => v4.octets().to_vec(),
            None => ip.octets()[..8].to_vec(),
        },
        Err(_) => host.as_bytes().to_vec(),
    }
}

/// A bucket's state: tokens (thousandths) at a time (ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    /// Tokens left, in thousandths.
    pub milli_tokens: u64,
    /// When `milli_tokens` was computed, Unix ms.
    pub at_ms: u64,
}

impl Bucket {
    /// Serializes for shared data (17 bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(BUCKET_BYTES);
        out.push(VERSION);
        out.extend_from_slice(&self.milli_tokens.to_le_bytes());
        out.extend_from_slice(&self.at_ms.to_le_bytes());
        out
    }

    /// Parses an entry; `None` when it is not a bucket of this version.
    pub fn decode(bytes: &[u8]) -> Option<Bucket> {
        let (&VERSION, rest) = bytes.split_first()? else {
            return None;
        };
        let milli_tokens = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
        let at_ms = u64::from_le_bytes(rest.get(8..16)?.try_into().ok()?);
        Some(Bucket {
            milli_tokens,
            at_ms,
        })
    }
}

/// Takes one admission from the bucket stored as `entry` at `now_ms`: the
/// entry to write back when there was one (`None`: refused, nothing to
/// write). A missing or unreadable entry is a full bucket; a clock behind
/// the entry's (another worker's) refills nothing.
pub fn take(entry: Option<&[u8]>, rate: Rate, now_ms: u64) -> Option<Vec<u8>> {
    take_above(entry, rate, now_ms, 0)
}

/// [`take`], leaving at least `floor` admissions in the bucket (refused
/// when taking one would go below).
pub fn take_above(entry: Option<&[u8]>, rate: Rate, now_ms: u64, floor: u32) -> Option<Vec<u8>> {
    let (level, at_ms) = level(entry, rate, now_ms);
    if level < MILLI + u64::from(floor) * MILLI {
        return None;
    }
    Some(
        Bucket {
            milli_tokens: level - MILLI,
            at_ms: now_ms.max(at_ms),
        }
        .encode(),
    )
}

/// The most lazy admissions a bucket of `rate` grants over `secs` seconds
/// from full: the bound the threat model states.
pub fn most_admitted(rate: Rate, secs: u64) -> u64 {
    u64::from(rate.burst) + u64::from(rate.per_sec).saturating_mul(secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const RATE: Rate = Rate {
        per_sec: 2,
        burst: 3,
    };

    fn run(rate: Rate, times_ms: &[u64]) -> u64 {
        let mut entry: Option<Vec<u8>> = None;
        let mut admitted = 0;
        for &t in times_ms {
            if let Some(next) = take(entry.as_deref(), rate, t) {
                entry = Some(next);
                admitted += 1;
            }
        }
        admitted
    }

    #[test]
    fn a_burst_then_the_rate() {
        // Ten requests at once: the burst.
        assert_eq!(run(RATE, &[1000; 10]), 3);
        // Then one every 100 ms for 10 s: 2 per second more.
        let times: Vec<u64> = (0..=100).map(|i| 1000 + i * 100).collect();
        assert_eq!(run(RATE, &times), 3 + 2 * 10);
        // Slow traffic never exceeds the burst after an idle time.
        assert_eq!(
            run(RATE, &[0, 1_000_000, 1_000_000, 1_000_000, 1_000_000]),
            4
        );
    }

    #[test]
    fn a_clock_behind_the_entry_refills_nothing() {
        let entry = take(None, RATE, 10_000).unwrap();
        let b = Bucket::decode(&entry).unwrap();
        assert_eq!(
            b,
            Bucket {
                milli_tokens: 2000,
                at_ms: 10_000
            }
        );
        let again = take(Some(&entry), RATE, 5_000).unwrap();
        assert_eq!(Bucket::decode(&again).unwrap().milli_tokens, 1000);
        assert_eq!(Bucket::decode(&again).unwrap().at_ms, 10_000);
        assert_eq!(Bucket::decode(b"\x01short"), None);
        assert_eq!(Bucket::decode(b""), None);
    }

    #[test]
    fn the_reserve_is_left_to_clients_with_a_full_bucket() {
        let rate = Rate {
            per_sec: 0,
            burst: 5,
        };
        let mut entry: Option<Vec<u8>> = None;
        let mut taken = 0;
        // A client that has spent its own bucket leaves 2 in the gateway's.
        while let Some(next) = take_above(entry.as_deref(), rate, 0, 2) {
            entry = Some(next);
            taken += 1;
        }
        assert_eq!(taken, 3);
        // A fresh client takes the rest.
        assert!(take_above(entry.as_deref(), rate, 0, 0).is_some());
        assert!(is_full(None, rate, 0));
        let spent = take(None, rate, 0).unwrap();
        assert!(!is_full(Some(&spent), rate, 10_000));
        let refilling = Rate {
            per_sec: 1,
            burst: 5,
        };
        let spent = take(None, refilling, 0).unwrap();
        assert!(!is_full(Some(&spent), refilling, 500));
        assert!(is_full(Some(&spent), refilling, 1000));
        assert_ne!(verify_key(None, 7), verify_key(Some(b"10.0.0.1:1"), 7));
        assert_eq!(
            verify_key(Some(b"10.0.0.1:1"), 7),
            verify_key(Some(b"10.0.0.1:2"), 7)
        );
        let mut b = VerifyBudget::default();
        assert!(b.check("verify_budget").is_ok());
        b.reserve = 20;
        assert_eq!(
            b.check("verify_budget").unwrap_err().to_string(),
            "verify_budget.reserve: 20 must be less than gateway.burst (20)"
        );
    }

    #[test]
    fn keys_per_scope() {
        assert_eq!(key(Scope::Gateway, 7), "zl:auth:budget:gateway");
        assert_eq!(key(Scope::Tenant(None), 7), "zl:auth:budget:no_tenant");
        assert_eq!(key(Scope::Tenant(Some("")), 7), "zl:auth:budget:no_tenant");
        assert_ne!(
            key(Scope::Tenant(Some("acme")), 7),
            key(Scope::Tenant(None), 7)
        );
        // The port does not make another client; a /64 is one client.
        assert_eq!(
            key(Scope::Client(b"10.0.0.1:4000"), 7),
            key(Scope::Client(b"10.0.0.1:4001"), 7)
        );
        assert_eq!(
            key(Scope::Client(b"[2001:db8:1:2::1]:443"), 7),
            key(Scope::Client(b"[2001:db8:1:2:ffff::9]:80"), 7)
        );
        // Another gateway's seed puts clients in other buckets: nobody can
        // pick an address that shares a victim's bucket everywhere.
        let moved = (0..64)
            .filter(|n| {
                let a = format!("10.0.0.{n}:1");
                key(Scope::Client(a.as_bytes()), 7) != key(Scope::Client(a.as_bytes()), 8)
            })
            .count();
        assert!(moved > 60, "{moved}");
        assert_eq!(
            seed(None, [1; 8]),
            (u64::from_le_bytes([1; 8]), Some(vec![1; 8]))
        );
        assert_eq!(
            seed(Some(&[2; 8]), [1; 8]),
            (u64::from_le_bytes([2; 8]), None)
        );
        assert_eq!(client_id(b"10.0.0.1"), vec![10, 0, 0, 1]);
        assert_eq!(client_id(b"[::ffff:10.0.0.1]:1"), vec![10, 0, 0, 1]);
        assert_eq!(client_id(b"2001:db8::1").len(), 8);
        assert_eq!(client_id(b"\xff\xfe"), b"\xff\xfe".to_vec());
    }

    #[test]
    fn config_errors_name_the_field() {
        let mut b = LazyBudget::default();
        assert!(b.check("lazy_budget").is_ok());
        b.per_tenant.burst = 0;
        assert_eq!(
            b.check("lazy_budget").unwrap_err().to_string(),
            "lazy_budget.per_tenant.burst: must be at least 1 (`unknown: sync` turns lazy admission off)"
        );
    }

    proptest! {
        /// Whatever the arrival times, a bucket grants at most
        /// `burst + per_sec × elapsed seconds` (rounded up) admissions.
        #[test]
        fn never_more_than_the_bound(
            per_sec in 0u32..50,
            burst in 1u32..50,
            mut gaps in proptest::collection::vec(0u64..400, 1..400),
        ) {
            let rate = Rate { per_sec, burst };
            let mut t = 0;
            let times: Vec<u64> = gaps.drain(..).map(|g| { t += g; t }).collect();
            let span_ms = times.last().copied().unwrap_or(0) - times[0];
            let admitted = run(rate, &times);
            let bound = u64::from(burst) + (u64::from(per_sec) * span_ms) / 1000;
            prop_assert!(admitted <= bound, "{admitted} > {bound}");
        }
    }
}
