//! The hot path's decision for a request with a credential, as pure
//! functions over what the filter read from shared data. Lazy never means
//! open: an unknown credential is admitted unverified only within the
//! exposure bounds, and never when a synchronous check is called for.

use serde::Deserialize;

/// What to do with credentials nobody has verified yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum UnknownPolicy {
    /// Admit within the exposure bounds, verify off the request path.
    #[default]
    Lazy,
    /// Verify before the request continues.
    Sync,
}

/// What to do with unknown credentials while the verifier is down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum VerifierDown {
    /// Refuse them at once (503).
    Deny,
    /// Admit them lazily within the exposure bounds, then refuse.
    #[default]
    AllowLazy,
}

/// The operator's choices that shape decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Default treatment of unknown credentials.
    pub unknown: UnknownPolicy,
    /// Requests one credential may make unverified (0: never lazy).
    pub max_unverified_per_token: u32,
    /// Verifications that may be pending at once before new credentials
    /// are verified synchronously.
    pub max_pending: u64,
    /// Treatment of unknown credentials while the verifier is down.
    pub on_verifier_down: VerifierDown,
}

crate::labels! {
    /// Why verification happens on the request path (the label of
    /// `zerolayer_auth_sync{reason=…}` and the audit records' reason).
    pub enum SyncReason {
        /// `unknown: sync` in the configuration.
        Policy => "policy",
        /// The credential's tenant fails too often: escalated.
        Escalated => "escalated",
        /// A trusted client (user-agent pattern): verified inline with cached keys.
        TrustedClient => "trusted_client",
        /// The credential used up its unverified requests.
        ExposureBound => "exposure_bound",
        /// Too many verifications pending.
        PendingBound => "pending_bound",
        /// A lazy-admission bucket (gateway, claimed tenant or client address)
        /// is empty: the gateway-wide bound on unverified admissions.
        Budget => "lazy_budget",
    }
}

/// How an unknown credential could be verified on the request path now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncCheck {
    /// Inside the filter (a JWT whose key is at hand): the verifier's
    /// health does not matter.
    Inline,
    /// By the verifier, which is up.
    Verifier,
    /// Only by the verifier, which is down.
    Unavailable,
}

/// The facts that route a credential nothing is cached for (a cached
/// verdict decides before any of them is read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unknown {
    /// Its claimed tenant, "no tenant" or the whole gateway is escalated.
    pub escalated: bool,
    /// The client is trusted (its user-agent matches a configured pattern).
    pub trusted_client: bool,
    /// How it could be verified now.
    pub check: SyncCheck,
}

/// First step for an unknown credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Verify now, on the request path.
    Sync(SyncReason),
    /// Count the request against the credential's exposure, then [`Policy::admit`].
    TryLazy,
    /// The verifier is down and the policy refuses unknown credentials: 503.
    Unavailable,
}

/// Second step for [`Route::TryLazy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Continue unverified; a verification job goes to the observer.
    Lazy,
    /// Verify now.
    Sync(SyncReason),
    /// Refuse (503): the verifier is down and the bounds are used.
    Unavailable,
}

impl Policy {
    /// Routes an unknown credential: a trusted client whose credential can
    /// be checked inline, an escalation or `unknown: sync` verify it now
    /// (503 if that needs the verifier and it is down); otherwise it may
    /// be admitted lazily, unless the verifier is down and the policy denies.
    pub fn route(&self, unknown: Unknown) -> Route {
        let Unknown {
            escalated,
            trusted_client,
            check,
        } = unknown;
        if trusted_client && check == SyncCheck::Inline {
            return Route::Sync(SyncReason::TrustedClient);
        }
        let forced = if escalated {
            Some(SyncReason::Escalated)
        } else if self.unknown == UnknownPolicy::Sync {
            Some(SyncReason::Policy)
        } else {
            None
        };
        match (forced, check) {
            (Some(_), SyncCheck::Unavailable) => Route::Unavailable,
            (Some(reason), _) => Route::Sync(reason),
            (None, SyncCheck::Unavailable) if self.on_verifier_down == VerifierDown::Deny => {
                Route::Unavailable
            }
            (None, _) => Route::TryLazy,
        }
    }

