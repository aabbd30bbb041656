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
//!   goes first), the holder gives up on it: the charge is handed to the
//!   fleet's store ([`UnsettledCharge`], in the hash
//!   [`crate::quota::store::hand_off_key`]), and `host-sim quota-reconcile`
//!   makes it there once an attribution row names the credential's tenant
//!   ([`GatewayQuota::reconciliation`]: the same counters, the same amounts
//!   as the holder's own charge would have been).
//!
//! `unverified` keeps the usage even when the credential proves valid: it
//! bounds what passes before verification per window, whoever it turns out
//! to be. Released instead, it would bound only what is in flight, and a
//! tenant past its budget that mints a fresh credential per request would
//! spend without end, one lazily admitted request each.
//!
//! Bounds: at most [`MAX_AWAITING`] charges wait per holder (a spray of
//! fresh credentials cannot grow it; each about 200 bytes plus its scope's
//! strings), each for at most [`LATE_HORIZON_MS`]; at most
//! [`MAX_HANDING_OFF`] given-up charges wait for the store per holder (each
//! at most [`MAX_HAND_OFF_BYTES`](crate::quota::store::MAX_HAND_OFF_BYTES); past it the oldest is lost, counted), and
//! the store's hash keeps at most
//! [`MAX_HANDED_OFF`](crate::quota::store::MAX_HANDED_OFF) (the script refuses
//! more; counted as lost). What a tenant is charged this way
//! was first admitted against the `unverified` budget, so while every
//! request's cost is within its bound a tenant settles at most `L_u` (that
//! budget's limit per window) past its own bound.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::gateway::{CallTarget, GatewayQuota, Identity, Settlement, StoreCall, Ticket};
use super::store::{
    Command, CounterKeys, CounterKind, MAX_HAND_OFF_BYTES, ScriptShas, delta_command,
    hand_off_command, hex, scope_digest,
};
use super::table::ScopeKey;
use crate::auth::attribution::{AttributionId, PendingCredential, Resolution};

/// Charges awaiting their credential's verdict, per holder, at most.
pub const MAX_AWAITING: usize = 1024;

/// How long a charge awaits its credential's verdict (ms): lazy-auth's
/// verification takes milliseconds, its callouts' timeouts seconds, and
/// its breaker keeps a failing verifier off for 30 s by default.
pub const LATE_HORIZON_MS: u64 = 60_000;

/// Most given-up charges a holder keeps for the store at once (the oldest
/// is lost past it, counted): the store unreachable for long, a spray of
/// fresh credentials while the verifier is down.
pub const MAX_HANDING_OFF: usize = 1024;

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
    /// Of those, stored in the store's hand-off hash for reconciliation.
    pub handed_off: u64,
    /// Of those, not stored: the holder's queue or the store's hash was
    /// full, or the charge too large.
    pub lost: u64,
}

/// A lazily admitted request's charge to its tenant that its holder gave
/// up on (the verdict did not come in time), as stored for reconciliation:
/// what [`GatewayQuota::reconciliation`] needs to charge it as the holder
/// would have.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnsettledCharge {
    /// The credential's [`AttributionId`] (what attribution rows name).
    pub credential: String,
    /// When the request settled, Unix ms (it selects a budget's window).
    pub at_ms: u64,
    /// What the request came to.
    pub settlement: Settlement,
    /// Its input bound (what a `partial` without input is charged).
    pub input_bound: u64,
    /// The credential header's SHA-256, hex (for policies scoped by
    /// credential).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_sha256: Option<String>,
    /// The model the request named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The route's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
    /// The values of `trusted_headers`, in their configured order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<Option<String>>,
}

/// One counter a reconciled charge goes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Correction {
    /// The policy's name.
    pub policy: String,
    /// The counter's key.
    pub counter: String,
    /// What is added to it.
    pub amount: u64,
    /// The delta call adding it, once: its record is the hand-off field's
    /// own, so a repeated run (or a lost answer sent again) adds nothing.
    pub command: Command,
}

/// A given-up charge waiting for the store.
#[derive(Debug)]
struct HandOff {
    id: u64,
    value: String,
    in_flight: bool,
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
    handing: VecDeque<HandOff>,
    next_hand_off: u64,
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

    /// Given-up charges not yet stored in the store.
    pub fn handing_off(&self) -> usize {
        self.handing.len()
    }

    /// How lazily admitted requests settled so far.
    pub fn counts(&self) -> LateCounts {
        self.counts
    }

    /// Gives up on `waiting` (its verdict did not come in time, too many
    /// waited, or the table is retired): queued for the store, counted.
    fn give_up(&mut self, waiting: Awaiting) {
        self.counts.unverified += 1;
        self.counts.expired += 1;
        let charge = UnsettledCharge {
            credential: AttributionId::of(&waiting.credential.hash).render(),
            at_ms: waiting.since_ms,
            settlement: waiting.settlement,
            input_bound: waiting.input_bound,
            credential_sha256: waiting.scope.credential.map(|c| hex(&c)),
            model: waiting.scope.model,
            route: waiting.scope.route,
            headers: waiting.scope.headers,
        };
        let value = match serde_json::to_string(&charge) {
            Ok(value) if value.len() <= MAX_HAND_OFF_BYTES => value,
            _ => {
                self.counts.lost += 1;
                return;
            }
        };
        if self.handing.len() >= MAX_HANDING_OFF && self.handing.pop_front().is_some() {
            self.counts.lost += 1;
        }
        self.next_hand_off += 1;
        self.handing.push_back(HandOff {
            id: self.next_hand_off,
            value,
            in_flight: false,
        });
    }
}

