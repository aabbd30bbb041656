//! Requests admitted before their credential was verified (lazy-auth's
//! lazy admission), settled to the tenant the verification found.
//!
//! Such a request is `unverified` when it is admitted, so it reserves from
//! the `unverified` budget only (a claim never spends a tenant's), and it
//! settles there when its response ends. Its credential's verdict then
//! decides whether its usage is also the tenant's:
//! - valid: the usage is charged to the verified identity's policies
//!   (tenant and subject from the verdict, the rest of the scope from the
//!   request), as a verified request's would have been, with no
//!   reservation: any excess is debt;
//! - invalid: `unverified`'s alone, for good;
//! - not known yet (a response faster than the verification): the charge
//!   waits here (no reservation held: the usage, the credential, the
//!   scope) and the holder's sync reads the verdict again; past
//!   [`LATE_HORIZON_MS`], or when [`MAX_AWAITING`] wait already (the oldest
//!   goes first), it is dropped, counted, and reconciliation from the usage
//!   records is left to charge the tenant.
//!
//! `unverified` keeps the usage even when the credential proves valid: it
//! bounds what passes before verification per window, whoever it turns out
//! to be. Released instead, it would bound only what is in flight, and a
//! tenant past its budget that mints a fresh credential per request would
//! spend without end, one lazily admitted request each.
//!
//! Bounds: at most [`MAX_AWAITING`] charges wait per holder (a spray of
//! fresh credentials cannot grow it; each about 200 bytes plus its scope's
//! strings), each for at most [`LATE_HORIZON_MS`]. What a tenant is charged this way
//! was first admitted against the `unverified` budget, so while every
//! request's cost is within its bound a tenant settles at most `L_u` (that
//! budget's limit per window) past its own bound.

use std::collections::VecDeque;

use super::gateway::{GatewayQuota, Identity, Settlement, Ticket};
use crate::auth::attribution::{PendingCredential, Resolution};

/// Charges awaiting their credential's verdict, per holder, at most.
pub const MAX_AWAITING: usize = 1024;

/// How long a charge awaits its credential's verdict (ms): lazy-auth's
/// verification takes milliseconds, its callouts' timeouts seconds, and
/// its breaker keeps a failing verifier off for 30 s by default.
pub const LATE_HORIZON_MS: u64 = 60_000;

/// The parts of a lazily admitted request's scope its verdict does not
/// give (the verdict gives the tenant and the subject).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LateScope {
    /// The credential header's SHA-256, for policies scoped by credential.
    pub credential: Option<[u8; 32]>,
    /// The model the request named.
    pub model: Option<String>,
    /// The route's name.
    pub route: Option<String>,
    /// The values of `trusted_headers`, in their configured order.
    pub headers: Vec<Option<String>>,
}

/// How lazily admitted requests settled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LateCounts {
    /// Charged to the tenant their credential's verification found.
    pub verified: u64,
    /// Left to `unverified` alone: the credential was invalid, its verdict
    /// did not come in time, too many awaited, or no usage was known.
    pub unverified: u64,
    /// Of those, left because the verdict did not come within
    /// [`LATE_HORIZON_MS`] or too many awaited: in a chain whose verdicts
    /// the stage can read, only while the verifier is down.
    pub expired: u64,
}

/// A lazily admitted request's usage, to charge to its tenant once its
/// credential's verdict says who that is.
#[derive(Debug)]
struct Awaiting {
    settlement: Settlement,
    input_bound: u64,
    credential: PendingCredential,
    scope: LateScope,
    since_ms: u64,
}

/// The requests a holder settles once their credentials are verified.
#[derive(Debug, Default)]
pub struct LateSettlements {
    awaiting: VecDeque<Awaiting>,
    counts: LateCounts,
}

impl LateSettlements {
    /// Requests awaiting their verdict.
    pub fn len(&self) -> usize {
        self.awaiting.len()
    }

    /// Whether none awaits.
    pub fn is_empty(&self) -> bool {
        self.awaiting.is_empty()
    }

    /// How lazily admitted requests settled so far.
    pub fn counts(&self) -> LateCounts {
        self.counts
    }

