//! RFC 3339 timestamps to and from Unix seconds, for the request's `time`
//! (the engine itself only ever sees Unix seconds, through
//! [`zerolayer_core::activation::RequestFacts::unix_seconds`]).

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// Unix seconds from RFC 3339 text (`2026-11-29T12:00:00Z`,
/// `2026-11-29T13:00:00.5+01:00`; `t`/`z`/a space accepted as RFC 3339
/// allows). Fractions of a second are dropped. `None` when it is not one.
pub fn parse_rfc3339(text: &str) -> Option<i64> {
    // The `time` crate takes the upper-case `T` and `Z` RFC 3339 prefers;
    // RFC 3339 (5.6, note) also allows lower case and a space.
    let normal: String = text
        .char_indices()
        .map(|(i, c)| match (i, c) {
            (10, 't' | ' ') => 'T',
            (_, 'z') => 'Z',
            (_, c) => c,
        })
        .collect();
    OffsetDateTime::parse(&normal, &Rfc3339)
        .ok()
        .map(OffsetDateTime::unix_timestamp)
}

/// `YYYY-MM-DDTHH:MM:SSZ` for `unix` seconds (UTC); outside the years
/// -9999..=9999 the plain number of seconds.
pub fn format_utc(unix: i64) -> String {
    OffsetDateTime::from_unix_timestamp(unix)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| format!("{unix} s since the epoch"))
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
