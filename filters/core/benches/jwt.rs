//! JWT verification cost per algorithm (RS256 with a 2048-bit key, ES256,
//! HS256), natively, for a typical gateway token; and `peek`, the decode the
//! filter does on an unknown token before deciding whether to verify.
#![allow(missing_docs)]

use std::hint::black_box;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use criterion::{Criterion, criterion_group, criterion_main};
use hmac::{Hmac, Mac};
use rand_chacha::ChaCha20Rng;
use rand_chacha::rand_core::SeedableRng;
use rsa::signature::{SignatureEncoding, Signer};
use sha2::Sha256;
use zerolayer_core::auth::credential::TokenHash;
use zerolayer_core::auth::jwt::{self, KeySet, Validation, VerifyingKey};

const NOW: u64 = 1_800_000_000;

fn claims() -> String {
    serde_json::json!({
        "sub": "user-7f3a9c",
        "iss": "https://auth.example.com/",
        "aud": ["llm-gateway", "https://api.example.com"],
        "exp": NOW + 3600,
        "nbf": NOW - 5,
        "iat": NOW - 5,
        "tenant": "acme",
        "scope": "models:invoke models:list",
    })
    .to_string()
}

fn token(alg: &str, kid: &str, sign: impl Fn(&[u8]) -> Vec<u8>) -> String {
    let header = format!(r#"{{"alg":"{alg}","typ":"JWT","kid":"{kid}"}}"#);
    let input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header),
        URL_SAFE_NO_PAD.encode(claims())
    );
    let signature = sign(input.as_bytes());
    format!("{input}.{}", URL_SAFE_NO_PAD.encode(signature))
}

fn verify(c: &mut Criterion) {
    let mut rng = ChaCha20Rng::seed_from_u64(1);
    let rsa = rsa::RsaPrivateKey::new(&mut rng, 2048).expect("RSA key");
    let ec = p256::ecdsa::SigningKey::random(&mut rng);
    let secret = [0x5a_u8; 32];

    let mut keys = KeySet::new();
    let rsa_pem = rsa::pkcs8::EncodePublicKey::to_public_key_pem(
        &rsa.to_public_key(),
        rsa::pkcs8::LineEnding::LF,
    )
    .expect("PEM");
    keys.insert(
        VerifyingKey::from_pem(&rsa_pem)
            .expect("RSA PEM")
            .with_kid("rsa"),
    );
    let ec_pem = rsa::pkcs8::EncodePublicKey::to_public_key_pem(
        ec.verifying_key(),
        rsa::pkcs8::LineEnding::LF,
    )
    .expect("PEM");
    keys.insert(
        VerifyingKey::from_pem(&ec_pem)
            .expect("EC PEM")
            .with_kid("ec"),
    );
    keys.insert(
        VerifyingKey::from_secret(&secret)
            .expect("secret")
            .with_kid("hs"),
    );

    let rsa_signer = rsa::pkcs1v15::SigningKey::<Sha256>::new(rsa);
    let tokens = [
        (
            "RS256",
            token("RS256", "rsa", |input| rsa_signer.sign(input).to_vec()),
        ),
        (
            "ES256",
            token("ES256", "ec", |input| {
                let signature: p256::ecdsa::Signature = ec.sign(input);
                signature.to_bytes().to_vec()
            }),
        ),
        (
            "HS256",
            token("HS256", "hs", |input| {
                let mut mac = Hmac::<Sha256>::new_from_slice(&secret).expect("any length");
                mac.update(input);
                mac.finalize().into_bytes().to_vec()
            }),
        ),
    ];
    let validation = Validation {
        issuers: vec!["https://auth.example.com/".into()],
        audiences: vec!["llm-gateway".into()],
        ..Validation::default()
    };

    let mut group = c.benchmark_group("jwt/verify");
    for (alg, token) in &tokens {
        jwt::verify(token.as_bytes(), &keys, &validation, NOW).expect("bench token verifies");
        group.bench_function(*alg, |b| {
            b.iter(|| jwt::verify(black_box(token.as_bytes()), &keys, &validation, NOW))
        });
    }
    group.finish();

    let (_, rs256) = &tokens[0];
    c.bench_function("jwt/peek", |b| {
        b.iter(|| jwt::peek(black_box(rs256.as_bytes())).map(|t| t.claims().exp()))
    });

    // The hot path's whole per-request credential work: the SHA-256 that
    // names the verdict, next to the RS256 verification it replaces.
    let mut group = c.benchmark_group("token_hash");
    group.bench_function("rs256_jwt", |b| {
        b.iter(|| TokenHash::of(black_box(rs256.as_bytes())))
    });
    let api_key = b"sk-live-4f9c2a7e1b3d5f6a8c0e2b4d6f8a1c3e";
    group.bench_function("api_key", |b| b.iter(|| TokenHash::of(black_box(api_key))));
    group.finish();
}

criterion_group!(benches, verify);
criterion_main!(benches);
