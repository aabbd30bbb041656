//! JSON Web Token verification (RFC 7519 tokens in JWS compact form) for
//! RS256, ES256 and HS256, built on RustCrypto so it runs inside a
//! `wasm32-wasip1` filter: verification needs no randomness from the host.
//!
//! [`peek`] decodes a token without checking anything (to find `kid`, `exp`
//! or a tenant claim cheaply); [`verify`] checks the
//! signature against a [`KeySet`] and then the claims against a
//! [`Validation`]. Claims are only checked once the signature holds, so a
//! forged token is reported as `bad_signature`, never as `expired`.
//!
//! What is refused on purpose: `alg: none` and every algorithm but the three
//! above; a header algorithm that does not fit the key's type (a key is typed
//! by its material, so an RSA public key can never serve as an HMAC secret);
//! `crit` headers (no extension is implemented); duplicate members in the
//! header or claims (parsers disagree on which one wins); base64url with
//! padding or non-zero trailing bits (every segment has one encoding);
//! tokens over [`MAX_TOKEN_LEN`] bytes.

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use rsa::pkcs8::SubjectPublicKeyInfoRef;
use rsa::signature::Verifier as _;
use rsa::traits::PublicKeyParts;
use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde_json::{Map, Value};
use sha2::Sha256;
use zeroize::Zeroizing;

/// Longest token accepted, in bytes; longer ones fail with
/// [`JwtError::TooLong`] before anything is decoded.
pub const MAX_TOKEN_LEN: usize = 16 * 1024;

/// Smallest RSA modulus accepted, in bits (RFC 7518 §3.3 requires 2048).
pub const MIN_RSA_BITS: usize = 2048;

/// Largest RSA modulus accepted, in bits (bounds the cost of one verification).
pub const MAX_RSA_BITS: usize = 4096;

/// Shortest HS256 secret accepted, in bytes (RFC 7518 §3.2: at least the
/// hash size).
pub const MIN_HMAC_SECRET_LEN: usize = 32;

/// Longest reproduction of a token-supplied value in an error message.
const EXCERPT_CHARS: usize = 64;

// ---------------------------------------------------------------------------
// Algorithms

/// A JWS signature algorithm this module verifies (RFC 7518 names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
pub enum Algorithm {
    /// RSASSA-PKCS1-v1_5 with SHA-256.
    RS256,
    /// ECDSA on P-256 with SHA-256, signature as fixed-size `r || s`.
    ES256,
    /// HMAC with SHA-256.
    HS256,
}

impl Algorithm {
    /// Every supported algorithm.
    pub const ALL: [Algorithm; 3] = [Algorithm::RS256, Algorithm::ES256, Algorithm::HS256];

    /// The algorithm named `name` in a JWS header (case-sensitive, as the
    /// RFC requires); `None` for `none` and everything unsupported.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "RS256" => Some(Self::RS256),
            "ES256" => Some(Self::ES256),
            "HS256" => Some(Self::HS256),
            _ => None,
        }
    }

    /// The algorithm's name as written in a JWS header.
    pub fn name(self) -> &'static str {
        match self {
            Self::RS256 => "RS256",
            Self::ES256 => "ES256",
            Self::HS256 => "HS256",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

// ---------------------------------------------------------------------------
// Errors

/// The part of a token an error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment {
    /// The token as a whole (its length or its dot-separated structure).
    Token,
    /// The JOSE header, first segment.
    Header,
    /// The claims, second segment.
    Payload,
    /// The signature, third segment.
    Signature,
}

impl fmt::Display for Segment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Token => "token",
            Self::Header => "header",
            Self::Payload => "payload",
            Self::Signature => "signature",
        })
    }
}

