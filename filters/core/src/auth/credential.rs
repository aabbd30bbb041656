//! Credentials on the request and their hash. Only the SHA-256 of a
//! credential is ever stored, logged or used as a key; the credential itself
//! lives only in the request and, for verification, in the observer's queue.

use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_64;
use zeroize::Zeroizing;

/// What a credential is, which decides how it is verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum CredentialKind {
    /// A JSON Web Token (verified by signature and claims).
    Jwt,
    /// An opaque API key (verified by the introspection endpoint).
    ApiKey,
}

/// Where a credential is read from: a header, optionally with a scheme
/// prefix (`Authorization: Bearer <token>`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct CredentialSource {
    /// Header name (case-insensitive).
    pub header: String,
    /// Scheme before the credential (`Bearer`), matched case-insensitively.
    #[serde(default)]
    pub scheme: Option<String>,
    /// How the credential is verified.
    pub kind: CredentialKind,
}

/// The SHA-256 of a credential.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenHash(pub [u8; 32]);

impl TokenHash {
    /// Hashes a credential.
    pub fn of(credential: &[u8]) -> TokenHash {
        TokenHash(Sha256::digest(credential).into())
    }

    /// The first 8 bytes as 16 hex digits: enough to follow a credential
    /// through logs and audit records, useless for recovering it.
    pub fn prefix(&self) -> String {
        hex(&self.0[..8])
    }

    /// The slot of this hash among `slots` (a bounded key space).
    pub fn slot(&self, slots: u32) -> u32 {
        let n = u32::from_le_bytes([self.0[0], self.0[1], self.0[2], self.0[3]]);
        n % slots.max(1)
    }
}

impl fmt::Debug for TokenHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenHash({}…)", self.prefix())
    }
}

/// The hashes of the last few credentials seen, so that a client sending
/// the same credential on every request (the usual case) has it hashed
/// once: SHA-256 of a JWT is the largest part of lazy-auth's hot path in
/// Wasm. An entry is found by the credential's bytes, compared in full
/// after a fast fingerprint; the copies kept are zeroed when dropped.
pub struct RecentCredentials {
    entries: Vec<RecentCredential>,
    capacity: usize,
    /// The entry the next new credential replaces (oldest first).
    next: usize,
}

struct RecentCredential {
    fingerprint: u64,
    credential: Zeroizing<Vec<u8>>,
    hash: TokenHash,
}

impl RecentCredentials {
    /// Longer credentials are hashed every time, not kept.
    pub const MAX_KEPT_LEN: usize = 4096;

    /// Remembers up to `capacity` credentials.
    pub fn new(capacity: usize) -> RecentCredentials {
        RecentCredentials {
            entries: Vec::with_capacity(capacity),
            capacity,
            next: 0,
        }
    }

    /// The credential's [`TokenHash`]: remembered, or computed and kept.
    pub fn hash(&mut self, credential: &[u8]) -> TokenHash {
        if self.capacity == 0 || credential.len() > Self::MAX_KEPT_LEN {
            return TokenHash::of(credential);
        }
        let fingerprint = xxh3_64(credential);
        if let Some(entry) = self
            .entries
            .iter()
            .find(|e| e.fingerprint == fingerprint && e.credential.as_slice() == credential)
        {
            return entry.hash;
        }
        let entry = RecentCredential {
            fingerprint,
            credential: Zeroizing::new(credential.to_vec()),
            hash: TokenHash::of(credential),
        };
        let hash = entry.hash;
        if self.entries.len() < self.capacity {
            self.entries.push(entry);
        } else if let Some(slot) = self.entries.get_mut(self.next) {
            *slot = entry;
        }
        self.next = (self.next + 1) % self.capacity;
        hash
    }
}

impl fmt::Debug for RecentCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the credentials themselves.
        write!(
            f,
            "RecentCredentials({} of {})",
            self.entries.len(),
            self.capacity
        )
    }
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

