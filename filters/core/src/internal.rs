//! Names zerolayer's filters use between themselves. One place, so every
//! filter strips, writes and reads exactly the same ones.
//!
//! Filters hand results to later filters of the same request through a
//! *property* whose path is a single segment starting with `wasmx.`:
//! - Envoy stores it as per-stream filter state (`wasm.wasmx.…`), readable by
//!   later Wasm filters, by `%FILTER_STATE(…)%` in access logs and by route
//!   header formatters; it never becomes a header, so it cannot leak upstream.
//! - ngx_wasm_module joins path segments with dots and keeps `wasmx.*` host
//!   properties per request, shared by the filter chain.
//! - Kong Gateway builds ngx_wasm_module with the host namespace `kong`:
//!   there the same values go to `kong.ctx.shared.<name>`
//!   ([`kong_handoff_path`]); `zerolayer_host::WasmHost` picks the namespace per host.
//! - host-sim implements all three.
//!
//! A two-segment path (`["wasmx", "x"]`) does not round-trip in Envoy, which is
//! why the dot is inside the one segment.

/// Prefix of the hand-off properties (`wasmx.zerolayer_*`).
pub const HANDOFF_PREFIX: &str = "wasmx.";

/// Kong Gateway builds ngx_wasm_module with the host-property namespace
/// `kong`: there `wasmx.*` is no host property, and per-request values live
/// in `kong.ctx.shared.*` (readable by Kong's Lua plugins and log formats).
pub const KONG_HANDOFF_PREFIX: &str = "kong.ctx.shared.";

/// A property only Kong Gateway answers: how a filter learns which of the
/// two hand-off namespaces its host has.
pub const KONG_VERSION_PROPERTY: &str = "kong.version";

/// A property only ngx_wasm_module answers (the nginx variable
/// `$nginx_version`, from a request context): how a filter learns that its
/// host runs the request body after every filter's request headers.
pub const NGX_VERSION_PROPERTY: &str = "ngx.nginx_version";

/// `path` (a `wasmx.*` hand-off property) as Kong Gateway names it.
pub fn kong_handoff_path(path: &str) -> Option<String> {
    path.strip_prefix(HANDOFF_PREFIX)
        .map(|name| format!("{KONG_HANDOFF_PREFIX}{name}"))
}

/// Property holding the activation decision as a comma list of observer names.
pub const OBSERVERS_PROPERTY: &str = "wasmx.zerolayer_observers";

/// Envoy filter-state key of [`OBSERVERS_PROPERTY`] (for access logs).
pub const OBSERVERS_FILTER_STATE: &str = "wasm.wasmx.zerolayer_observers";

/// Property: how the request was authenticated, with the tenant and
/// subject (`verified tenant=acme subject=user-1`, `unverified
/// tenant=<claimed>`, `public`); see `crate::auth::identity`.
pub const AUTH_PROPERTY: &str = "wasmx.zerolayer_auth";

/// Property: the credential of a request lazy-auth admitted before it was
/// verified (`crate::auth::attribution::PendingCredential`), so metering
/// can bill the request to the tenant verification finds. Set for those
/// requests only; never logged.
pub const CREDENTIAL_PROPERTY: &str = "wasmx.zerolayer_credential";

/// Property: the request's usage as metering recorded it (a JSON object,
/// see `crate::metering::UsageRecord::log_entry`), for the access log.
pub const USAGE_PROPERTY: &str = "wasmx.zerolayer_usage";

/// The nginx variable metering also sets, in ngx_wasm_module, to the
/// request's usage entry: nginx's `log_format` cannot name `wasmx.*`
/// properties, but it can log `$zerolayer_usage` once the operator declares
/// it (`set $zerolayer_usage "";`), which gives plain nginx deployments the
/// exact per-request log that reconciliation needs.
pub const USAGE_NGX_VARIABLE: &str = "ngx.zerolayer_usage";

/// Property: quota cut this `stream: hard` response, and this is what the
/// client was billed for it (`input output cache_read cache_creation`, in
/// metering's [`crate::usage::Usage`] meaning; see
/// `crate::quota::cut::encode_billed`). Metering, which sees the response
/// before quota (Envoy's response order, and the fused chain's), records
/// this usage instead of the backend's, so its record is what was billed.
pub const CUT_USAGE_PROPERTY: &str = "wasmx.zerolayer_cut_usage";

/// Property: what quota decided against the request, for the access log
/// (the audit of each refusal and cut): `refused policy=<name>
/// reason=<label>`, or `cut` (a hard stream ended at its limit); absent
/// when it was admitted whole.
pub const QUOTA_PROPERTY: &str = "wasmx.zerolayer_quota";

/// The filter state the access log reads quota's decision from (Envoy
/// prefixes `wasm.` to a Wasm filter's properties).
pub const QUOTA_FILTER_STATE: &str = "wasm.wasmx.zerolayer_quota";

/// Property: a filter paused this request's body step for a callout
/// (`1`). Published only where a body replaced after such a pause reaches
/// the upstream cut to its old length (ngx_wasm_module's separate filters):
/// the filters after it then leave the body as it is.
pub const BODY_WAITED_PROPERTY: &str = "wasmx.zerolayer_body_waited";

/// Property: metering asked the backend for OpenAI's usage chunk and hides
/// it from the client (`1`). Published only where the host runs response
/// phases in chain order (ngx_wasm_module's separate filters), so that
/// post-cache, which then sees the response before metering, stores what
/// the client gets.
pub const USAGE_HIDDEN_PROPERTY: &str = "wasmx.zerolayer_usage_hidden";

/// Envoy filter-state key of [`USAGE_PROPERTY`] (for access logs).
pub const USAGE_FILTER_STATE: &str = "wasm.wasmx.zerolayer_usage";

/// Response header carrying the decision when the operator enables debugging.
pub const DEBUG_RESPONSE_HEADER: &str = "x-zerolayer-debug";

/// Prefix of every header name zerolayer reserves. A client-sent request
/// header with it is removed by the first zerolayer filter, so no client can
/// impersonate a decision, whatever name a later version adds.
pub const INTERNAL_HEADER_PREFIX: &str = "x-zerolayer-";

/// Whether `name` is one of zerolayer's reserved header names (any case).
pub fn is_internal_header(name: impl AsRef<[u8]>) -> bool {
    name.as_ref()
        .get(..INTERNAL_HEADER_PREFIX.len())
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(INTERNAL_HEADER_PREFIX.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kong_names_the_hand_off_under_its_shared_context() {
        assert_eq!(
            kong_handoff_path(USAGE_PROPERTY).as_deref(),
            Some("kong.ctx.shared.zerolayer_usage")
        );
        assert_eq!(kong_handoff_path("request.path"), None);
    }

    #[test]
    fn internal_header_names() {
        assert!(is_internal_header("x-zerolayer-observers"));
        assert!(is_internal_header("X-ZeroLayer-Anything"));
        assert!(is_internal_header(DEBUG_RESPONSE_HEADER));
        assert!(!is_internal_header("x-zerolayer"));
        assert!(!is_internal_header("x-request-id"));
        assert!(!is_internal_header("é"));
    }
}
