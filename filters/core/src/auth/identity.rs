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
    if !raw.contains('%') {
        // Most values have nothing escaped (every stage reads them per request).
        return Some(raw.to_string());
    }
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
    pub state: &'static str,
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
        let state = match parts.next()? {
            "verified" => "verified",
            "unverified" => "unverified",
            "public" => "public",
            _ => return None,
        };
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

/// What lazy-auth published for a request (`internal::AUTH_PROPERTY`),
/// parsed once: a chain that runs in one filter keeps it for every stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Published {
    /// Nothing (lazy-auth is not before this stage).
    Nothing,
    /// A value that is not an identity (counts as unverified).
    Malformed,
    /// The identity.
    Identity(ParsedIdentity),
}

impl Published {
    /// The property's value as read (`None`: not set).
    pub fn parse(value: Option<&[u8]>) -> Published {
        match value.map(ParsedIdentity::parse) {
            None => Published::Nothing,
            Some(None) => Published::Malformed,
            Some(Some(identity)) => Published::Identity(identity),
        }
    }

    /// The identity, when one was published and readable.
    pub fn identity(&self) -> Option<&ParsedIdentity> {
        match self {
            Published::Identity(identity) => Some(identity),
            Published::Nothing | Published::Malformed => None,
        }
    }
}

/// What an unverified request is billed and labelled as: a claimed tenant
/// is never trusted for money, and a spray of made-up claims cannot fill a
/// bounded label table.
pub const UNVERIFIED_TENANT: &str = "unverified";

/// The tenant a request is billed, labelled, sampled and matched as, from
/// lazy-auth's published identity (`published`): the verified tenant; for
/// a verified credential without one, and for a public path,
/// `default_tenant` (`None`: `unknown`); for an unverified request,
/// [`UNVERIFIED_TENANT`] — never the tenant it claims. Only when no
/// identity was published (lazy-auth is not in the chain) does the
/// operator's `header_tenant` count (a header only the operator's own
/// proxy sets); an unreadable identity counts as unverified.
pub fn billing_tenant(
    published: &Published,
    header_tenant: Option<&str>,
    default_tenant: Option<&str>,
) -> String {
    let fallback = || default_tenant.unwrap_or(crate::metering::labels::UNKNOWN);
    let id = match published {
        Published::Nothing => {
            return header_tenant
                .filter(|t| !t.is_empty())
                .unwrap_or_else(fallback)
                .to_string();
        }
        Published::Malformed => return UNVERIFIED_TENANT.to_string(),
        Published::Identity(id) => id,
    };
    match id.state {
        "verified" => id
            .tenant
            .as_deref()
            .filter(|t| !t.is_empty())
            .unwrap_or_else(fallback)
            .to_string(),
        "public" => fallback().to_string(),
        _ => UNVERIFIED_TENANT.to_string(),
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

    #[test]
    fn billing_uses_only_verified_identity() {
        let acme = Some("acme");
        // (published identity, header tenant, default tenant) → billed as
        type Case<'a> = (Option<&'a [u8]>, Option<&'a str>, Option<&'a str>, &'a str);
        let cases: &[Case<'_>] = &[
            (
                Some(b"verified tenant=acme subject=u"),
                Some("evil"),
                None,
                "acme",
            ),
            // Verified without a tenant: the default, never the header.
            (Some(b"verified subject=svc"), Some("evil"), None, "unknown"),
            (Some(b"verified subject=svc"), Some("evil"), acme, "acme"),
            // Unverified: never the claim, never the header.
            (
                Some(b"unverified tenant=evil"),
                Some("evil"),
                acme,
                "unverified",
            ),
            (Some(b"unverified"), Some("evil"), None, "unverified"),
            (Some(b"public"), Some("evil"), None, "unknown"),
            (Some(b"garbage"), Some("evil"), None, "unverified"),
            // No lazy-auth in the chain: the operator's header, else the default.
            (None, Some("globex"), None, "globex"),
            (None, Some(""), acme, "acme"),
            (None, None, None, "unknown"),
        ];
        for (published, header, default, want) in cases {
            assert_eq!(
                billing_tenant(&Published::parse(*published), *header, *default),
                *want,
                "{:?}",
                published.map(String::from_utf8_lossy)
            );
        }
    }
}
