//! One lease holder's quota: the compiled policies, their leases and the
//! store calls that keep the leases filled. The stage calls
//! [`GatewayQuota::reserve`] once per request (no network, no allocation:
//! the scope keys are built on the stack and the [`Ticket`] is inline),
//! [`GatewayQuota::draw`] as a stream's output arrives and
//! [`GatewayQuota::settle`] once it is done; the observer (or the stage's
//! own tick) calls [`GatewayQuota::sync`] every `sync_interval_ms` and hands
//! each answer to [`GatewayQuota::on_reply`].

use std::cell::Cell;

use super::config::{
    CacheHitCharge, Limit, MAX_POLICIES, Mode, QuotaConfig, ScopeField, StreamMode,
    UNVERIFIED_POLICY, Unit,
};
use super::headers::Shown;
use super::late::LateSettlements;
use super::lease::{Draw, EndedWindow, LeaseOp, LeaseParams, Reservation, Shortfall};
use super::reserve::{CostModel, RequestBound, TokenCounts};
use super::store::{
    Applied, CounterKeys, CounterKind, DeltaBuffer, DeltaReply, EXPIRY_SLACK_SECS, GrantReply,
    PendingDelta, Reply, Script, ScriptShas, StoreError, delta_command, grant_command,
    parse_webdis, sha_from_reply,
};
use super::table::{Entry, LeaseTable, ScopeKey, SlotRef, TableFull};
use super::window::{WindowSpan, ceil_secs};
use crate::config::ConfigError;

/// Most store calls one sync emits; the rest wait for the next.
pub const MAX_CALLS_PER_SYNC: usize = 256;

/// Who a request is, as the stage knows it once lazy-auth has decided.
#[derive(Debug, Clone, Copy, Default)]
pub struct Identity<'a> {
    /// Whether the credential is verified (a verdict, not a claim):
    /// unverified requests draw only from the `unverified` budget.
    pub verified: bool,
    /// The verified tenant.
    pub tenant: Option<&'a str>,
    /// The verified subject.
    pub subject: Option<&'a str>,
    /// The credential's hash (never the credential).
    pub credential: Option<&'a [u8]>,
    /// The model the request names.
    pub model: Option<&'a str>,
    /// The route's name.
    pub route: Option<&'a str>,
    /// The values of `trusted_headers`, in their configured order.
    pub headers: &'a [Option<&'a str>],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScopePart {
    Tenant,
    Subject,
    Credential,
    Model,
    Route,
    Header(usize),
}

/// A policy, compiled.
#[derive(Debug, Clone)]
pub struct PolicySpec {
    /// Its name.
    pub name: String,
    scope: Vec<ScopePart>,
    /// The models counted one by one, sorted (any other shares one key).
    models: Box<[Box<str>]>,
    /// How usage becomes an amount.
    pub cost: CostModel,
    /// The limit.
    pub limit: Limit,
    /// Enforce or shadow.
    pub mode: Mode,
    /// What a cache hit costs.
    pub cache_hit: CacheHitCharge,
    /// The output bound when the request names none.
    pub default_max_output_tokens: u64,
    /// Soft or hard streams.
    pub stream: StreamMode,
    /// Whether this is the `unverified` budget.
    pub unverified: bool,
    /// Whether the rate-limit headers show it (a currency has no header).
    pub shown: bool,
    /// The lease parameters.
    pub params: LeaseParams,
    /// The budget's last window: the calendar is read again only once the
    /// clock leaves it (every request asks, each policy several times).
    last_span: Cell<Option<WindowSpan>>,
}

impl PolicySpec {
    /// Whether `model` is one the policy counts on its own.
    fn counts_model(&self, model: &str) -> bool {
        self.models.binary_search_by(|m| (**m).cmp(model)).is_ok()
    }

    /// Whether it can refuse a request for its tokens: it enforces (a
    /// shadow policy limits nothing) and counts tokens.
    pub fn limits_tokens(&self) -> bool {
        self.mode == Mode::Enforce && self.cost.counts_tokens()
    }

    /// What a request reserves: its upper bound, or for a stream under
    /// `stream: hard` only its input bound (the output is drawn as it comes).
    pub fn reservation(&self, model: Option<&str>, bound: &RequestBound, stream: bool) -> u64 {
        let output = if stream && self.stream == StreamMode::Hard {
            0
        } else {
            bound.output_tokens(self.default_max_output_tokens)
        };
        self.cost.bound(model, bound.input_tokens(), output)
    }

    /// What `settlement` costs under this policy, for a request whose input
    /// bound was `input_bound`; `Unknown` usage costs `reserved` (the
    /// reservation as it stands, until reconciliation corrects it).
    pub fn settled_cost(
        &self,
        model: Option<&str>,
        settlement: Settlement,
        input_bound: u64,
        reserved: u64,
    ) -> u64 {
        let none = TokenCounts::default();
        match settlement {
            Settlement::Usage(counts) => self.cost.cost(model, &counts, true),
            Settlement::CacheHit { usage } => match self.cache_hit {
                CacheHitCharge::Free => 0,
                CacheHitCharge::Request => self.cost.cost(model, &none, true),
                CacheHitCharge::Usage => self.cost.cost(model, &usage.unwrap_or_default(), true),
            },
            Settlement::Partial {
                input: Some(input),
                delivered_output,
            } => self.cost.cost(
                model,
                &TokenCounts {
                    input,
                    output: delivered_output,
                    ..TokenCounts::default()
                },
                true,
            ),
            Settlement::Partial {
                input: None,
                delivered_output,
            } => self.cost.bound(model, input_bound, delivered_output),
            Settlement::Unknown => reserved,
        }
    }

    pub(super) fn window(&self, now_ms: u64) -> Option<WindowSpan> {
        let Limit::Budget(b) = self.limit else {
            return None;
        };
        let now = (now_ms / 1000) as i64;
        // Windows partition time: the one holding `now` is the one
        // `span_at` would compute.
        if let Some(span) = self.last_span.get()
            && (span.start..span.end).contains(&now)
        {
            return Some(span);
        }
        let span = b.window.span_at(now, b.utc_offset_minutes);
        self.last_span.set(Some(span));
        Some(span)
    }