    /// Admits an unknown credential lazily if this request (the
    /// `unverified_count`-th of the credential), the pending jobs and the
    /// lazy-admission buckets stay within the bounds. `take_budget` takes
    /// one admission from the buckets (false: one is empty); it is called
    /// only when the other bounds hold, so a request verified synchronously
    /// for another reason spends no one's budget. Past a bound the
    /// credential is verified now, or refused (503) if that needs the
    /// verifier and it is down.
    pub fn admit(
        &self,
        unverified_count: u32,
        pending: u64,
        check: SyncCheck,
        take_budget: impl FnOnce() -> bool,
    ) -> Admission {
        let over = if unverified_count > self.max_unverified_per_token {
            Some(SyncReason::ExposureBound)
        } else if pending >= self.max_pending {
            Some(SyncReason::PendingBound)
        } else if !take_budget() {
            Some(SyncReason::Budget)
        } else {
            None
        };
        match over {
            None => Admission::Lazy,
            Some(_) if check == SyncCheck::Unavailable => Admission::Unavailable,
            Some(reason) => Admission::Sync(reason),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy {
            unknown: UnknownPolicy::Lazy,
            max_unverified_per_token: 1,
            max_pending: 100,
            on_verifier_down: VerifierDown::AllowLazy,
        }
    }

    #[test]
    fn routing_unknown_credentials() {
        let p = policy();
        let unknown = |escalated, trusted_client, check| Unknown {
            escalated,
            trusted_client,
            check,
        };
        use SyncCheck::{Inline, Unavailable, Verifier};
        let cases = [
            (unknown(false, false, Verifier), Route::TryLazy),
            (
                unknown(false, true, Inline),
                Route::Sync(SyncReason::TrustedClient),
            ),
            // Trusted clients are verified inline only when a key is at hand.
            (unknown(false, true, Verifier), Route::TryLazy),
            (
                unknown(true, false, Verifier),
                Route::Sync(SyncReason::Escalated),
            ),
            (unknown(true, false, Unavailable), Route::Unavailable),
            (
                unknown(true, false, Inline),
                Route::Sync(SyncReason::Escalated),
            ),
            (unknown(false, false, Unavailable), Route::TryLazy),
        ];
        for (facts, want) in cases {
            assert_eq!(p.route(facts), want, "{facts:?}");
        }
        let sync = Policy {
            unknown: UnknownPolicy::Sync,
            ..policy()
        };
        assert_eq!(
            sync.route(unknown(false, false, Verifier)),
            Route::Sync(SyncReason::Policy)
        );
        let deny = Policy {
            on_verifier_down: VerifierDown::Deny,
            ..policy()
        };
        assert_eq!(
            deny.route(unknown(false, false, Unavailable)),
            Route::Unavailable
        );
        assert_eq!(deny.route(unknown(false, false, Inline)), Route::TryLazy);
    }

    #[test]
    fn admission_respects_every_bound() {
        use SyncCheck::{Inline, Unavailable, Verifier};
        let p = policy();
        let ok = || true;
        assert_eq!(p.admit(1, 0, Verifier, ok), Admission::Lazy);
        assert_eq!(
            p.admit(2, 0, Verifier, ok),
            Admission::Sync(SyncReason::ExposureBound)
        );
        assert_eq!(
            p.admit(1, 100, Verifier, ok),
            Admission::Sync(SyncReason::PendingBound)
        );
        assert_eq!(p.admit(1, 99, Unavailable, ok), Admission::Lazy);
        assert_eq!(p.admit(2, 0, Unavailable, ok), Admission::Unavailable);
        assert_eq!(
            p.admit(2, 0, Inline, ok),
            Admission::Sync(SyncReason::ExposureBound)
        );
        // An empty bucket: verify now (or refuse while the verifier is down).
        assert_eq!(
            p.admit(1, 0, Verifier, || false),
            Admission::Sync(SyncReason::Budget)
        );
        assert_eq!(p.admit(1, 0, Unavailable, || false), Admission::Unavailable);
        // The buckets are not touched when another bound already says no.
        let untouched = || panic!("budget taken although the request is over a bound");
        assert_eq!(
            p.admit(2, 0, Verifier, untouched),
            Admission::Sync(SyncReason::ExposureBound)
        );
        let never_lazy = Policy {
            max_unverified_per_token: 0,
            ..policy()
        };
        assert_eq!(
            never_lazy.admit(1, 0, Verifier, ok),
            Admission::Sync(SyncReason::ExposureBound)
        );
    }
}
