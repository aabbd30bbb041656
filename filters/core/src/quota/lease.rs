//! A lease: part of a fleet-wide limit that one lease holder (a gateway's
//! lease table) has already debited from the store's counter, so it can
//! admit requests with no network call.
//!
//! A lease keeps three amounts, in the policy's unit: `granted` (debited
//! fleet-wide and held here), `reserved` (by requests in flight, at their
//! upper bound) and `spent` (settled exactly). What is left to reserve is
//! `granted − reserved − spent`; below zero it is debt. A reservation
//! succeeds when `available + credit ≥ amount`, the credit being β
//! (`max_debt`, default 0) less the debt already charged to the store in
//! this window (for a rate: in the last period), so a holder never admits
//! more than it was granted plus β, however often its debt is charged.
//!
//! **Refill.** The observer asks the store for more when what is left falls
//! below the low watermark (`low_watermark_percent` of the lease size) or a
//! refused request needed more than is left. The lease size shrinks as the
//! fleet nears its limit:
//!
//! ```text
//! size = min(max_lease, max(1, remaining / (2 × expected_gateways)))
//! ```
//!
//! with `remaining` the fleet's remainder at the store's last answer (the
//! limit before the first), so however many holders refill at once, the
//! leases out there hold at most about half of what is left, and the other
//! half stays for whoever needs it. A lease holding more than twice its size
//! gives the surplus back; one unused for `idle_return_ms` gives back all it
//! holds, so the store's counter comes back to what was spent.
//!
//! **Expiry and fallback.** A lease is confirmed by every store answer. Past
//! `lease_ttl_ms` without one while the store is unreachable, it follows the
//! fallback: `local_share` adds `remaining / expected_gateways` of the last
//! known remainder (for a rate: a local bucket refilling at
//! `amount / expected_gateways`), `fail_open` admits everything,
//! `fail_closed` refuses. What is spent that way is debt, charged to the
//! store with the next grant once it answers.

use super::config::Fallback;
use super::window::{RateBucket, ceil_secs};

/// What a lease needs to know of its policy and the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseParams {
    /// The limit's amount (a budget's per window, a rate's per period).
    pub limit: u64,
    /// A rate's period in ms; `None` for a budget.
    pub rate_period_ms: Option<u64>,
    /// The largest lease, in the policy's unit (at least 1).
    pub max_lease: u64,
    /// Refill below this percentage of the lease size.
    pub low_watermark_percent: u8,
    /// β: how far reservations may overdraw the lease.
    pub max_debt: u64,
    /// Lease holders expected in the fleet (at least 1).
    pub expected_gateways: u64,
    /// How long a lease is spent without the store confirming it, ms.
    pub ttl_ms: u64,
    /// A lease unused this long gives back what it holds, ms (so the
    /// store's counter comes back to what was spent).
    pub idle_ms: u64,
    /// What happens past expiry with the store unreachable.
    pub fallback: Fallback,
}

/// A request's hold on a lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// The amount held (the upper bound, plus what a stream drew beyond it).
    pub amount: u64,
    /// The lease's epoch when reserved: a reservation from an earlier
    /// budget window settles nothing in the new one.
    pub epoch: u32,
}

/// Why a lease could not cover a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shortfall {
    /// The fleet had room at the store's last answer: the lease is being
    /// refilled; retry after about one sync interval.
    Refilling,
    /// The fleet's remainder does not cover it: a budget until its window
    /// resets, a rate for `retry_after_secs`.
    Exhausted {
        /// For a rate, seconds until enough has refilled (`None`: a budget,
        /// or more than a rate can ever hold at once).
        retry_after_secs: Option<u64>,
    },
    /// The store is unreachable and the fallback is `fail_closed`.
    Unavailable,
}

/// What a stream's draw of more tokens came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Draw {
    /// Covered by the reservation or the lease.
    Covered,
    /// Not covered; charged anyway (the chunk was produced). With `stream:
    /// hard` the stream must end after this chunk; with `soft` it goes on
    /// and the excess is debt.
    Uncovered,
}