/// Why a token was not accepted. [`JwtError::reason`] gives a stable short
/// name per variant for logs and metric labels; the `Display` text adds the
/// offending field and value (token-supplied values are quoted, escaped and
/// cut to a few dozen characters).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwtError {
    /// The token is longer than [`MAX_TOKEN_LEN`].
    #[error("token is {len} bytes, more than the {max} accepted")]
    TooLong {
        /// The token's length in bytes.
        len: usize,
        /// The limit, [`MAX_TOKEN_LEN`].
        max: usize,
    },
    /// The token is not a well-formed JWS: structure, base64url, JSON, or the
    /// type of a header member or registered claim.
    #[error("malformed {segment}: {detail}")]
    Malformed {
        /// Which part of the token is wrong.
        segment: Segment,
        /// What is wrong with it.
        detail: String,
    },
    /// The header's `alg` is not one this module implements (`none` included).
    #[error("unsupported algorithm {}", excerpt_str(.0))]
    UnsupportedAlgorithm(String),
    /// The header's `alg` is supported but not in [`Validation::algorithms`].
    #[error("algorithm {0} is not allowed")]
    AlgorithmNotAllowed(Algorithm),
    /// The header names `crit` extensions, none of which are implemented
    /// (RFC 7515 §4.1.11 requires rejecting the token).
    #[error("header \"crit\" names extensions this verifier does not implement: {0}")]
    UnsupportedCritical(String),
    /// Keys match the token's `kid` but none is of the header's algorithm
    /// (for example an HS256 header against RSA keys).
    #[error("no key{} is for algorithm {alg}", kid_phrase(.kid.as_deref()))]
    AlgorithmMismatch {
        /// The header's algorithm.
        alg: Algorithm,
        /// The header's `kid`, if any.
        kid: Option<String>,
    },
    /// No key matches the token's `kid` (or, for a token without `kid`, the
    /// key set is empty).
    #[error("no key{}", kid_phrase(.0.as_deref()))]
    UnknownKey(Option<String>),
    /// No candidate key verifies the signature.
    #[error("signature does not verify")]
    BadSignature,
    /// `exp` (plus leeway) is not after `now`.
    #[error("token expired: exp {exp}, now {now}")]
    Expired {
        /// The token's `exp`.
        exp: u64,
        /// The time of verification.
        now: u64,
    },
    /// `nbf` (less leeway) is after `now`.
    #[error("token not valid yet: nbf {nbf}, now {now}")]
    NotYetValid {
        /// The token's `nbf`.
        nbf: u64,
        /// The time of verification.
        now: u64,
    },
    /// `iss` is not one of [`Validation::issuers`].
    #[error("issuer {} is not accepted", excerpt_str(.0))]
    WrongIssuer(String),
    /// No `aud` entry is one of [`Validation::audiences`].
    #[error("audience {} is not accepted", excerpt_list(.0))]
    WrongAudience(Vec<String>),
    /// A claim the validation requires is absent.
    #[error("claim {0:?} is required")]
    MissingClaim(&'static str),
}

impl JwtError {
    /// Every value [`JwtError::reason`] returns, for declaring metrics up front.
    pub const REASONS: [&'static str; 13] = [
        "too_long",
        "malformed",
        "unsupported_algorithm",
        "algorithm_not_allowed",
        "unsupported_critical",
        "algorithm_mismatch",
        "unknown_key",
        "bad_signature",
        "expired",
        "not_yet_valid",
        "wrong_issuer",
        "wrong_audience",
        "missing_claim",
    ];

    /// A stable short name for the variant (`expired`, `bad_signature`, ...).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::TooLong { .. } => "too_long",
            Self::Malformed { .. } => "malformed",
            Self::UnsupportedAlgorithm(_) => "unsupported_algorithm",
            Self::AlgorithmNotAllowed(_) => "algorithm_not_allowed",
            Self::UnsupportedCritical(_) => "unsupported_critical",
            Self::AlgorithmMismatch { .. } => "algorithm_mismatch",
            Self::UnknownKey(_) => "unknown_key",
            Self::BadSignature => "bad_signature",
            Self::Expired { .. } => "expired",
            Self::NotYetValid { .. } => "not_yet_valid",
            Self::WrongIssuer(_) => "wrong_issuer",
            Self::WrongAudience(_) => "wrong_audience",
            Self::MissingClaim(_) => "missing_claim",
        }
    }

    fn malformed(segment: Segment, detail: impl Into<String>) -> Self {
        Self::Malformed {
            segment,
            detail: detail.into(),
        }
    }
}

fn kid_phrase(kid: Option<&str>) -> String {
    match kid {
        Some(kid) => format!(" with kid {}", excerpt_str(kid)),
        None => " for a token without kid".to_string(),
    }
}

/// `value` cut to [`EXCERPT_CHARS`] characters (token-supplied strings kept
/// in errors stay small).
fn clip(value: &str) -> String {
    if value.chars().count() <= EXCERPT_CHARS {
        value.to_string()
    } else {
        let mut cut: String = value.chars().take(EXCERPT_CHARS).collect();
        cut.push('…');
        cut
    }
}

/// `value` quoted and escaped as JSON, cut to [`EXCERPT_CHARS`] characters.
fn excerpt_str(value: &str) -> String {
    excerpt_json(&Value::String(value.to_string()))
}

fn excerpt_list(values: &[String]) -> String {
    excerpt_json(&Value::Array(
        values.iter().map(|v| Value::String(v.clone())).collect(),
    ))
}

fn excerpt_json(value: &Value) -> String {
    clip(&value.to_string())
}

