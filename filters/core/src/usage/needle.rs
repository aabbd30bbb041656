//! Byte searches for the usage code's hot loops, eight bytes per step in
//! plain safe Rust (the filters run in wasm, where `memchr`'s SIMD paths do
//! not apply, and a byte-at-a-time loop cost as much as the SSE parser).

const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;

/// Bit 7 of each byte of the result is set for (at least the lowest) zero
/// byte of `x`: the classic "has zero byte" test. Bytes above a true zero may
/// be flagged too, so only the lowest flag is trusted.
#[inline]
fn zero_bytes(x: u64) -> u64 {
    x.wrapping_sub(LO) & !x & HI
}

#[inline]
fn word(bytes: &[u8]) -> u64 {
    let mut array = [0; 8];
    array.copy_from_slice(bytes.get(..8).unwrap_or(&[0; 8]));
    u64::from_le_bytes(array)
}

/// First position of `a` or `b` in `haystack`.
#[inline]
pub(crate) fn find_either(haystack: &[u8], a: u8, b: u8) -> Option<usize> {
    let (pa, pb) = (LO * u64::from(a), LO * u64::from(b));
    let mut words = haystack.chunks_exact(8);
    let mut base = 0;
    for bytes in &mut words {
        let w = word(bytes);
        let found = zero_bytes(w ^ pa) | zero_bytes(w ^ pb);
        if found != 0 {
            // Little-endian: the lowest flag is the first byte in memory.
            return Some(base + (found.trailing_zeros() / 8) as usize);
        }
        base += 8;
    }
    let rest = words.remainder();
    rest.iter()
        .position(|&c| c == a || c == b)
        .map(|at| base + at)
}

/// A fixed byte string, found by searching for one of its rarer bytes and
/// checking the bytes around each hit.
#[derive(Debug)]
pub(crate) struct Needle {
    bytes: &'static [u8],
    /// Index in `bytes` of the byte searched for.
    rare: usize,
}

impl Needle {
    /// A needle for `bytes`, searched by its byte at `rare` (pick one that
    /// is uncommon in the text searched).
    pub(crate) const fn new(bytes: &'static [u8], rare: usize) -> Needle {
        Needle { bytes, rare }
    }

    /// The needle's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }

    /// First position of the needle in `haystack`.
    pub(crate) fn find(&self, haystack: &[u8]) -> Option<usize> {
        let &rare = self.bytes.get(self.rare)?;
        let mut from = self.rare;
        loop {
            let hit = from + find_either(haystack.get(from..)?, rare, rare)?;
            let start = hit - self.rare;
            if haystack.get(start..start + self.bytes.len()) == Some(self.bytes) {
                return Some(start);
            }
            from = hit + 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Haystacks built from `pieces` by a fixed generator.
    fn haystacks(pieces: &[&[u8]], count: usize) -> Vec<Vec<u8>> {
        let mut state = 1u64;
        (0..count)
            .map(|_| {
                let mut hay = Vec::new();
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                for _ in 0..(state >> 60) {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1);
                    hay.extend_from_slice(pieces[(state >> 59) as usize % pieces.len()]);
                }
                hay
            })
            .collect()
    }

    #[test]
    fn find_either_finds_the_first_of_two_bytes() {
        for hay in haystacks(
            &[b"a", b"bcdefghijk", b"\"", b"\\", b"\x80\xff", b"\0"],
            20_000,
        ) {
            let naive = hay.iter().position(|&c| c == b'"' || c == b'\\');
            assert_eq!(find_either(&hay, b'"', b'\\'), naive, "{hay:?}");
            let naive = hay.iter().position(|&c| c == 0);
            assert_eq!(find_either(&hay, 0, 0), naive, "{hay:?}");
            let naive = hay.iter().position(|&c| c == 0xff);
            assert_eq!(find_either(&hay, 0xff, 0xff), naive, "{hay:?}");
        }
    }

    #[test]
    fn needle_finds_the_first_match_anywhere() {
        let needle = Needle::new(b"\"usage\"", 4);
        let mut matches = 0;
        for hay in haystacks(
            &[
                b"\"",
                b"u",
                b"g",
                b"usage",
                b"\"usage\"",
                b"\"usag",
                b"sage\"",
                b"0123456",
            ],
            20_000,
        ) {
            let naive = hay.windows(7).position(|w| w == b"\"usage\"");
            matches += usize::from(naive.is_some());
            assert_eq!(
                needle.find(&hay),
                naive,
                "{}",
                String::from_utf8_lossy(&hay)
            );
        }
        assert!(matches > 1000, "{matches}");
        assert_eq!(needle.find(b"\"usage"), None);
        assert_eq!(needle.find(b"g"), None);
        assert_eq!(needle.find(b""), None);
        assert_eq!(Needle::new(b"", 0).find(b"abc"), None);
        assert_eq!(Needle::new(b"ab", 5).find(b"ab"), None);
    }
}
