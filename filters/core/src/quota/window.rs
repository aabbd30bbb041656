//! Time for quotas: calendar windows for budgets (an hour, a day or a month
//! at a fixed UTC offset, computed from Unix time alone: no time-zone
//! database, no daylight saving) and the continuous refill of rates
//! ([`RateBucket`], GCRA's arithmetic in integers).
//!
//! A budget's window is a calendar fact, never a TTL: the store's key
//! carries the window's label, so a new window starts at 0 however often
//! the old key was written, and the key expires at the window's end.

use serde::Deserialize;

/// Milliseconds in a second.
const MS: i64 = 1000;
/// Seconds in a day.
const DAY: i64 = 86_400;
/// The widest UTC offset accepted, minutes (UTC−14:00 … UTC+14:00, as
/// real zones go).
pub const MAX_UTC_OFFSET_MINUTES: i32 = 14 * 60;

/// The earliest time windows are computed for (0001-01-01T00:00:00Z);
/// earlier clocks read as it.
pub const MIN_UNIX: i64 = -62_135_596_800;
/// The latest (9999-12-31T23:59:59Z); later clocks read as it.
pub const MAX_UNIX: i64 = 253_402_300_799;

/// A budget's calendar window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum Window {
    /// A clock hour (at the offset: with a half-hour offset, `:30` to `:30` UTC).
    Hour,
    /// A calendar day, midnight to midnight at the offset.
    Day,
    /// A calendar month, the 1st at midnight to the next 1st.
    Month,
}

/// One window: where it starts and ends (Unix seconds) and its label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSpan {
    /// Unix seconds of the window's first instant.
    pub start: i64,
    /// Unix seconds of the next window's first instant (the reset time).
    pub end: i64,
    /// The window's local calendar label as digits: `YYYYMM` for a month,
    /// `YYYYMMDD` for a day, `YYYYMMDDHH` for an hour. It names the store's
    /// key, so each window has a counter of its own.
    pub label: u64,
}

impl Window {
    /// The window holding `unix_secs`, its calendar read at
    /// `utc_offset_minutes` east of UTC.
    pub fn span_at(self, unix_secs: i64, utc_offset_minutes: i32) -> WindowSpan {
        let offset =
            i64::from(utc_offset_minutes.clamp(-MAX_UTC_OFFSET_MINUTES, MAX_UTC_OFFSET_MINUTES))
                * 60;
        // Local "wall" seconds: the calendar is computed there, then shifted
        // back. Years 1 to 9999 only, so no arithmetic below can overflow
        // whatever clock value arrives.
        let local = unix_secs.clamp(MIN_UNIX, MAX_UNIX) + offset;
        let days = local.div_euclid(DAY);
        let (year, month, day) = civil_from_days(days);
        let (start_local, end_local, label) = match self {
            Window::Hour => {
                let hour = local.div_euclid(3600);
                let h = hour.rem_euclid(24) as u64;
                (
                    hour * 3600,
                    hour * 3600 + 3600,
                    date_label(year, month, day) * 100 + h,
                )
            }
            Window::Day => (days * DAY, days * DAY + DAY, date_label(year, month, day)),
            Window::Month => {
                let first = days_from_civil(year, month, 1);
                let (ny, nm) = if month == 12 {
                    (year + 1, 1)
                } else {
                    (year, month + 1)
                };
                let next = days_from_civil(ny, nm, 1);
                (
                    first * DAY,
                    next * DAY,
                    (year.max(0) as u64) * 100 + u64::from(month),
                )
            }
        };
        WindowSpan {
            start: start_local - offset,
            end: end_local - offset,
            label,
        }
    }
}

fn date_label(year: i64, month: u32, day: u32) -> u64 {
    (year.max(0) as u64) * 10_000 + u64::from(month) * 100 + u64::from(day)
}