/// The hand-off hash's field for holder `instance`'s charge `id` (unique
/// fleet-wide: instance ids are random per start).
fn hand_off_field(instance: u64, id: u64) -> String {
    format!("{instance:016x}-{id}")
}

/// The holder id reconciliation's delta calls carry for the charge stored
/// under `field`: its own, so each counter takes that charge once.
fn reconciler_instance(field: &str) -> u64 {
    let digest = Sha256::digest(field.as_bytes());
    let mut id = [0u8; 8];
    id.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(id)
}

/// The 32 bytes of 64 hex digits.
fn unhex32(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
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
            if self.late.awaiting.len() >= MAX_AWAITING
                && let Some(oldest) = self.late.awaiting.pop_front()
            {
                self.late.give_up(oldest);
            }
            self.late.awaiting.push_back(waiting);
        }
    }

    /// Reads the verdicts of the charges awaiting theirs again
    /// (`verdict_of`: the verdict store's entry under a key) and makes
    /// those decided, giving up on those waiting past [`LATE_HORIZON_MS`]
    /// (handed to the store for reconciliation); on the holder's sync.
    /// Returns how many waited past it (for the caller to log).
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
                    self.late.give_up(waiting);
                } else {
                    self.late.awaiting.push_back(waiting);
                }
            }
        }
        expired
    }

    /// Gives up on every charge still awaiting its verdict (the table is
    /// retired): handed to the store, counted.
    pub(super) fn drop_late(&mut self) {
        while let Some(waiting) = self.late.awaiting.pop_front() {
            self.late.give_up(waiting);
        }
    }

    /// The hand-off calls due (those not out already), at most `budget`.
    pub(super) fn hand_off_calls(&mut self, budget: usize, out: &mut Vec<StoreCall>) {
        let (prefix, instance) = (&self.prefix, self.instance);
        for handing in self
            .late
            .handing
            .iter_mut()
            .filter(|h| !h.in_flight)
            .take(budget)
        {
            handing.in_flight = true;
            out.push(StoreCall {
                target: CallTarget::HandOff { id: handing.id },
                command: hand_off_command(
                    prefix,
                    &hand_off_field(instance, handing.id),
                    &handing.value,
                ),
            });
        }
    }

    /// The store's answer to hand-off `id`: `Ok(true)` stored (now or
    /// before), `Ok(false)` the store's hash was full (lost, counted); an
    /// error sends it again at the next sync.
    pub(super) fn hand_off_answered(&mut self, id: u64, stored: Result<bool, ()>) {
        let Some(at) = self.late.handing.iter().position(|h| h.id == id) else {
            return;
        };
        match stored {
            Ok(stored) => {
                self.late.handing.remove(at);
                if stored {
                    self.late.counts.handed_off += 1;
                } else {
                    self.late.counts.lost += 1;
                }
            }
            Err(()) => {
                if let Some(handing) = self.late.handing.get_mut(at) {
                    handing.in_flight = false;
                }
            }
        }
    }

    /// The delta calls that charge `charge` (stored under hand-off `field`)
    /// to the identity an attribution found for its credential (`tenant`,
    /// `subject`), at `now_ms`: every verified policy that scopes it, the
    /// cost the holder's own charge would have had, on the counter it would
    /// have used (a budget's window of the request's `at_ms`). A rate's
    /// charge older than its period is left out (its level would have
    /// drained it by now). Each call adds its amount once however often it
    /// is sent (its record is the field's own). Empty for an unusable
    /// charge (a malformed credential hash).
    pub fn reconciliation(
        &self,
        field: &str,
        charge: &UnsettledCharge,
        tenant: Option<&str>,
        subject: Option<&str>,
        now_ms: u64,
    ) -> Vec<Correction> {
        let credential = match &charge.credential_sha256 {
            Some(hash) => match unhex32(hash) {
                Some(bytes) => Some(bytes),
                None => return Vec::new(),
            },
            None => None,
        };
        let headers: Vec<Option<&str>> = charge.headers.iter().map(Option::as_deref).collect();
        let who = Identity {
            verified: true,
            tenant,
            subject,
            credential: credential.as_ref().map(|c| &c[..]),
            model: charge.model.as_deref(),
            route: charge.route.as_deref(),
            headers: &headers,
        };
        let instance = reconciler_instance(field);
        let mut key = ScopeKey::new();
        let mut out = Vec::new();
        for policy in &self.policies {
            if !Self::applies(policy, &who) {
                continue;
            }
            let span = policy.window(charge.at_ms);
            let kind = policy.counter_kind(span);
            if let CounterKind::Rate { period_ms, .. } = kind
                && now_ms.saturating_sub(charge.at_ms) >= period_ms
            {
                continue;
            }
            let amount = policy.settled_cost(who.model, charge.settlement, charge.input_bound, 0);
            if amount == 0 {
                continue;
            }
            Self::fill_scope_key(&mut key, policy, &who);
            let digest = scope_digest(&policy.name, key.as_bytes());
            let keys = CounterKeys::new(
                &self.prefix,
                &policy.name,
                &digest,
                span.map(|s| s.label),
                instance,
            );
            out.push(Correction {
                policy: policy.name.clone(),
                counter: keys.counter.clone(),
                amount,
                command: delta_command(
                    &ScriptShas::default(),
                    &keys,
                    kind,
                    1,
                    i64::try_from(amount).unwrap_or(i64::MAX),
                ),
            });
        }
        out
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