/// A store operation a lease wants, and retries until answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseOp {
    /// Charge `force` (debt, unconditionally), then grant up to `asked`.
    Grant {
        /// Debt charged before granting.
        force: u64,
        /// Asked for; the store grants `min(asked, limit − counter)`.
        asked: u64,
    },
    /// Give `amount` back (already taken out of the lease).
    Return {
        /// Units returned.
        amount: u64,
    },
}

/// The budget window a lease rolled out of, kept until the requests
/// reserved in it have settled: what the holder used there is then sent to
/// its counter in one delta (one delta, so no two race for the counter's
/// idempotency record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndedWindow {
    /// The window's label.
    pub window: u64,
    /// Still reserved by its requests in flight.
    pub reserved: u64,
    /// What to add to its counter: used there (spent, and reserved until
    /// settled) less what was granted; negative gives the unspent back.
    pub delta: i64,
}

/// An operation sent and not yet answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InFlight {
    /// Its sequence number (idempotency key with the instance id).
    pub seq: u64,
    /// What it does.
    pub op: LeaseOp,
    /// The lease's epoch when it was made.
    pub epoch: u32,
    /// Whether a call carrying it is out (no answer or failure yet).
    pub awaiting: bool,
}

/// The fallback's state while the store is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Degraded {
    /// Extra credit of the last known remainder's share (budget).
    Share(u64),
    /// A local bucket at the rate's share.
    RateShare(RateBucket),
    /// Everything admitted.
    Open,
    /// Everything refused.
    Closed,
}

/// One lease; see the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    granted: u64,
    reserved: u64,
    spent: u64,
    /// `limit − counter` at the store's last answer (negative past the limit).
    fleet_remaining: Option<i64>,
    /// When the store last confirmed the lease (or the lease was made), ms.
    confirmed_ms: u64,
    /// Whether the store ever answered for this lease.
    confirmed: bool,
    /// The largest amount refused since the last grant (the next ask covers it).
    wanted: u64,
    /// The largest request a grant was asked for, until a request that
    /// large is reserved or the lease goes idle: a surplus return keeps that
    /// much, or the request that asked would find it given back before it
    /// came again (and again: a livelock).
    keep: u64,
    /// Last reservation, ms.
    last_used_ms: u64,
    epoch: u32,
    /// The budget window's label the amounts belong to.
    window: u64,
    degraded: Option<Degraded>,
    in_flight: Option<InFlight>,
    /// The window rolled out of, its requests not all settled yet.
    ended: Option<EndedWindow>,
    /// Debt charged to the store (grants' `force`) in this window.
    forced: u64,
    /// When debt was last charged, ms (a rate's credit returns a period later).
    forced_at_ms: u64,
}

impl Lease {
    /// An empty lease made at `now_ms` for budget window `window` (0 for a rate).
    pub fn new(now_ms: u64, window: u64) -> Lease {
        Lease {
            granted: 0,
            reserved: 0,
            spent: 0,
            fleet_remaining: None,
            confirmed_ms: now_ms,
            confirmed: false,
            wanted: 0,
            keep: 0,
            last_used_ms: now_ms,
            epoch: 0,
            window,
            degraded: None,
            in_flight: None,
            ended: None,
            forced: 0,
            forced_at_ms: now_ms,
        }
    }

    /// What may still be overdrawn: β less the debt charged so far (in
    /// this window; for a rate, within the last period).
    pub fn credit(&self, now_ms: u64, p: &LeaseParams) -> u64 {
        let forced = match p.rate_period_ms {
            Some(period) if now_ms.saturating_sub(self.forced_at_ms) >= period => 0,
            _ => self.forced,
        };
        p.max_debt.saturating_sub(forced)
    }

    /// Amount granted and held.
    pub fn granted(&self) -> u64 {
        self.granted
    }