/// The credential in a header value for `source`, if it has the scheme
/// (when one is configured) and is not empty.
pub fn extract<'a>(source: &CredentialSource, value: &'a [u8]) -> Option<&'a [u8]> {
    let value = value.trim_ascii();
    let credential = match &source.scheme {
        None => value,
        Some(scheme) => {
            let scheme = scheme.as_bytes();
            let head = value.get(..scheme.len())?;
            if !head.eq_ignore_ascii_case(scheme) {
                return None;
            }
            let rest = &value[scheme.len()..];
            // The scheme must be followed by whitespace ("Bearertoken" is not Bearer).
            if !rest.first().is_some_and(u8::is_ascii_whitespace) {
                return None;
            }
            rest.trim_ascii_start()
        }
    };
    (!credential.is_empty()).then_some(credential)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer() -> CredentialSource {
        CredentialSource {
            header: "authorization".into(),
            scheme: Some("Bearer".into()),
            kind: CredentialKind::Jwt,
        }
    }

    #[test]
    fn recent_credentials_hash_like_sha256_and_keep_the_newest() {
        let mut recent = RecentCredentials::new(2);
        let tokens: [&[u8]; 3] = [b"token-a", b"token-b", b"token-c"];
        for token in tokens.iter().chain(tokens.iter()).chain([&&b"token-c"[..]]) {
            assert_eq!(recent.hash(token), TokenHash::of(token));
        }
        // Capacity 2: the two newest are kept, the oldest replaced.
        assert_eq!(recent.entries.len(), 2);
        let kept: Vec<&[u8]> = recent
            .entries
            .iter()
            .map(|e| e.credential.as_slice())
            .collect();
        assert!(
            kept.contains(&&b"token-c"[..]) && kept.contains(&&b"token-b"[..]),
            "{kept:?}"
        );
        // Too long to keep, or nothing kept at all: hashed every time.
        let long = vec![b'x'; RecentCredentials::MAX_KEPT_LEN + 1];
        assert_eq!(recent.hash(&long), TokenHash::of(&long));
        assert!(
            recent
                .entries
                .iter()
                .all(|e| e.credential.len() <= RecentCredentials::MAX_KEPT_LEN)
        );
        assert_eq!(RecentCredentials::new(0).hash(b"t"), TokenHash::of(b"t"));
        assert_eq!(format!("{recent:?}"), "RecentCredentials(2 of 2)");
    }

    proptest::proptest! {
        /// Whatever the sequence of credentials, the hash is the SHA-256.
        #[test]
        fn recent_credentials_never_answer_another_credentials_hash(
            picks in proptest::collection::vec(0usize..6, 1..40),
            capacity in 0usize..4,
        ) {
            let tokens: Vec<Vec<u8>> = (0..6).map(|i| format!("tok{i}").into_bytes()).collect();
            let mut recent = RecentCredentials::new(capacity);
            for pick in picks {
                proptest::prop_assert_eq!(recent.hash(&tokens[pick]), TokenHash::of(&tokens[pick]));
            }
        }
    }

    #[test]
    fn extraction() {
        let b = bearer();
        assert_eq!(
            extract(&b, b"Bearer abc.def.ghi"),
            Some(&b"abc.def.ghi"[..])
        );
        assert_eq!(extract(&b, b"bearer   abc "), Some(&b"abc"[..]));
        assert_eq!(extract(&b, b"Bearerabc"), None);
        assert_eq!(extract(&b, b"Basic abc"), None);
        assert_eq!(extract(&b, b"Bearer "), None);
        assert_eq!(extract(&b, b""), None);
        let key = CredentialSource {
            header: "x-api-key".into(),
            scheme: None,
            kind: CredentialKind::ApiKey,
        };
        assert_eq!(extract(&key, b" sk-123 "), Some(&b"sk-123"[..]));
        assert_eq!(extract(&key, b"   "), None);
    }

    #[test]
    fn hashing() {
        let h = TokenHash::of(b"abc");
        // SHA-256("abc"), FIPS 180-2 test vector.
        assert_eq!(
            hex(&h.0),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(h.prefix(), "ba7816bf8f01cfea");
        assert_eq!(format!("{h:?}"), "TokenHash(ba7816bf8f01cfea…)");
        assert!(h.slot(1000) < 1000);
        assert_eq!(h.slot(0), 0);
    }
}
