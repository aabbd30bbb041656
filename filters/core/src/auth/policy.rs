//! The hot path's decision for a request with a credential, as pure
//! functions over what the filter read from shared data. Lazy never means
//! open: an unknown credential is admitted unverified only within the
//! exposure bounds, and never when a synchronous check is called for.

use serde::Deserialize;

use super::verdict::{Lookup, Verdict};

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

/// First step: what the verdict cache and the request's facts decide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// A valid verdict: continue as its tenant and subject.
    Allow(Verdict),
    /// An invalid verdict: 401 at once.
    Deny(Verdict),
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
    /// Routes a request from the verdict lookup and the request's facts.
    /// `inline_ok`: this credential can be verified inside the filter (a
    /// JWT whose key is at hand), so a down verifier does not matter.
    pub fn route(
        &self,
        lookup: &Lookup,
        escalated: bool,
        trusted_client: bool,
        inline_ok: bool,
        verifier_down: bool,
    ) -> Route {
        match lookup {
            Lookup::Valid(v) => return Route::Allow(v.clone()),
            Lookup::Invalid(v) => return Route::Deny(v.clone()),
            Lookup::Unknown => {}
        }
        if trusted_client && inline_ok {
            return Route::Sync(SyncReason::TrustedClient);
        }
        let forced = if escalated {
            Some(SyncReason::Escalated)
        } else if self.unknown == UnknownPolicy::Sync {
            Some(SyncReason::Policy)
        } else {
            None
        };
        if let Some(reason) = forced {
            if verifier_down && !inline_ok {
                return Route::Unavailable;
            }
            return Route::Sync(reason);
        }
        if verifier_down && !inline_ok && self.on_verifier_down == VerifierDown::Deny {
            return Route::Unavailable;
        }
        Route::TryLazy
    }

    /// Admits an unknown credential lazily if this request (the
    /// `unverified_count`-th of the credential), the pending jobs and the
    /// lazy-admission buckets stay within the bounds. `take_budget` takes
    /// one admission from the buckets (false: one is empty); it is called
    /// only when the other bounds hold, so a request verified synchronously
    /// for another reason spends no one's budget.
    pub fn admit(
        &self,
        unverified_count: u32,
        pending: u64,
        inline_ok: bool,
        verifier_down: bool,
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
            Some(_) if verifier_down && !inline_ok => Admission::Unavailable,
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

    fn verdict(valid: bool) -> Verdict {
        Verdict {
            hash: [0; 32],
            valid,
            expires_at: 10,
            tenant: None,
            subject: None,
            reason: String::new(),
            verified_at: 0,
        }
    }

    #[test]
    fn cached_verdicts_decide_first_whatever_else_holds() {
        let p = Policy {
            unknown: UnknownPolicy::Sync,
            ..policy()
        };
        for (escalated, trusted, down) in [(true, true, true), (false, false, false)] {
            assert!(matches!(
                p.route(
                    &Lookup::Valid(verdict(true)),
                    escalated,
                    trusted,
                    false,
                    down
                ),
                Route::Allow(_)
            ));
            assert!(matches!(
                p.route(
                    &Lookup::Invalid(verdict(false)),
                    escalated,
                    trusted,
                    false,
                    down
                ),
                Route::Deny(_)
            ));
        }
    }

    #[test]
    fn routing_unknown_credentials() {
        let p = policy();
        let u = &Lookup::Unknown;
        // (escalated, trusted, inline_ok, verifier_down) → route
        let cases = [
            ((false, false, false, false), Route::TryLazy),
            (
                (false, true, true, false),
                Route::Sync(SyncReason::TrustedClient),
            ),
            // Trusted clients are verified inline only when a key is at hand.
            ((false, true, false, false), Route::TryLazy),
            (
                (true, false, false, false),
                Route::Sync(SyncReason::Escalated),
            ),
            ((true, false, false, true), Route::Unavailable),
            (
                (true, false, true, true),
                Route::Sync(SyncReason::Escalated),
            ),
            ((false, false, false, true), Route::TryLazy),
        ];
        for ((e, t, i, d), want) in cases {
            assert_eq!(
                p.route(u, e, t, i, d),
                want,
                "escalated={e} trusted={t} inline={i} down={d}"
            );
        }
        let sync = Policy {
            unknown: UnknownPolicy::Sync,
            ..policy()
        };
        assert_eq!(
            sync.route(u, false, false, false, false),
            Route::Sync(SyncReason::Policy)
        );
        let deny = Policy {
            on_verifier_down: VerifierDown::Deny,
            ..policy()
        };
        assert_eq!(deny.route(u, false, false, false, true), Route::Unavailable);
        assert_eq!(deny.route(u, false, false, true, true), Route::TryLazy);
    }

    #[test]
    fn admission_respects_every_bound() {
        let p = policy();
        let ok = || true;
        assert_eq!(p.admit(1, 0, false, false, ok), Admission::Lazy);
        assert_eq!(
            p.admit(2, 0, false, false, ok),
            Admission::Sync(SyncReason::ExposureBound)
        );
        assert_eq!(
            p.admit(1, 100, false, false, ok),
            Admission::Sync(SyncReason::PendingBound)
        );
        assert_eq!(p.admit(1, 99, false, true, ok), Admission::Lazy);
        assert_eq!(p.admit(2, 0, false, true, ok), Admission::Unavailable);
        assert_eq!(
            p.admit(2, 0, true, true, ok),
            Admission::Sync(SyncReason::ExposureBound)
        );
        // An empty bucket: verify now (or refuse while the verifier is down).
        assert_eq!(
            p.admit(1, 0, false, false, || false),
            Admission::Sync(SyncReason::Budget)
        );
        assert_eq!(p.admit(1, 0, false, true, || false), Admission::Unavailable);
        // The buckets are not touched when another bound already says no.
        let untouched = || panic!("budget taken although the request is over a bound");
        assert_eq!(
            p.admit(2, 0, false, false, untouched),
            Admission::Sync(SyncReason::ExposureBound)
        );
        let never_lazy = Policy {
            max_unverified_per_token: 0,
            ..policy()
        };
        assert_eq!(
            never_lazy.admit(1, 0, false, false, ok),
            Admission::Sync(SyncReason::ExposureBound)
        );
    }
}