    /// Amount reserved by requests in flight.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Amount settled.
    pub fn spent(&self) -> u64 {
        self.spent
    }

    /// `granted − reserved − spent` (negative: debt).
    pub fn available(&self) -> i128 {
        i128::from(self.granted) - i128::from(self.reserved) - i128::from(self.spent)
    }

    /// What is reserved or spent beyond the grants.
    pub fn debt(&self) -> u64 {
        u64::try_from((-self.available()).max(0)).unwrap_or(u64::MAX)
    }

    /// The fleet's remainder at the store's last answer.
    pub fn fleet_remaining(&self) -> Option<i64> {
        self.fleet_remaining
    }

    /// The budget window the lease counts in.
    pub fn window(&self) -> u64 {
        self.window
    }

    /// The epoch (bumped at each new window).
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    /// The operation awaiting the store's answer.
    pub fn in_flight(&self) -> Option<InFlight> {
        self.in_flight
    }

    /// Whether the fallback is in force.
    pub fn degraded(&self) -> bool {
        self.degraded.is_some()
    }

    /// Whether nothing is held, reserved, owed or pending: the lease may be
    /// forgotten without the store's counter being wrong.
    pub fn settled(&self) -> bool {
        self.reserved == 0
            && self.available() == 0
            && self.in_flight.is_none()
            && self.ended.is_none()
    }

    /// Last reservation, ms.
    pub fn last_used_ms(&self) -> u64 {
        self.last_used_ms
    }

    /// Moves the lease to budget window `window` if it is a new one: the
    /// lease starts empty, and the old window becomes [`EndedWindow`],
    /// whose counter is owed what was used there less what was granted
    /// (the unspent grant back, or the debt). Its requests in flight settle
    /// there ([`Lease::settle`]); an operation in flight is not sent again
    /// (a grant it made stays counted there: over, never under). Returns
    /// the window ended before, if its requests had not all settled (its
    /// delta is sent as it stands, their reservations counted whole).
    pub fn roll(&mut self, window: u64, now_ms: u64) -> Option<EndedWindow> {
        if window == self.window {
            return None;
        }
        let ended = EndedWindow {
            window: self.window,
            reserved: self.reserved,
            delta: i64::try_from(-self.available()).unwrap_or(0),
        };
        let unfinished = self.ended.take();
        *self = Lease {
            epoch: self.epoch.wrapping_add(1),
            // Still as recently used: an active scope is refilled at once in
            // its new window, an idle one is not.
            last_used_ms: self.last_used_ms,
            ended: Some(ended),
            ..Lease::new(now_ms, window)
        };
        unfinished
    }

    /// The window rolled out of, once its requests have all settled: its
    /// delta is due.
    pub fn take_ended(&mut self) -> Option<EndedWindow> {
        if self.ended.is_some_and(|e| e.reserved == 0) {
            return self.ended.take();
        }
        None
    }

    /// The window rolled out of, whatever is still reserved there (the
    /// lease is retired: its delta is sent as it stands).
    pub fn take_ended_now(&mut self) -> Option<EndedWindow> {
        self.ended.take()
    }

    /// The lease size now (see the module documentation).
    pub fn size(&self, p: &LeaseParams) -> u64 {
        let remaining = self
            .fleet_remaining
            .map_or(p.limit, |r| u64::try_from(r.max(0)).unwrap_or(0));
        let share = remaining / (2 * p.expected_gateways.max(1));
        p.max_lease.min(share.max(1))
    }

    /// Whether the lease is past its expiry at `now_ms`.
    pub fn expired(&self, now_ms: u64, p: &LeaseParams) -> bool {
        now_ms.saturating_sub(self.confirmed_ms) > p.ttl_ms
    }

