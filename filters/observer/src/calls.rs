//! Callouts the observer has in flight, by token.

use std::collections::HashMap;
use std::time::Duration;

use zerolayer_core::config::Endpoint;
use zerolayer_host::Host;
use zerolayer_core::event::VerifyJob;

use crate::shipper::Sink;

/// What a callout was for.
pub(crate) enum CallKind {
    /// A JWKS fetch.
    Jwks,
    /// An API key introspection for this job.
    Introspect(VerifyJob),
    /// A batch of JSON lines for a sink (kept to requeue on failure).
    Batch(Sink, Vec<(u64, Vec<u8>)>),
    /// A cache entry written to the fleet tier.
    CacheWrite,
}

/// Callouts in flight.
#[derive(Default)]
pub(crate) struct Calls {
    pending: HashMap<u32, CallKind>,
}

impl Calls {
    /// Dispatches a request to `endpoint`; on refusal (unknown cluster, bad
    /// arguments) logs and gives the payload back.
    pub(crate) fn dispatch(
        &mut self,
        host: &mut impl Host,
        endpoint: &Endpoint,
        method: &str,
        extra_headers: &[(&str, &[u8])],
        body: Option<&[u8]>,
        kind: CallKind,
    ) -> Result<(), CallKind> {
        self.dispatch_to(host, endpoint, &endpoint.path, method, extra_headers, body, kind)
    }

    /// Like [`Calls::dispatch`], to `path` instead of the endpoint's own.
    pub(crate) fn dispatch_to(
        &mut self,
        host: &mut impl Host,
        endpoint: &Endpoint,
        path: &str,
        method: &str,
        extra_headers: &[(&str, &[u8])],
        body: Option<&[u8]>,
        kind: CallKind,
    ) -> Result<(), CallKind> {
        let mut headers: Vec<(&str, &[u8])> = vec![
            (":method", method.as_bytes()),
            (":path", path.as_bytes()),
            (":authority", endpoint.authority().as_bytes()),
        ];
        headers.extend_from_slice(extra_headers);
        // The SDK takes &str header values; credentials are ASCII tokens.
        let text: Vec<(&str, String)> = headers
            .iter()
            .map(|(k, v)| (*k, String::from_utf8_lossy(v).into_owned()))
            .collect();
        let borrowed: Vec<(&str, &str)> = text.iter().map(|(k, v)| (*k, v.as_str())).collect();
        match host.dispatch(
            &endpoint.cluster,
            &borrowed,
            body,
            Duration::from_millis(u64::from(endpoint.timeout_ms)),
        ) {
            Ok(token) => {
                self.pending.insert(token, kind);
                Ok(())
            }
            Err(status) => {
                log::warn!(
                    "observer: cannot call cluster {} ({path}): {status:?}",
                    endpoint.cluster,
                );
                Err(kind)
            }
        }
    }

    /// The purpose of `token`, if it is one of ours.
    pub(crate) fn take(&mut self, token: u32) -> Option<CallKind> {
        self.pending.remove(&token)
    }

    /// Whether a JWKS fetch is in flight.
    pub(crate) fn jwks_in_flight(&self) -> bool {
        self.pending.values().any(|k| matches!(k, CallKind::Jwks))
    }
}
