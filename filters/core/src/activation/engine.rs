//! The compiled rule set and its evaluation. Everything that can be decided
//! at configure time is; evaluating a request reads the request's facts and
//! touches only precompiled data: no allocation, no parsing.

use std::cell::Cell;

use super::pattern::Pattern;
use crate::observers::{ObserverId, ObserverNames, ObserverSet};
use crate::sampling::Rate;

/// Index of a header in [`RuleSet::header_names`]; the host adapter fetches
/// headers by slot, and only the ones a rule actually asks for.
pub type HeaderSlot = usize;

/// What the rule engine may ask about a request. Host adapters implement it
/// over the proxy's request; tests implement it over plain values.
pub trait RequestFacts {
    /// Value of the header named `RuleSet::header_names()[slot]`.
    fn header(&self, slot: HeaderSlot) -> Option<&[u8]>;
    /// The request path as sent (`:path`), query string included.
    fn path(&self) -> &[u8];
    /// The request method (`:method`).
    fn method(&self) -> &[u8];
    /// The tenant the request belongs to, if known.
    fn tenant(&self) -> Option<&[u8]>;
    /// The request id (`x-request-id`), if any.
    fn request_id(&self) -> Option<&[u8]>;
    /// Wall-clock time, seconds since the Unix epoch.
    fn unix_seconds(&self) -> i64;
}

/// The rules that matched a request: bit `i` is `rules[i]` in config order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RuleMask(pub(crate) u64);

impl RuleMask {
    /// Whether the rule at config position `index` matched.
    pub fn contains(self, index: usize) -> bool {
        index < 64 && self.0 & (1 << index) != 0
    }

    /// Config positions of the matching rules, in config order.
    pub fn iter(self) -> impl Iterator<Item = usize> {
        (0..64).filter(move |i| self.0 & (1u64 << i) != 0)
    }

    /// The raw mask.
    pub fn bits(self) -> u64 {
        self.0
    }
}

/// The outcome for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Observers that run for this request.
    pub observers: ObserverSet,
    /// Rules whose condition held.
    pub matched: RuleMask,
}

/// A compiled condition.
#[derive(Debug)]
pub(crate) enum Cond {
    Always,
    HeaderPresent(HeaderSlot, bool),
    HeaderEquals(HeaderSlot, Box<[u8]>),
    HeaderIn(HeaderSlot, Box<[Box<[u8]>]>),
    HeaderMatches(HeaderSlot, Pattern),
    TenantIn(Box<[Box<[u8]>]>),
    PathPrefix(Box<[u8]>),
    PathMatches(Pattern),
    MethodIn(Box<[Box<[u8]>]>),
    /// Hours `[from, to)`, wrapping when `from > to`.
    Hours {
        from: u8,
        to: u8,
    },
    /// Bit `d` set: weekday `d` (Monday = 0) is inside.
    Weekdays(u8),
    Percent(Rate),
    All(Box<[Cond]>),
    Any(Box<[Cond]>),
    Not(Box<Cond>),
}

/// A compiled rule.
#[derive(Debug)]
pub(crate) struct Rule {
    /// Position in the configuration (bit in [`RuleMask`]).
    pub position: usize,
    pub when: Cond,
    pub activate: u64,
    pub deactivate: u64,
}

/// A configuration compiled for evaluation. Build it with
/// [`RuleSet::from_json`] or [`RuleSet::compile`].
#[derive(Debug)]
pub struct RuleSet {
    /// Rules in decision order: priority descending, then config order.
    pub(crate) rules: Box<[Rule]>,
    /// Rule names in config order.
    pub(crate) rule_names: Box<[Box<str>]>,
    pub(crate) observers: ObserverNames,
    pub(crate) defaults: ObserverSet,
    pub(crate) header_names: Box<[Box<str>]>,
    pub(crate) tenant_header: Box<str>,
    pub(crate) utc_offset_seconds: i32,
    pub(crate) debug_response_header: bool,
}

