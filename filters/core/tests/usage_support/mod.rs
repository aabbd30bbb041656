//! Whole-stream helpers the usage tests and the fuzz checks share: a body
//! fed to the extractor or the usage-chunk stripper in given chunks.
#![allow(dead_code)]

use zerolayer_core::cache::key::Provider;
use zerolayer_core::usage::{
    Extracted, MAX_HELD_EVENT, ResponseFormat, UsageChunkStripper, UsageExtractor,
};

/// The usage `chunks` carry, pushed one by one.
pub fn extract(provider: Provider, format: ResponseFormat, chunks: &[&[u8]]) -> Extracted {
    let mut extractor = UsageExtractor::new(provider, format);
    for chunk in chunks {
        extractor.push(chunk);
    }
    extractor.finish()
}

/// The stripper's output for `chunks` (pushes then `finish`) and how many
/// events it removed; panics if it ever held more than [`MAX_HELD_EVENT`]
/// or held anything after `finish`.
pub fn strip(chunks: &[&[u8]]) -> (Vec<u8>, usize) {
    let mut stripper = UsageChunkStripper::new();
    let mut out = Vec::new();
    for chunk in chunks {
        stripper.push(chunk, &mut out);
        assert!(stripper.held() <= MAX_HELD_EVENT, "held past the bound");
    }
    stripper.finish(&mut out);
    assert_eq!(stripper.held(), 0, "finish leaves nothing held");
    (out, stripper.removed())
}
