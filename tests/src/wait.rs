//! Waiting on a condition instead of sleeping a fixed time: a probe is
//! polled (backing off from 10 ms to 200 ms) until it yields a value or the
//! deadline passes, and the error says what was awaited.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

/// Polls `probe` until it returns `Some`, for at most `timeout`; a probe
/// error ends the wait at once.
pub fn until<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(10);
    loop {
        if let Some(value) = probe()? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            bail!("{what}: not within {timeout:?}");
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Polls `read` until two readings in a row agree (counters that reach
/// Envoy on the filters' ticks have all arrived), for at most `timeout`.
pub fn settled<T: PartialEq>(
    what: &str,
    timeout: Duration,
    mut read: impl FnMut() -> Result<T>,
) -> Result<T> {
    let mut last = read()?;
    until(what, timeout, || {
        // A tick is ≤ 1 s: readings 1 s apart that agree have settled.
        std::thread::sleep(Duration::from_secs(1));
        let now = read()?;
        if now == last {
            return Ok(Some(()));
        }
        last = now;
        Ok(None)
    })?;
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yields_the_probe_value_or_names_what_it_waited_for() -> Result<()> {
        let mut n = 0;
        let got = until("three tries", Duration::from_secs(5), || {
            n += 1;
            Ok((n == 3).then_some(n))
        })?;
        assert_eq!(got, 3);
        let err = until("never", Duration::from_millis(30), || Ok(None::<()>))
            .err()
            .map(|e| e.to_string());
        assert_eq!(err.as_deref(), Some("never: not within 30ms"));
        Ok(())
    }
}