    /// Reserves `amount` at `now_ms`; `store_down`: whether the holder
    /// counts the store as unreachable (every call failing for two sync
    /// intervals): then a lease past its expiry, or never confirmed,
    /// follows the fallback. `force`: reserve even when not covered (shadow
    /// mode), recording the shortfall.
    pub fn reserve(
        &mut self,
        amount: u64,
        now_ms: u64,
        p: &LeaseParams,
        store_down: bool,
        force: bool,
    ) -> (Reservation, Option<Shortfall>) {
        self.last_used_ms = now_ms;
        let shortfall = self.cover(amount, now_ms, p, store_down);
        if shortfall.is_some() {
            self.wanted = self.wanted.max(amount);
            if !force {
                return (
                    Reservation {
                        amount: 0,
                        epoch: self.epoch,
                    },
                    shortfall,
                );
            }
        }
        self.reserved = self.reserved.saturating_add(amount);
        if shortfall.is_none() && amount >= self.keep {
            // The request the grant was kept for got through.
            self.keep = 0;
        }
        (
            Reservation {
                amount,
                epoch: self.epoch,
            },
            shortfall,
        )
    }

    /// Whether `amount` more can be taken now, and if not, why.
    fn cover(
        &mut self,
        amount: u64,
        now_ms: u64,
        p: &LeaseParams,
        store_down: bool,
    ) -> Option<Shortfall> {
        if store_down && (!self.confirmed || self.expired(now_ms, p)) {
            return self.cover_degraded(amount, now_ms, p);
        }
        let headroom = self.available() + i128::from(self.credit(now_ms, p));
        if headroom >= i128::from(amount) {
            return None;
        }
        Some(self.why_short(amount, now_ms, p))
    }

    fn cover_degraded(&mut self, amount: u64, now_ms: u64, p: &LeaseParams) -> Option<Shortfall> {
        let n = p.expected_gateways.max(1);
        let remaining = self
            .fleet_remaining
            .map_or(p.limit, |r| u64::try_from(r.max(0)).unwrap_or(0));
        let headroom = self.available() + i128::from(self.credit(now_ms, p));
        let degraded = self.degraded.get_or_insert(match p.fallback {
            Fallback::FailOpen => Degraded::Open,
            Fallback::FailClosed => Degraded::Closed,
            Fallback::LocalShare => match p.rate_period_ms {
                Some(_) => Degraded::RateShare(RateBucket {
                    scaled: 0,
                    at_ms: now_ms,
                }),
                None => Degraded::Share(remaining / n),
            },
        });
        match degraded {
            Degraded::Open => None,
            Degraded::Closed => Some(Shortfall::Unavailable),
            Degraded::Share(credit) => (headroom + i128::from(*credit) < i128::from(amount))
                .then_some(Shortfall::Exhausted {
                    retry_after_secs: None,
                }),
            Degraded::RateShare(bucket) => {
                // What is still held is spent first; the local bucket, at
                // the rate's share, covers the rest.
                let beyond = u64::try_from(i128::from(amount) - headroom.max(0)).unwrap_or(0);
                if beyond == 0 {
                    return None;
                }
                let period = p.rate_period_ms.unwrap_or(1000);
                let share = (p.limit / n).max(1);
                if bucket.available(now_ms, share, period) >= beyond {
                    bucket.take(now_ms, beyond, share, period);
                    return None;
                }
                let wait = bucket.ms_until(now_ms, beyond, share, period);
                Some(Shortfall::Exhausted {
                    retry_after_secs: (wait != u64::MAX).then(|| ceil_secs(wait).max(1)),
                })
            }
        }
    }

