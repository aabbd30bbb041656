//! Callouts the observer has in flight, by token.

use std::collections::HashMap;
use std::time::Duration;

use zerolayer_core::config::Endpoint;
use zerolayer_core::event::VerifyJob;
use zerolayer_host::Host;

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

/// A request to an endpoint, as the observer sends it.
pub(crate) struct Request<'a> {
    /// Where it goes (cluster, authority, timeout; the path by default).
    pub endpoint: &'a Endpoint,
    /// `:method`.
    pub method: &'a str,
    /// `:path`, when not the endpoint's own.
    pub path: Option<&'a str>,
    /// Headers besides the pseudo-headers.
    pub headers: &'a [(&'a str, &'a [u8])],
    /// The body.
    pub body: Option<&'a [u8]>,
}

impl<'a> Request<'a> {
    /// `method` to `endpoint`'s path, no headers, no body.
    pub(crate) fn to(endpoint: &'a Endpoint, method: &'a str) -> Request<'a> {
        Request {
            endpoint,
            method,
            path: None,
            headers: &[],
            body: None,
        }
    }
}

impl Calls {
    /// Dispatches `request`, remembering `kind` for its answer; on refusal
    /// (unknown cluster, bad arguments) logs and gives `kind` back.
    pub(crate) fn dispatch(
        &mut self,
        host: &mut impl Host,
        request: Request<'_>,
        kind: CallKind,
    ) -> Result<(), CallKind> {
        let endpoint = request.endpoint;
        let path = request.path.unwrap_or(&endpoint.path);
        let mut headers: Vec<(&str, &[u8])> = vec![
            (":method", request.method.as_bytes()),
            (":path", path.as_bytes()),
            (":authority", endpoint.authority().as_bytes()),
        ];
        headers.extend_from_slice(request.headers);
        // The host takes text header values; credentials are ASCII tokens.
        let text: Vec<(&str, String)> = headers
            .iter()
            .map(|(k, v)| (*k, String::from_utf8_lossy(v).into_owned()))
            .collect();
        let borrowed: Vec<(&str, &str)> = text.iter().map(|(k, v)| (*k, v.as_str())).collect();
        match host.dispatch(
            &endpoint.cluster,
            &borrowed,
            request.body,
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