    pub(super) fn counter_kind(&self, span: Option<WindowSpan>) -> CounterKind {
        match (self.limit, span) {
            (Limit::Rate(r), _) => CounterKind::Rate {
                limit: r.amount,
                period_ms: r.per.millis(),
            },
            (Limit::Budget(b), span) => CounterKind::Budget {
                limit: b.amount,
                expire_at: span.map_or(0, |s| s.end) + EXPIRY_SLACK_SECS,
            },
        }
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// The refusing policy's index ([`GatewayQuota::policy`]).
    pub policy: usize,
    /// Why.
    pub kind: RefusalKind,
}

/// The kinds of refusal, each with when to come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// A rate is spent: enough refills in `retry_after_secs`.
    RateLimited {
        /// Seconds until enough has refilled.
        retry_after_secs: u64,
    },
    /// A budget cannot cover the request until its window resets at
    /// `reset_at` (Unix s): `remaining` is left of it, the request may cost
    /// `amount` (a smaller request may still fit).
    BudgetExhausted {
        /// Unix seconds of the next window's start.
        reset_at: i64,
        /// What the fleet has left of the budget, as the rate-limit
        /// headers show it.
        remaining: u64,
        /// What the request would reserve (its upper bound).
        amount: u64,
    },
    /// The request alone costs more than the limit can ever hold.
    TooLarge {
        /// What it would reserve.
        amount: u64,
        /// The limit.
        limit: u64,
    },
    /// The fleet had room but this holder's lease is being refilled (the
    /// first request of a scope, or a burst faster than refills): a stage
    /// may also wait up to one sync for the refill instead of refusing.
    Refilling {
        /// Seconds to wait (one sync interval, rounded up).
        retry_after_secs: u64,
    },
    /// The store is unreachable and the fallback is `fail_closed`.
    Unavailable {
        /// Seconds to wait.
        retry_after_secs: u64,
    },
    /// Every lease of the key's table set is busy (a flood of new keys).
    TableFull {
        /// Seconds to wait.
        retry_after_secs: u64,
    },
}

impl RefusalKind {
    /// A short name for logs and the access log (`budget_exhausted`, …).
    pub fn label(&self) -> &'static str {
        match self {
            RefusalKind::RateLimited { .. } => "rate_limited",
            RefusalKind::BudgetExhausted { .. } => "budget_exhausted",
            RefusalKind::TooLarge { .. } => "too_large",
            RefusalKind::Refilling { .. } => "refilling",
            RefusalKind::Unavailable { .. } => "store_unavailable",
            RefusalKind::TableFull { .. } => "table_full",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    policy: u8,
    slot: SlotRef,
    reservation: Reservation,
    /// What a stream has drawn so far (input bound included), in the unit.
    drawn: u64,
}

/// A request's reservations, one per policy that scopes it; kept inline
/// (no allocation) until [`GatewayQuota::settle`] consumes it (not `Clone`:
/// a reservation is settled once).
#[derive(Debug, PartialEq, Eq)]
pub struct Ticket {
    held: [Option<Held>; MAX_POLICIES],
    len: usize,
    input_bound: u64,
    stream: bool,
    /// Policies (bit per index) that would have refused, in shadow mode.
    pub shadow_refused: u16,
}

impl Ticket {
    fn new(input_bound: u64, stream: bool) -> Ticket {
        Ticket {
            held: [None; MAX_POLICIES],
            len: 0,
            input_bound,
            stream,
            shadow_refused: 0,
        }
    }

    fn held(&self) -> impl Iterator<Item = &Held> {
        self.held[..self.len].iter().flatten()
    }

    /// The amount reserved for policy `policy`, if it scopes the request.
    pub fn reserved(&self, policy: usize) -> Option<u64> {
        self.held()
            .find(|h| usize::from(h.policy) == policy)
            .map(|h| h.reservation.amount)
    }

    /// Policies the request holds a reservation of.
    pub fn policies(&self) -> impl Iterator<Item = usize> + '_ {
        self.held().map(|h| usize::from(h.policy))
    }

    /// The request's input bound, in tokens (what a stream's settlement
    /// counts as its input when the stream did not report it).
    pub fn input_bound(&self) -> u64 {
        self.input_bound
    }
}

/// What a request came to, for [`GatewayQuota::settle`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Settlement {
    /// The response's exact usage.
    Usage(TokenCounts),
    /// Served from the gateway's cache (`usage`: the stored response's).
    CacheHit {
        /// The stored response's usage, if known.
        usage: Option<TokenCounts>,
    },
    /// A stream that ended early (cut, or the client went away): its input
    /// (the body bound when unknown) and the output delivered.
    Partial {
        /// Input tokens, when the stream reported them.
        input: Option<u64>,
        /// Output tokens delivered (counted or bounded).
        delivered_output: u64,
    },
    /// No usage is known: the reservation is charged as it stands (until
    /// reconciliation corrects the counter).
    Unknown,
}

/// What a stream's draw decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamVerdict {
    /// Go on.
    Continue,
    /// An enforcing `stream: hard` policy cannot cover it: end the stream
    /// cleanly after this chunk (OpenAI `finish_reason: "length"`,
    /// Anthropic `stop_reason: "max_tokens"`).
    Cut,
}

/// Where a store call's answer goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CallTarget {
    /// A lease's operation.
    Lease {
        /// The lease.
        slot: SlotRef,
        /// The operation's sequence number.
        seq: u64,
        /// Which script it ran.
        script: Script,
    },
    /// A buffered delta.
    Orphan {
        /// Its sequence number.
        seq: u64,
    },
    /// A `SCRIPT LOAD`.
    Load(Script),
    /// A lazily admitted request's charge handed to the store for
    /// reconciliation.
    HandOff {
        /// Its number on this holder.
        id: u64,
    },
}

/// A store call to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreCall {
    /// Where its answer goes.
    pub target: CallTarget,
    /// The command.
    pub command: super::store::Command,
}

