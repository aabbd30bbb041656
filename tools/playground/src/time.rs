//! RFC 3339 timestamps to and from Unix seconds, for the request's `time`
//! (the engine itself only ever sees Unix seconds, through
//! [`zerolayer_core::activation::RequestFacts::unix_seconds`]).

/// Unix seconds from RFC 3339 text (`2026-11-29T12:00:00Z`,
/// `2026-11-29T13:00:00.5+01:00`; `t`/`z`/a space accepted as RFC 3339
/// allows). Fractions of a second are dropped. `None` when it is not one.
pub fn parse_rfc3339(text: &str) -> Option<i64> {
    let b = text.as_bytes();
    if b.len() < 20 || !text.is_ascii() {
        return None;
    }
    let num = |range: std::ops::Range<usize>| -> Option<i64> {
        let digits = b.get(range)?;
        if !digits.iter().all(u8::is_ascii_digit) {
            return None;
        }
        digits
            .iter()
            .try_fold(0i64, |n, d| Some(n * 10 + i64::from(d - b'0')))
    };
    let sep = |i: usize, c: &[u8]| b.get(i).is_some_and(|x| c.contains(x));
    if !(sep(4, b"-") && sep(7, b"-") && sep(10, b"Tt ") && sep(13, b":") && sep(16, b":")) {
        return None;
    }
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, minute, second) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month)
        || day < 1
        || day > days_in_month(year, month)
        || hour > 23
        || minute > 59
        || second > 60
    {
        return None;
    }
    let mut rest = &b[19..];
    if let Some(frac) = rest.strip_prefix(b".") {
        let digits = frac.iter().take_while(|d| d.is_ascii_digit()).count();
        if digits == 0 {
            return None;
        }
        rest = &frac[digits..];
    }
    let offset = match rest {
        [b'Z' | b'z'] => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2] => {
            let two = |a: u8, b: u8| -> Option<i64> {
                (a.is_ascii_digit() && b.is_ascii_digit())
                    .then(|| i64::from(a - b'0') * 10 + i64::from(b - b'0'))
            };
            let (h, m) = (two(*h1, *h2)?, two(*m1, *m2)?);
            if h > 23 || m > 59 {
                return None;
            }
            let seconds = h * 3600 + m * 60;
            if *sign == b'-' { -seconds } else { seconds }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    Some(days * 86_400 + hour * 3600 + minute * 60 + second - offset)
}

/// `YYYY-MM-DDTHH:MM:SSZ` for `unix` seconds (UTC).
pub fn format_utc(unix: i64) -> String {
    let days = unix.div_euclid(86_400);
    let secs = unix.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

fn is_leap(year: i64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The inverse of [`days_from_civil`].
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-11-29 (a Sunday) 12:00:00 UTC, as core's calendar tests use.
    const SUNDAY_NOON: i64 = 1_795_953_600;

    #[test]
    fn parses_utc_offsets_and_fractions() {
        assert_eq!(parse_rfc3339("2026-11-29T12:00:00Z"), Some(SUNDAY_NOON));
        assert_eq!(parse_rfc3339("2026-11-29t12:00:00z"), Some(SUNDAY_NOON));
        assert_eq!(parse_rfc3339("2026-11-29 12:00:00Z"), Some(SUNDAY_NOON));
        assert_eq!(
            parse_rfc3339("2026-11-29T13:30:00.999+01:30"),
            Some(SUNDAY_NOON)
        );
        assert_eq!(
            parse_rfc3339("2026-11-29T07:00:00-05:00"),
            Some(SUNDAY_NOON)
        );
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_rfc3339("1969-12-31T23:59:59Z"), Some(-1));
        assert_eq!(parse_rfc3339("2024-02-29T00:00:00Z"), Some(1_709_164_800));
    }

    #[test]
    fn refuses_what_is_not_rfc3339() {
        for bad in [
            "",
            "2026-11-29",
            "2026-11-29T12:00:00",
            "2026-11-29T12:00Z",
            "2026-13-01T00:00:00Z",
            "2025-02-29T00:00:00Z",
            "2026-11-31T00:00:00Z",
            "2026-11-29T24:00:00Z",
            "2026-11-29T12:00:00.Z",
            "2026-11-29T12:00:00+1:00",
            "2026-11-29T12:00:00+24:00",
            "2026-11-29T12:00:00Zjunk",
            "+026-11-29T12:00:00Z",
            "2026-11-29T12:00:00\u{e9}",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn formats_and_round_trips() {
        assert_eq!(format_utc(SUNDAY_NOON), "2026-11-29T12:00:00Z");
        assert_eq!(format_utc(-1), "1969-12-31T23:59:59Z");
        for unix in [
            0,
            951_782_400,
            4_102_444_799,
            -2_208_988_800,
            SUNDAY_NOON + 59,
        ] {
            assert_eq!(parse_rfc3339(&format_utc(unix)), Some(unix), "{unix}");
        }
        // Far outside any calendar a person types: no panic, some text.
        assert!(!format_utc(i64::MAX).is_empty());
        assert!(!format_utc(i64::MIN).is_empty());
    }
}
