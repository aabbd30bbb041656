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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use zerolayer_core::config::Endpoint;
    use zerolayer_host::FakeHost;

    use super::{CallKind, Calls, Request};

    fn endpoint(authority: Option<&str>) -> Endpoint {
        Endpoint {
            cluster: "idp".into(),
            path: "/jwks.json".into(),
            authority: authority.map(str::to_string),
            timeout_ms: 250,
        }
    }

    fn pairs(headers: &[(String, String)]) -> Vec<(&str, &str)> {
        headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect()
    }

    #[test]
    fn a_request_carries_the_pseudo_headers_its_headers_body_and_the_endpoint_timeout() {
        let mut host = FakeHost::default();
        let mut calls = Calls::default();
        let endpoint = endpoint(None);
        let request = Request {
            headers: &[("x-api-key", b"sk-1")],
            body: Some(b"body"),
            ..Request::to(&endpoint, "POST")
        };
        assert!(
            calls
                .dispatch(&mut host, request, CallKind::CacheWrite)
                .is_ok()
        );
        let call = &host.dispatched[0];
        assert_eq!(call.cluster, "idp");
        assert_eq!(
            pairs(&call.headers),
            [
                (":method", "POST"),
                (":path", "/jwks.json"),
                (":authority", "idp"),
                ("x-api-key", "sk-1"),
            ]
        );
        assert_eq!(call.body.as_deref(), Some(&b"body"[..]));
        assert_eq!(call.timeout, Duration::from_millis(250));
    }

    #[test]
    fn a_request_path_and_a_configured_authority_win_over_the_defaults() {
        let mut host = FakeHost::default();
        let mut calls = Calls::default();
        let endpoint = endpoint(Some("idp.example.com"));
        let request = Request {
            path: Some("/other"),
            ..Request::to(&endpoint, "GET")
        };
        assert!(calls.dispatch(&mut host, request, CallKind::Jwks).is_ok());
        let call = &host.dispatched[0];
        assert_eq!(call.header(":path"), Some("/other"));
        assert_eq!(call.header(":authority"), Some("idp.example.com"));
        assert_eq!(call.body, None);
    }

    #[test]
    fn an_answer_s_token_gives_its_purpose_back_once() {
        let mut host = FakeHost::default();
        let mut calls = Calls::default();
        let endpoint = endpoint(None);
        assert!(!calls.jwks_in_flight());
        let request = Request::to(&endpoint, "GET");
        assert!(calls.dispatch(&mut host, request, CallKind::Jwks).is_ok());
        assert!(calls.jwks_in_flight());
        let token = host.dispatched[0].token;
        assert!(calls.take(token + 1).is_none(), "not our token");
        assert!(matches!(calls.take(token), Some(CallKind::Jwks)));
        assert!(calls.take(token).is_none(), "taken twice");
        assert!(!calls.jwks_in_flight());
    }

    #[test]
    fn a_refused_dispatch_gives_the_purpose_back_and_keeps_nothing() {
        let mut host = FakeHost::default();
        host.refuse_dispatch = true;
        let mut calls = Calls::default();
        let endpoint = endpoint(None);
        let request = Request::to(&endpoint, "GET");
        let refused = calls.dispatch(&mut host, request, CallKind::Jwks);
        assert!(matches!(refused, Err(CallKind::Jwks)));
        assert!(!calls.jwks_in_flight());
        assert!(host.dispatched.is_empty());
    }
}