/// Why a key could not be built (from a JWK, a PEM document or a secret) or
/// a JWKS document could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The JWK's `kty` (or the PEM key's algorithm) is not RSA, EC or oct.
    #[error("key type {0} is not supported (expected \"RSA\", \"EC\" or \"oct\")")]
    UnsupportedKeyType(String),
    /// The EC key's curve is not P-256.
    #[error("curve {0} is not supported (expected \"P-256\")")]
    UnsupportedCurve(String),
    /// The JWK's `alg` is not the one algorithm its key type is used with here.
    #[error("\"alg\" {alg} is not supported for this key (expected {expected:?})")]
    UnsupportedAlgorithm {
        /// The JWK's `alg`, quoted.
        alg: String,
        /// The algorithm the key's type verifies.
        expected: Algorithm,
    },
    /// The JWK says it is not for verifying signatures (`use` other than
    /// `sig`, or `key_ops` without `verify`).
    #[error("key is not for verifying signatures ({0})")]
    NotForSignatures(String),
    /// A required JWK member is absent.
    #[error("{0:?} is required")]
    MissingField(&'static str),
    /// A JWK member, the PEM document or the key material is invalid.
    #[error("{field}: {problem}")]
    Invalid {
        /// The JWK member (`n`, `x`, `k`, ...) or `pem`, `jwk`, `key`.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// The RSA modulus is outside [`MIN_RSA_BITS`]..=[`MAX_RSA_BITS`].
    #[error("RSA modulus of {bits} bits is outside the accepted {MIN_RSA_BITS}..={MAX_RSA_BITS}")]
    RsaKeySize {
        /// The modulus size in bits.
        bits: usize,
    },
    /// The HMAC secret is shorter than [`MIN_HMAC_SECRET_LEN`].
    #[error("HS256 secret of {len} bytes is shorter than the {MIN_HMAC_SECRET_LEN} required")]
    SecretTooShort {
        /// The secret's length in bytes.
        len: usize,
    },
    /// The JWKS document is not `{"keys":[...]}`.
    #[error("JWKS: {0}")]
    Jwks(String),
}

impl KeyError {
    fn invalid(field: &'static str, problem: impl Into<String>) -> Self {
        Self::Invalid {
            field,
            problem: problem.into(),
        }
    }
}

// ---------------------------------------------------------------------------
// Keys

/// A key that verifies signatures of one algorithm, with an optional `kid`.
/// The algorithm follows from the material (RSA → RS256, P-256 → ES256,
/// secret → HS256). `Debug` never shows an HMAC secret.
#[derive(Clone)]
pub struct VerifyingKey {
    kid: Option<String>,
    material: Material,
}

#[derive(Clone)]
enum Material {
    Rsa(Box<rsa::pkcs1v15::VerifyingKey<Sha256>>),
    P256(Box<p256::ecdsa::VerifyingKey>),
    Hmac(Zeroizing<Vec<u8>>),
}

impl VerifyingKey {
    /// An RS256 key from the big-endian modulus and exponent.
    fn rsa(n: &[u8], e: &[u8]) -> Result<Self, KeyError> {
        let n = rsa::BigUint::from_bytes_be(n);
        let bits = n.bits();
        if !(MIN_RSA_BITS..=MAX_RSA_BITS).contains(&bits) {
            return Err(KeyError::RsaKeySize { bits });
        }
        let key =
            rsa::RsaPublicKey::new_with_max_size(n, rsa::BigUint::from_bytes_be(e), MAX_RSA_BITS)
                .map_err(|err| {
                let field = match err {
                    rsa::Error::InvalidModulus => "n",
                    _ => "e",
                };
                KeyError::invalid(field, format!("bad RSA public key: {err}"))
            })?;
        Ok(Self {
            kid: None,
            material: Material::Rsa(Box::new(rsa::pkcs1v15::VerifyingKey::new(key))),
        })
    }

    fn p256(key: p256::ecdsa::VerifyingKey) -> Self {
        Self {
            kid: None,
            material: Material::P256(Box::new(key)),
        }
    }

    /// An HS256 key from a shared secret of at least [`MIN_HMAC_SECRET_LEN`]
    /// bytes; the copy kept is zeroed when the key is dropped.
    pub fn from_secret(secret: &[u8]) -> Result<Self, KeyError> {
        if secret.len() < MIN_HMAC_SECRET_LEN {
            return Err(KeyError::SecretTooShort { len: secret.len() });
        }
        Ok(Self {
            kid: None,
            material: Material::Hmac(Zeroizing::new(secret.to_vec())),
        })
    }

    /// A key from a PEM document: `-----BEGIN PUBLIC KEY-----`
    /// (SubjectPublicKeyInfo, RSA or P-256) or `-----BEGIN RSA PUBLIC KEY-----`
    /// (PKCS#1).
    pub fn from_pem(pem: &str) -> Result<Self, KeyError> {
        if !pem.contains("-----BEGIN") {
            return Err(KeyError::invalid("pem", "no \"-----BEGIN\" line"));
        }
        let (label, der) = rsa::pkcs8::der::pem::decode_vec(pem.trim().as_bytes())
            .map_err(|err| KeyError::invalid("pem", format!("not a PEM document: {err}")))?;
        match label {
            "PUBLIC KEY" => Self::from_spki_der(&der),
            "RSA PUBLIC KEY" => Self::from_pkcs1_der(&der),
            other => Err(KeyError::invalid(
                "pem",
                format!(
                    "label {} is not supported (expected \"PUBLIC KEY\" or \"RSA PUBLIC KEY\")",
                    excerpt_str(other)
                ),
            )),
        }
    }

    fn from_pkcs1_der(der: &[u8]) -> Result<Self, KeyError> {
        let key = rsa::pkcs1::RsaPublicKey::try_from(der).map_err(|err| {
            KeyError::invalid("pem", format!("not a PKCS#1 RSA public key: {err}"))
        })?;
        Self::rsa(key.modulus.as_bytes(), key.public_exponent.as_bytes())
    }

    fn from_spki_der(der: &[u8]) -> Result<Self, KeyError> {
        let spki = SubjectPublicKeyInfoRef::try_from(der).map_err(|err| {
            KeyError::invalid("pem", format!("not a SubjectPublicKeyInfo: {err}"))
        })?;
        let oid = spki.algorithm.oid;
        if oid == rsa::pkcs1::ALGORITHM_OID {
            let pkcs1 = spki.subject_public_key.as_bytes().ok_or_else(|| {
                KeyError::invalid("pem", "RSA public key is not a whole number of bytes")
            })?;
            Self::from_pkcs1_der(pkcs1)
        } else if oid == p256::elliptic_curve::ALGORITHM_OID {
            let curve = spki.algorithm.parameters_oid().map_err(|err| {
                KeyError::invalid("pem", format!("EC key without a named curve: {err}"))
            })?;
            if curve != <p256::NistP256 as rsa::pkcs8::AssociatedOid>::OID {
                return Err(KeyError::UnsupportedCurve(format!("OID {curve}")));
            }
            let key = p256::PublicKey::try_from(spki)
                .map_err(|err| KeyError::invalid("pem", format!("bad P-256 public key: {err}")))?;
            Ok(Self::p256(key.into()))
        } else {
            Err(KeyError::UnsupportedKeyType(format!("OID {oid}")))
        }
    }

    /// A key from a JWK (RFC 7517): `kty` `RSA` (`n`, `e`), `EC` with `crv`
    /// `P-256` (`x`, `y`) or `oct` (`k`). `kid` is kept; `alg`, `use` and
    /// `key_ops`, when present, must allow verifying with the key's algorithm.
    pub fn from_jwk(jwk: &Value) -> Result<Self, KeyError> {
        let Some(members) = jwk.as_object() else {
            return Err(KeyError::invalid(
                "jwk",
                format!("expected a JSON object, got {}", excerpt_json(jwk)),
            ));
        };
        let kty = jwk_str(members, "kty")?.ok_or(KeyError::MissingField("kty"))?;
        let kid = jwk_str(members, "kid")?.map(str::to_string);
        let algorithm = match kty {
            "RSA" => Algorithm::RS256,
            "EC" => Algorithm::ES256,
            "oct" => Algorithm::HS256,
            other => return Err(KeyError::UnsupportedKeyType(excerpt_str(other))),
        };
        if let Some(alg) = jwk_str(members, "alg")?
            && alg != algorithm.name()
        {
            return Err(KeyError::UnsupportedAlgorithm {
                alg: excerpt_str(alg),
                expected: algorithm,
            });
        }
        if let Some(key_use) = jwk_str(members, "use")?
            && key_use != "sig"
        {
            return Err(KeyError::NotForSignatures(format!(
                "\"use\" is {}",
                excerpt_str(key_use)
            )));
        }
        if let Some(ops) = members.get("key_ops") {
            let Some(ops) = ops.as_array() else {
                return Err(KeyError::invalid(
                    "key_ops",
                    format!("expected an array of strings, got {}", excerpt_json(ops)),
                ));
            };
            if !ops.iter().any(|op| op.as_str() == Some("verify")) {
                return Err(KeyError::NotForSignatures(format!(
                    "\"key_ops\" is {} without \"verify\"",
                    excerpt_json(&Value::Array(ops.clone()))
                )));
            }
        }
        let key = match algorithm {
            Algorithm::RS256 => Self::rsa(&jwk_bytes(members, "n")?, &jwk_bytes(members, "e")?)?,
            Algorithm::ES256 => {
                let crv = jwk_str(members, "crv")?.ok_or(KeyError::MissingField("crv"))?;
                if crv != "P-256" {
                    return Err(KeyError::UnsupportedCurve(excerpt_str(crv)));
                }
                let x = jwk_coordinate(members, "x")?;
                let y = jwk_coordinate(members, "y")?;
                let mut sec1 = Vec::with_capacity(65);
                sec1.push(0x04);
                sec1.extend_from_slice(&x);
                sec1.extend_from_slice(&y);
                let key = p256::ecdsa::VerifyingKey::from_sec1_bytes(&sec1).map_err(|_| {
                    KeyError::invalid("x", "(x, y) is not a point on P-256".to_string())
                })?;
                Self::p256(key)
            }
            Algorithm::HS256 => {
                let k = Zeroizing::new(jwk_bytes(members, "k")?);
                Self::from_secret(&k)?
            }
        };
        Ok(match kid {
            Some(kid) => key.with_kid(kid),
            None => key,
        })
    }

    /// The same key carrying `kid`.
    pub fn with_kid(mut self, kid: impl Into<String>) -> Self {
        self.kid = Some(kid.into());
        self
    }

    /// The key's id, if it has one.
    pub fn kid(&self) -> Option<&str> {
        self.kid.as_deref()
    }

    /// The one algorithm this key verifies.
    pub fn algorithm(&self) -> Algorithm {
        match self.material {
            Material::Rsa(_) => Algorithm::RS256,
            Material::P256(_) => Algorithm::ES256,
            Material::Hmac(_) => Algorithm::HS256,
        }
    }

    /// Whether `signature` is this key's signature of `signing_input`.
    fn verifies(&self, signing_input: &[u8], signature: &[u8]) -> bool {
        match &self.material {
            Material::Rsa(key) => rsa::pkcs1v15::Signature::try_from(signature)
                .is_ok_and(|sig| key.verify(signing_input, &sig).is_ok()),
            Material::P256(key) => p256::ecdsa::Signature::from_slice(signature)
                .is_ok_and(|sig| key.verify(signing_input, &sig).is_ok()),
            Material::Hmac(secret) => match Hmac::<Sha256>::new_from_slice(secret) {
                Ok(mut mac) => {
                    mac.update(signing_input);
                    // Constant-time comparison, exact length.
                    mac.verify_slice(signature).is_ok()
                }
                Err(_) => false,
            },
        }
    }
}

impl fmt::Debug for VerifyingKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let material = match &self.material {
            Material::Rsa(key) => {
                let public: &rsa::RsaPublicKey = (**key).as_ref();
                format!("RSA {} bits", public.n().bits())
            }
            Material::P256(_) => "P-256".to_string(),
            Material::Hmac(secret) => format!("<redacted {}-byte secret>", secret.len()),
        };
        f.debug_struct("VerifyingKey")
            .field("kid", &self.kid)
            .field("algorithm", &self.algorithm())
            .field("key", &format_args!("{material}"))
            .finish()
    }
}

