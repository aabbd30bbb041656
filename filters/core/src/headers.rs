//! A header map as the Proxy-Wasm host hands it over
//! (`proxy_get_header_map_pairs`), read in place: one buffer for the whole
//! map instead of two allocations per header, which is most of what reading
//! a map costs inside a Wasm VM. Changes a filter makes later are kept
//! beside the buffer, so lookups see the map as the host now has it.
//!
//! Layout (little-endian): `count: u32`, then `count` pairs of
//! `(key_len: u32, value_len: u32)`, then each key and value in order, each
//! followed by a NUL byte.

use thiserror::Error;

/// Why a host's header map bytes were refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum HeaderBlockError {
    /// Shorter than its counts and lengths say.
    #[error("header map truncated: {needed} bytes needed, {len} given")]
    Truncated {
        /// Bytes the counts and lengths call for.
        needed: usize,
        /// Bytes given.
        len: usize,
    },
    /// A key or value is not followed by its NUL byte.
    #[error("header map entry {index} is not NUL-terminated")]
    Unterminated {
        /// The entry's position.
        index: usize,
    },
}

/// A header map read in place, with the changes made since it was read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderBlock {
    bytes: Vec<u8>,
    count: usize,
    /// Set (`value` `Some`) or removed headers, at most one per name, in
    /// the order they were changed.
    changes: Vec<Change>,
    /// The changed names (lower case) and values, in one buffer: a response
    /// gets six rate-limit headers, which would be twelve allocations.
    /// Replaced changes leave their bytes until the map is dropped (a
    /// stream's stages set each header a few times at most).
    changed: Vec<u8>,
}

/// One change: where its name and value are in [`HeaderBlock::changed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Change {
    name: (usize, usize),
    value: Option<(usize, usize)>,
}

impl Change {
    /// Whether this change is to header `name` (any case); lengths are
    /// compared before the name is sliced, as in `find_read`.
    #[inline]
    fn is_to(&self, changed: &[u8], name: &[u8]) -> bool {
        self.name.1.wrapping_sub(self.name.0) == name.len() && eq(span(changed, self.name), name)
    }
}

/// Room made for the changes at the first one (bytes, changes).
const CHANGED_ROOM: (usize, usize) = (512, 8);

/// The bytes of `span` in `buffer`.
fn span(buffer: &[u8], (start, end): (usize, usize)) -> &[u8] {
    buffer.get(start..end).unwrap_or_default()
}

/// Reads the `i`th little-endian u32 at `at`.
fn u32_at(bytes: &[u8], at: usize) -> Option<usize> {
    let word = bytes.get(at..at + 4)?;
    Some(u32::from_le_bytes([word[0], word[1], word[2], word[3]]) as usize)
}

impl HeaderBlock {
    /// The map in the host's serialized form; checked once here, so reading
    /// it later cannot go out of bounds. An empty buffer is an empty map.
    pub fn parse(bytes: Vec<u8>) -> Result<HeaderBlock, HeaderBlockError> {
        if bytes.is_empty() {
            return Ok(HeaderBlock::default());
        }
        let truncated = |needed| HeaderBlockError::Truncated {
            needed,
            len: bytes.len(),
        };
        let count = u32_at(&bytes, 0).ok_or(truncated(4))?;
        let mut data = count
            .checked_mul(8)
            .and_then(|n| n.checked_add(4))
            .ok_or(truncated(usize::MAX))?;
        if data > bytes.len() {
            return Err(truncated(data));
        }
        for index in 0..count {
            for half in 0..2 {
                let len = u32_at(&bytes, 4 + index * 8 + half * 4).ok_or(truncated(data))?;
                let end = data.checked_add(len).ok_or(truncated(usize::MAX))?;
                match bytes.get(end) {
                    Some(0) => data = end + 1,
                    Some(_) => return Err(HeaderBlockError::Unterminated { index }),
                    None => return Err(truncated(end + 1)),
                }
            }
        }
        Ok(HeaderBlock {
            bytes,
            count,
            ..HeaderBlock::default()
        })
    }

