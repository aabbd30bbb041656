//! Turns an [`ActivationConfig`] into a [`RuleSet`], checking everything
//! serde cannot: names, regexes, ranges, references to observers. Each error
//! names the field path and the bad value.

use super::engine::{Cond, HeaderSlot, Rule, RuleSet};
use super::pattern::Pattern;
use super::schema::{
    ActivationConfig, Condition, HeaderCondition, HoursRange, InList, PathCondition, WeekdayRange,
};
use crate::config::{ConfigError, from_json, invalid_regex, is_token_byte, quoted};
use crate::observers::{BUILTIN, MAX_OBSERVERS, ObserverNames, ObserverSet};
use crate::sampling::Rate;

/// Most rules one configuration may hold (one bit each in a [`super::RuleMask`]).
pub const MAX_RULES: usize = 64;
/// Deepest nesting of `all` / `any` / `not`.
pub const MAX_DEPTH: usize = 16;
/// Header the tenant is read from unless configured.
pub const DEFAULT_TENANT_HEADER: &str = "x-tenant-id";

impl RuleSet {
    /// Parses and compiles a JSON configuration.
    pub fn from_json(bytes: &[u8]) -> Result<RuleSet, ConfigError> {
        let config: ActivationConfig = from_json(bytes)?;
        RuleSet::compile(&config)
    }

    /// Compiles a parsed configuration.
    pub fn compile(config: &ActivationConfig) -> Result<RuleSet, ConfigError> {
        let observers = observer_names(&config.custom_observers)?;
        let defaults = observer_set(&observers, &config.defaults, "defaults")?;
        let tenant_header = match &config.tenant_header {
            Some(name) => header_name(name, "tenant_header")?,
            None => DEFAULT_TENANT_HEADER.into(),
        };
        let utc_offset_seconds = match &config.utc_offset {
            Some(offset) => utc_offset(offset)?,
            None => 0,
        };
        if config.rules.len() > MAX_RULES {
            return Err(ConfigError::new(
                "rules",
                format!("at most {MAX_RULES} rules (got {})", config.rules.len()),
            ));
        }

        let mut compiler = Compiler::default();
        let mut rules = Vec::with_capacity(config.rules.len());
        let mut rule_names: Vec<Box<str>> = Vec::with_capacity(config.rules.len());
        for (position, rule) in config.rules.iter().enumerate() {
            let at = format!("rules[{position}]");
            check_name(&rule.name, &format!("{at}.name"), "rule")?;
            if let Some(earlier) = rule_names.iter().position(|n| **n == *rule.name) {
                return Err(ConfigError::new(
                    format!("{at}.name"),
                    format!(
                        "duplicate rule name {} (also rules[{earlier}])",
                        quoted(&rule.name)
                    ),
                ));
            }
            let activate = observer_set(&observers, &rule.activate, &format!("{at}.activate"))?;
            let deactivate =
                observer_set(&observers, &rule.deactivate, &format!("{at}.deactivate"))?;
            if let Some((i, name)) = rule
                .deactivate
                .iter()
                .enumerate()
                .find(|(_, n)| observers.lookup(n).is_some_and(|id| activate.contains(id)))
            {
                return Err(ConfigError::new(
                    format!("{at}.deactivate[{i}]"),
                    format!("{} is also in activate", quoted(name)),
                ));
            }
            let when = match &rule.when {
                Some(cond) => compiler.condition(cond, &format!("{at}.when"), 0)?,
                None => Cond::Always,
            };
            rules.push((
                rule.priority,
                Rule {
                    position,
                    when,
                    activate: activate.bits(),
                    deactivate: deactivate.bits(),
                },
            ));
            rule_names.push(rule.name.as_str().into());
        }
        // Decision order: priority descending; the sort is stable, so equal
        // priorities keep configuration order.
        rules.sort_by_key(|(priority, _)| std::cmp::Reverse(*priority));

        Ok(RuleSet {
            rules: rules.into_iter().map(|(_, r)| r).collect(),
            rule_names: rule_names.into(),
            observers,
            defaults,
            header_names: compiler.headers.into(),
            tenant_header,
            utc_offset_seconds,
            debug_response_header: config.debug_response_header,
        })
    }
}

#[derive(Default)]
struct Compiler {
    headers: Vec<Box<str>>,
}

impl Compiler {
    fn slot(&mut self, name: &str, at: &str) -> Result<HeaderSlot, ConfigError> {
        let name = header_name(name, at)?;
        if let Some(slot) = self.headers.iter().position(|h| *h == name) {
            return Ok(slot);
        }
        self.headers.push(name);
        Ok(self.headers.len() - 1)
    }