/// Counts per policy (what the stage exports as metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PolicyStats {
    /// Requests admitted.
    pub admitted: u64,
    /// Requests refused.
    pub refused: u64,
    /// Requests a shadow policy would have refused.
    pub shadow_refused: u64,
    /// Amount reserved.
    pub reserved: u64,
    /// Amount settled.
    pub settled: u64,
    /// Reserved and given back at settlement.
    pub refunded: u64,
    /// Settled above the reservation (the bound did not hold).
    pub overshoot: u64,
    /// Grants asked for.
    pub refills: u64,
    /// Streams cut.
    pub cuts: u64,
}

/// One lease holder's quota; see the module documentation.
#[derive(Debug)]
pub struct GatewayQuota {
    pub(super) policies: Vec<PolicySpec>,
    pub(super) prefix: String,
    table: LeaseTable,
    /// The scope key being looked up, kept between lookups: each request
    /// builds one per policy, and a fresh key zero-fills its 528 bytes.
    scope_key: ScopeKey,
    pub(super) instance: u64,
    next_seq: u64,
    failing_since: Option<u64>,
    sync_interval_ms: u64,
    shas: ScriptShas,
    loading: [bool; 2],
    orphans: DeltaBuffer,
    stats: Vec<PolicyStats>,
    store_errors: u64,
    /// Calls that found no store: no answer, or webdis's own failure.
    store_unreachable: u64,
    /// Output caps added to request bodies, and those that could not be
    /// (`inject_max_tokens`): `[added, not added]`.
    caps: [u64; 2],
    /// Requests refused because their body's size could not be bounded.
    unbounded: u64,
    /// Requests admitted before verification, awaiting their verdict.
    pub(super) late: LateSettlements,
}

impl GatewayQuota {
    /// The quota of a checked configuration, for holder `instance` (random
    /// per start and per table, so its sequence numbers are its own) with
    /// table seed `seed` (random, secret).
    pub fn new(
        config: &QuotaConfig,
        instance: u64,
        seed: u64,
    ) -> Result<GatewayQuota, ConfigError> {
        config.check()?;
        let store = &config.store;
        let params = |limit: &Limit| {
            let amount = limit.amount();
            LeaseParams {
                limit: amount,
                rate_period_ms: match limit {
                    Limit::Rate(r) => Some(r.per.millis()),
                    Limit::Budget(_) => None,
                },
                max_lease: (amount.saturating_mul(u64::from(store.lease.max_percent)) / 100).max(1),
                low_watermark_percent: store.lease.low_watermark_percent,
                max_debt: store.max_debt,
                expected_gateways: u64::from(store.expected_gateways),
                ttl_ms: u64::from(store.lease_ttl_ms),
                idle_ms: u64::from(store.idle_return_ms),
                fallback: config.fallback,
            }
        };
        let mut policies = Vec::new();
        for policy in &config.policies {
            let scope = policy
                .scope
                .iter()
                .map(|f| match f {
                    ScopeField::Tenant => ScopePart::Tenant,
                    ScopeField::Subject => ScopePart::Subject,
                    ScopeField::Credential => ScopePart::Credential,
                    ScopeField::Model => ScopePart::Model,
                    ScopeField::Route => ScopePart::Route,
                    ScopeField::Header(h) => ScopePart::Header(
                        config
                            .trusted_headers
                            .iter()
                            .position(|t| t == h)
                            .unwrap_or(usize::MAX),
                    ),
                })
                .collect();
            let mut models: Vec<Box<str>> =
                policy.models.iter().map(|m| m.as_str().into()).collect();
            models.sort_unstable();
            let d = &config.defaults;
            policies.push(PolicySpec {
                name: policy.name.clone(),
                scope,
                models: models.into(),
                cost: CostModel::new(&policy.unit),
                limit: policy.limit,
                mode: policy.mode.unwrap_or(d.mode),
                cache_hit: policy.cache_hit.unwrap_or(d.cache_hit),
                default_max_output_tokens: u64::from(
                    policy
                        .default_max_output_tokens
                        .unwrap_or(d.default_max_output_tokens),
                ),
                stream: policy.stream.unwrap_or(d.stream),
                unverified: false,
                shown: !matches!(policy.unit, Unit::Currency(_)),
                params: params(&policy.limit),
                last_span: Cell::new(None),
            });
        }
        if let Some(u) = &config.unverified {
            if policies.len() >= MAX_POLICIES {
                return Err(ConfigError::new(
                    "unverified",
                    format!(
                        "with {MAX_POLICIES} policies there is no room for the unverified budget"
                    ),
                ));
            }
            policies.push(PolicySpec {
                name: UNVERIFIED_POLICY.into(),
                scope: Vec::new(),
                models: Box::default(),
                cost: CostModel::new(&u.unit),
                limit: u.limit,
                mode: u.mode,
                cache_hit: config.defaults.cache_hit,
                default_max_output_tokens: u64::from(config.defaults.default_max_output_tokens),
                stream: config.defaults.stream,
                unverified: true,
                shown: !matches!(u.unit, Unit::Currency(_)),
                params: params(&u.limit),
                last_span: Cell::new(None),
            });
        }
        let n = policies.len();
        Ok(GatewayQuota {
            policies,
            prefix: store.key_prefix.clone(),
            table: LeaseTable::new(store.max_leases as usize, seed),
            scope_key: ScopeKey::new(),
            instance,
            next_seq: 1,
            failing_since: None,
            sync_interval_ms: u64::from(store.sync_interval_ms),
            shas: ScriptShas::default(),
            loading: [false; 2],
            orphans: DeltaBuffer::new(store.max_buffered_deltas as usize),
            stats: vec![PolicyStats::default(); n],
            store_errors: 0,
            store_unreachable: 0,
            caps: [0; 2],
            unbounded: 0,
            late: LateSettlements::default(),
        })
    }

    /// The compiled policy at `index`.
    pub fn policy(&self, index: usize) -> Option<&PolicySpec> {
        self.policies.get(index)
    }

