//! JWT verification against real tokens signed here: RSA-2048, P-256 and
//! HMAC keys generated from a fixed seed, tokens encoded and signed with the
//! RustCrypto signing APIs, plus the RFC 7515 appendix examples as tokens
//! signed by somebody else.

use std::sync::OnceLock;

use base64::Engine as _;
use base64::engine::DecodePaddingMode;
use base64::engine::general_purpose::{
    GeneralPurpose, GeneralPurposeConfig, STANDARD, URL_SAFE_NO_PAD,
};
use hmac::{Hmac, Mac};
use p256::ecdsa::SigningKey as EcSigningKey;
use proptest::prelude::*;
use rand_chacha::ChaCha20Rng;
use rand_chacha::rand_core::SeedableRng;
use rsa::pkcs1::EncodeRsaPublicKey;
use rsa::pkcs8::{EncodePublicKey, LineEnding};
use rsa::signature::{SignatureEncoding, Signer};
use rsa::traits::PublicKeyParts;
use rsa::{RsaPrivateKey, RsaPublicKey};
use serde_json::{Value, json};
use sha2::Sha256;
use zerolayer_core::auth::jwt::{
    self, Algorithm, JwtError, KeyError, KeySet, MAX_TOKEN_LEN, Segment, Validation, VerifyingKey,
};

/// The verification time of every test unless it says otherwise.
const NOW: u64 = 1_800_000_000;

// ---------------------------------------------------------------------------
// Keys and signing

struct TestKeys {
    rsa: RsaPrivateKey,
    rsa_other: RsaPrivateKey,
    ec: EcSigningKey,
    ec_other: EcSigningKey,
    hmac: [u8; 32],
    hmac_other: [u8; 32],
}

fn keys() -> &'static TestKeys {
    static KEYS: OnceLock<TestKeys> = OnceLock::new();
    KEYS.get_or_init(|| {
        let mut rng = ChaCha20Rng::seed_from_u64(0x6a77_7420);
        TestKeys {
            rsa: RsaPrivateKey::new(&mut rng, 2048).expect("RSA key"),
            rsa_other: RsaPrivateKey::new(&mut rng, 2048).expect("RSA key"),
            ec: EcSigningKey::random(&mut rng),
            ec_other: EcSigningKey::random(&mut rng),
            hmac: *b"0123456789abcdef0123456789abcdef",
            hmac_other: *b"fedcba9876543210fedcba9876543210",
        }
    })
}