impl RuleSet {
    /// Decides which observers run for `request`.
    ///
    /// Every rule is evaluated (so per-rule counters are exact). For each
    /// observer, the matching rule that comes first in decision order
    /// (highest priority; on a tie, listed first) and names it decides it;
    /// observers no matching rule names keep their default.
    pub fn evaluate<R: RequestFacts + ?Sized>(&self, request: &R) -> Decision {
        let mut decided = 0u64;
        let mut on = 0u64;
        let mut matched = 0u64;
        let eval = Evaluation::new(request, self.utc_offset_seconds);
        for rule in self.rules.iter() {
            if eval.holds(&rule.when) {
                matched |= 1 << rule.position;
                on |= rule.activate & !decided;
                decided |= rule.activate | rule.deactivate;
            }
        }
        let observers = (self.defaults.bits() & !decided) | on;
        Decision {
            observers: ObserverSet::from_bits(observers),
            matched: RuleMask(matched),
        }
    }

    /// The rule that decided `observer` for a request whose matching rules
    /// are `matched` (a [`Decision::matched`] from this rule set): the
    /// configuration position of the first matching rule in decision order
    /// that lists the observer in `activate` or `deactivate`. `None` when no
    /// matching rule lists it, so it kept its default. Not for the hot path:
    /// tools that explain a decision call it (the filters never do).
    pub fn decided_by(&self, matched: RuleMask, observer: ObserverId) -> Option<usize> {
        let bit = ObserverSet::of(observer).bits();
        self.rules
            .iter()
            .find(|rule| {
                matched.contains(rule.position) && (rule.activate | rule.deactivate) & bit != 0
            })
            .map(|rule| rule.position)
    }

    /// Configuration positions of the rules in decision order: priority
    /// descending, equal priorities in configuration order.
    pub fn decision_order(&self) -> impl Iterator<Item = usize> + '_ {
        self.rules.iter().map(|rule| rule.position)
    }

    /// The configured `utc_offset`, in seconds east of UTC (what `hours` and
    /// `weekdays` conditions see, through [`local_hour`] and [`local_weekday`]).
    pub fn utc_offset_seconds(&self) -> i32 {
        self.utc_offset_seconds
    }

    /// Lower-case names of the headers rules read, indexed by [`HeaderSlot`].
    pub fn header_names(&self) -> &[Box<str>] {
        &self.header_names
    }

    /// The header the tenant is read from.
    pub fn tenant_header(&self) -> &str {
        &self.tenant_header
    }

    /// Rule names in configuration order.
    pub fn rule_names(&self) -> &[Box<str>] {
        &self.rule_names
    }

    /// The observer names this configuration knows.
    pub fn observers(&self) -> &ObserverNames {
        &self.observers
    }

    /// Observers on when no rule decides them.
    pub fn defaults(&self) -> ObserverSet {
        self.defaults
    }

    /// Whether responses carry the debug header.
    pub fn debug_response_header(&self) -> bool {
        self.debug_response_header
    }

    /// Whether any rule needs the request id (`percent` conditions).
    pub fn needs_request_id(&self) -> bool {
        self.rules
            .iter()
            .any(|r| uses(&r.when, &|c| matches!(c, Cond::Percent(_))))
    }

    /// Whether any rule reads the clock (`hours`, `weekdays` conditions):
    /// only then does a filter read the host's time for the rules.
    pub fn needs_clock(&self) -> bool {
        self.rules.iter().any(|r| {
            uses(&r.when, &|c| {
                matches!(c, Cond::Hours { .. } | Cond::Weekdays(_))
            })
        })
    }

    /// Whether any rule needs the tenant.
    pub fn needs_tenant(&self) -> bool {
        self.rules
            .iter()
            .any(|r| uses(&r.when, &|c| matches!(c, Cond::TenantIn(_))))
    }
}

fn uses(cond: &Cond, pred: &dyn Fn(&Cond) -> bool) -> bool {
    if pred(cond) {
        return true;
    }
    match cond {
        Cond::All(cs) | Cond::Any(cs) => cs.iter().any(|c| uses(c, pred)),
        Cond::Not(c) => uses(c, pred),
        _ => false,
    }
}

