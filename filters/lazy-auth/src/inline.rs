//! Keys for synchronous, in-filter JWT verification: the configured ones
//! plus the JWKS the observer last fetched (read from shared data, parsed
//! again only when it changed).

use std::cell::{Cell, RefCell};

use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::auth::jwt::KeySet;
use zerolayer_host::Host;
use zerolayer_observer::auth::{JWKS_KEY, configured_keys};

/// Configured keys and the cached JWKS.
pub(crate) struct InlineKeys {
    configured: KeySet,
    uses_jwks: bool,
    current: RefCell<(Option<u32>, KeySet)>,
}

impl InlineKeys {
    pub(crate) fn new(config: &LazyAuthConfig) -> Result<InlineKeys, String> {
        let configured = configured_keys(config)?;
        Ok(InlineKeys {
            current: RefCell::new((None, configured.clone())),
            configured,
            uses_jwks: config.jwt.jwks.is_some(),
        })
    }

    /// Whether any key is at hand right now (without reading shared data
    /// when only configured keys are used).
    pub(crate) fn available(&self, host: &mut impl Host) -> bool {
        if !self.uses_jwks {
            return !self.configured.is_empty();
        }
        self.refresh(host);
        !self.current.borrow().1.is_empty()
    }

    /// Runs `f` with the current keys.
    pub(crate) fn with<T>(&self, host: &mut impl Host, f: impl FnOnce(&KeySet) -> T) -> T {
        if self.uses_jwks {
            self.refresh(host);
        }
        f(&self.current.borrow().1)
    }

    fn refresh(&self, host: &mut impl Host) {
        let (bytes, cas) = host.shared_get(JWKS_KEY);
        if cas.is_none() || cas == self.current.borrow().0 {
            return;
        }
        let mut keys = self.configured.clone();
        if let Some(parsed) = bytes.and_then(|b| KeySet::from_jwks(&b).ok()) {
            keys.merge(parsed.keys);
        }
        *self.current.borrow_mut() = (cas, keys);
    }
}

/// JWKS fetches made from requests while no key is at hand (a restart or
/// reload, before the observer's first fetch): at most
/// [`MAX_REQUEST_JWKS_FETCHES`] in flight per VM, and none for
/// [`REQUEST_JWKS_RETRY_MS`] after one failed, so a down identity provider
/// sees at most that many calls per VM per interval.
#[derive(Default)]
pub(crate) struct RequestJwksFetches {
    in_flight: Cell<u32>,
    closed_until_ms: Cell<u64>,
}

/// JWKS fetches a VM's requests may have in flight at once.
pub(crate) const MAX_REQUEST_JWKS_FETCHES: u32 = 4;

/// After a failed request-path fetch, the VM's requests wait this long
/// before fetching again (refused 503 meanwhile, as without keys).
pub(crate) const REQUEST_JWKS_RETRY_MS: u64 = 1_000;

impl RequestJwksFetches {
    /// Takes a slot for one fetch, if one is free and fetching is open.
    pub(crate) fn start(&self, now_ms: u64) -> bool {
        if now_ms < self.closed_until_ms.get() || self.in_flight.get() >= MAX_REQUEST_JWKS_FETCHES {
            return false;
        }
        self.in_flight.set(self.in_flight.get() + 1);
        true
    }

    /// Gives the slot back; a failure closes fetching for a while.
    pub(crate) fn finished(&self, ok: bool, now_ms: u64) {
        self.in_flight.set(self.in_flight.get().saturating_sub(1));
        if !ok {
            self.closed_until_ms.set(now_ms + REQUEST_JWKS_RETRY_MS);
        }
    }
}

/// Inline verification keys: the JWKS the observer stores in shared data.
#[cfg(test)]
mod tests {
    use serde_json::json;
    use zerolayer_host::{Action, FakeHost, Host};
    use zerolayer_observer::auth::JWKS_KEY;

    use crate::testkit::{
        claims, configured, ec_key, host_with_observer, identity, jwk, jwt, jwts, request,
    };

    /// JWTs verified synchronously with keys from a JWKS endpoint.
    fn config(extra_keys: serde_json::Value) -> String {
        jwts(json!({
            "unknown": "sync",
            "jwt": {"jwks": {"cluster": "idp", "path": "/jwks"}, "keys": extra_keys},
        }))
    }

