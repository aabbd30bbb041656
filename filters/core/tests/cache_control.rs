//! `Cache-Control` parsing and the response cache's store/serve policy:
//! directive tables, every branch of the request and response decisions,
//! freshness edges, and properties of the parsers on arbitrary input.

use proptest::prelude::*;
use zerolayer_core::cache::control::{
    Bypass, RequestDirectives, RequestPlan, ResponseDirectives, TtlPolicy, age, fresh_enough,
    plan_request, response_ttl,
};
use zerolayer_core::metrics::Label;

const MAX: u64 = u32::MAX as u64;

fn req(value: &str) -> RequestDirectives {
    RequestDirectives::parse(value)
}

fn resp(value: &str) -> ResponseDirectives {
    ResponseDirectives::parse(value)
}

fn max_age(secs: u64) -> RequestDirectives {
    RequestDirectives {
        max_age: Some(secs),
        ..Default::default()
    }
}

const INVALID_REQ: RequestDirectives = RequestDirectives {
    no_store: false,
    no_cache: false,
    max_age: None,
    invalid_max_age: true,
    only_if_cached: false,
};

#[test]
fn request_directive_table() {
    let cases: &[(&str, RequestDirectives)] = &[
        ("", RequestDirectives::default()),
        (" , ,, ", RequestDirectives::default()),
        ("max-age=60", max_age(60)),
        ("MAX-AGE=60", max_age(60)),
        ("Max-Age=60", max_age(60)),
        ("  max-age=60  ", max_age(60)),
        ("\tmax-age = 60\t", max_age(60)),
        ("max-age=\"60\"", max_age(60)),
        ("max-age=060", max_age(60)),
        ("max-age=0", max_age(0)),
        ("max-age=60, max-age=60", max_age(60)),
        ("max-age=60,,", max_age(60)),
        ("x-foo=\"a, max-age=5\", max-age=60", max_age(60)),
        (
            "unknown, max-stale=10, min-fresh=5, max-age=60",
            max_age(60),
        ),
        ("max-age=4294967295", max_age(MAX)),
        ("max-age=4294967296", max_age(MAX)),
        ("max-age=99999999999999999999999999999999", max_age(MAX)),
        ("max-age=-1", INVALID_REQ),
        ("max-age=+1", INVALID_REQ),
        ("max-age=1.5", INVALID_REQ),
        ("max-age=abc", INVALID_REQ),
        ("max-age=", INVALID_REQ),
        ("max-age", INVALID_REQ),
        ("max-age=\"\"", INVALID_REQ),
        ("max-age=\"60", INVALID_REQ),
        ("max-age=6 0", INVALID_REQ),
        ("max-age=60, max-age=30", INVALID_REQ),
        ("max-age=60, max-age=x, max-age=60", INVALID_REQ),
        ("max-age=x, max-age=60", INVALID_REQ),
        (
            "no-store",
            RequestDirectives {
                no_store: true,
                ..Default::default()
            },
        ),
        (
            "No-Cache, ONLY-IF-CACHED",
            RequestDirectives {
                no_cache: true,
                only_if_cached: true,
                ..Default::default()
            },
        ),
        (
            "no-cache=\"set-cookie, x-a\", no-store, max-age=5",
            RequestDirectives {
                no_store: true,
                no_cache: true,
                max_age: Some(5),
                ..Default::default()
            },
        ),
        // Names are matched whole: prefixes and suffixes are other directives.
        (
            "no-stores, xno-cache, max-ages=5",
            RequestDirectives::default(),
        ),
    ];
    for (value, expected) in cases {
        assert_eq!(req(value), *expected, "value: {value:?}");
    }
}

#[test]
fn response_directive_table() {
    let cases: &[(&str, ResponseDirectives)] = &[
        ("", ResponseDirectives::default()),
        (
            "public, max-age=300",
            ResponseDirectives {
                public: true,
                max_age: Some(300),
                ..Default::default()
            },
        ),
        (
            "S-MAXAGE=\"120\", Max-Age=10",
            ResponseDirectives {
                max_age: Some(10),
                s_maxage: Some(120),
                ..Default::default()
            },
        ),
        (
            "private=\"x-user, x-b\", no-cache=\"set-cookie\", no-store",
            ResponseDirectives {
                no_store: true,
                no_cache: true,
                private: true,
                ..Default::default()
            },
        ),
        (
            "max-age=10, s-maxage=oops",
            ResponseDirectives {
                max_age: Some(10),
                invalid_age: true,
                ..Default::default()
            },
        ),
        (
            "s-maxage=10, s-maxage=20, max-age=5",
            ResponseDirectives {
                max_age: Some(5),
                invalid_age: true,
                ..Default::default()
            },
        ),
        (
            "max-age=99999999999",
            ResponseDirectives {
                max_age: Some(MAX),
                ..Default::default()
            },
        ),
        (
            "must-revalidate, no-transform, proxy-revalidate, immutable",
            ResponseDirectives::default(),
        ),
    ];
    for (value, expected) in cases {
        assert_eq!(resp(value), *expected, "value: {value:?}");
    }
}