fn jwk_str<'a>(
    members: &'a Map<String, Value>,
    name: &'static str,
) -> Result<Option<&'a str>, KeyError> {
    match members.get(name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(KeyError::invalid(
            name,
            format!("expected a string, got {}", excerpt_json(other)),
        )),
    }
}

fn jwk_bytes(members: &Map<String, Value>, name: &'static str) -> Result<Vec<u8>, KeyError> {
    let text = jwk_str(members, name)?.ok_or(KeyError::MissingField(name))?;
    if text.contains('=') {
        return Err(KeyError::invalid(
            name,
            "has '=' padding (JWK uses base64url without padding)",
        ));
    }
    let bytes = URL_SAFE_NO_PAD
        .decode(text)
        .map_err(|err| KeyError::invalid(name, format!("not base64url without padding: {err}")))?;
    if bytes.is_empty() {
        return Err(KeyError::invalid(name, "is empty"));
    }
    Ok(bytes)
}

fn jwk_coordinate(members: &Map<String, Value>, name: &'static str) -> Result<Vec<u8>, KeyError> {
    let bytes = jwk_bytes(members, name)?;
    // RFC 7518 §6.2.1.2: the full 32 bytes, leading zeros included.
    if bytes.len() != 32 {
        return Err(KeyError::invalid(
            name,
            format!("must be 32 bytes for P-256, got {}", bytes.len()),
        ));
    }
    Ok(bytes)
}