/// One request under evaluation: facts several conditions share (the path
/// without its query, the local hour and weekday) are computed at most once.
struct Evaluation<'r, R: ?Sized> {
    request: &'r R,
    utc_offset: i32,
    /// The path in normal form (see [`crate::path`]), query excluded.
    path: std::cell::OnceCell<std::borrow::Cow<'r, [u8]>>,
    clock: Cell<Option<(u8, u8)>>,
}

impl<'r, R: RequestFacts + ?Sized> Evaluation<'r, R> {
    fn new(request: &'r R, utc_offset: i32) -> Self {
        Evaluation {
            request,
            utc_offset,
            path: std::cell::OnceCell::new(),
            clock: Cell::new(None),
        }
    }

    /// Rules see the path the backend serves (`//v1/messages` is
    /// `/v1/messages`); one without a normal form is matched as sent.
    fn path(&self) -> &[u8] {
        self.path.get_or_init(|| {
            let raw = self.request.path();
            crate::path::normalize(raw)
                .unwrap_or_else(|_| std::borrow::Cow::Borrowed(path_without_query(raw)))
        })
    }

    /// Local (hour, weekday).
    fn clock(&self) -> (u8, u8) {
        if let Some(clock) = self.clock.get() {
            return clock;
        }
        let now = self.request.unix_seconds();
        let clock = (
            local_hour(now, self.utc_offset),
            local_weekday(now, self.utc_offset),
        );
        self.clock.set(Some(clock));
        clock
    }

    /// Leaves are evaluated inline; only combinators cost a call, which keeps
    /// the common flat rule free of function prologues.
    #[inline(always)]
    fn holds(&self, cond: &Cond) -> bool {
        let req = self.request;
        match cond {
            Cond::Always => true,
            Cond::HeaderPresent(slot, present) => req.header(*slot).is_some() == *present,
            Cond::HeaderEquals(slot, value) => req.header(*slot) == Some(&**value),
            Cond::HeaderIn(slot, values) => req
                .header(*slot)
                .is_some_and(|v| values.iter().any(|x| **x == *v)),
            Cond::HeaderMatches(slot, re) => req.header(*slot).is_some_and(|v| re.is_match(v)),
            Cond::TenantIn(values) => req
                .tenant()
                .is_some_and(|t| values.iter().any(|x| **x == *t)),
            Cond::PathPrefix(prefix) => self.path().starts_with(prefix),
            Cond::PathMatches(re) => re.is_match(self.path()),
            Cond::MethodIn(values) => {
                let method = req.method();
                values.iter().any(|x| x.eq_ignore_ascii_case(method))
            }
            Cond::Hours { from, to } => {
                let hour = self.clock().0;
                if from < to {
                    *from <= hour && hour < *to
                } else {
                    hour >= *from || hour < *to
                }
            }
            Cond::Weekdays(mask) => mask & (1 << self.clock().1) != 0,
            Cond::Percent(rate) => req.request_id().is_some_and(|id| rate.includes(id)),
            Cond::All(_) | Cond::Any(_) | Cond::Not(_) => self.holds_combined(cond),
        }
    }

    #[inline(never)]
    fn holds_combined(&self, cond: &Cond) -> bool {
        match cond {
            Cond::All(cs) => cs.iter().all(|c| self.holds(c)),
            Cond::Any(cs) => cs.iter().any(|c| self.holds(c)),
            Cond::Not(c) => !self.holds(c),
            leaf => self.holds(leaf),
        }
    }
}

/// The path up to (not including) `?`.
pub fn path_without_query(path: &[u8]) -> &[u8] {
    match path.iter().position(|b| *b == b'?') {
        Some(end) => &path[..end],
        None => path,
    }
}

const SECONDS_PER_DAY: i64 = 86_400;