    fn publish_jwks(host: &mut FakeHost, keys: serde_json::Value) {
        assert!(host.shared_put(JWKS_KEY, json!({ "keys": keys }).to_string().as_bytes()));
    }

    fn bearer(token: &str) -> String {
        format!("Bearer {token}")
    }

    #[test]
    fn without_a_fetched_jwks_a_jwt_is_refused_503_when_it_cannot_fetch_one() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &config(json!([])));
        let token = bearer(&jwt(&ec_key(1), "k1", claims("acme")));
        // The request fetches the JWKS itself (decide.rs's tests); here the
        // identity provider's cluster is unknown.
        host.refuse_dispatch = true;
        let (_, action) = request(&root, &mut host, &[("authorization", &token)]);
        assert_eq!(action, Action::Pause);
        assert_eq!(host.sent[0].status, 503);
    }

    #[test]
    fn a_jwt_verifies_with_the_jwks_in_shared_data() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &config(json!([])));
        let key = ec_key(1);
        publish_jwks(&mut host, json!([jwk(&key, "k1")]));
        let token = bearer(&jwt(&key, "k1", claims("acme")));
        let (_, action) = request(&root, &mut host, &[("authorization", &token)]);
        assert_eq!(action, Action::Continue);
        assert_eq!(
            identity(&host).as_deref(),
            Some("verified tenant=acme subject=user-1")
        );
    }

    #[test]
    fn a_rotated_jwks_is_read_again() {
        let mut host = host_with_observer();
        let root = configured(&mut host, &config(json!([])));
        let (old, new) = (ec_key(1), ec_key(2));
        publish_jwks(&mut host, json!([jwk(&old, "k1")]));
        let first = bearer(&jwt(&old, "k1", claims("acme")));
        assert_eq!(
            request(&root, &mut host, &[("authorization", &first)]).1,
            Action::Continue
        );
        // The observer fetched a new JWKS: the old key is gone, a new one came.
        publish_jwks(&mut host, json!([jwk(&new, "k2")]));
        let rotated = bearer(&jwt(&new, "k2", claims("acme")));
        assert_eq!(
            request(&root, &mut host, &[("authorization", &rotated)]).1,
            Action::Continue
        );
        host.sent.clear();
        let stale = bearer(&jwt(&old, "k1", claims("globex")));
        assert_eq!(
            request(&root, &mut host, &[("authorization", &stale)]).1,
            Action::Pause
        );
        assert_eq!(host.sent[0].status, 401);
    }

    #[test]
    fn configured_keys_stay_beside_the_jwks() {
        let mut host = host_with_observer();
        let configured_key = ec_key(3);
        let root = configured(&mut host, &config(json!([jwk(&configured_key, "local")])));
        // Before any JWKS is fetched the configured key verifies alone.
        let local = bearer(&jwt(&configured_key, "local", claims("acme")));
        assert_eq!(
            request(&root, &mut host, &[("authorization", &local)]).1,
            Action::Continue
        );
        let fetched = ec_key(1);
        publish_jwks(&mut host, json!([jwk(&fetched, "k1")]));
        for (key, kid, tenant) in [
            (&configured_key, "local", "globex"),
            (&fetched, "k1", "initech"),
        ] {
            let token = bearer(&jwt(key, kid, claims(tenant)));
            assert_eq!(
                request(&root, &mut host, &[("authorization", &token)]).1,
                Action::Continue,
                "{kid}"
            );
        }
        assert!(host.sent.is_empty());
    }

    #[test]
    fn an_unreadable_jwks_leaves_the_configured_keys() {
        let mut host = host_with_observer();
        let configured_key = ec_key(3);
        let root = configured(&mut host, &config(json!([jwk(&configured_key, "local")])));
        assert!(host.shared_put(JWKS_KEY, b"<html>not a JWKS</html>"));
        let local = bearer(&jwt(&configured_key, "local", claims("acme")));
        assert_eq!(
            request(&root, &mut host, &[("authorization", &local)]).1,
            Action::Continue
        );
    }
}