fn policy() -> TtlPolicy {
    TtlPolicy::default()
}

/// A policy that caches sampled requests too, for the non-temperature branches.
fn any_temperature() -> TtlPolicy {
    TtlPolicy {
        max_temperature: 2.0,
        ..TtlPolicy::default()
    }
}

fn lookup(max_age: Option<u64>, only_if_cached: bool) -> RequestPlan {
    RequestPlan::Lookup {
        max_age,
        store: true,
        only_if_cached,
    }
}

#[test]
fn plan_request_branches() {
    let p = any_temperature();
    let t = Some(0.0);
    let cases: &[(&str, Option<&str>, RequestPlan)] = &[
        ("GET", None, RequestPlan::Bypass(Bypass::NotCacheableMethod)),
        (
            "HEAD",
            None,
            RequestPlan::Bypass(Bypass::NotCacheableMethod),
        ),
        (
            "post",
            None,
            RequestPlan::Bypass(Bypass::NotCacheableMethod),
        ),
        (
            "GET",
            Some("no-store"),
            RequestPlan::Bypass(Bypass::NotCacheableMethod),
        ),
        ("POST", None, lookup(None, false)),
        ("POST", Some(""), lookup(None, false)),
        ("POST", Some("max-age=30"), lookup(Some(30), false)),
        (
            "POST",
            Some("no-store"),
            RequestPlan::Bypass(Bypass::RequestNoStore),
        ),
        (
            "POST",
            Some("no-store, only-if-cached"),
            RequestPlan::Bypass(Bypass::RequestNoStore),
        ),
        (
            "POST",
            Some("no-cache, no-store"),
            RequestPlan::Bypass(Bypass::RequestNoStore),
        ),
        ("POST", Some("no-cache"), RequestPlan::Refresh),
        ("POST", Some("max-age=0"), RequestPlan::Refresh),
        ("POST", Some("max-age=-5"), RequestPlan::Refresh),
        ("POST", Some("max-age=5, max-age=6"), RequestPlan::Refresh),
        ("POST", Some("only-if-cached"), lookup(None, true)),
        (
            "POST",
            Some("only-if-cached, max-age=10"),
            lookup(Some(10), true),
        ),
        (
            "POST",
            Some("only-if-cached, no-cache"),
            RequestPlan::Unsatisfiable,
        ),
        (
            "POST",
            Some("only-if-cached, max-age=0"),
            RequestPlan::Unsatisfiable,
        ),
        (
            "POST",
            Some("only-if-cached, max-age=x"),
            RequestPlan::Unsatisfiable,
        ),
    ];
    for (method, cc, expected) in cases {
        assert_eq!(
            plan_request(method, *cc, t, &p),
            *expected,
            "{method} {cc:?}"
        );
    }
}

#[test]
fn plan_request_temperature() {
    let d = policy();
    let temp = RequestPlan::Bypass(Bypass::Temperature);
    // Default policy: only explicit temperature 0 (or below) is cached.
    assert_eq!(
        plan_request("POST", None, Some(0.0), &d),
        lookup(None, false)
    );
    assert_eq!(
        plan_request("POST", None, Some(-0.0), &d),
        lookup(None, false)
    );
    assert_eq!(plan_request("POST", None, Some(0.01), &d), temp);
    assert_eq!(plan_request("POST", None, None, &d), temp);
    assert_eq!(plan_request("POST", None, Some(f64::NAN), &d), temp);
    assert_eq!(plan_request("POST", None, Some(f64::INFINITY), &d), temp);
    // Temperature is checked after no-store, before the freshness directives.
    assert_eq!(
        plan_request("POST", Some("no-store"), None, &d),
        RequestPlan::Bypass(Bypass::RequestNoStore)
    );
    assert_eq!(plan_request("POST", Some("no-cache"), None, &d), temp);
    assert_eq!(plan_request("POST", Some("only-if-cached"), None, &d), temp);

    let sampled = TtlPolicy {
        max_temperature: 1.0,
        ..TtlPolicy::default()
    };
    // Absent temperature counts as 1.0: at the bound, so cached.
    assert_eq!(
        plan_request("POST", None, None, &sampled),
        lookup(None, false)
    );
    assert_eq!(
        plan_request("POST", None, Some(1.0), &sampled),
        lookup(None, false)
    );
    assert_eq!(plan_request("POST", None, Some(1.0001), &sampled), temp);
    assert_eq!(plan_request("POST", None, Some(f64::NAN), &sampled), temp);
}