    fn why_short(&self, amount: u64, now_ms: u64, p: &LeaseParams) -> Shortfall {
        let Some(remaining) = self.fleet_remaining else {
            return Shortfall::Refilling;
        };
        // What the fleet must still have for this to pass once refilled.
        let needed =
            i128::from(amount) - self.available().max(0) - i128::from(self.credit(now_ms, p));
        if i128::from(remaining) >= needed {
            return Shortfall::Refilling;
        }
        let retry_after_secs = p.rate_period_ms.and_then(|period| {
            // At the last answer the rate had `remaining`; it refills
            // `limit` per `period`.
            let missing = u64::try_from(needed - i128::from(remaining.max(0))).ok()?;
            if missing > p.limit {
                return None;
            }
            let ms = u128::from(missing) * u128::from(period);
            let ms = u64::try_from(ms.div_ceil(u128::from(p.limit.max(1)))).ok()?;
            let elapsed = now_ms.saturating_sub(self.confirmed_ms);
            Some(ceil_secs(ms.saturating_sub(elapsed)).max(1))
        });
        Shortfall::Exhausted { retry_after_secs }
    }

    /// Notes that a request needing `amount` passed by at `now_ms` without
    /// reserving (another policy refused it): the next refill covers it, so
    /// a request scoped by several new leases waits for one sync, not one
    /// per lease.
    pub fn want(&mut self, amount: u64, now_ms: u64) {
        self.last_used_ms = now_ms;
        if i128::from(amount) > self.available() {
            self.wanted = self.wanted.max(amount);
        }
    }

    /// Settles `reservation` at its exact cost `actual`: the unused part
    /// returns to the lease; an `actual` above it is debt (past β, the next
    /// reservations wait for a grant). A reservation from the window the
    /// lease rolled out of settles there ([`EndedWindow`]); one older still
    /// settles nothing (counted whole).
    pub fn settle(&mut self, reservation: Reservation, actual: u64) {
        if reservation.epoch != self.epoch {
            if let Some(e) = self.ended.as_mut()
                && reservation.epoch == self.epoch.wrapping_sub(1)
            {
                e.reserved = e.reserved.saturating_sub(reservation.amount);
                let correction = i128::from(actual) - i128::from(reservation.amount);
                e.delta = i64::try_from(i128::from(e.delta) + correction).unwrap_or(e.delta);
            }
            return;
        }
        self.reserved = self.reserved.saturating_sub(reservation.amount);
        self.spent = self.spent.saturating_add(actual);
    }

    /// Spends `amount` that had no reservation (a usage attributed after
    /// the fact: a request admitted before verification, settled to the
    /// tenant verification found). Debt if the lease cannot cover it.
    pub fn charge(&mut self, amount: u64, now_ms: u64) {
        self.last_used_ms = now_ms;
        self.spent = self.spent.saturating_add(amount);
    }

    /// A stream drew `delta` more than it had drawn so far, with
    /// `reservation` covering the first `reservation.amount`: the part of
    /// the draw beyond the reservation is taken from the lease (the
    /// reservation grows), and is [`Draw::Uncovered`] when the lease cannot
    /// cover it. `drawn` is the stream's total before this draw.
    pub fn draw(
        &mut self,
        reservation: &mut Reservation,
        drawn: u64,
        delta: u64,
        now_ms: u64,
        p: &LeaseParams,
    ) -> Draw {
        if reservation.epoch != self.epoch {
            return Draw::Covered;
        }
        let total = drawn.saturating_add(delta);
        let beyond = total.saturating_sub(reservation.amount);
        if beyond == 0 {
            return Draw::Covered;
        }
        let covered = self.available() + i128::from(self.credit(now_ms, p)) >= i128::from(beyond)
            || self.degraded == Some(Degraded::Open);
        reservation.amount = total;
        self.reserved = self.reserved.saturating_add(beyond);
        if covered {
            Draw::Covered
        } else {
            Draw::Uncovered
        }
    }

    /// Whether the lease should be refilled now.
    pub fn needs_refill(&self, now_ms: u64, p: &LeaseParams) -> bool {
        if self.in_flight.is_some() {
            return false;
        }
        let recently_used = now_ms.saturating_sub(self.last_used_ms) <= p.idle_ms;
        let low =
            self.available() * 100 < i128::from(self.size(p)) * i128::from(p.low_watermark_percent);
        let short = self.wanted > 0 && i128::from(self.wanted) > self.available();
        self.debt() > 0 || (recently_used && (low || short || self.expired(now_ms, p)))
    }

