//! Keys for synchronous, in-filter JWT verification: the configured ones
//! plus the JWKS the observer last fetched (read from shared data, parsed
//! again only when it changed).

use std::cell::RefCell;

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
