//! The request as the rule engine sees it, read from the host once.

use std::cell::Cell;
use std::time::UNIX_EPOCH;

use proxy_wasm::hostcalls;
use zerolayer_core::activation::{HeaderSlot, RequestFacts, RuleSet};
use zerolayer_core::internal::is_internal_header;

/// Header map pairs as the SDK returns them.
type Pairs = [(String, Vec<u8>)];

/// A request's headers, fetched with one host call (one call is cheaper
/// than a call per header the rules read; in the fused filter, the stages'
/// shared copy), indexed for the rules.
pub(crate) struct HostRequest<'h> {
    headers: &'h Pairs,
    /// `slots[s]`: index in `headers` of the header in rule slot `s`.
    slots: Vec<Option<usize>>,
    path: Option<usize>,
    method: Option<usize>,
    tenant: Option<usize>,
    request_id: Option<usize>,
    now: Cell<Option<i64>>,
}

impl<'h> HostRequest<'h> {
    /// Indexes `headers` (the request's) for the ones `rules` use.
    pub(crate) fn new(headers: &'h Pairs, rules: &RuleSet) -> Self {
        let find = |name: &str| {
            headers
                .iter()
                .position(|(n, _)| n.eq_ignore_ascii_case(name))
        };
        let slots = rules.header_names().iter().map(|name| find(name)).collect();
        HostRequest {
            slots,
            path: find(":path"),
            method: find(":method"),
            tenant: find(rules.tenant_header()),
            request_id: find("x-request-id"),
            now: Cell::new(None),
            headers,
        }
    }

    /// Names of zerolayer-internal headers the client sent.
    pub(crate) fn forbidden_headers(&self) -> impl Iterator<Item = &'h str> {
        self.headers
            .iter()
            .map(|(name, _)| name.as_str())
            .filter(|name| is_internal_header(name))
    }

    fn value(&self, index: Option<usize>) -> Option<&'h [u8]> {
        index
            .and_then(|i| self.headers.get(i))
            .map(|(_, v)| v.as_slice())
    }
}

impl RequestFacts for HostRequest<'_> {
    fn header(&self, slot: HeaderSlot) -> Option<&[u8]> {
        self.value(self.slots.get(slot).copied().flatten())
    }

    fn path(&self) -> &[u8] {
        self.value(self.path).unwrap_or(b"/")
    }

    fn method(&self) -> &[u8] {
        self.value(self.method).unwrap_or(b"")
    }

    fn tenant(&self) -> Option<&[u8]> {
        self.value(self.tenant)
    }

    fn request_id(&self) -> Option<&[u8]> {
        self.value(self.request_id)
    }

    fn unix_seconds(&self) -> i64 {
        if let Some(now) = self.now.get() {
            return now;
        }
        // Only rules with `hours`/`weekdays` ask, so only they pay the call.
        let now = hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_secs() as i64);
        self.now.set(Some(now));
        now
    }
}