    fn condition(&mut self, cond: &Condition, at: &str, depth: usize) -> Result<Cond, ConfigError> {
        if depth > MAX_DEPTH {
            return Err(ConfigError::new(
                at,
                format!("conditions nested deeper than {MAX_DEPTH}"),
            ));
        }
        Ok(match cond {
            Condition::Header(h) => self.header(h, &format!("{at}.header"))?,
            Condition::Tenant(list) => Cond::TenantIn(values(list, &format!("{at}.tenant.in"))?),
            Condition::Path(p) => path(p, &format!("{at}.path"))?,
            Condition::Method(list) => {
                let at = format!("{at}.method.in");
                for (i, m) in list.values.iter().enumerate() {
                    if m.is_empty() || !m.bytes().all(is_token_byte) {
                        return Err(ConfigError::new(
                            format!("{at}[{i}]"),
                            format!("invalid method {}", quoted(m)),
                        ));
                    }
                }
                Cond::MethodIn(values(list, &at)?)
            }
            Condition::Hours(h) => hours(h, &format!("{at}.hours"))?,
            Condition::Weekdays(w) => Cond::Weekdays(weekdays(w)),
            Condition::Percent(p) => Cond::Percent(Rate::from_percent(*p).ok_or_else(|| {
                ConfigError::new(
                    format!("{at}.percent"),
                    format!("{p} must be 0-100 with at most two decimals"),
                )
            })?),
            Condition::All(cs) => Cond::All(self.conditions(cs, &format!("{at}.all"), depth)?),
            Condition::Any(cs) => Cond::Any(self.conditions(cs, &format!("{at}.any"), depth)?),
            Condition::Not(c) => Cond::Not(Box::new(self.condition(
                c,
                &format!("{at}.not"),
                depth + 1,
            )?)),
        })
    }

    fn conditions(
        &mut self,
        cs: &[Condition],
        at: &str,
        depth: usize,
    ) -> Result<Box<[Cond]>, ConfigError> {
        cs.iter()
            .enumerate()
            .map(|(i, c)| self.condition(c, &format!("{at}[{i}]"), depth + 1))
            .collect()
    }

    fn header(&mut self, h: &HeaderCondition, at: &str) -> Result<Cond, ConfigError> {
        let slot = self.slot(&h.name, &format!("{at}.name"))?;
        let given: Vec<&str> = [
            ("exists", h.exists.is_some()),
            ("equals", h.equals.is_some()),
            ("in", h.one_of.is_some()),
            ("matches", h.matches.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect();
        if given.len() != 1 {
            return Err(ConfigError::new(
                at,
                format!(
                    "exactly one of exists, equals, in, matches is required (found {})",
                    if given.is_empty() {
                        "none".to_string()
                    } else {
                        given.join(", ")
                    }
                ),
            ));
        }
        Ok(if let Some(present) = h.exists {
            Cond::HeaderPresent(slot, present)
        } else if let Some(value) = &h.equals {
            Cond::HeaderEquals(slot, value.as_bytes().into())
        } else if let Some(list) = &h.one_of {
            Cond::HeaderIn(slot, non_empty(list, &format!("{at}.in"))?)
        } else if let Some(pattern) = &h.matches {
            Cond::HeaderMatches(slot, regex(pattern, &format!("{at}.matches"))?)
        } else {
            Cond::Always
        })
    }
}

fn path(p: &PathCondition, at: &str) -> Result<Cond, ConfigError> {
    match (&p.prefix, &p.matches) {
        (Some(prefix), None) => {
            if !prefix.starts_with('/') {
                return Err(ConfigError::new(
                    format!("{at}.prefix"),
                    format!("must start with \"/\" (got {})", quoted(prefix)),
                ));
            }
            Ok(Cond::PathPrefix(prefix.as_bytes().into()))
        }
        (None, Some(pattern)) => Ok(Cond::PathMatches(regex(pattern, &format!("{at}.matches"))?)),
        (Some(_), Some(_)) => Err(ConfigError::new(
            at,
            "exactly one of prefix, matches is required (found prefix, matches)",
        )),
        (None, None) => Err(ConfigError::new(
            at,
            "exactly one of prefix, matches is required (found none)",
        )),
    }
}

fn hours(h: &HoursRange, at: &str) -> Result<Cond, ConfigError> {
    if h.from > 23 {
        return Err(ConfigError::new(
            format!("{at}.from"),
            format!("{} is not an hour (0-23)", h.from),
        ));
    }
    if h.to == 0 || h.to > 24 {
        return Err(ConfigError::new(
            format!("{at}.to"),
            format!("{} is not an end hour (1-24)", h.to),
        ));
    }
    if h.from == h.to {
        return Err(ConfigError::new(
            at,
            format!("from and to are both {}: the range is empty", h.from),
        ));
    }
    Ok(Cond::Hours {
        from: h.from,
        to: h.to % 24,
    })
}

fn weekdays(w: &WeekdayRange) -> u8 {
    let (from, to) = (w.from.index(), w.to.index());
    let mut mask = 0u8;
    let mut day = from;
    loop {
        mask |= 1 << day;
        if day == to {
            return mask;
        }
        day = (day + 1) % 7;
    }
}

fn values(list: &InList, at: &str) -> Result<Box<[Box<[u8]>]>, ConfigError> {
    non_empty(&list.values, at)
}

fn non_empty(list: &[String], at: &str) -> Result<Box<[Box<[u8]>]>, ConfigError> {
    if list.is_empty() {
        return Err(ConfigError::new(at, "empty list never matches"));
    }
    Ok(list.iter().map(|v| v.as_bytes().into()).collect())
}

fn regex(pattern: &str, at: &str) -> Result<Pattern, ConfigError> {
    Pattern::new(pattern).map_err(|err| ConfigError::new(at, invalid_regex(pattern, &err)))
}

/// A valid header name, lower-cased (HTTP/2 and Envoy use lower case).
fn header_name(name: &str, at: &str) -> Result<Box<str>, ConfigError> {
    let body = name.strip_prefix(':').unwrap_or(name);
    if body.is_empty() || !body.bytes().all(is_token_byte) {
        return Err(ConfigError::new(
            at,
            format!("invalid header name {}", quoted(name)),
        ));
    }
    // The filter removes a client's `x-zerolayer-*` headers, but it reads
    // the request before it removes them: a rule on one would see the
    // client's forged value. None is the client's to set, so none is a fact.
    if crate::internal::is_internal_header(name) {
        return Err(ConfigError::new(
            at,
            format!(
                "{} is reserved: zerolayer removes client-sent {}* headers, so no rule may read one",
                quoted(name),
                crate::internal::INTERNAL_HEADER_PREFIX
            ),
        ));
    }
    Ok(name.to_ascii_lowercase().into())
}

/// Rule and observer names end up in metric names: keep them plain.
fn check_name(name: &str, at: &str, what: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ConfigError::new(
            at,
            format!(
                "invalid {what} name {}: use 1-64 of [A-Za-z0-9_-]",
                quoted(name)
            ),
        ))
    }
}