// ---------------------------------------------------------------------------
// Key sets

/// The keys a token may be verified with, found by `kid`.
///
/// Which keys are tried (the rule Envoy's `jwt_authn` uses): for a token
/// with a `kid`, the keys with that `kid` and the keys without one; for a
/// token without `kid`, every key. Only keys of the header's algorithm are
/// tried, in insertion order, until one verifies.
#[derive(Debug, Clone, Default)]
pub struct KeySet {
    keys: Vec<VerifyingKey>,
    by_kid: BTreeMap<String, Vec<usize>>,
    without_kid: Vec<usize>,
}

/// A key set read from a JWKS document, with the keys that were left out.
#[derive(Debug, Clone)]
pub struct Jwks {
    /// The usable keys.
    pub keys: KeySet,
    /// The entries that were skipped (unsupported or invalid), in order.
    pub skipped: Vec<SkippedKey>,
}

/// A JWKS entry left out of a [`Jwks`], and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("keys[{index}]{}: {error}", .kid.as_deref().map(|k| format!(" (kid {})", excerpt_str(k))).unwrap_or_default())]
pub struct SkippedKey {
    /// Position in the document's `keys` array.
    pub index: usize,
    /// The entry's `kid`, when it has a string one.
    pub kid: Option<String>,
    /// Why it was skipped.
    pub error: KeyError,
}

