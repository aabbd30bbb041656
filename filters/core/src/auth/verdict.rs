//! Verdicts: what verification concluded about a credential, kept in shared
//! data so every worker's hot path can read it with one call.
//!
//! Shared data has no delete, so the key space is bounded: a verdict lives in
//! one of `slots` keys ("sets") chosen by its hash, each holding up to
//! `ways` verdicts, and carries the full hash so a lookup can tell its own
//! verdict from a colliding one (a collision reads as "unknown", never as
//! someone else's verdict). Expiry is inside the value.
//!
//! A new verdict replaces its credential's own, else an expired one, else
//! takes a free way, else evicts the one expiring soonest. An evicted
//! negative verdict does not reopen the lazy path: the credential's
//! exposure count ([`super::exposure`]), which collisions cannot reset,
//! sends it to synchronous verification, which refuses it again.

use serde::{Deserialize, Serialize};

use super::credential::TokenHash;

/// Shared-data key prefix of verdicts.
pub const VERDICT_PREFIX: &str = "zl:auth:verdict:";
/// Longest tenant or subject a verdict keeps, bytes: a credential whose
/// verified claims are longer is refused (`claim_too_long`), so a verdict's
/// size, and the memory of every set, has a bound.
pub const MAX_CLAIM_BYTES: usize = 256;
/// Longest reason kept, bytes (reasons are the filters' own short words).
const MAX_REASON_BYTES: usize = 64;
/// Largest encoded verdict: hash, flag, two times, two claims and a reason
/// at their limits, with postcard's lengths.
pub const MAX_VERDICT_BYTES: usize =
    32 + 1 + 10 + 2 * (3 + MAX_CLAIM_BYTES) + 2 + MAX_REASON_BYTES + 10;
/// Format version, first byte of every entry: an old entry after an
/// upgrade reads as "unknown" instead of being misread. Version 2: a set
/// of verdicts, each postcard-encoded behind its 2-byte length.
const VERSION: u8 = 2;

/// A verification outcome for one credential. `S` holds its strings:
/// `String` where a verdict is made or kept, `&str` where the hot path
/// reads one in place ([`VerdictView`]); both encode alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict<S = String> {
    /// SHA-256 of the credential.
    pub hash: [u8; 32],
    /// Whether the credential is valid.
    pub valid: bool,
    /// Unix seconds after which the verdict no longer counts.
    pub expires_at: u64,
    /// Verified tenant (valid verdicts).
    pub tenant: Option<S>,
    /// Verified subject (valid verdicts).
    pub subject: Option<S>,
    /// Short reason (`expired`, `bad_signature`, `revoked`, …) for invalid ones.
    pub reason: S,
    /// Unix seconds when it was verified.
    pub verified_at: u64,
}

/// A verdict read in place from a set entry, without copying its strings.
pub type VerdictView<'a> = Verdict<&'a str>;

/// What a verdict lookup found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// A valid, unexpired verdict for this credential.
    Valid(Verdict),
    /// An invalid, unexpired verdict for this credential.
    Invalid(Verdict),
    /// Nothing usable: no entry, another credential's, expired, or unreadable.
    Unknown,
}

/// The shared-data key for `hash` among `slots`.
pub fn key(hash: &TokenHash, slots: u32) -> String {
    format!("{VERDICT_PREFIX}{}", hash.slot(slots))
}

impl Verdict {
    /// Serializes as a set of one verdict.
    pub fn encode(&self) -> Vec<u8> {
        encode_set(std::slice::from_ref(self))
    }

    /// The verdict for `hash` in a set entry; `None` when there is none.
    pub fn decode(bytes: &[u8], hash: &TokenHash) -> Option<Verdict> {
        decode_set(bytes).into_iter().find(|v| v.hash == hash.0)
    }