#[test]
fn response_ttl_branches() {
    let d = policy();
    let cases: &[(u16, Option<&str>, Result<u64, Bypass>)] = &[
        (200, None, Ok(60)),
        (200, Some(""), Ok(60)),
        (200, Some("max-age=300"), Ok(300)),
        (200, Some("public, max-age=300"), Ok(300)),
        (201, None, Err(Bypass::Status)),
        (203, Some("max-age=300"), Err(Bypass::Status)),
        (304, None, Err(Bypass::Status)),
        (429, None, Err(Bypass::Status)),
        (500, Some("max-age=300"), Err(Bypass::Status)),
        (200, Some("no-store"), Err(Bypass::ResponseNoStore)),
        (200, Some("no-store, private"), Err(Bypass::ResponseNoStore)),
        (200, Some("private"), Err(Bypass::Private)),
        (200, Some("public, private"), Err(Bypass::Private)),
        (200, Some("private=\"x-user\""), Err(Bypass::Private)),
        (200, Some("private, max-age=x"), Err(Bypass::Private)),
        // Upstream no-cache is ignored by default.
        (200, Some("no-cache"), Ok(60)),
        (200, Some("no-cache, max-age=120"), Ok(120)),
        (200, Some("max-age=x"), Err(Bypass::InvalidMaxAge)),
        (200, Some("max-age=-1"), Err(Bypass::InvalidMaxAge)),
        (
            200,
            Some("max-age=1, max-age=2"),
            Err(Bypass::InvalidMaxAge),
        ),
        (
            200,
            Some("s-maxage=10, max-age=x"),
            Err(Bypass::InvalidMaxAge),
        ),
        (
            200,
            Some("max-age=10, s-maxage=1.5"),
            Err(Bypass::InvalidMaxAge),
        ),
        // s-maxage wins: the gateway is a shared cache.
        (200, Some("max-age=10, s-maxage=20"), Ok(20)),
        (200, Some("s-maxage=20, max-age=10"), Ok(20)),
        (200, Some("max-age=0, s-maxage=20"), Ok(20)),
        (
            200,
            Some("s-maxage=0, max-age=20"),
            Err(Bypass::ResponseNoCache),
        ),
        (200, Some("max-age=0"), Err(Bypass::ResponseNoCache)),
        // Clamped to max_ttl_secs.
        (200, Some("max-age=3600"), Ok(3600)),
        (200, Some("max-age=3601"), Ok(3600)),
        (200, Some("s-maxage=99999999999999999999"), Ok(3600)),
    ];
    for (status, cc, expected) in cases {
        assert_eq!(response_ttl(*status, *cc, &d), *expected, "{status} {cc:?}");
    }
}

#[test]
fn response_ttl_policy_switches() {
    let honour = TtlPolicy {
        honour_upstream_no_cache: true,
        ..TtlPolicy::default()
    };
    assert_eq!(
        response_ttl(200, Some("no-cache"), &honour),
        Err(Bypass::ResponseNoCache)
    );
    assert_eq!(
        response_ttl(200, Some("no-cache=\"set-cookie\", max-age=60"), &honour),
        Err(Bypass::ResponseNoCache)
    );
    assert_eq!(response_ttl(200, Some("max-age=60"), &honour), Ok(60));

    let private = TtlPolicy {
        store_private: true,
        ..TtlPolicy::default()
    };
    assert_eq!(response_ttl(200, Some("private"), &private), Ok(60));
    assert_eq!(
        response_ttl(200, Some("private, max-age=90"), &private),
        Ok(90)
    );
    assert_eq!(
        response_ttl(200, Some("private, no-store"), &private),
        Err(Bypass::ResponseNoStore)
    );

    // Clamping to 0 stores nothing.
    let zero = TtlPolicy {
        default_ttl_secs: 0,
        max_ttl_secs: 0,
        ..TtlPolicy::default()
    };
    assert_eq!(response_ttl(200, None, &zero), Err(Bypass::ResponseNoCache));
    assert_eq!(
        response_ttl(200, Some("max-age=60"), &zero),
        Err(Bypass::ResponseNoCache)
    );

    // A default TTL of 0 only stores responses that give a TTL themselves.
    let no_default = TtlPolicy {
        default_ttl_secs: 0,
        ..TtlPolicy::default()
    };
    assert_eq!(
        response_ttl(200, None, &no_default),
        Err(Bypass::ResponseNoCache)
    );
    assert_eq!(response_ttl(200, Some("max-age=5"), &no_default), Ok(5));

    let huge = TtlPolicy {
        max_ttl_secs: u64::MAX,
        ..TtlPolicy::default()
    };
    assert_eq!(
        response_ttl(200, Some("max-age=99999999999999"), &huge),
        Ok(MAX)
    );
}

