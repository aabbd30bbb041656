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

impl CredentialKind {
    /// The domain tag hashed ahead of a credential of this kind, so one
    /// string's verdict as one kind never answers for it as the other.
    fn tag(self) -> &'static [u8] {
        match self {
            CredentialKind::Jwt => b"zerolayer:jwt\0",
            CredentialKind::ApiKey => b"zerolayer:api_key\0",
        }
    }
}

/// What a source's credentials are: one kind, or `auto` (what
/// `Authorization: Bearer` carries from the official SDKs: a JWT or an API
/// key, told apart by shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum SourceKind {
    /// Always a JSON Web Token.
    Jwt,
    /// Always an opaque API key.
    ApiKey,
    /// A JWT when it has a JWT's shape (three base64url segments, the first
    /// a JSON object), otherwise an API key (a JWT again when no `api_keys`
    /// endpoint is configured: such a token then fails as a malformed JWT).
    Auto,
}

impl SourceKind {
    /// The kind `token` is verified as; `api_keys`: whether an
    /// introspection endpoint is configured.
    pub fn classify(self, token: &[u8], api_keys: bool) -> CredentialKind {
        match self {
            SourceKind::Jwt => CredentialKind::Jwt,
            SourceKind::ApiKey => CredentialKind::ApiKey,
            SourceKind::Auto if !api_keys || looks_like_jwt(token) => CredentialKind::Jwt,
            SourceKind::Auto => CredentialKind::ApiKey,
        }
    }
}

/// Whether `token` has a compact JWS's shape: exactly three non-empty
/// base64url segments, the first starting `eyJ` (the encoding of `{"`).
/// API keys (`sk-…`, `sk-ant-…`, hex or base64url strings) have no dots.
pub fn looks_like_jwt(token: &[u8]) -> bool {
    let mut segments = 0;
    for segment in token.split(|&b| b == b'.') {
        segments += 1;
        let base64url = |b: &u8| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_';
        if segments > 3 || segment.is_empty() || !segment.iter().all(base64url) {
            return false;
        }
    }
    segments == 3 && token.starts_with(b"eyJ")
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
    /// How the credential is verified: `jwt`, `api_key`, or `auto` (by
    /// shape: a JWT's three segments → JWT, anything else → API key).
    pub kind: SourceKind,
}

/// The SHA-256 of a credential: of its kind's domain tag and its bytes
/// ([`TokenHash::credential`]), which is what verdicts and counters are
/// keyed by, or of plain bytes ([`TokenHash::of`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenHash(pub [u8; 32]);

impl TokenHash {
    /// The SHA-256 of `bytes`.
    pub fn of(bytes: &[u8]) -> TokenHash {
        TokenHash(Sha256::digest(bytes).into())
    }

