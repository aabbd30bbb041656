//! The identity lazy-auth publishes for later filters, in one property
//! (`wasmx.zerolayer_auth`, see `crate::internal`): one host call on the hot
//! path instead of one per field, and still readable in an access log:
//! `verified tenant=acme subject=user-1`, `unverified tenant=mallory`
//! (claimed, never to be trusted for isolation), `public`.

/// How a request was authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Identity<'a> {
    /// A verified credential, with its verified tenant and subject.
    Verified {
        /// Tenant.
        tenant: Option<&'a str>,
        /// Subject.
        subject: Option<&'a str>,
    },
    /// Admitted before verification; the tenant is only claimed.
    Unverified {
        /// What the credential claims.
        claimed_tenant: Option<&'a str>,
    },
    /// A public path: no credential needed.
    Public,
}

fn push_value(out: &mut Vec<u8>, value: &str) {
    // Values are percent-encoded outside a safe set, so spaces and `=`
    // in a tenant name cannot break the format.
    for &b in value.as_bytes() {
        if b.is_ascii_alphanumeric() || b"-._~:@/+".contains(&b) {
            out.push(b);
        } else {
            out.extend_from_slice(format!("%{b:02X}").as_bytes());
        }
    }
}

fn decode_value(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = raw.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

impl Identity<'_> {
    /// The property value.
    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(48);
        let field = |out: &mut Vec<u8>, key: &str, value: Option<&str>| {
            if let Some(v) = value {
                out.push(b' ');
                out.extend_from_slice(key.as_bytes());
                out.push(b'=');
                push_value(out, v);
            }
        };
        match self {
            Identity::Verified { tenant, subject } => {
                out.extend_from_slice(b"verified");
                field(&mut out, "tenant", *tenant);
                field(&mut out, "subject", *subject);
            }
            Identity::Unverified { claimed_tenant } => {
                out.extend_from_slice(b"unverified");
                field(&mut out, "tenant", *claimed_tenant);
            }
            Identity::Public => out.extend_from_slice(b"public"),
        }
        out
    }
}

/// A published identity, parsed (owned, values decoded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedIdentity {
    /// `verified`, `unverified` or `public`.
    pub state: String,
    /// Tenant (verified, or claimed when unverified).
    pub tenant: Option<String>,
    /// Subject (verified only).
    pub subject: Option<String>,
}

impl ParsedIdentity {
    /// Parses a property value; `None` when it is not one.
    pub fn parse(value: &[u8]) -> Option<ParsedIdentity> {
        let text = std::str::from_utf8(value).ok()?;
        let mut parts = text.split(' ');
        let state = parts.next()?.to_string();
        if !matches!(state.as_str(), "verified" | "unverified" | "public") {
            return None;
        }
        let (mut tenant, mut subject) = (None, None);
        for part in parts {
            let (key, raw) = part.split_once('=')?;
            let value = decode_value(raw)?;
            match key {
                "tenant" => tenant = Some(value),
                "subject" => subject = Some(value),
                _ => {}
            }
        }
        Some(ParsedIdentity {
            state,
            tenant,
            subject,
        })
    }

    /// Whether the tenant was verified (only then may it isolate data).
    pub fn verified_tenant(&self) -> Option<&str> {
        (self.state == "verified")
            .then_some(self.tenant.as_deref())
            .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let cases = [
            (
                Identity::Verified {
                    tenant: Some("acme"),
                    subject: Some("user-1"),
                },
                "verified tenant=acme subject=user-1",
            ),
            (
                Identity::Verified {
                    tenant: None,
                    subject: Some("svc"),
                },
                "verified subject=svc",
            ),
            (
                Identity::Unverified {
                    claimed_tenant: Some("evil corp=x"),
                },
                "unverified tenant=evil%20corp%3Dx",
            ),
            (
                Identity::Unverified {
                    claimed_tenant: None,
                },
                "unverified",
            ),
            (Identity::Public, "public"),
        ];
        for (identity, text) in cases {
            let rendered = identity.render();
            assert_eq!(String::from_utf8_lossy(&rendered), text);
            let parsed = ParsedIdentity::parse(&rendered).unwrap();
            match identity {
                Identity::Verified { tenant, subject } => {
                    assert_eq!(parsed.verified_tenant(), tenant);
                    assert_eq!(parsed.subject.as_deref(), subject);
                }
                Identity::Unverified { claimed_tenant } => {
                    assert_eq!(parsed.tenant.as_deref(), claimed_tenant);
                    assert_eq!(parsed.verified_tenant(), None);
                }
                Identity::Public => assert_eq!(parsed.state, "public"),
            }
        }
        assert_eq!(ParsedIdentity::parse(b"admin tenant=x"), None);
        assert_eq!(ParsedIdentity::parse(b"verified tenant=%zz"), None);
    }
}