    /// The serialized form of `pairs`: what a host hands over (host-sim
    /// serializes its maps with this).
    pub fn serialize<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Vec<u8> {
        let pairs: Vec<(&str, &[u8])> = pairs.into_iter().collect();
        let size = 4 + pairs
            .iter()
            .map(|(k, v)| 8 + k.len() + v.len() + 2)
            .sum::<usize>();
        let mut out = Vec::with_capacity(size);
        out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
        for (key, value) in &pairs {
            out.extend_from_slice(&(key.len() as u32).to_le_bytes());
            out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        }
        for (key, value) in &pairs {
            out.extend_from_slice(key.as_bytes());
            out.push(0);
            out.extend_from_slice(value);
            out.push(0);
        }
        out
    }

    /// A map of `pairs` as a host without the serialized form hands them
    /// over (Envoy's dynamic modules: a view per header), in one buffer.
    pub fn from_pairs<'a>(pairs: &[(&'a [u8], &'a [u8])]) -> HeaderBlock {
        let size = 4 + pairs
            .iter()
            .map(|(k, v)| 8 + k.len() + v.len() + 2)
            .sum::<usize>();
        let mut bytes = Vec::with_capacity(size);
        bytes.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
        for (key, value) in pairs {
            bytes.extend_from_slice(&(key.len() as u32).to_le_bytes());
            bytes.extend_from_slice(&(value.len() as u32).to_le_bytes());
        }
        for (key, value) in pairs {
            bytes.extend_from_slice(key);
            bytes.push(0);
            bytes.extend_from_slice(value);
            bytes.push(0);
        }
        HeaderBlock {
            bytes,
            count: pairs.len(),
            ..HeaderBlock::default()
        }
    }

    /// Each pair as read from the host: where its key starts, the key's
    /// and the value's lengths (the length table walked once, for every
    /// reader of the map).
    fn entries(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let table = self.bytes.get(4..4 + self.count * 8).unwrap_or_default();
        let mut data = 4 + self.count * 8;
        table.chunks_exact(8).map(move |lengths| {
            let key_len = u32::from_le_bytes([lengths[0], lengths[1], lengths[2], lengths[3]]);
            let value_len = u32::from_le_bytes([lengths[4], lengths[5], lengths[6], lengths[7]]);
            let (key_len, value_len) = (key_len as usize, value_len as usize);
            let key = data;
            // In bounds and NUL-terminated: checked by `parse`.
            data += key_len + value_len + 2;
            (key, key_len, value_len)
        })
    }

    /// The value of the pair whose key starts at `key` and is `key_len` long.
    fn value_at(&self, key: usize, key_len: usize, value_len: usize) -> &[u8] {
        let value = key + key_len + 1;
        span(&self.bytes, (value, value + value_len))
    }

    /// The headers as read from the host, in order (changes not applied).
    fn read(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.entries().map(|(key, key_len, value_len)| {
            (
                span(&self.bytes, (key, key + key_len)),
                self.value_at(key, key_len, value_len),
            )
        })
    }

    /// Every header, in order: those read from the host and not changed
    /// since, then those set since, in the order they were set.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let read = self.read().filter(|(key, _)| self.change_of(key).is_none());
        let set = self.changes.iter().filter_map(|c| {
            c.value
                .map(|v| (span(&self.changed, c.name), span(&self.changed, v)))
        });
        read.chain(set)
    }

    /// The change made to header `name`, if any.
    fn change_of(&self, name: &[u8]) -> Option<&Change> {
        self.changes.iter().find(|c| c.is_to(&self.changed, name))
    }

    /// The first value of header `name` (any case).
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        if let Some(change) = self.change_of(name.as_bytes()) {
            return change.value.map(|v| span(&self.changed, v));
        }
        self.find_read(name.as_bytes())
    }

    /// The first value of `name` as read from the host. Every lookup of
    /// every stage runs this: lengths are compared from the table before
    /// any name is sliced, and no value is sliced but the one found.
    fn find_read(&self, name: &[u8]) -> Option<&[u8]> {
        self.entries()
            .find(|&(key, key_len, _)| {
                key_len == name.len() && eq(span(&self.bytes, (key, key + key_len)), name)
            })
            .map(|(key, key_len, value_len)| self.value_at(key, key_len, value_len))
    }

    /// Header `name` now has the one value `value`.
    pub fn set(&mut self, name: &str, value: &[u8]) {
        self.change(name, Some(value));
    }

    /// Header `name` is gone.
    pub fn remove(&mut self, name: &str) {
        self.change(name, None);
    }

    fn change(&mut self, name: &str, value: Option<&[u8]>) {
        // At most one change per name: the earlier one goes (a header set
        // again moves to the end, as the host appends it).
        let changed = &self.changed;
        if let Some(at) = self
            .changes
            .iter()
            .position(|c| c.is_to(changed, name.as_bytes()))
        {
            self.changes.remove(at);
        }
        if self.changes.capacity() == 0 {
            self.changed.reserve(CHANGED_ROOM.0);
            self.changes.reserve(CHANGED_ROOM.1);
        }
        let start = self.changed.len();
        self.changed.extend_from_slice(name.as_bytes());
        if let Some(added) = self.changed.get_mut(start..) {
            added.make_ascii_lowercase();
        }
        let name = (start, self.changed.len());
        let value = value.map(|v| {
            let start = self.changed.len();
            self.changed.extend_from_slice(v);
            (start, self.changed.len())
        });
        self.changes.push(Change { name, value });
    }
}

