//! Observers are the optional, off-path pieces of work a request can switch
//! on: `audit`, `metering`, `cache`, plus names an operator defines. A set of
//! them is a 64-bit mask; names travel between filters as a comma list.

use std::fmt;

/// The built-in observers, in bit order. Their ids are fixed so every filter
/// agrees on them without sharing configuration.
pub const BUILTIN: [&str; 3] = ["audit", "metering", "cache"];

/// Most observers a configuration may name (built-ins included).
pub const MAX_OBSERVERS: usize = 64;

/// Index of an observer in its [`ObserverNames`] table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ObserverId(u8);

impl ObserverId {
    /// Auth audit records.
    pub const AUDIT: ObserverId = ObserverId(0);
    /// Full usage records.
    pub const METERING: ObserverId = ObserverId(1);
    /// Response caching.
    pub const CACHE: ObserverId = ObserverId(2);

    /// The bit position of this observer.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

/// A set of observers, one bit each.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ObserverSet(u64);

impl ObserverSet {
    /// No observer.
    pub const EMPTY: ObserverSet = ObserverSet(0);

    /// The set holding exactly `id`.
    pub fn of(id: ObserverId) -> Self {
        ObserverSet(1 << id.0)
    }

    /// The set from its raw mask.
    pub fn from_bits(bits: u64) -> Self {
        ObserverSet(bits)
    }

    /// The raw mask.
    pub fn bits(self) -> u64 {
        self.0
    }

    /// Whether `id` is in the set.
    pub fn contains(self, id: ObserverId) -> bool {
        self.0 & (1 << id.0) != 0
    }

    /// Adds `id`.
    pub fn insert(&mut self, id: ObserverId) {
        self.0 |= 1 << id.0;
    }

    /// Members of both sets.
    pub fn intersection(self, other: ObserverSet) -> Self {
        ObserverSet(self.0 & other.0)
    }

    /// Members of either set.
    pub fn union(self, other: ObserverSet) -> Self {
        ObserverSet(self.0 | other.0)
    }

    /// Members of `self` not in `other`.
    pub fn difference(self, other: ObserverSet) -> Self {
        ObserverSet(self.0 & !other.0)
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The members, lowest id first.
    pub fn iter(self) -> impl Iterator<Item = ObserverId> {
        (0..MAX_OBSERVERS as u8)
            .filter(move |i| self.0 & (1u64 << i) != 0)
            .map(ObserverId)
    }
}

impl fmt::Debug for ObserverSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ObserverSet({:#x})", self.0)
    }
}

/// The names of the observers a configuration knows: the built-ins first,
/// then the operator's own, each at a fixed id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObserverNames {
    names: Vec<Box<str>>,
}

impl Default for ObserverNames {
    fn default() -> Self {
        Self {
            names: BUILTIN.iter().map(|n| Box::from(*n)).collect(),
        }
    }
}

impl ObserverNames {
    /// Appends an operator-defined observer; the caller has checked the name.
    pub(crate) fn push(&mut self, name: &str) -> Option<ObserverId> {
        if self.names.len() >= MAX_OBSERVERS || self.lookup(name).is_some() {
            return None;
        }
        self.names.push(Box::from(name));
        Some(ObserverId((self.names.len() - 1) as u8))
    }

    /// The id of the observer called `name`.
    pub fn lookup(&self, name: &str) -> Option<ObserverId> {
        self.names
            .iter()
            .position(|n| &**n == name)
            .map(|i| ObserverId(i as u8))
    }

    /// The name of `id`, if this table has it.
    pub fn name(&self, id: ObserverId) -> Option<&str> {
        self.names.get(id.index()).map(|n| &**n)
    }

    /// All names, in id order.
    pub fn all(&self) -> impl Iterator<Item = (ObserverId, &str)> {
        self.names
            .iter()
            .enumerate()
            .map(|(i, n)| (ObserverId(i as u8), &**n))
    }

    /// Writes `set` as a comma list of names (`audit,metering`), the form
    /// filters publish and operators read in logs.
    pub fn render(&self, set: ObserverSet, out: &mut String) {
        let mut first = true;
        for id in set.iter() {
            if let Some(name) = self.name(id) {
                if !first {
                    out.push(',');
                }
                out.push_str(name);
                first = false;
            }
        }
    }

    /// Reads a comma list written by [`ObserverNames::render`]; names this
    /// table does not know are skipped (another filter may define more).
    pub fn parse(&self, list: &[u8]) -> ObserverSet {
        let mut set = ObserverSet::EMPTY;
        for name in list.split(|b| *b == b',') {
            let name = name.trim_ascii();
            if let Some(id) = std::str::from_utf8(name).ok().and_then(|n| self.lookup(n)) {
                set.insert(id);
            }
        }
        set
    }
}

/// Whether a published observers list (`audit,metering`, activation's
/// decision) names observer `name`.
pub fn listed(list: &[u8], name: &str) -> bool {
    list.split(|b| *b == b',')
        .any(|listed| listed.trim_ascii() == name.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_names_an_observer_whole() {
        assert!(listed(b"audit,metering", "metering"));
        assert!(listed(b"audit, cache", "cache"));
        assert!(!listed(b"audit,metering", "meter"));
        assert!(!listed(b"", "audit"));
    }

    #[test]
    fn builtins_have_fixed_ids() {
        let names = ObserverNames::default();
        assert_eq!(names.lookup("audit"), Some(ObserverId::AUDIT));
        assert_eq!(names.lookup("metering"), Some(ObserverId::METERING));
        assert_eq!(names.lookup("cache"), Some(ObserverId::CACHE));
        assert_eq!(names.lookup("shadow"), None);
    }

    #[test]
    fn render_and_parse_round_trip() {
        let mut names = ObserverNames::default();
        let shadow = names.push("shadow").unwrap();
        let mut set = ObserverSet::of(ObserverId::CACHE);
        set.insert(shadow);
        set.insert(ObserverId::AUDIT);
        let mut out = String::new();
        names.render(set, &mut out);
        assert_eq!(out, "audit,cache,shadow");
        assert_eq!(names.parse(out.as_bytes()), set);
        // A filter that only knows the built-ins keeps what it knows.
        let builtin_only = ObserverNames::default();
        assert_eq!(
            builtin_only.parse(b" audit , cache,shadow,"),
            ObserverSet::of(ObserverId::AUDIT).union(ObserverSet::of(ObserverId::CACHE))
        );
        let mut empty = String::new();
        names.render(ObserverSet::EMPTY, &mut empty);
        assert_eq!(empty, "");
        assert_eq!(names.parse(b""), ObserverSet::EMPTY);
    }

    #[test]
    fn table_is_bounded() {
        let mut names = ObserverNames::default();
        for i in 0..(MAX_OBSERVERS - BUILTIN.len()) {
            assert!(names.push(&format!("o{i}")).is_some());
        }
        assert!(names.push("one_too_many").is_none());
        assert!(names.push("audit").is_none());
    }
}