#[test]
fn age_edges() {
    assert_eq!(age(100, 100), 0);
    assert_eq!(age(100, 160), 60);
    // A clock behind the writer's: never negative.
    assert_eq!(age(100, 90), 0);
    assert_eq!(age(u64::MAX, 0), 0);
    assert_eq!(age(0, u64::MAX), u64::MAX);
}

#[test]
fn freshness_edges() {
    // Stored at 100, expires at 160.
    assert!(fresh_enough(100, 160, 100, None));
    assert!(fresh_enough(100, 160, 159, None));
    // Fresh while now < expires_at: the expiry second itself is stale.
    assert!(!fresh_enough(100, 160, 160, None));
    assert!(!fresh_enough(100, 160, 161, None));
    // now before stored_at (skewed clocks): age 0, still fresh.
    assert!(fresh_enough(100, 160, 90, None));
    assert!(fresh_enough(100, 160, 90, Some(0)));
    // Request max-age: age <= max_age.
    assert!(fresh_enough(100, 160, 130, Some(30)));
    assert!(!fresh_enough(100, 160, 131, Some(30)));
    assert!(fresh_enough(100, 160, 100, Some(0)));
    assert!(!fresh_enough(100, 160, 101, Some(0)));
    // max_age cannot extend past expiry.
    assert!(!fresh_enough(100, 160, 160, Some(1000)));
    // Corrupt entries (expiring no later than stored) are never served.
    assert!(!fresh_enough(100, 100, 90, None));
    assert!(!fresh_enough(100, 50, 40, None));
}