    /// Counts `n` charges dropped unmade: their verdict did not come in
    /// time (or too many waited).
    fn expire(&mut self, n: usize) {
        self.counts.unverified += n as u64;
        self.counts.expired += n as u64;
    }
}

impl GatewayQuota {
    /// Settles a request admitted before `credential` was verified (its
    /// `ticket` holds only `unverified`) and charges its tenant as
    /// `verdict`, the verdict store's entry for it now (if any), decides:
    /// see the module documentation.
    pub fn settle_lazily(
        &mut self,
        ticket: Ticket,
        settlement: Settlement,
        credential: PendingCredential,
        scope: LateScope,
        verdict: Option<&[u8]>,
        now_ms: u64,
    ) {
        let input_bound = ticket.input_bound();
        self.settle(ticket, scope.model.as_deref(), settlement, now_ms);
        if settlement == Settlement::Unknown {
            // No usage to charge: the reservation stays `unverified`'s.
            self.late.counts.unverified += 1;
            return;
        }
        let waiting = Awaiting {
            settlement,
            input_bound,
            credential,
            scope,
            since_ms: now_ms,
        };
        if let Some(waiting) = self.charge_verified(waiting, verdict, now_ms) {
            if self.late.awaiting.len() >= MAX_AWAITING && self.late.awaiting.pop_front().is_some()
            {
                self.late.expire(1);
            }
            self.late.awaiting.push_back(waiting);
        }
    }

    /// Reads the verdicts of the charges awaiting theirs again
    /// (`verdict_of`: the verdict store's entry under a key) and makes
    /// those decided, dropping those waiting past [`LATE_HORIZON_MS`]; on
    /// the holder's sync. Returns how many waited past it (for the caller
    /// to log).
    pub fn settle_late(
        &mut self,
        now_ms: u64,
        mut verdict_of: impl FnMut(&str) -> Option<Vec<u8>>,
    ) -> usize {
        let mut expired = 0;
        for _ in 0..self.late.awaiting.len() {
            let Some(waiting) = self.late.awaiting.pop_front() else {
                break;
            };
            let entry = verdict_of(&waiting.credential.verdict_key());
            if let Some(waiting) = self.charge_verified(waiting, entry.as_deref(), now_ms) {
                if now_ms.saturating_sub(waiting.since_ms) >= LATE_HORIZON_MS {
                    expired += 1;
                } else {
                    self.late.awaiting.push_back(waiting);
                }
            }
        }
        self.late.expire(expired);
        expired
    }

    /// Drops every charge still awaiting its verdict (the table is
    /// retired), counted.
    pub(super) fn drop_late(&mut self) {
        let dropped = self.late.awaiting.len();
        self.late.awaiting.clear();
        self.late.expire(dropped);
    }

    /// The charges awaiting their verdict and how the others ended.
    pub fn late(&self) -> &LateSettlements {
        &self.late
    }

    /// Charges `waiting`'s tenant if `verdict` says its credential is
    /// valid; returns it when its verdict is still unknown.
    fn charge_verified(
        &mut self,
        waiting: Awaiting,
        verdict: Option<&[u8]>,
        now_ms: u64,
    ) -> Option<Awaiting> {
        let resolution = waiting
            .credential
            .resolve(verdict.unwrap_or_default(), now_ms / 1000);
        match resolution {
            Resolution::Verified { tenant, subject } => {
                let scope = &waiting.scope;
                let headers: Vec<Option<&str>> =
                    scope.headers.iter().map(Option::as_deref).collect();
                let who = Identity {
                    verified: true,
                    tenant,
                    subject,
                    credential: scope.credential.as_ref().map(|c| &c[..]),
                    model: scope.model.as_deref(),
                    route: scope.route.as_deref(),
                    headers: &headers,
                };
                self.charge(&who, waiting.settlement, waiting.input_bound, now_ms);
                self.late.counts.verified += 1;
                None
            }
            Resolution::Refused => {
                self.late.counts.unverified += 1;
                None
            }
            Resolution::Pending(_) => Some(waiting),
        }
    }
}