/// Header names compare without regard to ASCII case. Inlined: most
/// comparisons in a lookup differ in length and end at the first test.
#[inline]
fn eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.eq_ignore_ascii_case(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn block(pairs: &[(&str, &str)]) -> HeaderBlock {
        let bytes = HeaderBlock::serialize(pairs.iter().map(|(k, v)| (*k, v.as_bytes())));
        HeaderBlock::parse(bytes).expect("well-formed")
    }

    fn all(block: &HeaderBlock) -> Vec<(String, String)> {
        block
            .iter()
            .map(|(k, v)| {
                (
                    String::from_utf8_lossy(k).into_owned(),
                    String::from_utf8_lossy(v).into_owned(),
                )
            })
            .collect()
    }

    proptest! {
        #[test]
        fn a_map_from_views_is_the_map_its_serialized_form_parses_to(
            pairs in proptest::collection::vec(("[a-z:-]{0,12}", "[ -~]{0,40}"), 0..12)
        ) {
            let views: Vec<(&[u8], &[u8])> =
                pairs.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())).collect();
            let parsed = HeaderBlock::parse(HeaderBlock::serialize(
                pairs.iter().map(|(k, v)| (k.as_str(), v.as_bytes())),
            ))
            .expect("well-formed");
            prop_assert_eq!(HeaderBlock::from_pairs(&views), parsed);
        }
    }

    proptest! {
        /// A lookup finds what a walk over the pairs finds first, any case.
        #[test]
        fn a_lookup_is_the_first_pair_of_that_name(
            pairs in proptest::collection::vec(("[a-cA-C:-]{0,4}", "[ -~]{0,12}"), 0..12),
            name in "[a-cA-C:-]{0,4}",
        ) {
            let headers = block(&pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect::<Vec<_>>());
            let first = pairs
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(&name))
                .map(|(_, v)| v.as_bytes());
            prop_assert_eq!(headers.get(&name), first);
        }
    }

    #[test]
    fn reads_in_place_with_changes_on_top() {
        let mut headers = block(&[
            (":method", "POST"),
            ("authorization", "Bearer abc"),
            ("x-zerolayer-debug", "1"),
            ("accept", "a"),
            ("accept", "b"),
        ]);
        assert_eq!(headers.get("Authorization"), Some(&b"Bearer abc"[..]));
        assert_eq!(headers.get("accept"), Some(&b"a"[..]), "the first value");
        assert_eq!(headers.get("missing"), None);
        headers.remove("X-Zerolayer-Debug");
        headers.set("content-length", b"42");
        headers.set("accept", b"c");
        assert_eq!(headers.get("x-zerolayer-debug"), None);
        assert_eq!(headers.get("content-length"), Some(&b"42"[..]));
        assert_eq!(
            headers.get("accept"),
            Some(&b"c"[..]),
            "set replaces every value"
        );
        assert_eq!(
            all(&headers),
            [
                (":method", "POST"),
                ("authorization", "Bearer abc"),
                ("content-length", "42"),
                ("accept", "c"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
    }

    proptest! {
        /// Any sequence of sets and removes reads back as a plain list of
        /// changes on top of the map would (each name changed moves last).
        #[test]
        fn changes_read_back_as_a_list_of_them_would(
            pairs in proptest::collection::vec(("[a-cA-C]{1,2}", "[ -~]{0,8}"), 0..6),
            ops in proptest::collection::vec(("[a-cA-C]{1,2}", proptest::option::of("[ -~]{0,8}")), 0..24),
        ) {
            let mut block = HeaderBlock::parse(HeaderBlock::serialize(
                pairs.iter().map(|(k, v)| (k.as_str(), v.as_bytes())),
            ))
            .expect("well-formed");
            let mut model: Vec<(String, Option<String>)> = Vec::new();
            for (name, value) in &ops {
                match value {
                    Some(v) => block.set(name, v.as_bytes()),
                    None => block.remove(name),
                }
                let lower = name.to_ascii_lowercase();
                model.retain(|(n, _)| *n != lower);
                model.push((lower, value.clone()));
            }
            let changed = |k: &str| model.iter().any(|(n, _)| n.eq_ignore_ascii_case(k));
            let expected: Vec<(String, String)> = pairs
                .iter()
                .filter(|(k, _)| !changed(k))
                .cloned()
                .chain(model.iter().filter_map(|(n, v)| v.clone().map(|v| (n.clone(), v))))
                .collect();
            prop_assert_eq!(all(&block), expected);
            for (name, _) in &ops {
                let want = match model.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)) {
                    Some((_, v)) => v.clone(),
                    None => pairs
                        .iter()
                        .find(|(k, _)| k.eq_ignore_ascii_case(name))
                        .map(|(_, v)| v.clone()),
                };
                prop_assert_eq!(block.get(name).map(|v| String::from_utf8_lossy(v).into_owned()), want);
            }
        }
    }

    #[test]
    fn empty_and_malformed_maps() {
        assert_eq!(
            HeaderBlock::parse(Vec::new()).map(|b| b.iter().count()),
            Ok(0)
        );
        let good = HeaderBlock::serialize([("a", &b"1"[..])]);
        for cut in 1..good.len() {
            assert!(
                matches!(
                    HeaderBlock::parse(good[..cut].to_vec()),
                    Err(HeaderBlockError::Truncated { .. })
                ),
                "cut at {cut}"
            );
        }
        let mut unterminated = good.clone();
        let last = unterminated.len() - 1;
        unterminated[last] = b'x';
        assert_eq!(
            HeaderBlock::parse(unterminated),
            Err(HeaderBlockError::Unterminated { index: 0 })
        );
        // A count no buffer could hold.
        let mut huge = good;
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(HeaderBlock::parse(huge).is_err());
    }

    proptest! {
        /// Whatever the host hands over: never a panic, and a well-formed
        /// map reads back exactly as it was written.
        #[test]
        fn round_trips_and_never_panics(
            pairs in proptest::collection::vec(("[a-z:-]{0,12}", proptest::collection::vec(any::<u8>(), 0..20)), 0..12),
            noise in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let bytes = HeaderBlock::serialize(pairs.iter().map(|(k, v)| (k.as_str(), v.as_slice())));
            let block = HeaderBlock::parse(bytes).expect("well-formed");
            let read: Vec<(Vec<u8>, Vec<u8>)> = block.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect();
            let written: Vec<(Vec<u8>, Vec<u8>)> = pairs.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.clone())).collect();
            prop_assert_eq!(read, written);
            if let Ok(block) = HeaderBlock::parse(noise) {
                let _ = block.iter().count();
                let _ = block.get("a");
            }
        }
    }
}
