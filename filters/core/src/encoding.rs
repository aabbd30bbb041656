//! Content codings (RFC 9110 §8.4) for the stages that read response
//! bodies. They ask the backend for `identity` (a compressed body has no
//! usage to read and must not become a cache entry a client that did not
//! ask for gzip is served); when a backend compresses anyway, metering
//! decodes gzip and deflate to read the usage, and post-cache stores
//! nothing.

use std::io::Write;

use flate2::write::{GzDecoder, ZlibDecoder};
use thiserror::Error;

/// What a request asks the backend for when a stage must read the body.
pub const IDENTITY: &[u8] = b"identity";

/// Most bytes one response decodes to; past it decoding stops (a small
/// compressed body can expand a thousandfold: a decompression bomb).
pub const MAX_DECODED_BYTES: usize = 16 << 20;

/// Whether `accept_encoding` already restricts the backend to `identity`.
/// Without the header any coding is acceptable (RFC 9110 §12.5.3), so
/// only an exact `identity` needs no rewrite.
pub fn asks_identity(accept_encoding: Option<&[u8]>) -> bool {
    accept_encoding.is_some_and(|v| v.trim_ascii().eq_ignore_ascii_case(IDENTITY))
}

/// A response's `content-encoding`, as far as the stages can read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentCoding {
    /// No coding (no header, empty, or `identity`).
    Identity,
    /// `gzip` (or its alias `x-gzip`).
    Gzip,
    /// `deflate`: the zlib format (RFC 1950), as HTTP defines it.
    Deflate,
    /// Anything else, or several codings stacked: not decodable here.
    Other,
}

impl ContentCoding {
    /// Parses a `content-encoding` value (case-insensitive).
    pub fn from_header(value: Option<&[u8]>) -> ContentCoding {
        let Some(value) = value else {
            return ContentCoding::Identity;
        };
        let mut codings = value
            .split(|b| *b == b',')
            .map(<[u8]>::trim_ascii)
            .filter(|c| !c.is_empty() && !c.eq_ignore_ascii_case(IDENTITY));
        let Some(first) = codings.next() else {
            return ContentCoding::Identity;
        };
        if codings.next().is_some() {
            return ContentCoding::Other;
        }
        if first.eq_ignore_ascii_case(b"gzip") || first.eq_ignore_ascii_case(b"x-gzip") {
            ContentCoding::Gzip
        } else if first.eq_ignore_ascii_case(b"deflate") {
            ContentCoding::Deflate
        } else {
            ContentCoding::Other
        }
    }
}

/// Why a body could not be decoded.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// The coding is not one this decoder reads.
    #[error("content-encoding not decodable here")]
    Unsupported,
    /// The bytes are not valid for their coding.
    #[error("corrupt {0} data")]
    Corrupt(&'static str),
    /// The body decodes to more than [`MAX_DECODED_BYTES`].
    #[error("decodes to more than {MAX_DECODED_BYTES} bytes")]
    TooLarge,
}

enum Inner {
    Gzip(GzDecoder<Vec<u8>>),
    Deflate(ZlibDecoder<Vec<u8>>),
}

/// Decodes a compressed response chunk by chunk, handing each chunk's
/// decoded bytes on; memory is one chunk's output, not the body.
pub struct BodyDecoder {
    inner: Inner,
    decoded: usize,
    failed: Option<DecodeError>,
}

impl BodyDecoder {
    /// A decoder for `coding` (`Unsupported` for identity or other codings).
    pub fn new(coding: ContentCoding) -> Result<BodyDecoder, DecodeError> {
        let inner = match coding {
            ContentCoding::Gzip => Inner::Gzip(GzDecoder::new(Vec::new())),
            ContentCoding::Deflate => Inner::Deflate(ZlibDecoder::new(Vec::new())),
            ContentCoding::Identity | ContentCoding::Other => {
                return Err(DecodeError::Unsupported);
            }
        };
        Ok(BodyDecoder {
            inner,
            decoded: 0,
            failed: None,
        })
    }