impl KeySet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads a JWKS document (`{"keys":[...]}`, RFC 7517 §5). Entries that
    /// are unsupported or invalid are skipped and listed, so one odd key
    /// does not disable the others; only a document that is not a JWKS at
    /// all is an error.
    pub fn from_jwks(json: &[u8]) -> Result<Jwks, KeyError> {
        let document: Value = serde_json::from_slice(json)
            .map_err(|err| KeyError::Jwks(format!("not JSON: {err}")))?;
        let Some(entries) = document.get("keys").and_then(Value::as_array) else {
            return Err(KeyError::Jwks(
                "expected an object with a \"keys\" array".to_string(),
            ));
        };
        let mut keys = KeySet::new();
        let mut skipped = Vec::new();
        for (index, entry) in entries.iter().enumerate() {
            match VerifyingKey::from_jwk(entry) {
                Ok(key) => keys.insert(key),
                Err(error) => skipped.push(SkippedKey {
                    index,
                    kid: entry.get("kid").and_then(Value::as_str).map(str::to_string),
                    error,
                }),
            }
        }
        Ok(Jwks { keys, skipped })
    }

    /// Adds a key.
    pub fn insert(&mut self, key: VerifyingKey) {
        let index = self.keys.len();
        match key.kid() {
            Some(kid) => self.by_kid.entry(kid.to_string()).or_default().push(index),
            None => self.without_kid.push(index),
        }
        self.keys.push(key);
    }

    /// Adds every key of `other` (for example configured keys to a fetched
    /// JWKS); keys sharing a `kid` are all kept and all tried.
    pub fn merge(&mut self, other: KeySet) {
        self.extend(other.keys);
    }

    /// How many keys the set holds.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether the set holds no key.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The keys, in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = &VerifyingKey> {
        self.keys.iter()
    }

    /// The keys a token with `kid` may be verified with, of any algorithm.
    fn candidates(&self, kid: Option<&str>) -> Vec<&VerifyingKey> {
        match kid {
            None => self.keys.iter().collect(),
            Some(kid) => self
                .by_kid
                .get(kid)
                .into_iter()
                .flatten()
                .chain(&self.without_kid)
                .filter_map(|&index| self.keys.get(index))
                .collect(),
        }
    }
}

impl Extend<VerifyingKey> for KeySet {
    fn extend<I: IntoIterator<Item = VerifyingKey>>(&mut self, keys: I) {
        for key in keys {
            self.insert(key);
        }
    }
}

impl FromIterator<VerifyingKey> for KeySet {
    fn from_iter<I: IntoIterator<Item = VerifyingKey>>(keys: I) -> Self {
        let mut set = KeySet::new();
        set.extend(keys);
        set
    }
}

// ---------------------------------------------------------------------------
// Validation

/// What a verified token's claims must satisfy.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Validation {
    /// Accepted `iss` values; empty accepts any (and a missing `iss`).
    pub issuers: Vec<String>,
    /// Accepted audiences: some `aud` entry must be one of them; empty skips
    /// the check.
    pub audiences: Vec<String>,
    /// Clock skew tolerated on `exp` and `nbf`, in seconds.
    pub leeway_secs: u64,
    /// Whether a token without `exp` is refused.
    pub require_exp: bool,
    /// Header algorithms accepted (a key still verifies only its own).
    pub algorithms: Vec<Algorithm>,
}

impl Default for Validation {
    /// Any issuer and audience, 60 s leeway, `exp` required, all algorithms.
    fn default() -> Self {
        Self {
            issuers: Vec::new(),
            audiences: Vec::new(),
            leeway_secs: 60,
            require_exp: true,
            algorithms: Algorithm::ALL.to_vec(),
        }
    }
}

// ---------------------------------------------------------------------------
// Tokens

/// A token's JOSE header members this module reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    alg: String,
    kid: Option<String>,
    typ: Option<String>,
    crit: Option<Value>,
}

impl Header {
    /// `alg` as written (may be unsupported, `none` included).
    pub fn alg(&self) -> &str {
        &self.alg
    }

    /// `alg` as a supported [`Algorithm`].
    pub fn algorithm(&self) -> Result<Algorithm, JwtError> {
        Algorithm::from_name(&self.alg)
            .ok_or_else(|| JwtError::UnsupportedAlgorithm(clip(&self.alg)))
    }

    /// `kid`, if present.
    pub fn kid(&self) -> Option<&str> {
        self.kid.as_deref()
    }

    /// `typ`, if present (not checked).
    pub fn typ(&self) -> Option<&str> {
        self.typ.as_deref()
    }

    fn from_json(json: &[u8]) -> Result<Self, JwtError> {
        let mut members = parse_object(json, Segment::Header)?;
        let alg = match members.remove("alg") {
            Some(Value::String(alg)) => alg,
            Some(other) => return Err(wrong_type(Segment::Header, "alg", "a string", &other)),
            None => return Err(JwtError::malformed(Segment::Header, "\"alg\" is missing")),
        };
        Ok(Self {
            alg,
            kid: optional_string(&mut members, Segment::Header, "kid")?,
            typ: optional_string(&mut members, Segment::Header, "typ")?,
            crit: members.remove("crit"),
        })
    }
}

/// A token's claims: the registered ones typed, every one reachable by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    aud: Vec<String>,
    exp: Option<u64>,
    nbf: Option<u64>,
    iat: Option<u64>,
    all: Map<String, Value>,
}

impl Claims {
    /// `sub`, if present.
    pub fn sub(&self) -> Option<&str> {
        self.get_str("sub")
    }

    /// `iss`, if present.
    pub fn iss(&self) -> Option<&str> {
        self.get_str("iss")
    }

    /// `aud` as a list (a single string is a list of one; absent is empty).
    pub fn aud(&self) -> &[String] {
        &self.aud
    }

    /// `exp` in seconds since the epoch (fractions dropped).
    pub fn exp(&self) -> Option<u64> {
        self.exp
    }

    /// `nbf` in seconds since the epoch (fractions dropped).
    pub fn nbf(&self) -> Option<u64> {
        self.nbf
    }

    /// `iat` in seconds since the epoch (fractions dropped; not checked).
    pub fn iat(&self) -> Option<u64> {
        self.iat
    }

