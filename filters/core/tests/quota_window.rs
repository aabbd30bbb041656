//! Calendar windows (hour, day, month at a UTC offset; month lengths, leap
//! years, boundaries) and the continuous refill of rates.

use zerolayer_core::quota::window::{
    MAX_UNIX, MIN_UNIX, RateBucket, Window, WindowSpan, civil_from_days, days_from_civil,
};

fn span(window: Window, t: i64, offset: i32) -> (i64, i64, u64) {
    let WindowSpan { start, end, label } = window.span_at(t, offset);
    (start, end, label)
}

#[test]
fn days_hours_and_months_at_utc() {
    // 2024-02-29T13:00:00Z, a leap day.
    let t = 1_709_211_600;
    assert_eq!(
        span(Window::Day, t, 0),
        (1_709_164_800, 1_709_251_200, 20_240_229)
    );
    assert_eq!(span(Window::Hour, t, 0), (t, t + 3600, 2_024_022_913));
    let (start, end, label) = span(Window::Month, t, 0);
    assert_eq!(label, 202_402);
    assert_eq!((end - start) / 86_400, 29, "February 2024 has 29 days");
}

#[test]
fn offsets_move_the_calendar_not_just_the_clock() {
    // 2024-02-29T23:30Z is 2024-03-01 00:30 at UTC+1: a new day and month there.
    let t = 1_709_249_400;
    assert_eq!(
        span(Window::Day, t, 60),
        (1_709_247_600, 1_709_334_000, 20_240_301)
    );
    assert_eq!(span(Window::Month, t, 60).2, 202_403);
    assert_eq!(span(Window::Month, t, 0).2, 202_402);
    // 2024-01-01T03:00Z is still 2023-12-31 22:00 at UTC−5.
    let t = 1_704_078_000;
    assert_eq!(
        span(Window::Day, t, -300),
        (1_703_998_800, 1_704_085_200, 20_231_231)
    );
    assert_eq!(
        span(Window::Month, t, -300),
        (1_701_406_800, 1_704_085_200, 202_312)
    );
    // A half-hour offset: hours run from :30 to :30 UTC (India, UTC+5:30).
    let t = 1_796_315_634; // 2026-12-03T16:33:54Z = 22:03:54 local
    assert_eq!(
        span(Window::Hour, t, 330),
        (1_796_315_400, 1_796_319_000, 2_026_120_322)
    );
}

#[test]
fn a_boundary_instant_belongs_to_the_new_window() {
    for (window, offset) in [
        (Window::Hour, 0),
        (Window::Hour, -570),
        (Window::Day, 0),
        (Window::Day, 840),
        (Window::Month, 0),
        (Window::Month, -840),
    ] {
        let first = window.span_at(1_709_211_600, offset);
        let next = window.span_at(first.end, offset);
        assert_eq!(next.start, first.end, "{window:?} {offset}");
        assert_ne!(next.label, first.label);
        assert_eq!(window.span_at(first.end - 1, offset), first);
        assert_eq!(window.span_at(first.start, offset), first);
    }
}

#[test]
fn month_lengths_and_leap_years() {
    let lengths = |year: i64| -> Vec<i64> {
        (1..=12)
            .map(|month| {
                let t = days_from_civil(year, month, 15) * 86_400;
                let s = Window::Month.span_at(t, 0);
                assert_eq!(s.label, (year as u64) * 100 + u64::from(month));
                (s.end - s.start) / 86_400
            })
            .collect()
    };
    let common = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    let mut leap = common;
    leap[1] = 29;
    assert_eq!(lengths(2023), common);
    assert_eq!(lengths(2024), leap);
    assert_eq!(lengths(1900), common, "divisible by 100: not leap");
    assert_eq!(lengths(2000), leap, "divisible by 400: leap");
    assert_eq!(lengths(2100), common);
}

#[test]
fn the_civil_calendar_matches_counting_days_one_by_one() {
    // Walk every day from 1970 to 2200 with a naive calendar.
    let leap = |y: i64| (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let mut days = 0i64;
    for year in 1970..2200 {
        for month in 1..=12u32 {
            let n = match month {
                2 if leap(year) => 29,
                2 => 28,
                4 | 6 | 9 | 11 => 30,
                _ => 31,
            };
            for day in 1..=n {
                assert_eq!(civil_from_days(days), (year, month, day));
                assert_eq!(days_from_civil(year, month, day), days);
                days += 1;
            }
        }
    }
}

#[test]
fn any_clock_value_gives_a_window_without_panicking() {
    for t in [i64::MIN, MIN_UNIX - 1, -1, 0, MAX_UNIX, i64::MAX] {
        for window in [Window::Hour, Window::Day, Window::Month] {
            for offset in [-840, 0, 840, i32::MIN, i32::MAX] {
                let s = window.span_at(t, offset);
                assert!(s.start < s.end);
            }
        }
    }
}

const MINUTE: u64 = 60_000;

#[test]
fn a_rate_refills_continuously_and_never_past_one_period() {
    let mut b = RateBucket {
        scaled: 0,
        at_ms: 0,
    };
    assert_eq!(
        b.take(0, 100, 60, MINUTE),
        60,
        "at most one period's amount at once"
    );
    assert_eq!(b.take(0, 1, 60, MINUTE), 0);
    assert_eq!(b.ms_until(0, 1, 60, MINUTE), 1000, "one unit a second");
    assert_eq!(b.available(999, 60, MINUTE), 0);
    assert_eq!(b.available(1000, 60, MINUTE), 1);
    assert_eq!(b.available(30_000, 60, MINUTE), 30);
    assert_eq!(b.ms_until(30_000, 45, 60, MINUTE), 15_000);
    assert_eq!(
        b.ms_until(30_000, 61, 60, MINUTE),
        u64::MAX,
        "more than it can ever hold"
    );
    assert_eq!(b.available(10 * MINUTE, 60, MINUTE), 60, "full, not more");
    // A clock going back refills nothing.
    let mut c = RateBucket {
        scaled: 0,
        at_ms: 5000,
    };
    c.take(5000, 60, 60, MINUTE);
    assert_eq!(c.available(1000, 60, MINUTE), 0);
    assert_eq!(c.available(6000, 60, MINUTE), 1);
}

#[test]
fn a_slow_rate_refills_between_whole_units_exactly() {
    // 7 a second: a unit every 142.857… ms, kept exact by scaling by the period.
    let mut b = RateBucket {
        scaled: 0,
        at_ms: 0,
    };
    assert_eq!(b.take(0, 7, 7, 1000), 7);
    assert_eq!(b.available(142, 7, 1000), 0);
    assert_eq!(b.available(143, 7, 1000), 1);
    assert_eq!(b.available(286, 7, 1000), 2);
    assert_eq!(b.available(1000, 7, 1000), 7);
}

#[test]
fn returns_and_debts_move_the_level() {
    let mut b = RateBucket {
        scaled: 0,
        at_ms: 0,
    };
    b.take(0, 50, 60, MINUTE);
    b.adjust(0, -20, 60, MINUTE);
    assert_eq!(b.available(0, 60, MINUTE), 30);
    b.adjust(0, -1000, 60, MINUTE);
    assert_eq!(b.available(0, 60, MINUTE), 60, "never below empty");
    b.adjust(0, 70, 60, MINUTE);
    assert_eq!(b.available(0, 60, MINUTE), 0, "a debt past capacity");
    assert_eq!(
        b.ms_until(0, 1, 60, MINUTE),
        11_000,
        "the debt drains first"
    );
}