    /// The store's key prefix (`store.key_prefix`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The compiled policies, in configuration order (`unverified` last).
    pub fn policies(&self) -> &[PolicySpec] {
        &self.policies
    }

    /// Counts for the policy at `index`.
    pub fn stats(&self, index: usize) -> PolicyStats {
        self.stats.get(index).copied().unwrap_or_default()
    }

    /// Store answers that were errors or unreadable.
    pub fn store_errors(&self) -> u64 {
        self.store_errors
    }

    /// Store calls that found no store (no answer in time, or webdis
    /// failing): what an outage or a blackholed Redis shows as.
    pub fn store_unreachable(&self) -> u64 {
        self.store_unreachable
    }

    /// Counts an output cap added to a request body (`added`), or one that
    /// could not be (the body had gone on, or the host took no new body).
    pub fn count_cap(&mut self, added: bool) {
        let at = usize::from(!added);
        self.caps[at] = self.caps[at].saturating_add(1);
    }

    /// Output caps added to request bodies and those that could not be.
    pub fn caps(&self) -> [u64; 2] {
        self.caps
    }

    /// Whether an enforcing policy counts tokens: a request body whose size
    /// cannot be bounded (an unreadable coding) is then refused.
    pub fn bounds_input(&self) -> bool {
        self.policies.iter().any(PolicySpec::limits_tokens)
    }

    /// Counts a request refused because its body could not be bounded.
    pub fn count_unbounded(&mut self) {
        self.unbounded = self.unbounded.saturating_add(1);
    }

    /// Requests refused because their body could not be bounded.
    pub fn unbounded(&self) -> u64 {
        self.unbounded
    }

    /// The buffered deltas (dropped counts included).
    pub fn orphans(&self) -> &DeltaBuffer {
        &self.orphans
    }

    /// The lease table.
    pub fn table(&self) -> &LeaseTable {
        &self.table
    }

    /// Whether the store is considered unreachable at `now_ms`: every call
    /// for two sync intervals has failed (one lost answer is not an outage).
    /// Only then do leases past their expiry, and new leases, follow the
    /// fallback.
    pub fn store_down(&self, now_ms: u64) -> bool {
        self.failing_since
            .is_some_and(|since| now_ms.saturating_sub(since) >= 2 * self.sync_interval_ms)
    }

    pub(super) fn applies(policy: &PolicySpec, who: &Identity<'_>) -> bool {
        // Unverified requests never spend a claimed tenant's budget: they
        // count only against `unverified`, verified ones never against it.
        policy.unverified != who.verified
    }

    pub(super) fn fill_scope_key(key: &mut ScopeKey, policy: &PolicySpec, who: &Identity<'_>) {
        key.clear();
        for part in &policy.scope {
            let (tag, value) = match *part {
                ScopePart::Tenant => (1, who.tenant.map(str::as_bytes)),
                ScopePart::Subject => (2, who.subject.map(str::as_bytes)),
                ScopePart::Credential => (3, who.credential),
                // A model not listed, or none, is "another model": one key
                // for them all, so a made-up name makes no key of its own.
                ScopePart::Model => match who.model {
                    Some(m) if policy.counts_model(m) => (4, Some(m.as_bytes())),
                    _ => (6, None),
                },
                ScopePart::Route => (5, who.route.map(str::as_bytes)),
                ScopePart::Header(i) => (
                    // Tags past 16 name the header's place in `trusted_headers`.
                    16u8.saturating_add(u8::try_from(i).unwrap_or(u8::MAX)),
                    who.headers.get(i).copied().flatten().map(str::as_bytes),
                ),
            };
            key.push(tag, value);
        }
    }

    /// Finds (or makes) the lease of `policy` for `who`, moved to the
    /// current window (an ended window's debt goes to the delta buffer).
    fn lease_slot(
        &mut self,
        index: usize,
        who: &Identity<'_>,
        now_ms: u64,
    ) -> Result<SlotRef, TableFull> {
        let Some(policy) = self.policies.get(index) else {
            return Err(TableFull);
        };
        Self::fill_scope_key(&mut self.scope_key, policy, who);
        let span = policy.window(now_ms);
        let label = span.map_or(0, |s| s.label);
        // Disjoint fields: the name and key are borrowed, not copied (this
        // runs on every request).
        let slot = self.table.find_or_insert(
            index as u8,
            &policy.name,
            self.scope_key.as_bytes(),
            now_ms,
            label,
        )?;
        self.roll(index, slot, label, now_ms);
        Ok(slot)
    }

    /// Moves a budget lease to window `label`; what the old window owes
    /// its counter is buffered once its requests have settled.
    fn roll(&mut self, index: usize, slot: SlotRef, label: u64, now_ms: u64) {
        let Some(entry) = self.table.get_mut(slot) else {
            return;
        };
        if entry.lease.window() == label {
            return;
        }
        let unfinished = entry.lease.roll(label, now_ms);
        let done = entry.lease.take_ended();
        for ended in [unfinished, done].into_iter().flatten() {
            self.send_ended(index, slot, ended, now_ms);
        }
    }

    /// Buffers an ended window's delta for its counter (the lease at
    /// `slot` names it).
    fn send_ended(&mut self, index: usize, slot: SlotRef, ended: EndedWindow, now_ms: u64) {
        let (Some(policy), Some(entry)) = (self.policies.get(index), self.table.get(slot)) else {
            return;
        };
        if ended.delta == 0 {
            return;
        }
        let keys = CounterKeys::new(
            &self.prefix,
            &policy.name,
            &entry.digest,
            Some(ended.window),
            self.instance,
        );
        // The old window's end: one window before the current one's start
        // is not known from the label alone; its keys expire at the slack
        // past the current window's start at the latest.
        let span = policy.window(now_ms);
        let kind = match policy.counter_kind(span) {
            CounterKind::Budget { limit, .. } => CounterKind::Budget {
                limit,
                expire_at: span
                    .map_or(0, |s| s.start)
                    .saturating_add(EXPIRY_SLACK_SECS),
            },
            rate => rate,
        };
        self.buffer_delta(keys, kind, ended.delta);
    }