    /// Decodes `chunk` and calls `out` with what it decoded to. After the
    /// first error every call returns it and decodes nothing.
    pub fn push(&mut self, chunk: &[u8], mut out: impl FnMut(&[u8])) -> Result<(), DecodeError> {
        // Input in slices: one slice decodes to at most ~1,000× its size
        // (deflate's limit), so the bound is checked before memory grows.
        for slice in chunk.chunks(INPUT_SLICE) {
            if let Some(error) = &self.failed {
                return Err(error.clone());
            }
            let (written, buffer, name) = match &mut self.inner {
                Inner::Gzip(d) => (
                    d.write_all(slice).and_then(|()| d.flush()),
                    d.get_mut(),
                    "gzip",
                ),
                Inner::Deflate(d) => (
                    d.write_all(slice).and_then(|()| d.flush()),
                    d.get_mut(),
                    "deflate",
                ),
            };
            self.decoded = self.decoded.saturating_add(buffer.len());
            if written.is_err() {
                self.failed = Some(DecodeError::Corrupt(name));
            } else if self.decoded > MAX_DECODED_BYTES {
                self.failed = Some(DecodeError::TooLarge);
            } else {
                out(buffer);
            }
            buffer.clear();
        }
        match &self.failed {
            Some(error) => Err(error.clone()),
            None => Ok(()),
        }
    }
}

/// Compressed bytes decoded at a time (see [`BodyDecoder::push`]).
const INPUT_SLICE: usize = 4096;

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::Compression;
    use flate2::write::{GzEncoder, ZlibEncoder};

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = GzEncoder::new(Vec::new(), Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn zlib(data: &[u8]) -> Vec<u8> {
        let mut e = ZlibEncoder::new(Vec::new(), Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn decode_split(coding: ContentCoding, body: &[u8], at: usize) -> Result<Vec<u8>, DecodeError> {
        let mut decoder = BodyDecoder::new(coding)?;
        let mut out = Vec::new();
        for part in [&body[..at], &body[at..]] {
            decoder.push(part, |d| out.extend_from_slice(d))?;
        }
        Ok(out)
    }

    #[test]
    fn only_an_exact_identity_needs_no_rewrite() {
        assert!(asks_identity(Some(b"identity")));
        assert!(asks_identity(Some(b" Identity ")));
        assert!(!asks_identity(None));
        assert!(!asks_identity(Some(b"gzip, deflate, br")));
        assert!(!asks_identity(Some(b"identity, gzip")));
        assert!(!asks_identity(Some(b"*")));
    }

    #[test]
    fn codings_are_read_case_insensitively_and_stacks_are_other() {
        use ContentCoding::*;
        let parse = |v: &[u8]| ContentCoding::from_header(Some(v));
        assert_eq!(ContentCoding::from_header(None), Identity);
        assert_eq!(parse(b""), Identity);
        assert_eq!(parse(b"identity"), Identity);
        assert_eq!(parse(b"GZIP"), Gzip);
        assert_eq!(parse(b"x-gzip"), Gzip);
        assert_eq!(parse(b" deflate "), Deflate);
        assert_eq!(parse(b"br"), Other);
        assert_eq!(parse(b"zstd"), Other);
        assert_eq!(parse(b"gzip, br"), Other);
        assert_eq!(parse(b"identity, gzip"), Gzip);
    }

    #[test]
    fn gzip_and_deflate_decode_whatever_the_split() {
        let body = b"data: {\"usage\":{\"input_tokens\":12}}\n\n".repeat(40);
        for (coding, encoded) in [
            (ContentCoding::Gzip, gzip(&body)),
            (ContentCoding::Deflate, zlib(&body)),
        ] {
            for at in 0..=encoded.len() {
                assert_eq!(
                    decode_split(coding, &encoded, at).unwrap(),
                    body,
                    "{coding:?} at {at}"
                );
            }
        }
    }

    #[test]
    fn corrupt_data_and_bombs_are_errors_not_panics() {
        let mut garbage = gzip(b"hello");
        garbage[12] ^= 0xff;
        garbage.extend_from_slice(b"trailing garbage");
        assert!(matches!(
            decode_split(ContentCoding::Gzip, &garbage, 5),
            Err(DecodeError::Corrupt("gzip"))
        ));
        assert!(decode_split(ContentCoding::Deflate, b"not zlib at all", 3).is_err());
        let bomb = gzip(&vec![0u8; MAX_DECODED_BYTES + 1]);
        assert_eq!(
            decode_split(ContentCoding::Gzip, &bomb, bomb.len() / 2),
            Err(DecodeError::TooLarge)
        );
        assert!(BodyDecoder::new(ContentCoding::Other).is_err());
    }
}