/// The proleptic Gregorian (year, month, day) of `days` since 1970-01-01
/// (Howard Hinnant's `civil_from_days`: exact for every `i64` day count a
/// clock can give, leap years included).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (the inverse of
/// [`civil_from_days`]).
pub fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// A rate's period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema, serde::Serialize))]
#[serde(rename_all = "snake_case")]
pub enum Period {
    /// Per second.
    Second,
    /// Per minute.
    Minute,
    /// Per hour.
    Hour,
}

impl Period {
    /// The period in milliseconds.
    pub fn millis(self) -> u64 {
        match self {
            Period::Second => 1000,
            Period::Minute => 60_000,
            Period::Hour => 3_600_000,
        }
    }

    /// Its name in the store's keys and in messages.
    pub fn name(self) -> &'static str {
        match self {
            Period::Second => "second",
            Period::Minute => "minute",
            Period::Hour => "hour",
        }
    }
}

/// A rate's fleet-wide state, as the store's script keeps it: a level that
/// drains continuously at `amount` per `period` (a leaky bucket, which is
/// GCRA with the theoretical arrival time written as a level), holding at
/// most one period's `amount`. The level is kept scaled by the period in
/// milliseconds, so draining by `elapsed_ms × amount` is exact in integers.
///
/// The store's Lua numbers are doubles: configuration keeps
/// `amount × period_ms` within 2^53 ([`MAX_EXACT`]), so the script and this
/// model agree to the unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateBucket {
    /// The level × `period_ms` (units·ms).
    pub scaled: u64,
    /// When the level was last computed, Unix ms.
    pub at_ms: u64,
}

/// The largest integer a double holds exactly: bounds every amount the
/// store's script computes with.
pub const MAX_EXACT: u64 = 1 << 53;

impl RateBucket {
    /// Drains the level to `now_ms` (a clock behind `at_ms` drains nothing).
    pub fn drain(&mut self, now_ms: u64, amount: u64) {
        let elapsed = now_ms.saturating_sub(self.at_ms);
        self.scaled = self.scaled.saturating_sub(elapsed.saturating_mul(amount));
        self.at_ms = self.at_ms.max(now_ms);
    }

    /// Units that may be taken at `now_ms` (capacity minus the drained level,
    /// rounded down).
    pub fn available(&mut self, now_ms: u64, amount: u64, period_ms: u64) -> u64 {
        self.drain(now_ms, amount);
        let capacity = amount.saturating_mul(period_ms);
        capacity.saturating_sub(self.scaled) / period_ms.max(1)
    }

    /// Takes up to `asked` units at `now_ms`; returns what was taken.
    pub fn take(&mut self, now_ms: u64, asked: u64, amount: u64, period_ms: u64) -> u64 {
        let taken = asked.min(self.available(now_ms, amount, period_ms));
        self.scaled = self.scaled.saturating_add(taken.saturating_mul(period_ms));
        taken
    }

    /// Adds `delta` units to the level (negative: gives units back; the
    /// level never goes below 0, and a debt may take it above capacity).
    pub fn adjust(&mut self, now_ms: u64, delta: i64, amount: u64, period_ms: u64) {
        self.drain(now_ms, amount);
        let change = delta.unsigned_abs().saturating_mul(period_ms);
        self.scaled = if delta >= 0 {
            self.scaled.saturating_add(change)
        } else {
            self.scaled.saturating_sub(change)
        };
    }

    /// Milliseconds from `now_ms` until `needed` units are available (0 when
    /// they are; `u64::MAX` when `needed` exceeds the capacity).
    pub fn ms_until(&mut self, now_ms: u64, needed: u64, amount: u64, period_ms: u64) -> u64 {
        if needed > amount {
            return u64::MAX;
        }
        self.drain(now_ms, amount);
        let capacity = amount.saturating_mul(period_ms);
        let target = capacity.saturating_sub(needed.saturating_mul(period_ms));
        let excess = self.scaled.saturating_sub(target);
        excess.div_ceil(amount.max(1))
    }
}

/// Seconds, rounded up, of `ms` milliseconds (what `retry-after` says).
pub fn ceil_secs(ms: u64) -> u64 {
    ms.div_ceil(MS as u64)
}