    /// A valid verdict from verified facts, or an invalid one
    /// (`claim_too_long`, kept `negative_ttl`) when a claim is longer than
    /// [`MAX_CLAIM_BYTES`].
    pub fn verified(
        hash: &TokenHash,
        now: u64,
        credential_expiry: Option<u64>,
        ttl: (u64, u64),
        tenant: Option<String>,
        subject: Option<String>,
    ) -> Verdict {
        let (max_ttl, negative_ttl) = ttl;
        let too_long = |c: &Option<String>| c.as_ref().is_some_and(|c| c.len() > MAX_CLAIM_BYTES);
        if too_long(&tenant) || too_long(&subject) {
            return Verdict::invalid(hash, now, negative_ttl, "claim_too_long");
        }
        Verdict::valid(hash, now, credential_expiry, max_ttl, tenant, subject)
    }

    /// A valid verdict from verified facts (JWT claims or an introspection
    /// answer): TTL = min(credential expiry, `max_ttl`).
    pub fn valid(
        hash: &TokenHash,
        now: u64,
        credential_expiry: Option<u64>,
        max_ttl: u64,
        tenant: Option<String>,
        subject: Option<String>,
    ) -> Verdict {
        Verdict {
            hash: hash.0,
            valid: true,
            expires_at: Verdict::expiry(now, credential_expiry, max_ttl),
            tenant,
            subject,
            reason: String::new(),
            verified_at: now,
        }
    }

    /// This verdict read in place, as the hot path reads a stored one.
    pub fn view(&self) -> VerdictView<'_> {
        Verdict {
            hash: self.hash,
            valid: self.valid,
            expires_at: self.expires_at,
            tenant: self.tenant.as_deref(),
            subject: self.subject.as_deref(),
            reason: &self.reason,
            verified_at: self.verified_at,
        }
    }

    /// An invalid verdict, kept for `negative_ttl` seconds.
    pub fn invalid(hash: &TokenHash, now: u64, negative_ttl: u64, reason: &str) -> Verdict {
        Verdict {
            hash: hash.0,
            valid: false,
            expires_at: now.saturating_add(negative_ttl),
            tenant: None,
            subject: None,
            reason: reason.chars().take(MAX_REASON_BYTES).collect(),
            verified_at: now,
        }
    }

    /// The expiry of a verdict: the credential's own expiry capped by the
    /// configured maximum (a revoked key stops working within `max_ttl`).
    pub fn expiry(now: u64, credential_expiry: Option<u64>, max_ttl: u64) -> u64 {
        let cap = now.saturating_add(max_ttl);
        credential_expiry.map_or(cap, |exp| exp.min(cap))
    }
}

/// The verdict of a JWT verification, with the tenant from the configured
/// claim: one place for the observer and the filter's inline checks.
pub fn of_jwt(
    config: &super::config::LazyAuthConfig,
    hash: &TokenHash,
    now: u64,
    result: Result<super::jwt::Claims, super::jwt::JwtError>,
) -> Verdict {
    match result {
        Ok(claims) => Verdict::verified(
            hash,
            now,
            claims.exp(),
            (config.verdict_max_ttl_secs, config.negative_ttl_secs),
            claims.get_str(&config.jwt.tenant_claim).map(str::to_string),
            claims.sub().map(str::to_string),
        ),
        Err(err) => Verdict::invalid(hash, now, config.negative_ttl_secs, err.reason()),
    }
}

/// Serializes a set of verdicts for shared data: each verdict behind its
/// length (2 bytes, little-endian), so a lookup skips another credential's
/// verdict after comparing its hash, without decoding it.
pub fn encode_set(verdicts: &[Verdict]) -> Vec<u8> {
    let mut out = vec![VERSION];
    for v in verdicts {
        // Serializing plain owned data into a Vec cannot fail; a verdict
        // past the bound (claims are checked before) is not kept.
        if let Ok(body) = postcard::to_allocvec(v)
            && body.len() <= MAX_VERDICT_BYTES
            && let Ok(len) = u16::try_from(body.len())
        {
            out.extend_from_slice(&len.to_le_bytes());
            out.extend(body);
        }
    }
    out
}