    /// Buffers `delta` for the counter at `keys`, with the next sequence
    /// number.
    fn buffer_delta(&mut self, keys: CounterKeys, kind: CounterKind, delta: i64) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.orphans.push(PendingDelta {
            keys,
            kind,
            seq,
            delta,
        });
    }

    /// Reserves `who`'s request of `bound` (`stream`: the response is
    /// streamed) against every policy that scopes it, all or nothing.
    pub fn reserve(
        &mut self,
        who: &Identity<'_>,
        bound: &RequestBound,
        stream: bool,
        now_ms: u64,
    ) -> Result<Ticket, Refusal> {
        let mut ticket = Ticket::new(bound.input_tokens(), stream);
        let store_down = self.store_down(now_ms);
        for index in 0..self.policies.len() {
            let Some(policy) = self.policies.get(index) else {
                continue;
            };
            if !Self::applies(policy, who) {
                continue;
            }
            let shadow = policy.mode == Mode::Shadow;
            let amount = policy.reservation(who.model, bound, stream);
            let input_only = policy.cost.bound(who.model, bound.input_tokens(), 0);
            let params = policy.params;
            let span = policy.window(now_ms);
            let refuse = |kind| Refusal {
                policy: index,
                kind,
            };
            if amount > params.limit {
                let refusal = refuse(RefusalKind::TooLarge {
                    amount,
                    limit: params.limit,
                });
                if self.refused(&mut ticket, index, shadow) {
                    continue;
                }
                return Err(refusal);
            }
            let slot = match self.lease_slot(index, who, now_ms) {
                Ok(slot) => slot,
                Err(TableFull) => {
                    let refusal = refuse(RefusalKind::TableFull {
                        retry_after_secs: ceil_secs(params.ttl_ms).max(1),
                    });
                    if self.refused(&mut ticket, index, shadow) {
                        continue;
                    }
                    return Err(refusal);
                }
            };
            let Some(entry) = self.table.get_mut(slot) else {
                continue;
            };
            let (reservation, shortfall) = entry
                .lease
                .reserve(amount, now_ms, &params, store_down, shadow);
            if let Some(short) = shortfall {
                let kind = match short {
                    Shortfall::Refilling => RefusalKind::Refilling {
                        retry_after_secs: ceil_secs(self.sync_interval_ms).max(1),
                    },
                    Shortfall::Unavailable => RefusalKind::Unavailable {
                        retry_after_secs: ceil_secs(self.sync_interval_ms).max(1),
                    },
                    Shortfall::Exhausted {
                        retry_after_secs: Some(s),
                    } => RefusalKind::RateLimited {
                        retry_after_secs: s,
                    },
                    Shortfall::Exhausted {
                        retry_after_secs: None,
                    } => match span {
                        Some(s) => RefusalKind::BudgetExhausted {
                            reset_at: s.end,
                            remaining: Self::remaining_of(entry, params.limit),
                            amount,
                        },
                        // A rate short of more than it can hold at once.
                        None => RefusalKind::TooLarge {
                            amount,
                            limit: params.limit,
                        },
                    },
                };
                if !shadow {
                    self.refused(&mut ticket, index, false);
                    self.want_rest(index + 1, who, bound, stream, now_ms);
                    return Err(refuse(kind));
                }
                ticket.shadow_refused |= 1 << index;
                if let Some(s) = self.stats.get_mut(index) {
                    s.shadow_refused += 1;
                }
            }
            if let Some(h) = ticket.held.get_mut(ticket.len) {
                *h = Some(Held {
                    policy: index as u8,
                    slot,
                    reservation,
                    drawn: input_only,
                });
                ticket.len += 1;
            }
            if let Some(s) = self.stats.get_mut(index) {
                s.admitted += 1;
                s.reserved += amount;
            }
        }
        Ok(ticket)
    }

    /// After a refusal by an earlier policy: the leases of the policies from
    /// `from` on that scope the request learn what it needed, so one sync
    /// refills them all.
    fn want_rest(
        &mut self,
        from: usize,
        who: &Identity<'_>,
        bound: &RequestBound,
        stream: bool,
        now_ms: u64,
    ) {
        for index in from..self.policies.len() {
            let Some(policy) = self.policies.get(index) else {
                continue;
            };
            if !Self::applies(policy, who) {
                continue;
            }
            let amount = policy.reservation(who.model, bound, stream);
            if let Ok(slot) = self.lease_slot(index, who, now_ms)
                && let Some(entry) = self.table.get_mut(slot)
            {
                entry.lease.want(amount, now_ms);
            }
        }
    }

    /// Counts a refusal by policy `index`: a shadow one is recorded on the
    /// ticket (returns true: go on); an enforced one releases what the
    /// ticket holds (returns false: refuse).
    fn refused(&mut self, ticket: &mut Ticket, index: usize, shadow: bool) -> bool {
        if shadow {
            ticket.shadow_refused |= 1 << index;
            if let Some(s) = self.stats.get_mut(index) {
                s.shadow_refused += 1;
            }
            return true;
        }
        if let Some(s) = self.stats.get_mut(index) {
            s.refused += 1;
        }
        for held in ticket.held[..ticket.len].iter_mut() {
            if let Some(h) = held.take()
                && let Some(entry) = self.table.get_mut(h.slot)
            {
                entry.lease.settle(h.reservation, 0);
                if let Some(s) = self.stats.get_mut(usize::from(h.policy)) {
                    s.admitted = s.admitted.saturating_sub(1);
                    s.reserved = s.reserved.saturating_sub(h.reservation.amount);
                }
            }
        }
        ticket.len = 0;
        false
    }

    /// The output cap to add to a request body that names none
    /// (`inject_max_tokens`): the smallest `default_max_output_tokens` of
    /// the enforcing, token-counting policies that scope it, so the
    /// backend stops within every one of their reservations (a shadow
    /// policy limits nothing); `None` when no such policy scopes it.
    pub fn output_cap(&self, ticket: &Ticket) -> Option<u64> {
        ticket
            .policies()
            .filter_map(|index| self.policies.get(index))
            .filter(|p| p.limits_tokens())
            .map(|p| p.default_max_output_tokens)
            .min()
    }

    /// Whether `ticket`'s output is drawn as it streams
    /// ([`GatewayQuota::draw`]): a stream held by a token-counting
    /// `stream: hard` policy (shadow ones too: they draw, and never cut).
    pub fn draws(&self, ticket: &Ticket) -> bool {
        ticket.stream
            && ticket.held().any(|h| {
                self.policies
                    .get(usize::from(h.policy))
                    .is_some_and(|p| p.stream == StreamMode::Hard && p.cost.counts_tokens())
            })
    }

    /// A stream has produced `output_tokens` so far (counted, or bounded by
    /// the text bytes delivered: a token covers at least one byte): each
    /// token-counting policy draws the difference from its lease.
    pub fn draw(
        &mut self,
        ticket: &mut Ticket,
        model: Option<&str>,
        output_tokens: u64,
        now_ms: u64,
    ) -> StreamVerdict {
        let mut verdict = StreamVerdict::Continue;
        let input = ticket.input_bound;
        for held in ticket.held[..ticket.len].iter_mut().flatten() {
            let Some(policy) = self.policies.get(usize::from(held.policy)) else {
                continue;
            };
            if !policy.cost.counts_tokens() {
                continue;
            }
            let total = policy.cost.bound(model, input, output_tokens);
            let delta = total.saturating_sub(held.drawn);
            if delta == 0 {
                continue;
            }
            let params = policy.params;
            let cut =
                ticket.stream && policy.stream == StreamMode::Hard && policy.mode == Mode::Enforce;
            let Some(entry) = self.table.get_mut(held.slot) else {
                continue;
            };
            let draw = entry
                .lease
                .draw(&mut held.reservation, held.drawn, delta, now_ms, &params);
            held.drawn = total;
            if draw == Draw::Uncovered && cut {
                verdict = StreamVerdict::Cut;
            }
        }
        if verdict == StreamVerdict::Cut {
            for index in ticket
                .held()
                .map(|h| usize::from(h.policy))
                .collect::<Vec<_>>()
            {
                if let Some(s) = self.stats.get_mut(index) {
                    s.cuts += 1;
                }
            }
        }
        verdict
    }

    /// Whether a lease `ticket` draws from is below its low watermark (or
    /// short) with no store operation out: a stream draining it should
    /// have the holder sync now rather than at its next tick, so that the
    /// stream is cut at the fleet's limit, not where its lease ran dry
    /// between two ticks.
    pub fn refill_due(&self, ticket: &Ticket, now_ms: u64) -> bool {
        ticket.held().any(|held| {
            let (Some(policy), Some(entry)) = (
                self.policies.get(usize::from(held.policy)),
                self.table.get(held.slot),
            ) else {
                return false;
            };
            policy.cost.counts_tokens() && entry.lease.needs_refill(now_ms, &policy.params)
        })
    }

    /// Settles `ticket`: each policy's reservation is replaced by the exact
    /// cost of `settlement` (the difference returns to the lease).
    pub fn settle(
        &mut self,
        ticket: Ticket,
        model: Option<&str>,
        settlement: Settlement,
        now_ms: u64,
    ) {
        for held in ticket.held() {
            let index = usize::from(held.policy);
            let Some(policy) = self.policies.get(index) else {
                continue;
            };
            let actual = policy.settled_cost(
                model,
                settlement,
                ticket.input_bound,
                held.reservation.amount,
            );
            if let Some(entry) = self.table.get_mut(held.slot) {
                entry.lease.settle(held.reservation, actual);
                // The last request of an ended window settles its delta.
                if let Some(ended) = entry.lease.take_ended() {
                    self.send_ended(index, held.slot, ended, now_ms);
                }
            }
            if let Some(s) = self.stats.get_mut(index) {
                s.settled += actual;
                let reserved = held.reservation.amount;
                s.refunded += reserved.saturating_sub(actual);
                s.overshoot += actual.saturating_sub(reserved);
            }
        }
    }

    /// Charges what `settlement` costs to `who`'s policies with no
    /// reservation (debt where a lease cannot cover it): the usage of a
    /// request admitted before verification, attributed to the tenant the
    /// verification found.
    pub(super) fn charge(
        &mut self,
        who: &Identity<'_>,
        settlement: Settlement,
        input_bound: u64,
        now_ms: u64,
    ) {
        for index in 0..self.policies.len() {
            let Some(policy) = self.policies.get(index) else {
                continue;
            };
            if !Self::applies(policy, who) {
                continue;
            }
            let amount = policy.settled_cost(who.model, settlement, input_bound, 0);
            if let Ok(slot) = self.lease_slot(index, who, now_ms)
                && let Some(entry) = self.table.get_mut(slot)
            {
                entry.lease.charge(amount, now_ms);
            }
            if let Some(s) = self.stats.get_mut(index) {
                s.settled += amount;
            }
        }
    }

    /// What the stage reports in the rate-limit headers for policy
    /// `index` as `ticket` left it: (limit, remaining, reset at, Unix ms).
    /// `remaining` is the fleet's remainder at the store's last answer plus
    /// what this lease has not spent: reservations in flight are not
    /// subtracted (they mostly come back), so a client's successive
    /// requests see it only go down, by what each one used.
    pub fn limit_state(&self, ticket: &Ticket, index: usize, now_ms: u64) -> Option<LimitState> {
        let held = ticket.held().find(|h| usize::from(h.policy) == index)?;
        let policy = self.policies.get(index)?;
        let entry = self.table.get(held.slot)?;
        let limit = policy.params.limit;
        let remaining = Self::remaining_of(entry, limit);
        let reset_at_ms = match (policy.limit, policy.window(now_ms)) {
            (Limit::Budget(_), Some(span)) => u64::try_from(span.end).unwrap_or(0) * 1000,
            (Limit::Rate(r), _) => {
                let missing = u128::from(limit - remaining) * u128::from(r.per.millis());
                now_ms + u64::try_from(missing.div_ceil(u128::from(limit.max(1)))).unwrap_or(0)
            }
            (Limit::Budget(_), None) => now_ms,
        };
        Some(LimitState {
            limit,
            remaining,
            reset_at_ms,
            counts_tokens: policy.cost.counts_tokens(),
        })
    }

    /// What the fleet has left of `limit` as this holder knows it: the
    /// store's last remainder (or the limit less what it granted) plus what
    /// this lease holds unspent, reserved or on its way back.
    fn remaining_of(entry: &Entry, limit: u64) -> u64 {
        let fleet = entry.lease.fleet_remaining().map_or(
            i128::from(limit) - i128::from(entry.lease.granted()),
            i128::from,
        );
        // A return on its way to the store left the lease but is not yet in
        // the fleet's remainder: still this holder's until answered.
        let returning = match entry.lease.in_flight().map(|f| f.op) {
            Some(LeaseOp::Return { amount }) => i128::from(amount),
            _ => 0,
        };
        let unspent = entry.lease.available() + i128::from(entry.lease.reserved()) + returning;
        let remaining = (fleet + unspent).clamp(0, i128::from(limit));
        u64::try_from(remaining).unwrap_or(0)
    }

    /// The states the rate-limit headers show for `ticket`: its tightest
    /// requests policy and its tightest token policy.
    pub fn shown(&self, ticket: &Ticket, now_ms: u64) -> Shown {
        let mut shown = Shown::default();
        for index in ticket.policies() {
            if self.policies.get(index).is_some_and(|p| p.shown)
                && let Some(state) = self.limit_state(ticket, index, now_ms)
            {
                shown.add(state);
            }
        }
        shown
    }

    /// The store calls due at `now_ms` (at most [`MAX_CALLS_PER_SYNC`]):
    /// script loads, lease refills and returns (one per lease at a time,
    /// repeated until answered), buffered deltas.
    pub fn sync(&mut self, now_ms: u64, out: &mut Vec<StoreCall>) {
        self.sync_calls(now_ms, false, out);
    }

    /// [`GatewayQuota::sync`] for a request waiting for a grant, which
    /// hears only its own calls' answers: operations already out are
    /// included again (the same sequence number: applied once, answered
    /// alike).
    pub fn sync_waiting(&mut self, now_ms: u64, out: &mut Vec<StoreCall>) {
        self.sync_calls(now_ms, true, out);
    }

    /// Moves every budget lease whose window has ended to the current one.
    fn roll_every_lease(&mut self, now_ms: u64) {
        let rolls: Vec<(usize, SlotRef, u64)> = self
            .table
            .iter_mut()
            .filter_map(|(slot, e)| {
                let policy = self.policies.get(usize::from(e.policy))?;
                let label = policy.window(now_ms)?.label;
                (label != e.lease.window()).then_some((usize::from(e.policy), slot, label))
            })
            .collect();
        for (index, slot, label) in rolls {
            self.roll(index, slot, label, now_ms);
        }
    }

    fn sync_calls(&mut self, now_ms: u64, out_too: bool, out: &mut Vec<StoreCall>) {
        for (i, script) in [Script::Grant, Script::Delta].into_iter().enumerate() {
            if self.shas.get(script).is_none() && !self.loading[i] {
                self.loading[i] = true;
                out.push(StoreCall {
                    target: CallTarget::Load(script),
                    command: super::store::Command::script_load(script),
                });
            }
        }
        // Ended windows first, so their deltas are buffered before anything else.
        self.roll_every_lease(now_ms);
        let mut budget = MAX_CALLS_PER_SYNC.saturating_sub(out.len());
        let (policies, prefix, instance, shas) =
            (&self.policies, &self.prefix, self.instance, &self.shas);
        let stats = &mut self.stats;
        let next_seq = &mut self.next_seq;
        for (slot, entry) in self.table.iter_mut() {
            if budget == 0 {
                break;
            }
            let Some(policy) = policies.get(usize::from(entry.policy)) else {
                continue;
            };
            let params = policy.params;
            let resent = match entry.lease.resend() {
                None if out_too => entry.lease.in_flight(),
                resent => resent,
            };
            let op = match resent {
                Some(op) => op,
                None => match entry.lease.next_op(now_ms, *next_seq, &params) {
                    Some(op) => {
                        *next_seq += 1;
                        op
                    }
                    None => continue,
                },
            };
            let span = policy.window(now_ms);
            let keys = CounterKeys::new(
                prefix,
                &policy.name,
                &entry.digest,
                span.map(|s| s.label),
                instance,
            );
            let kind = policy.counter_kind(span);
            let (command, script) = match op.op {
                LeaseOp::Grant { force, asked } => {
                    if let Some(s) = stats.get_mut(usize::from(entry.policy)) {
                        s.refills += 1;
                    }
                    (
                        grant_command(shas, &keys, kind, op.seq, force, asked),
                        Script::Grant,
                    )
                }
                LeaseOp::Return { amount } => (
                    delta_command(
                        shas,
                        &keys,
                        kind,
                        op.seq,
                        -i64::try_from(amount).unwrap_or(i64::MAX),
                    ),
                    Script::Delta,
                ),
            };
            out.push(StoreCall {
                target: CallTarget::Lease {
                    slot,
                    seq: op.seq,
                    script,
                },
                command,
            });
            budget -= 1;
        }
        for delta in self.orphans.pending().take(budget) {
            out.push(StoreCall {
                target: CallTarget::Orphan { seq: delta.seq },
                command: delta_command(&self.shas, &delta.keys, delta.kind, delta.seq, delta.delta),
            });
            budget -= 1;
        }
        if !out_too {
            // Not from a waiting request: it waits for its own grant only.
            self.hand_off_calls(budget, out);
        }
    }

    /// The store's answer to a call (or why there is none), at `now_ms`.
    pub fn on_reply(&mut self, target: &CallTarget, reply: Result<Reply, StoreError>, now_ms: u64) {
        let failed = |this: &mut GatewayQuota, error: &StoreError| {
            match error {
                StoreError::Unreachable(_) => {
                    this.failing_since.get_or_insert(now_ms);
                    this.store_unreachable += 1;
                }
                StoreError::NoScript => {
                    this.failing_since = None;
                    this.shas.forget();
                    this.loading = [false; 2];
                }
                StoreError::Malformed(_) | StoreError::Redis(_) => {
                    this.failing_since = None;
                    this.store_errors += 1;
                }
            }
            if let CallTarget::Lease { slot, seq, .. } = *target
                && let Some(entry) = this.table.get_mut(slot)
            {
                entry.lease.unanswered(seq);
            }
            if let CallTarget::Load(script) = *target {
                this.loading[usize::from(script == Script::Delta)] = false;
            }
            if let CallTarget::HandOff { id } = *target {
                this.hand_off_answered(id, Err(()));
            }
        };
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => return failed(self, &e),
        };
        match *target {
            CallTarget::Load(script) => {
                self.loading[usize::from(script == Script::Delta)] = false;
                match sha_from_reply(&reply) {
                    Ok(sha) => {
                        self.failing_since = None;
                        self.shas.learn(script, &sha);
                    }
                    Err(e) => failed(self, &e),
                }
            }
            CallTarget::Lease { slot, seq, script } => {
                let parsed = match script {
                    Script::Grant => {
                        GrantReply::from_reply(&reply).map(|g| (g.remaining, g.granted, g.status))
                    }
                    Script::Delta => {
                        DeltaReply::from_reply(&reply).map(|d| (d.remaining, 0, d.status))
                    }
                };
                match parsed {
                    Err(e) => failed(self, &e),
                    Ok((remaining, granted, status)) => {
                        self.failing_since = None;
                        if let Some(entry) = self.table.get_mut(slot) {
                            match status {
                                Applied::Now | Applied::Replay => {
                                    entry.lease.answered(seq, granted, remaining, now_ms);
                                }
                                Applied::Stale => entry.lease.abandon(seq),
                            }
                        }
                    }
                }
            }
            CallTarget::Orphan { seq } => match DeltaReply::from_reply(&reply) {
                Ok(_) => {
                    self.failing_since = None;
                    self.orphans.answered(seq);
                }
                Err(e) => failed(self, &e),
            },
            CallTarget::HandOff { id } => match super::store::hand_off_stored(&reply) {
                Ok(stored) => {
                    self.failing_since = None;
                    self.hand_off_answered(id, Ok(stored));
                }
                Err(e) => failed(self, &e),
            },
        }
    }

    /// A call whose answer can no longer arrive though the store may have
    /// had it (the stream that sent it went away and the host cancelled
    /// it): asked again at the next sync, with the same sequence number
    /// (applied once), and not counted as the store's failure.
    pub fn withdrawn(&mut self, target: &CallTarget) {
        match *target {
            CallTarget::Lease { slot, seq, .. } => {
                if let Some(entry) = self.table.get_mut(slot) {
                    entry.lease.unanswered(seq);
                }
            }
            CallTarget::Load(script) => self.loading[usize::from(script == Script::Delta)] = false,
            CallTarget::Orphan { .. } => {}
            CallTarget::HandOff { id } => self.hand_off_answered(id, Err(())),
        }
    }

    /// [`GatewayQuota::on_reply`] for a webdis answer: the HTTP status
    /// (`None`: the call failed) and body of the `POST` of `call`.
    pub fn on_webdis_response(
        &mut self,
        call: &StoreCall,
        status: Option<u16>,
        body: &[u8],
        now_ms: u64,
    ) {
        let reply = match status {
            Some(200) => parse_webdis(body, &call.command.verb()),
            Some(s) => Err(StoreError::Unreachable(format!("webdis answered {s}"))),
            None => Err(StoreError::Unreachable("no answer".into())),
        };
        self.on_reply(&call.target, reply, now_ms);
    }

    /// Gives back what every idle lease holds (at shutdown or before the
    /// table is replaced), as buffered deltas: the store's counters then
    /// equal what was spent once the buffer is sent.
    pub fn retire(&mut self, now_ms: u64) {
        self.drop_late();
        // Each lease in the current window, and what each ended window
        // owes sent as it stands (its requests will not settle here).
        self.roll_every_lease(now_ms);
        let ended: Vec<(usize, SlotRef, EndedWindow)> = self
            .table
            .iter_mut()
            .filter_map(|(slot, e)| Some((usize::from(e.policy), slot, e.lease.take_ended_now()?)))
            .collect();
        for (index, slot, window) in ended {
            self.send_ended(index, slot, window, now_ms);
        }
        let mut out = Vec::new();
        for (_, entry) in self.table.iter_mut() {
            let Some(policy) = self.policies.get(usize::from(entry.policy)) else {
                continue;
            };
            if entry.lease.in_flight().is_some() || entry.lease.reserved() > 0 {
                continue;
            }
            let delta = -entry.lease.available();
            if delta == 0 {
                continue;
            }
            let span = policy.window(now_ms);
            out.push((
                CounterKeys::new(
                    &self.prefix,
                    &policy.name,
                    &entry.digest,
                    span.map(|s| s.label),
                    self.instance,
                ),
                policy.counter_kind(span),
                i64::try_from(delta).unwrap_or(0),
            ));
            // Held amounts are given back, debt is charged: the lease is even.
            entry.lease = super::lease::Lease::new(now_ms, entry.lease.window());
        }
        for (keys, kind, delta) in out {
            self.buffer_delta(keys, kind, delta);
        }
    }
}

/// A policy's limit as the rate-limit headers show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitState {
    /// The limit.
    pub limit: u64,
    /// What is left.
    pub remaining: u64,
    /// When it is whole again (a budget's next window, a rate's full
    /// refill), Unix ms.
    pub reset_at_ms: u64,
    /// Whether the policy counts tokens (else requests).
    pub counts_tokens: bool,
}
