//! Regular expressions for rule conditions, compiled for the hot path.
//!
//! A fully built DFA answers "does it match?" with one table walk and no
//! scratch space, which is several times faster than a general regex for
//! the short header and path patterns rules use. Patterns whose DFA would be
//! too large (big Unicode classes, counted repetitions) fall back to the
//! `regex` crate.

use regex::bytes::{Regex, RegexBuilder};
use regex_automata::dfa::{Automaton, StartKind, dense};
use regex_automata::util::syntax;
use regex_automata::{Anchored, Input};

/// Largest DFA one pattern may build (it lives in every worker's VM).
const DFA_SIZE_LIMIT: usize = 64 * 1024;
/// Compiled size limit for the fallback regex.
const REGEX_SIZE_LIMIT: usize = 256 * 1024;

/// A compiled pattern (unanchored, like `regex::Regex::is_match`).
#[derive(Debug)]
pub(crate) struct Pattern {
    dfa: Option<dense::DFA<Vec<u32>>>,
    /// The pattern can only match at the start (`^…`): search anchored, so
    /// the DFA stops at the first byte that cannot continue a match.
    anchored: bool,
    regex: Regex,
}

impl Pattern {
    /// Compiles `pattern`; the error is the regex crate's, for the caller to word.
    pub(crate) fn new(pattern: &str) -> Result<Pattern, regex::Error> {
        // The regex crate validates and gives the operator-facing errors.
        let regex = RegexBuilder::new(pattern)
            .size_limit(REGEX_SIZE_LIMIT)
            .build()?;
        let syntax = syntax::Config::new().utf8(false);
        let anchored = syntax::parse_with(pattern, &syntax).is_ok_and(|hir| {
            hir.properties()
                .look_set_prefix()
                .contains(regex_syntax::hir::Look::Start)
        });
        let start = if anchored {
            StartKind::Anchored
        } else {
            StartKind::Unanchored
        };
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .start_kind(start)
                    .dfa_size_limit(Some(DFA_SIZE_LIMIT))
                    .determinize_size_limit(Some(4 * DFA_SIZE_LIMIT)),
            )
            .syntax(syntax)
            .build(pattern)
            .ok();
        Ok(Pattern {
            dfa,
            anchored,
            regex,
        })
    }

    /// Whether `haystack` contains a match.
    #[inline]
    pub(crate) fn is_match(&self, haystack: &[u8]) -> bool {
        if let Some(found) = self
            .dfa
            .as_ref()
            .and_then(|dfa| self.dfa_is_match(dfa, haystack))
        {
            return found;
        }
        self.regex.is_match(haystack)
    }

    /// The DFA walk, one table lookup per byte (regex-automata's documented
    /// low-level loop). `None` when the DFA gives up: it has quit bytes for
    /// Unicode word boundaries on non-ASCII input; the regex crate answers then.
    #[inline]
    fn dfa_is_match(&self, dfa: &dense::DFA<Vec<u32>>, haystack: &[u8]) -> Option<bool> {
        let anchored = if self.anchored {
            Anchored::Yes
        } else {
            Anchored::No
        };
        let mut state = dfa
            .start_state_forward(&Input::new(haystack).anchored(anchored))
            .ok()?;
        if dfa.is_dead_state(state) {
            return Some(false);
        }
        for &byte in haystack {
            state = dfa.next_state(state, byte);
            if dfa.is_special_state(state) {
                // Matches are reported one byte late, so a match state here
                // means a match ended before `byte`.
                if dfa.is_match_state(state) {
                    return Some(true);
                }
                if dfa.is_dead_state(state) {
                    return Some(false);
                }
                if dfa.is_quit_state(state) {
                    return None;
                }
            }
        }
        Some(dfa.is_match_state(dfa.next_eoi_state(state)))
    }

    /// Whether the fast DFA path is in use (for tests).
    #[cfg(test)]
    pub(crate) fn has_dfa(&self) -> bool {
        self.dfa.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dfa_and_regex_agree() {
        let patterns = [
            "^(anthropic|openai)-(python|node)/",
            "^/v1/chat/completions$",
            "ld$",
            "s.l",
            r"\bword\b",
            "^a|b",
            "(^a)|(^b)",
            "(?m)^x",
            "(?i)CURL",
            "^$",
            "é+",
        ];
        let haystacks: [&[u8]; 12] = [
            b"anthropic-python/0.4",
            b"openai-node/1",
            b"/v1/chat/completions",
            b"gold",
            b"a word here",
            b"curl/8",
            b"",
            "café".as_bytes(),
            b"\xff\xfe invalid utf8 word",
            b"xb",
            b"ax",
            b"y\nx",
        ];
        for p in patterns {
            let pattern = Pattern::new(p).unwrap();
            let reference = Regex::new(p).unwrap();
            for h in haystacks {
                assert_eq!(pattern.is_match(h), reference.is_match(h), "{p} on {h:?}");
            }
        }
    }

    #[test]
    fn large_patterns_fall_back_to_the_regex_crate() {
        assert!(Pattern::new("^/v1/").unwrap().has_dfa());
        // The classic exponential DFA: "an `a` 15 bytes from the end".
        let big = Pattern::new("[ab]*a[ab]{14}$").unwrap();
        assert!(!big.has_dfa());
        assert!(big.is_match(format!("a{}", "b".repeat(14)).as_bytes()));
        assert!(!big.is_match("b".repeat(15).as_bytes()));
    }
}
