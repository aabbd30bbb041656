//! Where a request's Wasm time goes under a real host: spans timed with the
//! host's clock, summed by label and logged as means per stream every
//! [`REPORT_EVERY`] streams. Only with the `timing` feature (profiling
//! builds: each clock read costs a host call); otherwise every function here
//! is empty and compiles away.
// The one place the raw host calls are made (see clippy.toml).
#![allow(clippy::disallowed_methods)]

#[cfg(feature = "timing")]
use std::cell::RefCell;
#[cfg(feature = "timing")]
use std::collections::BTreeMap;

/// Streams between reports.
#[cfg(feature = "timing")]
const REPORT_EVERY: u64 = 20_000;

/// Label → (nanoseconds, spans); streams since the last report.
#[cfg(feature = "timing")]
type Sums = (BTreeMap<&'static str, (u64, u64)>, u64);

#[cfg(feature = "timing")]
thread_local! {
    static SUMS: RefCell<Sums> = const { RefCell::new((BTreeMap::new(), 0)) };
}

/// A span being timed.
#[derive(Clone, Copy)]
pub struct Span {
    #[cfg(feature = "timing")]
    start: u64,
}

impl Span {
    /// Starts a span now.
    #[inline(always)]
    pub fn start() -> Span {
        Span {
            #[cfg(feature = "timing")]
            start: now(),
        }
    }

    /// Ends the span, adding its time to `label`.
    #[inline(always)]
    pub fn end(self, _label: &'static str) {
        #[cfg(feature = "timing")]
        {
            let ns = now().saturating_sub(self.start);
            SUMS.with(|s| {
                let mut sums = s.borrow_mut();
                let entry = sums.0.entry(_label).or_default();
                entry.0 += ns;
                entry.1 += 1;
            });
        }
    }
}

/// The host clock, nanoseconds.
#[cfg(feature = "timing")]
fn now() -> u64 {
    proxy_wasm::hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A stream ended: every [`REPORT_EVERY`] streams, logs each label's mean
/// nanoseconds per stream (and spans per stream) and starts over.
#[inline(always)]
pub fn stream_ended() {
    #[cfg(feature = "timing")]
    SUMS.with(|s| {
        let mut s = s.borrow_mut();
        s.1 += 1;
        if s.1 < REPORT_EVERY {
            return;
        }
        let streams = s.1;
        let mut line = format!("zerolayer timing, ns per stream over {streams} streams:");
        for (label, (ns, n)) in &s.0 {
            line.push_str(&format!(
                " {label}={} ({:.1}×)",
                ns / streams,
                *n as f64 / streams as f64
            ));
        }
        log::warn!("{line}");
        s.0.clear();
        s.1 = 0;
    });
}