/// The entries of a set: each verdict's bytes (an unreadable tail ends it;
/// another version reads as empty).
fn entries(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut body = match bytes.split_first() {
        Some((&VERSION, body)) => body,
        _ => &[],
    };
    std::iter::from_fn(move || {
        let (len, rest) = body.split_first_chunk::<2>()?;
        let len = usize::from(u16::from_le_bytes(*len));
        let entry = rest.get(..len)?;
        body = &rest[len..];
        Some(entry)
    })
}

/// The verdicts of a set entry (unreadable ones are skipped).
pub fn decode_set(bytes: &[u8]) -> Vec<Verdict> {
    entries(bytes)
        .filter_map(|e| postcard::from_bytes(e).ok())
        .collect()
}

/// The set entry after storing `verdict` at `now` in the set `entry`, at
/// most `ways` verdicts: its credential's own is replaced, else an expired
/// one, else a free way is taken, else one goes: the soonest expiring of
/// the newcomer's own tenant (invalid verdicts: of the invalid ones) when
/// that tenant already holds half the ways or more, else the soonest
/// expiring of all. One tenant minting credentials therefore never takes
/// more than half of any set from the others.
pub fn insert(entry: Option<&[u8]>, verdict: &Verdict, now: u64, ways: u32) -> Vec<u8> {
    let ways = ways.max(1) as usize;
    let mut set: Vec<Verdict> = entry
        .map(decode_set)
        .unwrap_or_default()
        .into_iter()
        .filter(|v| v.hash != verdict.hash && v.expires_at > now)
        .collect();
    let same_owner = |v: &Verdict| v.valid == verdict.valid && v.tenant == verdict.tenant;
    while set.len() >= ways {
        let own_share = set.iter().filter(|v| same_owner(v)).count();
        let Some(i) = set
            .iter()
            .enumerate()
            .filter(|(_, v)| own_share * 2 < ways || same_owner(v))
            .min_by_key(|(_, v)| v.expires_at)
            .map(|(i, _)| i)
        else {
            break;
        };
        set.remove(i);
    }
    set.push(verdict.clone());
    encode_set(&set)
}

/// A usable verdict for `hash` at `now`, read in place: `None` when the
/// set has none, or only an unreadable or expired one. Other credentials'
/// verdicts cost a hash comparison each (postcard writes the hash first,
/// as its 32 bytes).
pub fn view<'a>(entry: &'a [u8], hash: &TokenHash, now: u64) -> Option<VerdictView<'a>> {
    let own = entries(entry).find(|e| e.get(..32) == Some(&hash.0[..]))?;
    let view: VerdictView<'a> = postcard::from_bytes(own).ok()?;
    (view.hash == hash.0 && view.expires_at > now).then_some(view)
}