fn observer_names(custom: &[String]) -> Result<ObserverNames, ConfigError> {
    let mut names = ObserverNames::default();
    let room = MAX_OBSERVERS - BUILTIN.len();
    if custom.len() > room {
        return Err(ConfigError::new(
            "custom_observers",
            format!("at most {room} custom observers (got {})", custom.len()),
        ));
    }
    for (i, name) in custom.iter().enumerate() {
        let at = format!("custom_observers[{i}]");
        check_name(name, &at, "observer")?;
        if name.to_ascii_lowercase().starts_with("auth") {
            // Activation only switches optional observers; a name that reads
            // like authentication would suggest it could switch that off.
            return Err(ConfigError::new(
                at,
                format!(
                    "{} is reserved: activation turns optional observers on and off, never authentication",
                    quoted(name)
                ),
            ));
        }
        if names.push(name).is_none() {
            return Err(ConfigError::new(
                at,
                format!("duplicate observer {}", quoted(name)),
            ));
        }
    }
    Ok(names)
}

fn observer_set(
    names: &ObserverNames,
    list: &[String],
    at: &str,
) -> Result<ObserverSet, ConfigError> {
    let mut set = ObserverSet::EMPTY;
    for (i, name) in list.iter().enumerate() {
        let Some(id) = names.lookup(name) else {
            let known: Vec<&str> = names.all().map(|(_, n)| n).collect();
            return Err(ConfigError::new(
                format!("{at}[{i}]"),
                format!(
                    "unknown observer {}; known: {}",
                    quoted(name),
                    known.join(", ")
                ),
            ));
        };
        set.insert(id);
    }
    Ok(set)
}

/// Seconds east of UTC from `+HH:MM` / `-HH:MM` (at most ±14:00).
fn utc_offset(text: &str) -> Result<i32, ConfigError> {
    let bad = || {
        ConfigError::new(
            "utc_offset",
            format!(
                "invalid offset {}: use +HH:MM or -HH:MM within ±14:00",
                quoted(text)
            ),
        )
    };
    let bytes = text.as_bytes();
    if !text.is_ascii() || bytes.len() != 6 || bytes[3] != b':' {
        return Err(bad());
    }
    let sign = match bytes[0] {
        b'+' => 1,
        b'-' => -1,
        _ => return Err(bad()),
    };
    let digits = |s: &str| -> Option<i32> {
        s.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| s.parse().ok())
            .flatten()
    };
    let (Some(h), Some(m)) = (digits(&text[1..3]), digits(&text[4..6])) else {
        return Err(bad());
    };
    if m > 59 || h * 60 + m > 14 * 60 {
        return Err(bad());
    }
    Ok(sign * (h * 3600 + m * 60))
}