/// What signs a test token.
#[derive(Clone, Copy)]
enum By<'a> {
    Rsa(&'a RsaPrivateKey),
    Ec(&'a EcSigningKey),
    Hmac(&'a [u8]),
    /// Fixed signature bytes (or none).
    Raw(&'a [u8]),
}

fn b64(bytes: impl AsRef<[u8]>) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

fn signature_of(input: &[u8], by: By<'_>) -> Vec<u8> {
    match by {
        By::Rsa(key) => rsa::pkcs1v15::SigningKey::<Sha256>::new(key.clone())
            .sign(input)
            .to_vec(),
        By::Ec(key) => {
            let signature: p256::ecdsa::Signature = key.sign(input);
            signature.to_bytes().to_vec()
        }
        By::Hmac(secret) => {
            let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("any length");
            mac.update(input);
            mac.finalize().into_bytes().to_vec()
        }
        By::Raw(bytes) => bytes.to_vec(),
    }
}

/// A compact JWS of the given header and claims JSON text.
fn token_of(header: &str, claims: &str, by: By<'_>) -> String {
    let input = format!("{}.{}", b64(header), b64(claims));
    let signature = signature_of(input.as_bytes(), by);
    format!("{input}.{}", b64(signature))
}

fn token(header: Value, claims: Value, by: By<'_>) -> String {
    token_of(&header.to_string(), &claims.to_string(), by)
}

fn claims() -> Value {
    json!({
        "sub": "user-1",
        "iss": "https://issuer.example",
        "aud": "llm-gateway",
        "exp": NOW + 3600,
        "nbf": NOW - 10,
        "iat": NOW - 10,
        "tenant": "acme",
    })
}

fn claims_with(changes: Value) -> Value {
    let mut all = claims();
    for (name, value) in changes.as_object().expect("object") {
        if value.is_null() {
            all.as_object_mut().expect("object").remove(name);
        } else {
            all[name] = value.clone();
        }
    }
    all
}

fn rsa_jwk(key: &RsaPublicKey, kid: &str) -> Value {
    json!({
        "kty": "RSA", "kid": kid, "alg": "RS256", "use": "sig",
        "n": b64(key.n().to_bytes_be()), "e": b64(key.e().to_bytes_be()),
    })
}

fn ec_jwk(key: &EcSigningKey, kid: &str) -> Value {
    let point = key.verifying_key().to_encoded_point(false);
    json!({
        "kty": "EC", "kid": kid, "crv": "P-256",
        "x": b64(point.x().expect("uncompressed")), "y": b64(point.y().expect("uncompressed")),
    })
}

fn oct_jwk(secret: &[u8], kid: &str) -> Value {
    json!({"kty": "oct", "kid": kid, "k": b64(secret)})
}

/// The three test keys, as JWKs with kids `rsa`, `ec` and `hs`.
fn key_set() -> KeySet {
    let k = keys();
    [
        rsa_jwk(&k.rsa.to_public_key(), "rsa"),
        ec_jwk(&k.ec, "ec"),
        oct_jwk(&k.hmac, "hs"),
    ]
    .iter()
    .map(|jwk| VerifyingKey::from_jwk(jwk).expect("test JWK"))
    .collect()
}

/// A valid token per algorithm, with the kid of its key in [`key_set`].
fn valid_tokens() -> Vec<(Algorithm, String)> {
    let k = keys();
    vec![
        (
            Algorithm::RS256,
            token(
                json!({"alg": "RS256", "typ": "JWT", "kid": "rsa"}),
                claims(),
                By::Rsa(&k.rsa),
            ),
        ),
        (
            Algorithm::ES256,
            token(
                json!({"alg": "ES256", "typ": "JWT", "kid": "ec"}),
                claims(),
                By::Ec(&k.ec),
            ),
        ),
        (
            Algorithm::HS256,
            token(
                json!({"alg": "HS256", "typ": "JWT", "kid": "hs"}),
                claims(),
                By::Hmac(&k.hmac),
            ),
        ),
    ]
}

fn check(token: &str) -> Result<jwt::Claims, JwtError> {
    jwt::verify(token.as_bytes(), &key_set(), &Validation::default(), NOW)
}

fn malformed(segment: Segment, detail: &str) -> JwtError {
    JwtError::Malformed {
        segment,
        detail: detail.to_string(),
    }
}

// ---------------------------------------------------------------------------
// Valid tokens

#[test]
fn valid_tokens_verify_with_every_algorithm() {
    for (alg, token) in valid_tokens() {
        let claims = check(&token).unwrap_or_else(|err| panic!("{alg}: {err}"));
        assert_eq!(claims.sub(), Some("user-1"), "{alg}");
        assert_eq!(claims.iss(), Some("https://issuer.example"), "{alg}");
        assert_eq!(claims.aud(), ["llm-gateway"], "{alg}");
        assert_eq!(claims.exp(), Some(NOW + 3600), "{alg}");
        assert_eq!(claims.nbf(), Some(NOW - 10), "{alg}");
        assert_eq!(claims.iat(), Some(NOW - 10), "{alg}");
        assert_eq!(claims.get_str("tenant"), Some("acme"), "{alg}");
        assert_eq!(claims.get_str("org_id"), None, "{alg}");
        assert_eq!(claims.get("exp"), Some(&json!(NOW + 3600)), "{alg}");

        let peeked = jwt::peek(token.as_bytes()).expect("peek");
        assert_eq!(peeked.header().algorithm(), Ok(alg));
        assert_eq!(peeked.header().typ(), Some("JWT"));
        assert_eq!(peeked.claims(), &claims, "{alg}: peek sees the same claims");
    }
}

/// RFC 7515 appendices A.1 (HS256), A.2 (RS256) and A.3 (ES256): tokens and
/// keys from the standard, so encoding details (the header's CRLF, `r || s`)
/// are somebody else's, not this test's.
#[test]
fn rfc7515_examples_verify() {
    const PAYLOAD: &str = "eyJpc3MiOiJqb2UiLA0KICJleHAiOjEzMDA4MTkzODAsDQogImh0dHA6Ly9leGFtcGxlLmNvbS9pc19yb290Ijp0cnVlfQ";
    let cases = [
        (
            json!({"kty": "oct", "k": "AyM1SysPpbyDfgZld3umj1qzKObwVMkoqQ-EstJQLr_T-1qS0gZH75aKtMN3Yj0iPS4hcgUuTwjAzZr1Z9CAow"}),
            format!(
                "eyJ0eXAiOiJKV1QiLA0KICJhbGciOiJIUzI1NiJ9.{PAYLOAD}.dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"
            ),
        ),
        (
            json!({"kty": "RSA", "e": "AQAB", "n": concat!(
                "ofgWCuLjybRlzo0tZWJjNiuSfb4p4fAkd_wWJcyQoTbji9k0l8W26mPddxHmfHQp-Vaw-4qPCJrcS2mJPMEzP1Pt0Bm4d4QlL-yRT-SFd2lZS-pCgNMs",
                "D1W_YpRPEwOWvG6b32690r2jZ47soMZo9wGzjb_7OMg0LOL-bSf63kpaSHSXndS5z5rexMdbBYUsLA9e-KXBdQOS-UTo7WTBEMa2R2CapHg665xsmtdV",
                "MTBQY4uDZlxvb3qCo5ZwKh9kG4LT6_I5IhlJH7aGhyxXFvUK-DWNmoudF8NAco9_h9iaGNj8q2ethFkMLs91kzk2PAcDTW9gb54h4FRWyuXpoQ")}),
            format!(
                "eyJhbGciOiJSUzI1NiJ9.{PAYLOAD}.{}",
                concat!(
                    "cC4hiUPoj9Eetdgtv3hF80EGrhuB__dzERat0XF9g2VtQgr9PJbu3XOiZj5RZmh7AAuHIm4Bh-0Qc_lF5YKt_O8W2Fp5jujGbds9uJdbF9CUAr7t1dnZcAcQjbKBYNX4",
                    "BAynRFdiuB--f_nZLgrnbyTyWzO75vRK5h6xBArLIARNPvkSjtQBMHlb1L07Qe7K0GarZRmB_eSN9383LcOLn6_dO--xi12jzDwusC-eOkHWEsqtFZESc6BfI7noOPqv",
                    "hJ1phCnvWh6IeYI2w9QOYEUipUTI8np6LbgGY9Fs98rqVt5AXLIhWkWywlVmtVrBp0igcN_IoypGlUPQGe77Rw"
                )
            ),
        ),
        (
            json!({"kty": "EC", "crv": "P-256", "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU", "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}),
            format!(
                "eyJhbGciOiJFUzI1NiJ9.{PAYLOAD}.DtEhU3ljbEg8L38VWAfUAqOyKAM6-Xx-F4GawxaepmXFCgfTjDxw5djxLa8ISlSApmWQxfKTUJqPP3-Kg6NU1Q"
            ),
        ),
    ];
    const EXP: u64 = 1_300_819_380;
    for (jwk, token) in cases {
        let keys: KeySet = [VerifyingKey::from_jwk(&jwk).expect("RFC key")]
            .into_iter()
            .collect();
        let verify_at = |now| jwt::verify(token.as_bytes(), &keys, &Validation::default(), now);
        let claims = verify_at(EXP - 10).unwrap_or_else(|err| panic!("{jwk}: {err}"));
        assert_eq!(claims.iss(), Some("joe"));
        assert_eq!(claims.exp(), Some(EXP));
        assert_eq!(claims.get("http://example.com/is_root"), Some(&json!(true)));
        assert_eq!(
            verify_at(EXP + 60),
            Err(JwtError::Expired {
                exp: EXP,
                now: EXP + 60
            })
        );
    }
}

// ---------------------------------------------------------------------------
// Claims

#[test]
fn time_claims_with_leeway() {
    let k = keys();
    let cases: &[(&str, Value, Validation, Result<(), JwtError>)] = &[
        (
            "exp ahead",
            json!({"exp": NOW + 1}),
            Validation::default(),
            Ok(()),
        ),
        (
            "exp within leeway",
            json!({"exp": NOW - 59}),
            Validation::default(),
            Ok(()),
        ),
        (
            "exp at the end of leeway",
            json!({"exp": NOW - 60}),
            Validation::default(),
            Err(JwtError::Expired {
                exp: NOW - 60,
                now: NOW,
            }),
        ),
        (
            "expired",
            json!({"exp": NOW - 3600}),
            Validation::default(),
            Err(JwtError::Expired {
                exp: NOW - 3600,
                now: NOW,
            }),
        ),
        (
            "exp equal to now without leeway",
            json!({"exp": NOW}),
            Validation {
                leeway_secs: 0,
                ..Validation::default()
            },
            Err(JwtError::Expired { exp: NOW, now: NOW }),
        ),
        (
            "fractional exp",
            json!({"exp": (NOW + 1) as f64 + 0.5}),
            Validation::default(),
            Ok(()),
        ),
        (
            "huge exp",
            json!({"exp": u64::MAX}),
            Validation::default(),
            Ok(()),
        ),
        (
            "missing exp, required",
            json!({"exp": null}),
            Validation::default(),
            Err(JwtError::MissingClaim("exp")),
        ),
        (
            "missing exp, not required",
            json!({"exp": null}),
            Validation {
                require_exp: false,
                ..Validation::default()
            },
            Ok(()),
        ),
        (
            "nbf within leeway",
            json!({"nbf": NOW + 60}),
            Validation::default(),
            Ok(()),
        ),
        (
            "not yet valid",
            json!({"nbf": NOW + 61}),
            Validation::default(),
            Err(JwtError::NotYetValid {
                nbf: NOW + 61,
                now: NOW,
            }),
        ),
        (
            "nbf ahead without leeway",
            json!({"nbf": NOW + 1}),
            Validation {
                leeway_secs: 0,
                ..Validation::default()
            },
            Err(JwtError::NotYetValid {
                nbf: NOW + 1,
                now: NOW,
            }),
        ),
        (
            "iat in the future is not checked",
            json!({"iat": NOW + 9999}),
            Validation::default(),
            Ok(()),
        ),
    ];
    for (name, changes, validation, expected) in cases {
        let token = token(
            json!({"alg": "HS256"}),
            claims_with(changes.clone()),
            By::Hmac(&k.hmac),
        );
        let got = jwt::verify(token.as_bytes(), &key_set(), validation, NOW).map(|_| ());
        assert_eq!(&got, expected, "{name}");
    }
}

#[test]
fn issuer_and_audience() {
    let k = keys();
    let strict = Validation {
        issuers: vec![
            "https://issuer.example".into(),
            "https://other.example".into(),
        ],
        audiences: vec!["llm-gateway".into(), "admin".into()],
        ..Validation::default()
    };
    let cases: &[(&str, Value, &Validation, Result<(), JwtError>)] = &[
        ("both accepted", json!({}), &strict, Ok(())),
        (
            "second issuer",
            json!({"iss": "https://other.example"}),
            &strict,
            Ok(()),
        ),
        (
            "wrong issuer",
            json!({"iss": "https://evil.example"}),
            &strict,
            Err(JwtError::WrongIssuer("https://evil.example".into())),
        ),
        (
            "missing issuer",
            json!({"iss": null}),
            &strict,
            Err(JwtError::MissingClaim("iss")),
        ),
        (
            "wrong audience (string)",
            json!({"aud": "billing"}),
            &strict,
            Err(JwtError::WrongAudience(vec!["billing".into()])),
        ),
        (
            "wrong audience (array)",
            json!({"aud": ["billing", "search"]}),
            &strict,
            Err(JwtError::WrongAudience(vec![
                "billing".into(),
                "search".into(),
            ])),
        ),
        (
            "audience in array",
            json!({"aud": ["billing", "admin"]}),
            &strict,
            Ok(()),
        ),
        (
            "empty audience array",
            json!({"aud": []}),
            &strict,
            Err(JwtError::WrongAudience(vec![])),
        ),
        (
            "missing audience",
            json!({"aud": null}),
            &strict,
            Err(JwtError::MissingClaim("aud")),
        ),
        (
            "audience is case-sensitive",
            json!({"aud": "LLM-gateway"}),
            &strict,
            Err(JwtError::WrongAudience(vec!["LLM-gateway".into()])),
        ),
        (
            "any issuer and audience",
            json!({"iss": "x", "aud": ["y"]}),
            &Validation::default(),
            Ok(()),
        ),
        (
            "no iss nor aud needed",
            json!({"iss": null, "aud": null}),
            &Validation::default(),
            Ok(()),
        ),
    ];
    for (name, changes, validation, expected) in cases {
        let token = token(
            json!({"alg": "HS256"}),
            claims_with(changes.clone()),
            By::Hmac(&k.hmac),
        );
        let got = jwt::verify(token.as_bytes(), &key_set(), validation, NOW).map(|_| ());
        assert_eq!(&got, expected, "{name}");
    }
}

#[test]
fn claims_are_checked_only_after_the_signature() {
    let k = keys();
    let expired_forgery = token(
        json!({"alg": "RS256", "kid": "rsa"}),
        claims_with(json!({"exp": 1})),
        By::Rsa(&k.rsa_other),
    );
    assert_eq!(check(&expired_forgery), Err(JwtError::BadSignature));
}

// ---------------------------------------------------------------------------
// Tampering and keys

fn swap_segment(token: &str, index: usize, new: &str) -> String {
    let mut segments: Vec<&str> = token.split('.').collect();
    segments[index] = new;
    segments.join(".")
}

#[test]
fn tampered_and_truncated_tokens_fail() {
    for (alg, token) in valid_tokens() {
        let [_, _, signature] = token.split('.').collect::<Vec<_>>()[..] else {
            panic!("three segments")
        };
        let mut flipped = URL_SAFE_NO_PAD.decode(signature).expect("signature");
        flipped[0] ^= 1;
        let cases = [
            (
                "payload changed",
                swap_segment(
                    &token,
                    1,
                    &b64(claims_with(json!({"sub": "admin"})).to_string()),
                ),
                Err(JwtError::BadSignature),
            ),
            (
                "signature bit flipped",
                swap_segment(&token, 2, &b64(&flipped)),
                Err(JwtError::BadSignature),
            ),
            (
                "signature 3 bytes short",
                swap_segment(&token, 2, &b64(three_bytes_short(signature))),
                Err(JwtError::BadSignature),
            ),
            (
                "signature with a zero byte more",
                swap_segment(
                    &token,
                    2,
                    &b64([&[0u8][..], &URL_SAFE_NO_PAD.decode(signature).expect("sig")].concat()),
                ),
                Err(JwtError::BadSignature),
            ),
            (
                "signature removed",
                token[..token.rfind('.').expect("dot") + 1].to_string(),
                Err(malformed(Segment::Signature, "empty")),
            ),
            (
                "signature segment removed",
                token[..token.rfind('.').expect("dot")].to_string(),
                Err(malformed(
                    Segment::Token,
                    "expected 3 dot-separated segments (header.payload.signature), found 2",
                )),
            ),
            (
                "header of another algorithm",
                swap_segment(&token, 0, &b64(r#"{"alg":"ES256","kid":"rsa"}"#)),
                Err(JwtError::AlgorithmMismatch {
                    alg: Algorithm::ES256,
                    kid: Some("rsa".into()),
                }),
            ),
            (
                "header of the same algorithm, changed",
                swap_segment(
                    &token,
                    0,
                    &b64(format!(r#"{{"alg":"{alg}","kid":"{}"}}"#, kid_of(alg))),
                ),
                Err(JwtError::BadSignature),
            ),
        ];
        for (name, tampered, expected) in cases {
            assert_eq!(check(&tampered).map(|_| ()), expected, "{alg}: {name}");
        }
        // Every truncation fails: as malformed (not base64, or no longer
        // three segments) or as a signature of the wrong length.
        for len in 0..token.len() {
            let got = check(&token[..len]).map(|_| ());
            assert!(
                matches!(
                    got,
                    Err(JwtError::Malformed { .. } | JwtError::BadSignature)
                ),
                "{alg}: cut to {len}: {got:?}"
            );
        }
    }
}

fn three_bytes_short(signature: &str) -> Vec<u8> {
    let mut bytes = URL_SAFE_NO_PAD.decode(signature).expect("signature");
    bytes.truncate(bytes.len() - 3);
    bytes
}

fn kid_of(alg: Algorithm) -> &'static str {
    match alg {
        Algorithm::RS256 => "rsa",
        Algorithm::ES256 => "ec",
        Algorithm::HS256 => "hs",
    }
}

#[test]
fn wrong_key_fails() {
    let k = keys();
    let cases = [
        (
            token(
                json!({"alg": "RS256", "kid": "rsa"}),
                claims(),
                By::Rsa(&k.rsa_other),
            ),
            JwtError::BadSignature,
        ),
        (
            token(
                json!({"alg": "ES256", "kid": "ec"}),
                claims(),
                By::Ec(&k.ec_other),
            ),
            JwtError::BadSignature,
        ),
        (
            token(
                json!({"alg": "HS256", "kid": "hs"}),
                claims(),
                By::Hmac(&k.hmac_other),
            ),
            JwtError::BadSignature,
        ),
        (
            token(json!({"alg": "HS256"}), claims(), By::Hmac(&k.hmac_other)),
            JwtError::BadSignature,
        ),
        // The right key, but the kid of another: only that kid's keys are tried.
        (
            token(
                json!({"alg": "RS256", "kid": "ec"}),
                claims(),
                By::Rsa(&k.rsa),
            ),
            JwtError::AlgorithmMismatch {
                alg: Algorithm::RS256,
                kid: Some("ec".into()),
            },
        ),
    ];
    for (token, expected) in cases {
        assert_eq!(check(&token).map(|_| ()), Err(expected), "{token}");
    }
}

#[test]
fn key_selection_by_kid() {
    let k = keys();
    let rsa_only_kid = |kid: &str| -> KeySet {
        [VerifyingKey::from_jwk(&rsa_jwk(&k.rsa.to_public_key(), kid)).expect("jwk")]
            .into_iter()
            .collect()
    };
    let signed = |header: Value| token(header, claims(), By::Rsa(&k.rsa));
    let v = Validation::default();
    let verify =
        |token: &str, keys: &KeySet| jwt::verify(token.as_bytes(), keys, &v, NOW).map(|_| ());

    assert_eq!(
        verify(&signed(json!({"alg": "RS256", "kid": "nope"})), &key_set()),
        Err(JwtError::UnknownKey(Some("nope".into())))
    );
    assert_eq!(
        verify(&signed(json!({"alg": "RS256"})), &rsa_only_kid("k1")),
        Ok(()),
        "kid-less token, one key"
    );
    assert_eq!(
        verify(&signed(json!({"alg": "RS256"})), &key_set()),
        Ok(()),
        "kid-less token, every key tried"
    );
    assert_eq!(
        verify(&signed(json!({"alg": "RS256"})), &KeySet::new()),
        Err(JwtError::UnknownKey(None))
    );
    let without_kid: KeySet = [VerifyingKey::from_pem(&rsa_pem(&k.rsa)).expect("pem")]
        .into_iter()
        .collect();
    assert_eq!(
        verify(
            &signed(json!({"alg": "RS256", "kid": "anything"})),
            &without_kid
        ),
        Ok(()),
        "a key without kid serves every kid"
    );

    // Configured keys merged into a fetched JWKS: both serve.
    let mut merged = rsa_only_kid("fetched");
    merged.merge(
        [VerifyingKey::from_secret(&k.hmac)
            .expect("secret")
            .with_kid("configured")]
        .into_iter()
        .collect(),
    );
    assert_eq!(merged.len(), 2);
    assert_eq!(
        verify(&signed(json!({"alg": "RS256", "kid": "fetched"})), &merged),
        Ok(())
    );
    let hs = token(
        json!({"alg": "HS256", "kid": "configured"}),
        claims(),
        By::Hmac(&k.hmac),
    );
    assert_eq!(verify(&hs, &merged), Ok(()));
    // Two keys under one kid: the second one verifies.
    let mut rotated = rsa_only_kid("same");
    rotated.insert(
        VerifyingKey::from_jwk(&rsa_jwk(&k.rsa_other.to_public_key(), "same")).expect("jwk"),
    );
    let by_other = token(
        json!({"alg": "RS256", "kid": "same"}),
        claims(),
        By::Rsa(&k.rsa_other),
    );
    assert_eq!(verify(&by_other, &rotated), Ok(()));
}

fn rsa_pem(key: &RsaPrivateKey) -> String {
    key.to_public_key()
        .to_public_key_pem(LineEnding::LF)
        .expect("PEM")
}

/// The classic attack: a verifier that picks the algorithm from the header
/// would use the RSA public key's bytes as an HMAC secret. Here a key is
/// typed by its material, so an HS256 header finds no key to use.
#[test]
fn algorithm_confusion_fails() {
    let k = keys();
    let public = k.rsa.to_public_key();
    let pem = rsa_pem(&k.rsa);
    let der = public.to_public_key_der().expect("DER");
    let pkcs1 = public.to_pkcs1_der().expect("DER");
    let with_kid: KeySet = [VerifyingKey::from_pem(&pem).expect("pem").with_kid("rsa")]
        .into_iter()
        .collect();
    for (what, secret) in [
        ("PEM text", pem.as_bytes()),
        ("SPKI DER", der.as_bytes()),
        ("PKCS#1 DER", pkcs1.as_bytes()),
        ("modulus", &public.n().to_bytes_be()[..]),
    ] {
        for header in [
            json!({"alg": "HS256", "kid": "rsa"}),
            json!({"alg": "HS256"}),
        ] {
            let forged = token(header.clone(), claims(), By::Hmac(secret));
            let got = jwt::verify(forged.as_bytes(), &with_kid, &Validation::default(), NOW);
            assert_eq!(
                got,
                Err(JwtError::AlgorithmMismatch {
                    alg: Algorithm::HS256,
                    kid: header["kid"].as_str().map(str::to_string)
                }),
                "{what}, {header}"
            );
        }
    }
    // An ES256 header against the RSA key, and an RS256 header against the HMAC key.
    let es = token(
        json!({"alg": "ES256", "kid": "rsa"}),
        claims(),
        By::Ec(&k.ec),
    );
    assert_eq!(
        check(&es),
        Err(JwtError::AlgorithmMismatch {
            alg: Algorithm::ES256,
            kid: Some("rsa".into())
        })
    );
    let rs = token(
        json!({"alg": "RS256", "kid": "hs"}),
        claims(),
        By::Rsa(&k.rsa),
    );
    assert_eq!(
        check(&rs),
        Err(JwtError::AlgorithmMismatch {
            alg: Algorithm::RS256,
            kid: Some("hs".into())
        })
    );
    // A key embedded in the header is ignored: only the key set counts.
    let attacker = &k.ec_other;
    let embedded = token(
        json!({"alg": "ES256", "kid": "ec", "jwk": ec_jwk(attacker, "ec")}),
        claims(),
        By::Ec(attacker),
    );
    assert_eq!(check(&embedded), Err(JwtError::BadSignature));
}

#[test]
fn unsupported_and_disallowed_algorithms() {
    let k = keys();
    let cases: &[(Value, By<'_>, JwtError)] = &[
        (
            json!({"alg": "none"}),
            By::Raw(b""),
            JwtError::UnsupportedAlgorithm("none".into()),
        ),
        (
            json!({"alg": "none", "kid": "hs"}),
            By::Hmac(&k.hmac),
            JwtError::UnsupportedAlgorithm("none".into()),
        ),
        (
            json!({"alg": "None"}),
            By::Raw(b""),
            JwtError::UnsupportedAlgorithm("None".into()),
        ),
        (
            json!({"alg": "hs256"}),
            By::Hmac(&k.hmac),
            JwtError::UnsupportedAlgorithm("hs256".into()),
        ),
        (
            json!({"alg": "RS384"}),
            By::Rsa(&k.rsa),
            JwtError::UnsupportedAlgorithm("RS384".into()),
        ),
        (
            json!({"alg": "PS256"}),
            By::Rsa(&k.rsa),
            JwtError::UnsupportedAlgorithm("PS256".into()),
        ),
        (
            json!({"alg": ""}),
            By::Raw(b"x"),
            JwtError::UnsupportedAlgorithm("".into()),
        ),
        (
            json!({"alg": "HS256", "crit": ["b64"], "b64": false}),
            By::Hmac(&k.hmac),
            JwtError::UnsupportedCritical(r#"["b64"]"#.into()),
        ),
    ];
    for (header, by, expected) in cases {
        let token = token(header.clone(), claims(), *by);
        assert_eq!(check(&token).as_ref().err(), Some(expected), "{header}");
    }
    let rs256_only = Validation {
        algorithms: vec![Algorithm::RS256],
        ..Validation::default()
    };
    let hs = token(
        json!({"alg": "HS256", "kid": "hs"}),
        claims(),
        By::Hmac(&k.hmac),
    );
    assert_eq!(
        jwt::verify(hs.as_bytes(), &key_set(), &rs256_only, NOW).err(),
        Some(JwtError::AlgorithmNotAllowed(Algorithm::HS256))
    );
    let nothing = Validation {
        algorithms: vec![],
        ..Validation::default()
    };
    for (alg, token) in valid_tokens() {
        assert_eq!(
            jwt::verify(token.as_bytes(), &key_set(), &nothing, NOW).err(),
            Some(JwtError::AlgorithmNotAllowed(alg))
        );
    }
}

// ---------------------------------------------------------------------------
// Malformed tokens

#[test]
fn malformed_tokens_table() {
    let k = keys();
    let hs = |header: &str, claims: &str| token_of(header, claims, By::Hmac(&k.hmac));
    let ok_header = r#"{"alg":"HS256"}"#;
    let ok_claims = claims().to_string();
    let huge = format!("{}.{}.x", b64(ok_header), "A".repeat(MAX_TOKEN_LEN));
    let cases: Vec<(&str, Vec<u8>, JwtError)> = vec![
        ("empty", vec![], malformed(Segment::Token, "empty")),
        (
            "one segment",
            b"abc".to_vec(),
            malformed(
                Segment::Token,
                "expected 3 dot-separated segments (header.payload.signature), found 1",
            ),
        ),
        (
            "one dot",
            b"abc.def".to_vec(),
            malformed(
                Segment::Token,
                "expected 3 dot-separated segments (header.payload.signature), found 2",
            ),
        ),
        (
            "four segments",
            format!("{}.x", hs(ok_header, &ok_claims)).into_bytes(),
            malformed(
                Segment::Token,
                "expected 3 dot-separated segments (header.payload.signature), found 4",
            ),
        ),
        (
            "five segments (JWE)",
            b"a.b.c.d.e".to_vec(),
            malformed(
                Segment::Token,
                "expected 3 dot-separated segments (header.payload.signature), found 5 (five segments: an encrypted JWE?)",
            ),
        ),
        (
            "only dots",
            b"..".to_vec(),
            malformed(Segment::Header, "empty"),
        ),
        (
            "bad base64 header",
            b"!!!!.e30.c2ln".to_vec(),
            malformed(
                Segment::Header,
                "not base64url without padding: Invalid symbol 33, offset 0.",
            ),
        ),
        (
            "standard base64 alphabet",
            format!(
                "{}.e30.c2ln",
                STANDARD
                    .encode(r#"{"alg":"HS256","x":"??>"}"#)
                    .trim_end_matches('=')
            )
            .into_bytes(),
            malformed(
                Segment::Header,
                "not base64url without padding: Invalid symbol 47, offset 27.",
            ),
        ),
        (
            "padded base64",
            format!("{}=.e30.c2ln", b64(r#"{"alg":"HS256"}"#)).into_bytes(),
            malformed(
                Segment::Header,
                "has '=' padding (JWS uses base64url without padding)",
            ),
        ),
        (
            "whitespace inside",
            format!("{} .e30.c2ln", b64(ok_header)).into_bytes(),
            malformed(
                Segment::Header,
                "not base64url without padding: Invalid symbol 32, offset 20.",
            ),
        ),
        (
            "bad base64 payload",
            format!("{}.e30*.c2ln", b64(ok_header)).into_bytes(),
            malformed(
                Segment::Payload,
                "not base64url without padding: Invalid symbol 42, offset 3.",
            ),
        ),
        (
            "bad base64 signature",
            format!("{}.{}.c2l*", b64(ok_header), b64(&ok_claims)).into_bytes(),
            malformed(
                Segment::Signature,
                "not base64url without padding: Invalid symbol 42, offset 3.",
            ),
        ),
        (
            "non-JSON header",
            hs("<html>", &ok_claims).into_bytes(),
            malformed(
                Segment::Header,
                "not a JSON object: expected value at line 1 column 1",
            ),
        ),
        (
            "header is an array",
            hs(r#"["HS256"]"#, &ok_claims).into_bytes(),
            malformed(
                Segment::Header,
                "not a JSON object: invalid type: sequence, expected a JSON object at line 1 column 0",
            ),
        ),
        (
            "header is a number",
            hs("1", &ok_claims).into_bytes(),
            malformed(
                Segment::Header,
                "not a JSON object: invalid type: integer `1`, expected a JSON object at line 1 column 1",
            ),
        ),
        (
            "header with trailing bytes",
            hs(r#"{"alg":"HS256"} {}"#, &ok_claims).into_bytes(),
            malformed(
                Segment::Header,
                "not a JSON object: trailing characters at line 1 column 17",
            ),
        ),
        (
            "header without alg",
            hs(r#"{"typ":"JWT"}"#, &ok_claims).into_bytes(),
            malformed(Segment::Header, "\"alg\" is missing"),
        ),
        (
            "alg not a string",
            hs(r#"{"alg":256}"#, &ok_claims).into_bytes(),
            malformed(Segment::Header, "\"alg\" must be a string, got 256"),
        ),
        (
            "kid not a string",
            hs(r#"{"alg":"HS256","kid":["hs"]}"#, &ok_claims).into_bytes(),
            malformed(Segment::Header, "\"kid\" must be a string, got [\"hs\"]"),
        ),
        (
            "duplicate alg",
            hs(r#"{"alg":"none","alg":"HS256"}"#, &ok_claims).into_bytes(),
            malformed(
                Segment::Header,
                "not a JSON object: duplicate member \"alg\" at line 1 column 19",
            ),
        ),
        (
            "payload not JSON",
            hs(ok_header, "{").into_bytes(),
            malformed(
                Segment::Payload,
                "not a JSON object: EOF while parsing an object at line 1 column 1",
            ),
        ),
        (
            "payload is a string",
            hs(ok_header, r#""claims""#).into_bytes(),
            malformed(
                Segment::Payload,
                "not a JSON object: invalid type: string \"claims\", expected a JSON object at line 1 column 8",
            ),
        ),
        (
            "payload invalid UTF-8",
            format!("{}.{}.c2ln", b64(ok_header), b64(b"{\"sub\":\"\xff\"}")).into_bytes(),
            malformed(
                Segment::Payload,
                "not a JSON object: invalid unicode code point at line 1 column 9",
            ),
        ),
        (
            "duplicate exp",
            hs(ok_header, &format!(r#"{{"exp":{},"exp":1}}"#, NOW + 60)).into_bytes(),
            malformed(
                Segment::Payload,
                "not a JSON object: duplicate member \"exp\" at line 1 column 23",
            ),
        ),
        (
            "exp a string",
            hs(ok_header, r#"{"exp":"tomorrow"}"#).into_bytes(),
            malformed(
                Segment::Payload,
                "\"exp\" must be a NumericDate (non-negative seconds since the epoch), got \"tomorrow\"",
            ),
        ),
        (
            "nbf negative",
            hs(ok_header, r#"{"nbf":-5}"#).into_bytes(),
            malformed(
                Segment::Payload,
                "\"nbf\" must be a NumericDate (non-negative seconds since the epoch), got -5",
            ),
        ),
        (
            "iat null",
            hs(ok_header, r#"{"iat":null}"#).into_bytes(),
            malformed(
                Segment::Payload,
                "\"iat\" must be a NumericDate (non-negative seconds since the epoch), got null",
            ),
        ),
        (
            "iss a number",
            hs(ok_header, r#"{"iss":7}"#).into_bytes(),
            malformed(Segment::Payload, "\"iss\" must be a string, got 7"),
        ),
        (
            "aud an object",
            hs(ok_header, r#"{"aud":{"a":1}}"#).into_bytes(),
            malformed(
                Segment::Payload,
                "\"aud\" must be a string or an array of strings, got {\"a\":1}",
            ),
        ),
        (
            "aud array with a number",
            hs(ok_header, r#"{"aud":["a",1]}"#).into_bytes(),
            malformed(
                Segment::Payload,
                "\"aud\" must be a string or an array of strings, got [\"a\",1]",
            ),
        ),
        (
            "long values are cut in errors",
            hs(ok_header, &format!(r#"{{"sub":["{}"]}}"#, "a".repeat(300))).into_bytes(),
            malformed(
                Segment::Payload,
                &format!("\"sub\" must be a string, got [\"{}…", "a".repeat(62)),
            ),
        ),
        (
            "huge token",
            huge.clone().into_bytes(),
            JwtError::TooLong {
                len: huge.len(),
                max: MAX_TOKEN_LEN,
            },
        ),
    ];
    for (name, token, expected) in cases {
        assert_eq!(
            jwt::peek(&token).err().as_ref(),
            Some(&expected),
            "{name} (peek)"
        );
        assert_eq!(check_bytes(&token).err(), Some(expected), "{name} (verify)");
    }
}

fn check_bytes(token: &[u8]) -> Result<jwt::Claims, JwtError> {
    jwt::verify(token, &key_set(), &Validation::default(), NOW)
}

#[test]
fn token_of_exactly_the_limit_is_accepted() {
    let k = keys();
    let sized = |typ: &str, filler: usize| {
        token(
            json!({"alg": "HS256", "kid": "hs", "typ": typ}),
            claims_with(json!({"filler": "x".repeat(filler)})),
            By::Hmac(&k.hmac),
        )
    };
    let approx = (MAX_TOKEN_LEN - sized("JWT", 0).len()) * 3 / 4;
    // base64 lengths skip every fourth value; a longer `typ` shifts the header's.
    let token = ["JWT", "JWTx", "JWTxx"]
        .iter()
        .flat_map(|typ| (approx - 4..approx + 4).map(move |filler| sized(typ, filler)))
        .find(|token| token.len() == MAX_TOKEN_LEN)
        .expect("a token of exactly the limit");
    assert_eq!(
        check(&token).map(|claims| claims.get_str("tenant").map(str::len)),
        Ok(Some(4))
    );
    let over = format!("{}x{}", &token[..10], &token[10..]);
    assert_eq!(
        check(&over),
        Err(JwtError::TooLong {
            len: MAX_TOKEN_LEN + 1,
            max: MAX_TOKEN_LEN
        })
    );
}

// ---------------------------------------------------------------------------
// Base64 padding bits

/// A lenient decoder accepts non-zero trailing bits in the last character,
/// so two texts decode to the same signature. This one does not: each
/// signature has exactly one encoding, so the mutation test below need not
/// except any case.
#[test]
fn non_canonical_base64_is_rejected() {
    let lenient = GeneralPurpose::new(
        &base64::alphabet::URL_SAFE,
        GeneralPurposeConfig::new()
            .with_decode_allow_trailing_bits(true)
            .with_decode_padding_mode(DecodePaddingMode::RequireNone),
    );
    for (alg, token) in valid_tokens() {
        let (input, signature) = token.rsplit_once('.').expect("dot");
        let bytes = URL_SAFE_NO_PAD.decode(signature).expect("signature");
        // 256 and 64 bytes leave 4 unused bits in the last character, 32 bytes 2.
        let unused_bits = match bytes.len() % 3 {
            1 => 4,
            2 => 2,
            _ => 0,
        };
        assert!(unused_bits > 0, "{alg}");
        let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let last = signature.as_bytes()[signature.len() - 1];
        let value = alphabet.iter().position(|&c| c == last).expect("alphabet");
        assert_eq!(
            value & ((1 << unused_bits) - 1),
            0,
            "{alg}: canonical encoding"
        );
        for extra in 1..(1 << unused_bits) {
            let twin = format!(
                "{input}.{}{}",
                &signature[..signature.len() - 1],
                alphabet[value | extra] as char
            );
            let twin_signature = twin.rsplit_once('.').expect("dot").1;
            assert_eq!(
                lenient.decode(twin_signature).expect("lenient"),
                bytes,
                "{alg}: same bytes"
            );
            assert_eq!(
                check(&twin).map(|_| ()).map_err(|e| (
                    e.reason(),
                    matches!(
                        e,
                        JwtError::Malformed {
                            segment: Segment::Signature,
                            ..
                        }
                    )
                )),
                Err(("malformed", true)),
                "{alg}: {twin_signature}"
            );
        }
    }
}

/// Single-character changes of a valid token fail. No exception is needed:
/// the signature covers the header and payload *text*, so any change there
/// breaks it, and a changed signature text decodes to other bytes or not at
/// all (see `non_canonical_base64_is_rejected`).
///
/// The last two characters of each segment, where base64's unused bits sit,
/// get every replacement; the others a sample (a low and a high bit of the
/// 6-bit value, a dot, padding, a NUL and a non-ASCII byte), which keeps the
/// ~1,000 RSA and ECDSA verifications per token affordable in a debug build.
#[test]
fn every_single_character_change_fails() {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let every: Vec<u8> = ALPHABET.iter().chain(b".=+/ \0\x80\xff").copied().collect();
    let keys = key_set();
    let validation = Validation::default();
    for (alg, token) in valid_tokens() {
        let bytes = token.as_bytes();
        let segment_ends: Vec<usize> = (0..bytes.len())
            .filter(|&i| i + 1 == bytes.len() || bytes[i + 1] == b'.')
            .collect();
        let mut tried = 0;
        for (position, &original) in bytes.iter().enumerate() {
            let near_end = segment_ends
                .iter()
                .any(|&end| end == position || end == position + 1);
            let replacements = match ALPHABET.iter().position(|&c| c == original) {
                Some(_) if near_end => every.clone(),
                Some(value) => vec![
                    ALPHABET[value ^ 1],
                    ALPHABET[value ^ 32],
                    b'.',
                    b'=',
                    0,
                    0xff,
                ],
                None => every.clone(),
            };
            for byte in replacements {
                if byte == original {
                    continue;
                }
                let mut mutated = bytes.to_vec();
                mutated[position] = byte;
                tried += 1;
                assert!(
                    jwt::verify(&mutated, &keys, &validation, NOW).is_err(),
                    "{alg}: byte {position} → {byte:#04x} still verifies"
                );
            }
        }
        assert!(tried > bytes.len() * 5, "{alg}: {tried} changes");
    }
}

// ---------------------------------------------------------------------------
// Keys: JWK, JWKS, PEM, secrets

#[test]
fn jwks_with_mixed_and_unsupported_keys() {
    let k = keys();
    let document = json!({"keys": [
        rsa_jwk(&k.rsa.to_public_key(), "rsa"),
        {"kty": "OKP", "crv": "Ed25519", "kid": "ed", "x": "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"},
        ec_jwk(&k.ec, "ec"),
        {"kty": "EC", "crv": "P-384", "kid": "p384", "x": "AAAA", "y": "AAAA"},
        {"kty": "RSA", "kid": "enc", "use": "enc", "n": "AQAB", "e": "AQAB"},
        {"kty": "RSA", "kid": "rs384", "alg": "RS384", "n": "AQAB", "e": "AQAB"},
        {"kty": "RSA", "kid": "bad-n", "n": "not base64!", "e": "AQAB"},
        oct_jwk(&k.hmac, "hs"),
        "not an object",
        {"kid": 5, "kty": "EC"},
    ]});
    let jwks = KeySet::from_jwks(document.to_string().as_bytes()).expect("JWKS");
    assert_eq!(jwks.keys.len(), 3);
    assert_eq!(
        jwks.keys
            .iter()
            .map(|key| (key.kid(), key.algorithm()))
            .collect::<Vec<_>>(),
        [
            (Some("rsa"), Algorithm::RS256),
            (Some("ec"), Algorithm::ES256),
            (Some("hs"), Algorithm::HS256)
        ]
    );
    let skipped: Vec<String> = jwks.skipped.iter().map(ToString::to_string).collect();
    assert_eq!(
        skipped,
        [
            r#"keys[1] (kid "ed"): key type "OKP" is not supported (expected "RSA", "EC" or "oct")"#,
            r#"keys[3] (kid "p384"): curve "P-384" is not supported (expected "P-256")"#,
            r#"keys[4] (kid "enc"): key is not for verifying signatures ("use" is "enc")"#,
            r#"keys[5] (kid "rs384"): "alg" "RS384" is not supported for this key (expected RS256)"#,
            r#"keys[6] (kid "bad-n"): n: not base64url without padding: Invalid symbol 32, offset 3."#,
            r#"keys[8]: jwk: expected a JSON object, got "not an object""#,
            r#"keys[9]: kid: expected a string, got 5"#,
        ]
    );
    for (_, token) in valid_tokens() {
        assert!(jwt::verify(token.as_bytes(), &jwks.keys, &Validation::default(), NOW).is_ok());
    }
}

#[test]
fn jwks_document_errors() {
    let cases: &[(&str, &str)] = &[
        (
            "",
            "JWKS: not JSON: EOF while parsing a value at line 1 column 0",
        ),
        ("[]", r#"JWKS: expected an object with a "keys" array"#),
        (
            r#"{"keys":{}}"#,
            r#"JWKS: expected an object with a "keys" array"#,
        ),
        (
            r#"{"key":[]}"#,
            r#"JWKS: expected an object with a "keys" array"#,
        ),
    ];
    for (document, expected) in cases {
        let got = KeySet::from_jwks(document.as_bytes()).map(|jwks| jwks.keys.len());
        assert_eq!(
            got.map_err(|e| e.to_string()),
            Err(expected.to_string()),
            "{document}"
        );
    }
    let empty = KeySet::from_jwks(br#"{"keys":[]}"#).expect("empty JWKS");
    assert!(empty.keys.is_empty() && empty.skipped.is_empty());
}

#[test]
fn jwk_errors_name_the_member() {
    let k = keys();
    let public = k.rsa.to_public_key();
    let n = b64(public.n().to_bytes_be());
    let small = RsaPrivateKey::new(&mut ChaCha20Rng::seed_from_u64(1), 1024).expect("RSA-1024");
    let point = k.ec.verifying_key().to_encoded_point(false);
    let x = b64(point.x().expect("x"));
    let y = b64(point.y().expect("y"));
    let mut off_curve_y = URL_SAFE_NO_PAD.decode(&y).expect("y");
    off_curve_y[31] ^= 1;
    let cases: Vec<(Value, &str)> = vec![
        (json!({"n": n, "e": "AQAB"}), r#""kty" is required"#),
        (json!({"kty": "RSA", "e": "AQAB"}), r#""n" is required"#),
        (json!({"kty": "RSA", "n": n}), r#""e" is required"#),
        (json!({"kty": "RSA", "n": n, "e": ""}), "e: is empty"),
        (
            json!({"kty": "RSA", "n": n, "e": "AQAB="}),
            "e: has '=' padding (JWK uses base64url without padding)",
        ),
        (
            json!({"kty": "RSA", "n": n, "e": "Ag"}),
            "e: bad RSA public key: invalid exponent",
        ),
        (
            json!({"kty": "RSA", "n": b64([[0xff; 255].as_slice(), &[0xfe]].concat()), "e": "AQAB"}),
            "n: bad RSA public key: invalid modulus",
        ),
        (
            rsa_jwk(&small.to_public_key(), "small"),
            "RSA modulus of 1024 bits is outside the accepted 2048..=4096",
        ),
        (
            json!({"kty": "RSA", "n": b64([0xff; 1024]), "e": "AQAB"}),
            "RSA modulus of 8192 bits is outside the accepted 2048..=4096",
        ),
        (
            json!({"kty": "RSA", "n": n, "e": "AQAB", "key_ops": ["sign"]}),
            r#"key is not for verifying signatures ("key_ops" is ["sign"] without "verify")"#,
        ),
        (
            json!({"kty": "RSA", "n": n, "e": "AQAB", "key_ops": "verify"}),
            r#"key_ops: expected an array of strings, got "verify""#,
        ),
        (json!({"kty": "EC", "x": x, "y": y}), r#""crv" is required"#),
        (
            json!({"kty": "EC", "crv": "P-256", "x": x}),
            r#""y" is required"#,
        ),
        (
            json!({"kty": "EC", "crv": "P-256", "x": x, "y": b64([1u8; 31])}),
            "y: must be 32 bytes for P-256, got 31",
        ),
        (
            json!({"kty": "EC", "crv": "P-256", "x": x, "y": b64(off_curve_y)}),
            "x: (x, y) is not a point on P-256",
        ),
        (
            json!({"kty": "EC", "crv": "P-256", "alg": "ES384", "x": x, "y": y}),
            r#""alg" "ES384" is not supported for this key (expected ES256)"#,
        ),
        (
            json!({"kty": "oct", "k": b64(b"short secret")}),
            "HS256 secret of 12 bytes is shorter than the 32 required",
        ),
        (
            json!({"kty": "oct", "k": b64(k.hmac), "alg": "HS512"}),
            r#""alg" "HS512" is not supported for this key (expected HS256)"#,
        ),
        (
            json!({"kty": "oct", "k": b64(k.hmac), "use": 1}),
            "use: expected a string, got 1",
        ),
    ];
    for (jwk, expected) in cases {
        let got = VerifyingKey::from_jwk(&jwk).map(|key| key.algorithm());
        assert_eq!(
            got.map_err(|e| e.to_string()),
            Err(expected.to_string()),
            "{jwk}"
        );
    }
    // `use: sig` and `key_ops` with `verify` are fine.
    let ok = json!({"kty": "oct", "k": b64(k.hmac), "use": "sig", "key_ops": ["sign", "verify"], "alg": "HS256"});
    assert_eq!(
        VerifyingKey::from_jwk(&ok).map(|key| key.algorithm()),
        Ok(Algorithm::HS256)
    );
}

#[test]
fn pem_keys_verify() {
    let k = keys();
    let rsa_spki = rsa_pem(&k.rsa);
    let rsa_pkcs1 = k
        .rsa
        .to_public_key()
        .to_pkcs1_pem(LineEnding::CRLF)
        .expect("PKCS#1 PEM");
    let ec_spki =
        k.ec.verifying_key()
            .to_public_key_pem(LineEnding::LF)
            .expect("EC PEM");
    assert!(rsa_spki.starts_with("-----BEGIN PUBLIC KEY-----"));
    assert!(rsa_pkcs1.starts_with("-----BEGIN RSA PUBLIC KEY-----"));
    assert!(ec_spki.starts_with("-----BEGIN PUBLIC KEY-----"));
    let [rs, es, _] = &valid_tokens()[..] else {
        panic!("three tokens")
    };
    for (pem, token) in [(&rsa_spki, &rs.1), (&rsa_pkcs1, &rs.1), (&ec_spki, &es.1)] {
        let key = VerifyingKey::from_pem(&format!("\n{pem}\n")).expect("PEM key");
        let set: KeySet = [key].into_iter().collect();
        assert!(
            jwt::verify(token.as_bytes(), &set, &Validation::default(), NOW).is_ok(),
            "{pem}"
        );
    }
}

fn pem(label: &str, der: &[u8]) -> String {
    let base64 = STANDARD.encode(der);
    let lines: Vec<&str> = base64
        .as_bytes()
        .chunks(64)
        .map(|line| std::str::from_utf8(line).expect("ASCII"))
        .collect();
    format!(
        "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
        lines.join("\n")
    )
}

#[test]
fn pem_errors() {
    // SubjectPublicKeyInfo headers for Ed25519 and P-384 around zero bytes.
    let mut ed25519 = vec![
        0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
    ];
    ed25519.extend([0; 32]);
    let mut p384 = vec![
        0x30, 0x76, 0x30, 0x10, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x05,
        0x2b, 0x81, 0x04, 0x00, 0x22, 0x03, 0x62, 0x00, 0x04,
    ];
    p384.extend([7; 96]);
    let cases: Vec<(String, &str)> = vec![
        ("not pem".into(), r#"pem: no "-----BEGIN" line"#),
        (
            pem("CERTIFICATE", b"x"),
            r#"pem: label "CERTIFICATE" is not supported (expected "PUBLIC KEY" or "RSA PUBLIC KEY")"#,
        ),
        (
            pem("PUBLIC KEY", b"\x30\x00"),
            "pem: not a SubjectPublicKeyInfo: ASN.1 error: ASN.1 DER message is incomplete: expected 3, actual 2 at DER byte 2",
        ),
        (
            pem("PUBLIC KEY", &ed25519),
            r#"key type OID 1.3.101.112 is not supported (expected "RSA", "EC" or "oct")"#,
        ),
        (
            pem("PUBLIC KEY", &p384),
            r#"curve OID 1.3.132.0.34 is not supported (expected "P-256")"#,
        ),
        (
            pem("RSA PUBLIC KEY", b"\x30\x00"),
            "pem: not a PKCS#1 RSA public key: PKCS#1 ASN.1 error: ASN.1 DER message is incomplete: expected 3, actual 2 at DER byte 2",
        ),
    ];
    let small = RsaPrivateKey::new(&mut ChaCha20Rng::seed_from_u64(1), 1024)
        .expect("RSA-1024")
        .to_public_key();
    let small_message = "RSA modulus of 1024 bits is outside the accepted 2048..=4096";
    let cases = cases.into_iter().chain([
        (
            small.to_public_key_pem(LineEnding::LF).expect("PEM"),
            small_message,
        ),
        (
            small.to_pkcs1_pem(LineEnding::LF).expect("PEM"),
            small_message,
        ),
    ]);
    for (pem, expected) in cases {
        let got = VerifyingKey::from_pem(&pem).map(|key| key.algorithm());
        assert_eq!(
            got.map_err(|e| e.to_string()),
            Err(expected.to_string()),
            "{pem}"
        );
    }
}

#[test]
fn secrets_are_checked_and_never_printed() {
    assert_eq!(
        VerifyingKey::from_secret(b"").map(|_| ()),
        Err(KeyError::SecretTooShort { len: 0 })
    );
    assert_eq!(
        VerifyingKey::from_secret(&[7; 31]).map(|_| ()),
        Err(KeyError::SecretTooShort { len: 31 })
    );
    let secret = b"SECRET-secret-SECRET-secret-SECRET";
    let key = VerifyingKey::from_secret(secret)
        .expect("secret")
        .with_kid("hs");
    let debug = format!("{key:?} {:?} {:#?}", key_set(), std::slice::from_ref(&key));
    for leak in [
        "SECRET".to_string(),
        format!("{:?}", &secret[..4]),
        b64(secret)[..8].to_string(),
        "83, 69, 67".to_string(),
    ] {
        assert!(!debug.contains(&leak), "{leak} in {debug}");
    }
    assert!(
        debug.contains(
            r#"VerifyingKey { kid: Some("hs"), algorithm: HS256, key: <redacted 34-byte secret> }"#
        ),
        "{debug}"
    );
    assert!(
        debug.contains("RSA 2048 bits") && debug.contains("P-256"),
        "{debug}"
    );
}

// ---------------------------------------------------------------------------
// Errors and configuration

#[test]
fn every_error_has_a_listed_reason() {
    let errors = [
        JwtError::TooLong { len: 1, max: 0 },
        malformed(Segment::Token, "x"),
        JwtError::UnsupportedAlgorithm("none".into()),
        JwtError::AlgorithmNotAllowed(Algorithm::HS256),
        JwtError::UnsupportedCritical("[]".into()),
        JwtError::AlgorithmMismatch {
            alg: Algorithm::HS256,
            kid: None,
        },
        JwtError::UnknownKey(None),
        JwtError::BadSignature,
        JwtError::Expired { exp: 1, now: 2 },
        JwtError::NotYetValid { nbf: 2, now: 1 },
        JwtError::WrongIssuer("x".into()),
        JwtError::WrongAudience(vec![]),
        JwtError::MissingClaim("exp"),
    ];
    let reasons: Vec<&str> = errors.iter().map(JwtError::reason).collect();
    assert_eq!(reasons, JwtError::REASONS);
    let texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(
        texts,
        [
            "token is 1 bytes, more than the 0 accepted",
            "malformed token: x",
            r#"unsupported algorithm "none""#,
            "algorithm HS256 is not allowed",
            r#"header "crit" names extensions this verifier does not implement: []"#,
            "no key for a token without kid is for algorithm HS256",
            "no key for a token without kid",
            "signature does not verify",
            "token expired: exp 1, now 2",
            "token not valid yet: nbf 2, now 1",
            r#"issuer "x" is not accepted"#,
            "audience [] is not accepted",
            r#"claim "exp" is required"#,
        ]
    );
    assert_eq!(
        JwtError::UnknownKey(Some("k\n1".into())).to_string(),
        r#"no key with kid "k\n1""#,
        "token-supplied values are escaped"
    );
}

#[test]
fn validation_from_configuration() {
    let parsed: Validation = serde_json::from_str(
        r#"{"issuers":["https://issuer.example"],"audiences":["llm"],"leeway_secs":5,"require_exp":false,"algorithms":["RS256","ES256"]}"#,
    )
    .expect("validation");
    assert_eq!(
        parsed,
        Validation {
            issuers: vec!["https://issuer.example".into()],
            audiences: vec!["llm".into()],
            leeway_secs: 5,
            require_exp: false,
            algorithms: vec![Algorithm::RS256, Algorithm::ES256],
        }
    );
    assert_eq!(
        serde_json::from_str::<Validation>("{}").expect("defaults"),
        Validation::default()
    );
    let errors = [
        (
            r#"{"algorithms":["none"]}"#,
            "unknown variant `none`, expected one of `RS256`, `ES256`, `HS256` at line 1 column 21",
        ),
        (
            r#"{"leeway":5}"#,
            "unknown field `leeway`, expected one of `issuers`, `audiences`, `leeway_secs`, `require_exp`, `algorithms` at line 1 column 9",
        ),
    ];
    for (json, expected) in errors {
        let got = serde_json::from_str::<Validation>(json).map_err(|e| e.to_string());
        assert_eq!(got.err().as_deref(), Some(expected), "{json}");
    }
}

// ---------------------------------------------------------------------------
// Properties

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        ".{0,12}".prop_map(Value::from),
        prop::sample::select(vec!["RS256", "ES256", "HS256", "none", "rsa", "ec", "hs"])
            .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(".{0,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Objects whose registered members hold values of any type.
fn json_object(names: &'static [&'static str]) -> impl Strategy<Value = Value> {
    prop::collection::vec((prop::sample::select(names), json_value()), 0..6).prop_map(|members| {
        Value::Object(
            members
                .into_iter()
                .map(|(n, v)| (n.to_string(), v))
                .collect(),
        )
    })
}

const HEADER_NAMES: &[&str] = &["alg", "kid", "typ", "crit", "jwk", "x"];
const CLAIM_NAMES: &[&str] = &["exp", "nbf", "iat", "iss", "aud", "sub", "tenant"];

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let _ = jwt::peek(&bytes);
        prop_assert!(check_bytes(&bytes).is_err());
    }

    #[test]
    fn arbitrary_segments_never_panic(
        segments in prop::collection::vec("[A-Za-z0-9_=+/.-]{0,80}", 1..6),
    ) {
        let token = segments.join(".");
        let _ = jwt::peek(token.as_bytes());
        prop_assert!(check(&token).is_err());
    }

    #[test]
    fn arbitrary_json_never_panics(
        header in json_object(HEADER_NAMES),
        claims in json_object(CLAIM_NAMES),
        alg in 0usize..3,
    ) {
        let k = keys();
        let by = [By::Rsa(&k.rsa), By::Ec(&k.ec), By::Hmac(&k.hmac)][alg];
        let token = token(header, claims, by);
        if let Ok(unverified) = jwt::peek(token.as_bytes()) {
            let _ = (unverified.header().alg(), unverified.claims().exp(), unverified.claims().aud());
        }
        let _ = check(&token);
    }

    #[test]
    fn any_single_byte_change_fails(which in 0usize..3, position in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let (alg, token) = valid_tokens().swap_remove(which);
        let position = position.index(token.len());
        let mut mutated = token.into_bytes();
        prop_assume!(mutated[position] != byte);
        mutated[position] = byte;
        prop_assert!(check_bytes(&mutated).is_err(), "{alg}: {position} → {byte:#04x}");
    }

    #[test]
    fn several_changes_never_panic(
        which in 0usize..3,
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6),
    ) {
        let (_, token) = valid_tokens().swap_remove(which);
        let original = token.clone().into_bytes();
        let mut mutated = original.clone();
        for (position, byte, kind) in edits {
            if mutated.is_empty() {
                break;
            }
            let at = position.index(mutated.len());
            match kind {
                0 => mutated[at] = byte,
                1 => { mutated.remove(at); }
                _ => mutated.insert(at, byte),
            }
        }
        let got = check_bytes(&mutated);
        prop_assert_eq!(got.is_ok(), mutated == original);
    }
}
