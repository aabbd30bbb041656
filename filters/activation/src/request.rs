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
            .filter_map(|(name, _)| std::str::from_utf8(name).ok())
            .filter(|name| is_internal_header(name))
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