/// Hour of day (0–23) at `unix` seconds in the given UTC offset.
pub fn local_hour(unix: i64, utc_offset_seconds: i32) -> u8 {
    let local = unix.saturating_add(i64::from(utc_offset_seconds));
    (local.rem_euclid(SECONDS_PER_DAY) / 3600) as u8
}

/// Weekday (Monday = 0 … Sunday = 6) at `unix` seconds in the given UTC offset.
pub fn local_weekday(unix: i64, utc_offset_seconds: i32) -> u8 {
    let local = unix.saturating_add(i64::from(utc_offset_seconds));
    let days = local.div_euclid(SECONDS_PER_DAY);
    // 1970-01-01 was a Thursday (3 with Monday = 0).
    (days + 3).rem_euclid(7) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calendar() {
        // 2026-11-29 12:00:00 UTC is a Sunday.
        let t = 1_795_953_600;
        assert_eq!(local_hour(t, 0), 12);
        assert_eq!(local_weekday(t, 0), 6);
        // 14 hours east it is already Monday 02:00.
        assert_eq!(local_hour(t, 14 * 3600), 2);
        assert_eq!(local_weekday(t, 14 * 3600), 0);
        // Before the epoch.
        assert_eq!(local_weekday(-1, 0), 2);
        assert_eq!(local_hour(-1, 0), 23);
    }

    /// A request with only a path (no headers, no id, the epoch).
    struct PathOnly(&'static str);

    impl RequestFacts for PathOnly {
        fn header(&self, _: HeaderSlot) -> Option<&[u8]> {
            None
        }
        fn path(&self) -> &[u8] {
            self.0.as_bytes()
        }
        fn method(&self) -> &[u8] {
            b"GET"
        }
        fn tenant(&self) -> Option<&[u8]> {
            None
        }
        fn request_id(&self) -> Option<&[u8]> {
            None
        }
        fn unix_seconds(&self) -> i64 {
            0
        }
    }

    #[test]
    fn decided_by_names_the_first_matching_rule_in_decision_order() {
        let rules = RuleSet::from_json(
            br#"{"defaults":["audit"],"utc_offset":"-05:30","rules":[
                {"name":"low","priority":1,"activate":["metering","cache"]},
                {"name":"high","priority":9,"when":{"path":{"prefix":"/v1"}},"deactivate":["metering"]},
                {"name":"never","priority":50,"when":{"any":[]},"activate":["metering"]}]}"#,
        )
        .unwrap();
        assert_eq!(rules.decision_order().collect::<Vec<_>>(), [2, 1, 0]);
        assert_eq!(rules.utc_offset_seconds(), -(5 * 3600 + 30 * 60));

        let v1 = rules.evaluate(&PathOnly("/v1/messages"));
        assert_eq!(v1.matched.iter().collect::<Vec<_>>(), [0, 1]);
        // `never` lists metering but did not match: `high` decides it (off).
        assert_eq!(rules.decided_by(v1.matched, ObserverId::METERING), Some(1));
        assert!(!v1.observers.contains(ObserverId::METERING));
        // Only `low` lists cache.
        assert_eq!(rules.decided_by(v1.matched, ObserverId::CACHE), Some(0));
        // Nobody lists audit: it kept its default.
        assert_eq!(rules.decided_by(v1.matched, ObserverId::AUDIT), None);
        assert!(v1.observers.contains(ObserverId::AUDIT));

        let other = rules.evaluate(&PathOnly("/healthz"));
        assert_eq!(
            rules.decided_by(other.matched, ObserverId::METERING),
            Some(0)
        );
        assert!(other.observers.contains(ObserverId::METERING));
        // No rule matched at all: nothing decided anything.
        assert_eq!(
            rules.decided_by(RuleMask::default(), ObserverId::CACHE),
            None
        );
    }

    #[test]
    fn query_is_not_part_of_the_path() {
        assert_eq!(
            path_without_query(b"/v1/messages?beta=true"),
            b"/v1/messages"
        );
        assert_eq!(path_without_query(b"/v1/messages"), b"/v1/messages");
        assert_eq!(path_without_query(b"?x"), b"");
    }
}
