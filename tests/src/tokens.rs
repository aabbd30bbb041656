//! An identity provider for tests: fixed RSA-2048, P-256 and HMAC keys,
//! their JWKS, and tokens signed with them (RS256, ES256, HS256).

use std::sync::OnceLock;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use p256::ecdsa::SigningKey as EcSigningKey;
use rand_chacha::ChaCha20Rng;
use rand_chacha::rand_core::SeedableRng;
use rsa::RsaPrivateKey;
use rsa::signature::{SignatureEncoding, Signer};
use rsa::traits::PublicKeyParts;
use serde_json::{Value, json};
use sha2::Sha256;

/// Key ids in the JWKS.
pub const RSA_KID: &str = "test-rsa";
/// Key id of the P-256 key.
pub const EC_KID: &str = "test-ec";
/// The HMAC secret (tests pass it to VMs through the environment).
pub const HS_SECRET: &str = "zerolayer-test-hs256-secret-0123456789";

/// The test identity provider.
pub struct Issuer {
    rsa: RsaPrivateKey,
    ec: EcSigningKey,
}

/// The process-wide issuer (RSA key generation takes a moment: once).
pub fn issuer() -> &'static Issuer {
    static ISSUER: OnceLock<Issuer> = OnceLock::new();
    ISSUER.get_or_init(|| {
        let mut rng = ChaCha20Rng::seed_from_u64(0x7a65_726f);
        let rsa = match RsaPrivateKey::new(&mut rng, 2048) {
            Ok(key) => key,
            Err(err) => unreachable!("RSA key generation from a seeded RNG: {err}"),
        };
        Issuer {
            rsa,
            ec: EcSigningKey::random(&mut rng),
        }
    })
}

fn b64(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

/// Unix seconds now (the clock tokens are issued against).
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Claims for `sub` of `tenant`, valid from `now` for `ttl_secs`.
pub fn claims(sub: &str, tenant: &str, now: u64, ttl_secs: i64) -> Value {
    json!({
        "sub": sub,
        "tenant": tenant,
        "iss": "https://idp.test",
        "aud": "zerolayer",
        "iat": now,
        "exp": (now as i64 + ttl_secs).max(0),
    })
}

impl Issuer {
    /// The public keys as a JWKS document.
    pub fn jwks(&self) -> Value {
        let public = self.rsa.to_public_key();
        let point = self.ec.verifying_key().to_encoded_point(false);
        json!({"keys": [
            {"kty": "RSA", "kid": RSA_KID, "alg": "RS256", "use": "sig",
             "n": b64(&public.n().to_bytes_be()), "e": b64(&public.e().to_bytes_be())},
            {"kty": "EC", "kid": EC_KID, "alg": "ES256", "use": "sig", "crv": "P-256",
             "x": b64(point.x().map(|x| x.as_slice()).unwrap_or_default()),
             "y": b64(point.y().map(|y| y.as_slice()).unwrap_or_default())},
        ]})
    }

    fn signing_input(alg: &str, kid: Option<&str>, claims: &Value) -> String {
        let mut header = json!({"alg": alg, "typ": "JWT"});
        if let Some(kid) = kid {
            header["kid"] = json!(kid);
        }
        format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        )
    }

    /// An RS256 token.
    pub fn rs256(&self, claims: &Value) -> String {
        let input = Self::signing_input("RS256", Some(RSA_KID), claims);
        let key = rsa::pkcs1v15::SigningKey::<Sha256>::new(self.rsa.clone());
        let sig = key.sign(input.as_bytes()).to_vec();
        format!("{input}.{}", b64(&sig))
    }

    /// An ES256 token.
    pub fn es256(&self, claims: &Value) -> String {
        let input = Self::signing_input("ES256", Some(EC_KID), claims);
        let sig: p256::ecdsa::Signature = self.ec.sign(input.as_bytes());
        format!("{input}.{}", b64(&sig.to_bytes()))
    }

    /// An HS256 token with [`HS_SECRET`].
    pub fn hs256(&self, claims: &Value) -> String {
        let input = Self::signing_input("HS256", None, claims);
        let mut mac = match Hmac::<Sha256>::new_from_slice(HS_SECRET.as_bytes()) {
            Ok(mac) => mac,
            Err(err) => unreachable!("HMAC takes any key length: {err}"),
        };
        mac.update(input.as_bytes());
        format!("{input}.{}", b64(&mac.finalize().into_bytes()))
    }

    /// A token with a valid-looking structure and a signature nobody made.
    pub fn forged(&self, claims: &Value, n: u64) -> String {
        let input = Self::signing_input("ES256", Some(EC_KID), claims);
        let mut sig = [0u8; 64];
        sig[..8].copy_from_slice(&n.to_le_bytes());
        sig[63] = 1;
        format!("{input}.{}", b64(&sig))
    }
}