/// Interprets the shared-data entry found for `hash` at `now`.
pub fn lookup(entry: Option<&[u8]>, hash: &TokenHash, now: u64) -> Lookup {
    let Some(verdict) = entry.and_then(|e| Verdict::decode(e, hash)) else {
        return Lookup::Unknown;
    };
    if verdict.expires_at <= now {
        return Lookup::Unknown;
    }
    if verdict.valid {
        Lookup::Valid(verdict)
    } else {
        Lookup::Invalid(verdict)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(hash: &TokenHash, valid: bool, expires_at: u64) -> Verdict {
        Verdict {
            hash: hash.0,
            valid,
            expires_at,
            tenant: Some("acme".into()),
            subject: Some("user-1".into()),
            reason: if valid {
                String::new()
            } else {
                "bad_signature".into()
            },
            verified_at: 100,
        }
    }

    #[test]
    fn round_trip_and_lookup() {
        let h = TokenHash::of(b"token");
        let v = verdict(&h, true, 200);
        let bytes = v.encode();
        assert_eq!(Verdict::decode(&bytes, &h), Some(v.clone()));
        assert_eq!(lookup(Some(&bytes), &h, 150), Lookup::Valid(v.clone()));
        // Expired.
        assert_eq!(lookup(Some(&bytes), &h, 200), Lookup::Unknown);
        // Another credential in the same slot.
        assert_eq!(
            lookup(Some(&bytes), &TokenHash::of(b"other"), 150),
            Lookup::Unknown
        );
        // Nothing there, garbage, an unknown version.
        assert_eq!(lookup(None, &h, 150), Lookup::Unknown);
        assert_eq!(lookup(Some(b"garbage"), &h, 150), Lookup::Unknown);
        let mut v2 = bytes.clone();
        v2[0] = 9;
        assert_eq!(lookup(Some(&v2), &h, 150), Lookup::Unknown);
        let invalid = verdict(&h, false, 200);
        assert_eq!(
            lookup(Some(&invalid.encode()), &h, 150),
            Lookup::Invalid(invalid)
        );
    }

    #[test]
    fn views_read_in_place() {
        let h = TokenHash::of(b"token");
        let bytes = verdict(&h, true, 200).encode();
        let v = view(&bytes, &h, 150).unwrap();
        assert_eq!(
            (v.valid, v.tenant, v.subject),
            (true, Some("acme"), Some("user-1"))
        );
        assert_eq!(view(&bytes, &h, 200), None);
        assert_eq!(view(&bytes, &TokenHash::of(b"other"), 150), None);
        assert_eq!(view(b"\x01junk", &h, 150), None);
        let invalid = verdict(&h, false, 200).encode();
        assert_eq!(
            view(&invalid, &h, 150).map(|v| (v.valid, v.reason)),
            Some((false, "bad_signature"))
        );
        // The stored verdict read in place is the verdict itself, viewed.
        for v in [verdict(&h, true, 200), verdict(&h, false, 200)] {
            assert_eq!(view(&v.encode(), &h, 150), Some(v.view()));
        }
    }

    #[test]
    fn sets_keep_colliding_verdicts_apart() {
        let a = TokenHash::of(b"a");
        let b = TokenHash::of(b"b");
        let c = TokenHash::of(b"c");
        let e = insert(None, &verdict(&a, false, 160), 100, 2);
        let e = insert(Some(&e), &verdict(&b, true, 400), 100, 2);
        // Both readable: a collision evicts nobody while a way is free.
        assert!(matches!(lookup(Some(&e), &a, 150), Lookup::Invalid(_)));
        assert!(matches!(lookup(Some(&e), &b, 150), Lookup::Valid(_)));
        assert_eq!(view(&e, &a, 150).map(|v| v.valid), Some(false));
        assert_eq!(view(&e, &b, 150).map(|v| v.valid), Some(true));
        assert_eq!(view(&e, &c, 150), None);
        // Re-verifying a replaces its own verdict, never b's.
        let e = insert(Some(&e), &verdict(&a, false, 170), 110, 2);
        assert_eq!(decode_set(&e).len(), 2);
        assert_eq!(view(&e, &a, 150).map(|v| v.expires_at), Some(170));
        // A third verdict in a full set evicts the one expiring soonest
        // (another tenant's: see the next test for its own).
        let mut other = verdict(&c, true, 500);
        other.tenant = Some("globex".into());
        let e = insert(Some(&e), &other, 120, 2);
        assert_eq!(view(&e, &a, 150), None);
        assert!(view(&e, &b, 150).is_some() && view(&e, &c, 150).is_some());
        // Expired verdicts go first, whatever their expiry order.
        let e = insert(Some(&e), &verdict(&a, false, 600), 450, 2);
        assert_eq!(view(&e, &b, 450), None);
        assert!(view(&e, &c, 450).is_some() && view(&e, &a, 450).is_some());
        // An unreadable tail does not hide the verdicts before it.
        let mut broken = e.clone();
        broken.extend_from_slice(b"\xff\xff\x01");
        assert!(view(&broken, &c, 450).is_some());
        assert_eq!(decode_set(&broken).len(), 2);
        // Nor does an unreadable entry the ones after it.
        let mut junk = vec![2, 3, 0, 1, 2, 3];
        junk.extend_from_slice(&e[1..]);
        assert!(view(&junk, &c, 450).is_some());
        assert_eq!(decode_set(&junk).len(), 2);
    }

    #[test]
    fn expiry_is_capped() {
        assert_eq!(Verdict::expiry(1000, Some(1100), 300), 1100);
        assert_eq!(Verdict::expiry(1000, Some(5000), 300), 1300);
        assert_eq!(Verdict::expiry(1000, None, 300), 1300);
        assert_eq!(Verdict::expiry(u64::MAX, None, 300), u64::MAX);
    }

    #[test]
    fn keys_are_bounded() {
        let k = key(&TokenHash::of(b"x"), 16);
        let slot: u32 = k.strip_prefix(VERDICT_PREFIX).unwrap().parse().unwrap();
        assert!(slot < 16);
    }

    #[test]
    fn one_tenant_never_takes_more_than_half_a_set_from_the_others() {
        let mut entry: Option<Vec<u8>> = None;
        let mut put = |name: &str, tenant: &str, expires_at: u64| {
            let mut v = verdict(&TokenHash::of(name.as_bytes()), true, expires_at);
            v.tenant = Some(tenant.into());
            entry = Some(insert(entry.as_deref(), &v, 100, 4));
            decode_set(entry.as_deref().unwrap())
        };
        put("g1", "globex", 1000);
        put("g2", "globex", 1000);
        // acme mints credentials: it takes the two free ways, then evicts
        // only its own, however soon globex's expire.
        for n in 0..50 {
            put(&format!("a{n}"), "acme", 2000 + n);
        }
        let set = put("a-last", "acme", 5000);
        let globex = set
            .iter()
            .filter(|v| v.tenant.as_deref() == Some("globex"))
            .count();
        assert_eq!((set.len(), globex), (4, 2));
        // Below half, a newcomer evicts the soonest expiring of all.
        let set = put("i1", "initech", 3000);
        assert_eq!(set.len(), 4);
        assert!(set.iter().any(|v| v.tenant.as_deref() == Some("initech")));
        assert_eq!(
            set.iter()
                .filter(|v| v.tenant.as_deref() == Some("globex"))
                .count(),
            1
        );
    }

    #[test]
    fn claims_past_the_limit_are_refused_and_every_verdict_fits_its_bound() {
        let h = TokenHash::of(b"t");
        let long = "x".repeat(MAX_CLAIM_BYTES + 1);
        let v = Verdict::verified(&h, 100, None, (300, 60), Some(long.clone()), None);
        assert!(!v.valid);
        assert_eq!(v.reason, "claim_too_long");
        assert_eq!(v.expires_at, 160);
        let v = Verdict::verified(&h, 100, None, (300, 60), None, Some(long));
        assert_eq!(v.reason, "claim_too_long");
        let most = "x".repeat(MAX_CLAIM_BYTES);
        let v = Verdict {
            expires_at: u64::MAX,
            verified_at: u64::MAX,
            ..Verdict::verified(&h, 100, None, (300, 60), Some(most.clone()), Some(most))
        };
        assert!(v.valid);
        assert!(postcard::to_allocvec(&v).unwrap().len() <= MAX_VERDICT_BYTES);
        let reason = Verdict::invalid(&h, 0, u64::MAX, &"r".repeat(500)).reason;
        assert_eq!(reason.len(), MAX_REASON_BYTES);
        // A set of four at their largest stays within the stated bound.
        let mut entry = None;
        for n in 0..4u8 {
            let mut big = v.clone();
            big.hash[0] = n;
            entry = Some(insert(entry.as_deref(), &big, 100, 4));
        }
        let entry = entry.unwrap();
        assert_eq!(decode_set(&entry).len(), 4);
        assert!(entry.len() <= 1 + 4 * (2 + MAX_VERDICT_BYTES));
    }
}