    /// The claim `name`, of any type.
    pub fn get(&self, name: &str) -> Option<&Value> {
        self.all.get(name)
    }

    /// The claim `name` if it is a string (for example a tenant claim).
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.all.get(name).and_then(Value::as_str)
    }

    /// Every claim by name.
    pub fn as_map(&self) -> &Map<String, Value> {
        &self.all
    }

    fn from_json(json: &[u8]) -> Result<Self, JwtError> {
        let all = parse_object(json, Segment::Payload)?;
        for name in ["iss", "sub"] {
            if let Some(value) = all.get(name)
                && !value.is_string()
            {
                return Err(wrong_type(Segment::Payload, name, "a string", value));
            }
        }
        let aud = match all.get("aud") {
            None => Vec::new(),
            Some(Value::String(aud)) => vec![aud.clone()],
            Some(Value::Array(entries)) => entries
                .iter()
                .map(|entry| entry.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    wrong_type(
                        Segment::Payload,
                        "aud",
                        "a string or an array of strings",
                        &Value::Array(entries.clone()),
                    )
                })?,
            Some(other) => {
                return Err(wrong_type(
                    Segment::Payload,
                    "aud",
                    "a string or an array of strings",
                    other,
                ));
            }
        };
        Ok(Self {
            aud,
            exp: numeric_date(&all, "exp")?,
            nbf: numeric_date(&all, "nbf")?,
            iat: numeric_date(&all, "iat")?,
            all,
        })
    }
}

/// A decoded but unverified token, from [`peek`]. Nothing in it can be
/// trusted until [`Unverified::verify`] succeeds.
#[derive(Debug, Clone)]
pub struct Unverified<'a> {
    header: Header,
    claims: Claims,
    /// `header.payload`, the ASCII the signature covers.
    signing_input: &'a [u8],
    /// The third segment, decoded (empty when the token has none).
    signature: Vec<u8>,
}

impl<'a> Unverified<'a> {
    /// The header, unverified.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The claims, unverified.
    pub fn claims(&self) -> &Claims {
        &self.claims
    }

    /// Verifies the signature with `keys`, then the claims with `validation`
    /// at `now_unix` (seconds since the epoch); see [`verify`].
    pub fn verify(
        self,
        keys: &KeySet,
        validation: &Validation,
        now_unix: u64,
    ) -> Result<Claims, JwtError> {
        let alg = self.header.algorithm()?;
        if let Some(crit) = &self.header.crit {
            return Err(JwtError::UnsupportedCritical(excerpt_json(crit)));
        }
        if !validation.algorithms.contains(&alg) {
            return Err(JwtError::AlgorithmNotAllowed(alg));
        }
        if self.signature.is_empty() {
            return Err(JwtError::malformed(Segment::Signature, "empty"));
        }
        let kid = self.header.kid();
        let candidates = keys.candidates(kid);
        if candidates.is_empty() {
            return Err(JwtError::UnknownKey(kid.map(clip)));
        }
        let mut of_alg = candidates
            .into_iter()
            .filter(|key| key.algorithm() == alg)
            .peekable();
        if of_alg.peek().is_none() {
            return Err(JwtError::AlgorithmMismatch {
                alg,
                kid: kid.map(clip),
            });
        }
        if !of_alg.any(|key| key.verifies(self.signing_input, &self.signature)) {
            return Err(JwtError::BadSignature);
        }
        validate_claims(&self.claims, validation, now_unix)?;
        Ok(self.claims)
    }
}

/// Splits `token` and decodes its header, claims and signature without
/// verifying anything. Fails on anything that is not a three-segment JWS
/// with a JSON object header (with a string `alg`), a JSON object payload
/// whose registered claims have the right types and a base64url signature.
/// Never panics, whatever the bytes.
pub fn peek(token: &[u8]) -> Result<Unverified<'_>, JwtError> {
    if token.len() > MAX_TOKEN_LEN {
        return Err(JwtError::TooLong {
            len: token.len(),
            max: MAX_TOKEN_LEN,
        });
    }
    if token.is_empty() {
        return Err(JwtError::malformed(Segment::Token, "empty"));
    }
    let dots = token.iter().filter(|&&b| b == b'.').count();
    let mut segments = token.splitn(3, |&b| b == b'.');
    let (Some(header), Some(payload), Some(signature), 2) =
        (segments.next(), segments.next(), segments.next(), dots)
    else {
        let hint = if dots == 4 {
            " (five segments: an encrypted JWE?)"
        } else {
            ""
        };
        return Err(JwtError::malformed(
            Segment::Token,
            format!(
                "expected 3 dot-separated segments (header.payload.signature), found {}{hint}",
                dots + 1
            ),
        ));
    };
    let signing_len = header.len() + 1 + payload.len();
    let signing_input = token.get(..signing_len).unwrap_or(token);
    let header = Header::from_json(&decode_segment(header, Segment::Header)?)?;
    let claims = Claims::from_json(&decode_segment(payload, Segment::Payload)?)?;
    // An empty signature is reported by `verify`, after `alg` (`none` tokens
    // have one and are better reported as such).
    let signature = if signature.is_empty() {
        Vec::new()
    } else {
        decode_segment(signature, Segment::Signature)?
    };
    Ok(Unverified {
        header,
        claims,
        signing_input,
        signature,
    })
}

