//! Billing a lazily admitted request to the tenant its credential turns out
//! to have. Such a request reaches the backend before anyone verified its
//! credential, so at the time it is `unverified`; the observer verifies the
//! credential off the request path, usually within milliseconds.
//!
//! Two ways make the bill exact per tenant, whatever the timing:
//! - at the response's end, metering reads the credential's verdict (the
//!   hand-off [`crate::internal::CREDENTIAL_PROPERTY`] names it): valid →
//!   the request is billed to the verified tenant there and then; invalid →
//!   it stays `unverified` for good;
//! - still pending (a response faster than the verification) → its record
//!   carries the credential's [`AttributionId`], and the observer ships an
//!   [`AttributionRecord`] when it finds the credential valid;
//!   `host-sim reconcile` joins the two. A forged credential never gets an
//!   attribution record, so its requests stay `unverified`.

use serde::Serialize;

use super::credential::{TokenHash, hex};
use super::verdict::{self, VerdictView};

/// The credential of a request admitted before verification, as lazy-auth
/// hands it to metering: its hash and the verdict store's slot count (where
/// its verdict will be).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingCredential {
    /// The credential's [`TokenHash::credential`].
    pub hash: TokenHash,
    /// lazy-auth's `verdict_slots`.
    pub slots: u32,
}

impl PendingCredential {
    /// The hand-off value: `<64 hex digits>:<slots>`.
    pub fn render(&self) -> Vec<u8> {
        format!("{}:{}", hex(&self.hash.0), self.slots).into_bytes()
    }

    /// Parses a hand-off value; `None` when it is not one.
    pub fn parse(value: &[u8]) -> Option<PendingCredential> {
        let text = std::str::from_utf8(value).ok()?;
        let (digits, slots) = text.split_once(':')?;
        if digits.len() != 64 {
            return None;
        }
        let mut hash = [0u8; 32];
        for (i, byte) in hash.iter_mut().enumerate() {
            *byte = u8::from_str_radix(digits.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(PendingCredential {
            hash: TokenHash(hash),
            slots: slots.parse().ok()?,
        })
    }

    /// The shared-data key its verdict lives under.
    pub fn verdict_key(&self) -> String {
        verdict::key(&self.hash, self.slots)
    }

    /// What its verdict (the set entry under [`Self::verdict_key`]) says now.
    pub fn resolve<'a>(&self, entry: &'a [u8], now: u64) -> Resolution<'a> {
        match verdict::view(entry, &self.hash, now) {
            Some(VerdictView {
                valid: true,
                tenant,
                subject,
                ..
            }) => Resolution::Verified { tenant, subject },
            Some(_) => Resolution::Refused,
            None => Resolution::Pending(AttributionId::of(&self.hash)),
        }
    }
}

/// What a lazily admitted request is billed as once its response ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution<'a> {
    /// The credential was verified: its tenant and subject.
    Verified {
        /// Verified tenant.
        tenant: Option<&'a str>,
        /// Verified subject.
        subject: Option<&'a str>,
    },
    /// The credential was refused: `unverified` for good.
    Refused,
    /// Not decided yet: `unverified`, with the id an attribution record
    /// will name.
    Pending(AttributionId),
}

/// A credential's id in usage records and attribution records: 128 bits of
/// its hash as 32 hex digits. An attacker would need a second preimage of
/// those 128 bits to have a valid credential's attribution name its
/// requests; useless for recovering the credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttributionId(pub [u8; 16]);

impl AttributionId {
    /// The id of the credential with this hash.
    pub fn of(hash: &TokenHash) -> AttributionId {
        let mut id = [0u8; 16];
        id.copy_from_slice(&hash.0[..16]);
        AttributionId(id)
    }

    /// As written in records: 32 lower-case hex digits.
    pub fn render(&self) -> String {
        hex(&self.0)
    }
}

/// The observer's finding that a lazily admitted credential is valid: the
/// row reconciliation joins usage records naming the same credential with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AttributionRecord {
    /// [`AttributionId::render`] of the credential.
    pub credential: String,
    /// Its verified tenant (none: billed as a verified request without one).
    pub tenant: Option<String>,
    /// Its verified subject.
    pub subject: Option<String>,
    /// Unix ms when it was verified.
    pub at_ms: u64,
}

impl AttributionRecord {
    /// The sink's JSON line (with its trailing newline) appended to `out`.
    pub fn write_sink_row(&self, out: &mut Vec<u8>) {
        if serde_json::to_writer(&mut *out, self).is_ok() {
            out.push(b'\n');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::credential::CredentialKind;
    use crate::auth::verdict::Verdict;

    #[test]
    fn a_pending_credential_round_trips_and_finds_its_verdict() {
        let hash = TokenHash::credential(CredentialKind::ApiKey, b"sk-1");
        let pending = PendingCredential { hash, slots: 64 };
        let parsed = PendingCredential::parse(&pending.render()).unwrap();
        assert_eq!(parsed, pending);
        assert_eq!(parsed.verdict_key(), verdict::key(&hash, 64));
        for bad in [&b""[..], b"zz:1", b"00:1", &pending.render()[..64]] {
            assert_eq!(PendingCredential::parse(bad), None);
        }
        let now = 1_000;
        let id = AttributionId::of(&hash);
        assert_eq!(pending.resolve(b"", now), Resolution::Pending(id));
        let valid = Verdict::valid(&hash, now, None, 300, Some("acme".into()), Some("u".into()));
        let entry = valid.encode();
        assert_eq!(
            pending.resolve(&entry, now),
            Resolution::Verified {
                tenant: Some("acme"),
                subject: Some("u")
            }
        );
        // Expired: pending again (a later verification decides).
        assert_eq!(pending.resolve(&entry, now + 301), Resolution::Pending(id));
        let refused = Verdict::invalid(&hash, now, 60, "revoked").encode();
        assert_eq!(pending.resolve(&refused, now), Resolution::Refused);
        // Another credential's verdict in the same set says nothing of this one.
        let other = TokenHash::credential(CredentialKind::ApiKey, b"sk-2");
        let theirs = Verdict::valid(&other, now, None, 300, Some("evil".into()), None).encode();
        assert_eq!(pending.resolve(&theirs, now), Resolution::Pending(id));
    }

    #[test]
    fn an_attribution_row_is_one_json_line() {
        let hash = TokenHash::credential(CredentialKind::Jwt, b"t");
        let record = AttributionRecord {
            credential: AttributionId::of(&hash).render(),
            tenant: Some("acme".into()),
            subject: None,
            at_ms: 5,
        };
        assert_eq!(record.credential.len(), 32);
        let mut out = Vec::new();
        record.write_sink_row(&mut out);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            format!(
                "{{\"credential\":\"{}\",\"tenant\":\"acme\",\"subject\":null,\"at_ms\":5}}\n",
                record.credential
            )
        );
    }
}
