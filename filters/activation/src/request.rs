//! The request as the rule engine sees it, read from the host once.

use zerolayer_core::activation::{HeaderSlot, RequestFacts, RuleSet};
use zerolayer_core::headers::HeaderBlock;
use zerolayer_core::internal::is_internal_header;

/// A request's headers, read from the host in one call (one call is
/// cheaper than a call per header the rules read; in the fused filter, the
/// stages' shared copy), indexed for the rules.
pub(crate) struct HostRequest<'h> {
    headers: &'h HeaderBlock,
    /// `slots[s]`: the value of the header in rule slot `s`.
    slots: Vec<Option<&'h [u8]>>,
    path: Option<&'h [u8]>,
    method: Option<&'h [u8]>,
    tenant: Option<&'h [u8]>,
    request_id: Option<&'h [u8]>,
    /// The host's time, when a rule reads it (only rules with
    /// `hours`/`weekdays` do, so only they pay for the read).
    now: Option<i64>,
}

impl<'h> HostRequest<'h> {
    /// Indexes `headers` (the request's) for the ones `rules` use.
    pub(crate) fn new(headers: &'h HeaderBlock, rules: &RuleSet) -> Self {
        HostRequest {
            slots: rules
                .header_names()
                .iter()
                .map(|name| headers.get(name))
                .collect(),
            path: headers.get(":path"),
            method: headers.get(":method"),
            tenant: headers.get(rules.tenant_header()),
            request_id: headers.get("x-request-id"),
            now: None,
            headers,
        }
    }

    /// The tenant from lazy-auth's published identity, in place of the
    /// tenant header's.
    pub(crate) fn set_tenant(&mut self, tenant: &'h [u8]) {
        self.tenant = Some(tenant);
    }

    /// Gives the rules the host's time (Unix seconds).
    pub(crate) fn set_now(&mut self, unix_seconds: i64) {
        self.now = Some(unix_seconds);
    }

    /// Names of zerolayer-internal headers the client sent.
    pub(crate) fn forbidden_headers(&self) -> impl Iterator<Item = &'h str> {
        self.headers
            .iter()
            .filter(|(name, _)| is_internal_header(name))
            .filter_map(|(name, _)| std::str::from_utf8(name).ok())
    }
}

impl RequestFacts for HostRequest<'_> {
    fn header(&self, slot: HeaderSlot) -> Option<&[u8]> {
        self.slots.get(slot).copied().flatten()
    }

    fn path(&self) -> &[u8] {
        self.path.unwrap_or(b"/")
    }

    fn method(&self) -> &[u8] {
        self.method.unwrap_or(b"")
    }

    fn tenant(&self) -> Option<&[u8]> {
        self.tenant
    }

    fn request_id(&self) -> Option<&[u8]> {
        self.request_id
    }

    fn unix_seconds(&self) -> i64 {
        self.now.unwrap_or(0)
    }
}

/// The request facts the rules read, from a header block.
#[cfg(test)]
mod tests {
    use zerolayer_core::activation::{RequestFacts, RuleSet};
    use zerolayer_core::headers::HeaderBlock;

    use super::HostRequest;

    fn block(headers: &[(&str, &str)]) -> HeaderBlock {
        HeaderBlock::parse(HeaderBlock::serialize(
            headers.iter().map(|(n, v)| (*n, v.as_bytes())),
        ))
        .unwrap()
    }

    fn rules() -> RuleSet {
        RuleSet::from_json(
            br#"{"tenant_header": "x-tenant-id", "rules": [
                {"name": "sdk", "when": {"header": {"name": "user-agent", "exists": true}}, "activate": ["audit"]}
            ]}"#,
        )
        .unwrap()
    }

    #[test]
    fn internal_headers_are_listed_in_any_case() {
        let headers = block(&[
            ("X-ZeroLayer-Observers", "audit"),
            ("x-zerolayer-", "empty suffix"),
            ("x-zerolayerx", "not reserved"),
            ("x-request-id", "1"),
        ]);
        let rules = rules();
        let request = HostRequest::new(&headers, &rules);
        let forbidden: Vec<_> = request.forbidden_headers().collect();
        assert_eq!(forbidden.len(), 2, "{forbidden:?}");
        assert!(
            forbidden
                .iter()
                .all(|n| n.to_ascii_lowercase().starts_with("x-zerolayer-"))
        );
    }

    #[test]
    fn facts_come_from_the_headers() {
        let headers = block(&[
            (":method", "POST"),
            (":path", "/v1/messages?beta=1"),
            ("user-agent", "anthropic-sdk"),
            ("x-tenant-id", "acme"),
            ("x-request-id", "req-1"),
        ]);
        let rules = rules();
        let request = HostRequest::new(&headers, &rules);
        assert_eq!(request.method(), b"POST");
        assert_eq!(request.path(), b"/v1/messages?beta=1");
        assert_eq!(request.header(0), Some(&b"anthropic-sdk"[..]));
        assert_eq!(request.tenant(), Some(&b"acme"[..]));
        assert_eq!(request.request_id(), Some(&b"req-1"[..]));
    }

    #[test]
    fn a_request_without_a_path_reads_as_the_root() {
        let headers = block(&[]);
        let rules = rules();
        let request = HostRequest::new(&headers, &rules);
        assert_eq!(request.path(), b"/");
        assert_eq!(request.method(), b"");
        assert_eq!(request.header(0), None);
    }

    #[test]
    fn the_published_tenant_replaces_the_header() {
        let headers = block(&[("x-tenant-id", "acme")]);
        let rules = rules();
        let mut request = HostRequest::new(&headers, &rules);
        request.set_tenant(b"unverified");
        assert_eq!(request.tenant(), Some(&b"unverified"[..]));
    }

    #[test]
    fn the_clock_is_zero_until_set() {
        let headers = block(&[]);
        let rules = rules();
        let mut request = HostRequest::new(&headers, &rules);
        assert_eq!(request.unix_seconds(), 0);
        request.set_now(1_700_000_000);
        assert_eq!(request.unix_seconds(), 1_700_000_000);
    }
}