/// Verifies `token` (JWS compact form, no `Bearer ` prefix) and returns its
/// claims.
///
/// In order: [`peek`]; the header's `alg` must be supported, carry no `crit`
/// and be in [`Validation::algorithms`]; the keys of the header's `kid` (see
/// [`KeySet`]) of that algorithm are tried on the signature over the ASCII
/// `header.payload`; then `exp` (required if [`Validation::require_exp`];
/// valid while `now_unix < exp + leeway`), `nbf` (valid once
/// `now_unix + leeway >= nbf`), `iss` and `aud` are checked.
pub fn verify(
    token: &[u8],
    keys: &KeySet,
    validation: &Validation,
    now_unix: u64,
) -> Result<Claims, JwtError> {
    peek(token)?.verify(keys, validation, now_unix)
}

fn validate_claims(claims: &Claims, validation: &Validation, now: u64) -> Result<(), JwtError> {
    let leeway = validation.leeway_secs;
    match claims.exp {
        Some(exp) if now >= exp.saturating_add(leeway) => {
            return Err(JwtError::Expired { exp, now });
        }
        None if validation.require_exp => return Err(JwtError::MissingClaim("exp")),
        _ => {}
    }
    if let Some(nbf) = claims.nbf
        && now.saturating_add(leeway) < nbf
    {
        return Err(JwtError::NotYetValid { nbf, now });
    }
    if !validation.issuers.is_empty() {
        let iss = claims.iss().ok_or(JwtError::MissingClaim("iss"))?;
        if !validation.issuers.iter().any(|accepted| accepted == iss) {
            return Err(JwtError::WrongIssuer(clip(iss)));
        }
    }
    if !validation.audiences.is_empty() {
        if claims.get("aud").is_none() {
            return Err(JwtError::MissingClaim("aud"));
        }
        if !claims
            .aud
            .iter()
            .any(|aud| validation.audiences.contains(aud))
        {
            return Err(JwtError::WrongAudience(
                claims.aud.iter().take(8).map(|aud| clip(aud)).collect(),
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Decoding

/// Decodes one base64url segment: no padding, no whitespace, zero trailing
/// bits, so each byte string has exactly one accepted encoding.
fn decode_segment(segment: &[u8], which: Segment) -> Result<Vec<u8>, JwtError> {
    if segment.is_empty() {
        return Err(JwtError::malformed(which, "empty"));
    }
    if segment.contains(&b'=') {
        return Err(JwtError::malformed(
            which,
            "has '=' padding (JWS uses base64url without padding)",
        ));
    }
    URL_SAFE_NO_PAD
        .decode(segment)
        .map_err(|err| JwtError::malformed(which, format!("not base64url without padding: {err}")))
}

/// Parses a JSON object, refusing duplicate members.
fn parse_object(json: &[u8], which: Segment) -> Result<Map<String, Value>, JwtError> {
    serde_json::from_slice::<UniqueObject>(json)
        .map(|object| object.0)
        .map_err(|err| JwtError::malformed(which, format!("not a JSON object: {err}")))
}

fn optional_string(
    members: &mut Map<String, Value>,
    which: Segment,
    name: &'static str,
) -> Result<Option<String>, JwtError> {
    match members.remove(name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(wrong_type(which, name, "a string", &other)),
    }
}

fn wrong_type(which: Segment, name: &str, expected: &str, got: &Value) -> JwtError {
    JwtError::malformed(
        which,
        format!("{name:?} must be {expected}, got {}", excerpt_json(got)),
    )
}

/// A NumericDate claim: a non-negative JSON number of seconds, fractions
/// dropped.
fn numeric_date(claims: &Map<String, Value>, name: &'static str) -> Result<Option<u64>, JwtError> {
    let Some(value) = claims.get(name) else {
        return Ok(None);
    };
    let seconds = match value {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0)
                // Saturating float-to-int conversion.
                .map(|f| f as u64)
        }),
        _ => None,
    };
    seconds.map(Some).ok_or_else(|| {
        wrong_type(
            Segment::Payload,
            name,
            "a NumericDate (non-negative seconds since the epoch)",
            value,
        )
    })
}

/// A JSON object whose member names are unique.
struct UniqueObject(Map<String, Value>);

impl<'de> Deserialize<'de> for UniqueObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct UniqueVisitor;

        impl<'de> Visitor<'de> for UniqueVisitor {
            type Value = UniqueObject;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<UniqueObject, A::Error> {
                let mut members = Map::new();
                while let Some(name) = access.next_key::<String>()? {
                    if members.contains_key(&name) {
                        return Err(de::Error::custom(format_args!(
                            "duplicate member {}",
                            excerpt_str(&name)
                        )));
                    }
                    let value: Value = access.next_value()?;
                    members.insert(name, value);
                }
                Ok(UniqueObject(members))
            }
        }

        deserializer.deserialize_map(UniqueVisitor)
    }
}