    /// The hash a credential of `kind` is known by: verdicts and exposure
    /// counts are keyed by (kind, credential), so a string refused as a JWT
    /// is still unknown as an API key, and the other way round.
    pub fn credential(kind: CredentialKind, credential: &[u8]) -> TokenHash {
        let mut hasher = Sha256::new();
        hasher.update(kind.tag());
        hasher.update(credential);
        TokenHash(hasher.finalize().into())
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
    kind: CredentialKind,
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

    /// The credential's [`TokenHash::credential`]: remembered, or computed
    /// and kept.
    pub fn hash(&mut self, kind: CredentialKind, credential: &[u8]) -> TokenHash {
        if self.capacity == 0 || credential.len() > Self::MAX_KEPT_LEN {
            return TokenHash::credential(kind, credential);
        }
        let fingerprint = xxh3_64(credential);
        if let Some(entry) = self.entries.iter().find(|e| {
            e.fingerprint == fingerprint && e.kind == kind && e.credential.as_slice() == credential
        }) {
            return entry.hash;
        }
        let entry = RecentCredential {
            fingerprint,
            kind,
            credential: Zeroizing::new(credential.to_vec()),
            hash: TokenHash::credential(kind, credential),
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

    const JWT: CredentialKind = CredentialKind::Jwt;
    const KEY: CredentialKind = CredentialKind::ApiKey;

    fn bearer() -> CredentialSource {
        CredentialSource {
            header: "authorization".into(),
            scheme: Some("Bearer".into()),
            kind: SourceKind::Auto,
        }
    }

    #[test]
    fn recent_credentials_hash_like_sha256_and_keep_the_newest() {
        let mut recent = RecentCredentials::new(2);
        let tokens: [&[u8]; 3] = [b"token-a", b"token-b", b"token-c"];
        for token in tokens.iter().chain(tokens.iter()).chain([&&b"token-c"[..]]) {
            assert_eq!(recent.hash(JWT, token), TokenHash::credential(JWT, token));
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
        assert_eq!(recent.hash(KEY, &long), TokenHash::credential(KEY, &long));
        assert!(
            recent
                .entries
                .iter()
                .all(|e| e.credential.len() <= RecentCredentials::MAX_KEPT_LEN)
        );
        assert_eq!(
            RecentCredentials::new(0).hash(KEY, b"t"),
            TokenHash::credential(KEY, b"t")
        );
        // The same bytes as the other kind are another credential.
        assert_eq!(
            recent.hash(KEY, b"token-c"),
            TokenHash::credential(KEY, b"token-c")
        );
        assert_ne!(recent.hash(KEY, b"token-c"), recent.hash(JWT, b"token-c"));
        assert_eq!(format!("{recent:?}"), "RecentCredentials(2 of 2)");
    }

    proptest::proptest! {
        /// Whatever the sequence of credentials, the hash is the SHA-256.
        #[test]
        fn recent_credentials_never_answer_another_credentials_hash(
            picks in proptest::collection::vec((0usize..6, proptest::bool::ANY), 1..40),
            capacity in 0usize..4,
        ) {
            let tokens: Vec<Vec<u8>> = (0..6).map(|i| format!("tok{i}").into_bytes()).collect();
            let mut recent = RecentCredentials::new(capacity);
            for (pick, jwt) in picks {
                let kind = if jwt { JWT } else { KEY };
                proptest::prop_assert_eq!(
                    recent.hash(kind, &tokens[pick]),
                    TokenHash::credential(kind, &tokens[pick])
                );
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
            kind: SourceKind::ApiKey,
        };
        assert_eq!(extract(&key, b" sk-123 "), Some(&b"sk-123"[..]));
        assert_eq!(extract(&key, b"   "), None);
    }

    /// What the official SDKs and identity providers really send.
    #[test]
    fn auto_tells_jwts_from_api_keys_by_shape() {
        let jwts: [&[u8]; 2] = [
            b"eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ1In0.c2lnbmF0dXJl",
            b"eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.e30.AbC-_09",
        ];
        for jwt in jwts {
            assert!(looks_like_jwt(jwt), "{jwt:?}");
            assert_eq!(SourceKind::Auto.classify(jwt, true), JWT);
        }
        let keys: [&[u8]; 7] = [
            b"sk-proj-Abc_def-123",
            b"sk-ant-api03-xyz_-ABC",
            b"sk-chain-globex",
            b"0123456789abcdef",
            b"eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ1In0",
            b"eyJa.b.c.d",
            b"eyJa..c",
        ];
        for key in keys {
            assert!(!looks_like_jwt(key), "{key:?}");
            assert_eq!(SourceKind::Auto.classify(key, true), KEY);
            // Without an introspection endpoint nothing can verify a key.
            assert_eq!(SourceKind::Auto.classify(key, false), JWT);
        }
        assert!(!looks_like_jwt(b"abc.def.ghi"), "not a JSON header");
        assert!(!looks_like_jwt(b"eyJ+.e30.sig"), "not base64url");
        assert_eq!(SourceKind::Jwt.classify(b"sk-1", true), JWT);
        assert_eq!(SourceKind::ApiKey.classify(jwts[0], true), KEY);
    }

    #[test]
    fn a_credentials_hash_depends_on_its_kind() {
        let (jwt, key) = (
            TokenHash::credential(JWT, b"sk-1"),
            TokenHash::credential(KEY, b"sk-1"),
        );
        assert_ne!(jwt, key);
        assert_ne!(jwt, TokenHash::of(b"sk-1"));
        let mut tagged = b"zerolayer:api_key\0".to_vec();
        tagged.extend_from_slice(b"sk-1");
        assert_eq!(key, TokenHash::of(&tagged));
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