#[test]
fn policy_defaults_and_serde() {
    let d = TtlPolicy::default();
    assert_eq!(d.default_ttl_secs, 60);
    assert_eq!(d.max_ttl_secs, 3600);
    assert!(!d.honour_upstream_no_cache);
    assert!(!d.store_private);
    assert_eq!(d.max_temperature, 0.0);
    assert_eq!(d.validate(), Ok(()));

    let parsed: TtlPolicy = serde_json::from_str("{}").unwrap();
    assert_eq!(parsed, d);
    let parsed: TtlPolicy =
        serde_json::from_str(r#"{"max_ttl_secs": 600, "max_temperature": 0.7}"#).unwrap();
    assert_eq!(parsed.max_ttl_secs, 600);
    assert_eq!(parsed.max_temperature, 0.7);
    assert_eq!(parsed.default_ttl_secs, 60);

    let err = serde_json::from_str::<TtlPolicy>(r#"{"max_ttl": 600}"#).unwrap_err();
    assert!(err.to_string().contains("unknown field `max_ttl`"), "{err}");
}

#[test]
fn policy_validation_names_the_field() {
    let cases: &[(TtlPolicy, &str)] = &[
        (
            TtlPolicy {
                max_temperature: -0.5,
                ..TtlPolicy::default()
            },
            "max_temperature: -0.5 is not a temperature (a finite number >= 0)",
        ),
        (
            TtlPolicy {
                max_temperature: f64::NAN,
                ..TtlPolicy::default()
            },
            "max_temperature: NaN is not a temperature (a finite number >= 0)",
        ),
        (
            TtlPolicy {
                max_temperature: f64::INFINITY,
                ..TtlPolicy::default()
            },
            "max_temperature: inf is not a temperature (a finite number >= 0)",
        ),
        (
            TtlPolicy {
                default_ttl_secs: 601,
                max_ttl_secs: 600,
                ..TtlPolicy::default()
            },
            "default_ttl_secs: 601 exceeds max_ttl_secs (600)",
        ),
    ];
    for (policy, expected) in cases {
        let err = policy.validate().unwrap_err();
        assert_eq!(err.to_string(), *expected);
    }
    let nested = TtlPolicy {
        default_ttl_secs: 10,
        max_ttl_secs: 5,
        ..TtlPolicy::default()
    }
    .validate_in("cache.ttl")
    .unwrap_err();
    assert_eq!(nested.path(), "cache.ttl.default_ttl_secs");

    let ok = TtlPolicy {
        default_ttl_secs: 600,
        max_ttl_secs: 600,
        max_temperature: 2.0,
        ..TtlPolicy::default()
    };
    assert_eq!(ok.validate(), Ok(()));
}

#[test]
fn bypass_names() {
    let names: Vec<&str> = Bypass::ALL.iter().map(|b| b.label()).collect();
    assert_eq!(
        names,
        [
            "request_no_store",
            "temperature",
            "not_cacheable_method",
            "status",
            "response_no_store",
            "response_no_cache",
            "private",
            "invalid_max_age",
            "incomplete",
            "too_large",
            "not_activated",
            "no_verified_tenant",
            "unkeyable",
            "encoded",
        ]
    );
}

/// Cache-Control-like text built from known directives, with random case,
/// whitespace, quoting and stray separators, so properties exercise the
/// recognised names and not just noise.
fn cache_control_text() -> impl Strategy<Value = String> {
    let directive = prop_oneof![
        Just("no-store".to_string()),
        Just("no-cache".to_string()),
        Just("private".to_string()),
        Just("public".to_string()),
        Just("only-if-cached".to_string()),
        Just("no-cache=\"set-cookie, x-a\"".to_string()),
        (
            prop_oneof![Just("max-age"), Just("s-maxage")],
            prop_oneof![
                any::<u64>().prop_map(|n| n.to_string()),
                (0u32..100).prop_map(|n| n.to_string()),
                "[0-9a-z+.\"-]{0,6}",
            ],
            any::<bool>(),
        )
            .prop_map(|(name, value, quote)| if quote {
                format!("{name}=\"{value}\"")
            } else {
                format!("{name}={value}")
            }),
        "[a-z-]{1,10}",
    ];
    prop::collection::vec((directive, "[ \t]{0,2}", "[ \t,]{0,2}"), 0..6).prop_map(|parts| {
        parts
            .into_iter()
            .map(|(d, pad, sep)| format!("{pad}{d}{pad}{sep}"))
            .collect::<Vec<_>>()
            .join(",")
    })
}

/// `text` with the ASCII case of each letter flipped where `flips` says.
fn recase(text: &str, flips: &[bool]) -> String {
    text.chars()
        .zip(flips.iter().cycle())
        .map(|(c, &flip)| {
            if !flip {
                c
            } else if c.is_ascii_lowercase() {
                c.to_ascii_uppercase()
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn parsers_never_panic(text in any::<String>()) {
        let _ = RequestDirectives::parse(&text);
        let _ = ResponseDirectives::parse(&text);
        let p = TtlPolicy::default();
        let _ = plan_request("POST", Some(&text), Some(0.0), &p);
        let _ = response_ttl(200, Some(&text), &p);
    }

    #[test]
    fn parsers_ignore_ascii_case_of_arbitrary_text(text in any::<String>()) {
        // Only names and digits carry meaning, so case anywhere changes nothing.
        let upper = text.to_ascii_uppercase();
        prop_assert_eq!(RequestDirectives::parse(&text), RequestDirectives::parse(&upper));
        prop_assert_eq!(ResponseDirectives::parse(&text), ResponseDirectives::parse(&upper));
    }

    #[test]
    fn parsers_ignore_ascii_case_of_directive_names(
        text in cache_control_text(),
        flips in prop::collection::vec(any::<bool>(), 1..16),
    ) {
        let recased = recase(&text, &flips);
        prop_assert_eq!(RequestDirectives::parse(&text), RequestDirectives::parse(&recased));
        prop_assert_eq!(ResponseDirectives::parse(&text), ResponseDirectives::parse(&recased));
    }

    #[test]
    fn ages_are_saturated_and_exclusive_with_invalid(text in cache_control_text()) {
        let r = RequestDirectives::parse(&text);
        prop_assert!(r.max_age.is_none_or(|a| a <= MAX));
        prop_assert!(!(r.invalid_max_age && r.max_age.is_some()));
        let s = ResponseDirectives::parse(&text);
        prop_assert!(s.max_age.is_none_or(|a| a <= MAX));
        prop_assert!(s.s_maxage.is_none_or(|a| a <= MAX));
    }

    #[test]
    fn stored_ttls_are_within_bounds(text in cache_control_text(), max_ttl in 0u64..10_000) {
        let p = TtlPolicy { default_ttl_secs: max_ttl / 2, max_ttl_secs: max_ttl, ..TtlPolicy::default() };
        if let Ok(ttl) = response_ttl(200, Some(&text), &p) {
            prop_assert!(ttl >= 1 && ttl <= max_ttl);
        }
    }
}