    /// The operation the lease wants sent at `now_ms` with sequence number
    /// `seq` (`None`: nothing to send, or one is already awaiting an
    /// answer). A return takes its amount out of the lease at once.
    pub fn next_op(&mut self, now_ms: u64, seq: u64, p: &LeaseParams) -> Option<InFlight> {
        if self.in_flight.is_some() {
            return None;
        }
        let size = self.size(p);
        let low = self.available() * 100 < i128::from(size) * i128::from(p.low_watermark_percent);
        let short = self.wanted > 0 && i128::from(self.wanted) > self.available();
        let op = if self.needs_refill(now_ms, p) {
            // Past expiry with enough left, the grant only confirms the
            // lease and learns the fleet's remainder; an idle lease only
            // charges its debt. Neither asks for more.
            let idle = now_ms.saturating_sub(self.last_used_ms) > p.idle_ms;
            let asked = if (low || short) && !idle {
                size.max(self.wanted)
            } else {
                0
            };
            LeaseOp::Grant {
                force: self.debt(),
                asked: asked.min(p.limit),
            }
        } else {
            let available = u64::try_from(self.available().max(0)).unwrap_or(0);
            let idle = self.reserved == 0 && now_ms.saturating_sub(self.last_used_ms) > p.idle_ms;
            let surplus = if idle {
                self.keep = 0;
                available
            } else {
                available.saturating_sub((2 * self.size(p)).max(self.keep))
            };
            if surplus == 0 {
                return None;
            }
            self.granted = self.granted.saturating_sub(surplus);
            LeaseOp::Return { amount: surplus }
        };
        let sent = InFlight {
            seq,
            op,
            epoch: self.epoch,
            awaiting: true,
        };
        self.in_flight = Some(sent);
        Some(sent)
    }

    /// The store answered `seq`: `granted` more (for a grant) and the
    /// fleet's remainder after it. An answer for another operation (or an
    /// earlier window) changes nothing; returns whether it applied.
    pub fn answered(&mut self, seq: u64, granted: u64, remaining: i64, now_ms: u64) -> bool {
        let Some(sent) = self.in_flight else {
            return false;
        };
        if sent.seq != seq || sent.epoch != self.epoch {
            return false;
        }
        if let LeaseOp::Grant { force, .. } = sent.op {
            self.granted = self.granted.saturating_add(force).saturating_add(granted);
            self.keep = self.keep.max(self.wanted);
            self.wanted = 0;
            if force > 0 {
                self.forced = self.forced.saturating_add(force);
                self.forced_at_ms = now_ms;
            }
        }
        self.fleet_remaining = Some(remaining);
        self.confirmed_ms = now_ms;
        self.confirmed = true;
        self.degraded = None;
        self.in_flight = None;
        true
    }

    /// The call carrying `seq` failed: it may or may not have reached the
    /// store, so the operation stays in flight, to be sent again with the
    /// same sequence number (applied at most once).
    pub fn unanswered(&mut self, seq: u64) {
        if let Some(f) = self.in_flight.as_mut()
            && f.seq == seq
        {
            f.awaiting = false;
        }
    }

    /// The operation to send again (in flight, its last call failed).
    pub fn resend(&mut self) -> Option<InFlight> {
        let f = self.in_flight.as_mut()?;
        if f.awaiting {
            return None;
        }
        f.awaiting = true;
        Some(*f)
    }

    /// Forgets the operation in flight for good (the store refused it as
    /// malformed): a grant is lost (the store may have applied it: its
    /// counter then overcounts, never undercounts), a return is kept by the
    /// store.
    pub fn abandon(&mut self, seq: u64) {
        if self.in_flight.is_some_and(|f| f.seq == seq) {
            self.in_flight = None;
        }
    }
}
