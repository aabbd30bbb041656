//! Activation configuration: table of inputs and the exact error each gives.

use zerolayer_core::activation::RuleSet;

fn error_of(json: &str) -> String {
    match RuleSet::from_json(json.as_bytes()) {
        Ok(_) => panic!("expected an error for {json}"),
        Err(err) => err.to_string(),
    }
}

#[test]
fn bad_configurations_name_the_field_and_value() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"rules":[{"name":"a"},{"name":"b"},{"name":"c","when":{"path":{"matches":"("}}}]}"#,
            r#"rules[2].when.path.matches: invalid regex "(": unclosed group"#,
        ),
        (
            r#"{"rules":[{"name":"a","when":{"all":[{"method":{"in":["GET"]}},{"not":{"header":{"name":"x-a","matches":"[z-a]"}}}]}}]}"#,
            r#"rules[0].when.all[1].not.header.matches: invalid regex "[z-a]": invalid character class range, the start must be <= the end"#,
        ),
        (
            r#"{"rulez":[]}"#,
            "rulez: unknown field `rulez`, expected one of `custom_observers`, `defaults`, `tenant_header`, `utc_offset`, `debug_response_header`, `rules` at line 1 column 8",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"path":{"prefix":"/v1","regex":"x"}}}]}"#,
            "rules[0].when.path.regex: unknown field `regex`, expected `prefix` or `matches` at line 1 column 60",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"host":{"in":["x"]}}}]}"#,
            "rules[0].when: unknown variant `host`, expected one of `header`, `tenant`, `path`, `method`, `hours`, `weekdays`, `percent`, `all`, `any`, `not` at line 1 column 36",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"header":{"name":"x-a","equals":"1","in":["2"]}}}]}"#,
            "rules[0].when.header: exactly one of exists, equals, in, matches is required (found equals, in)",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"header":{"name":"x-a"}}}]}"#,
            "rules[0].when.header: exactly one of exists, equals, in, matches is required (found none)",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"header":{"name":"bad header","exists":true}}}]}"#,
            r#"rules[0].when.header.name: invalid header name "bad header""#,
        ),
        (
            r#"{"rules":[{"name":"a","when":{"header":{"name":"X-ZeroLayer-Observers","equals":"all"}}}]}"#,
            r#"rules[0].when.header.name: "X-ZeroLayer-Observers" is reserved: zerolayer removes client-sent x-zerolayer-* headers, so no rule may read one"#,
        ),
        (
            r#"{"tenant_header":"x-zerolayer-tenant"}"#,
            r#"tenant_header: "x-zerolayer-tenant" is reserved: zerolayer removes client-sent x-zerolayer-* headers, so no rule may read one"#,
        ),
        (
            r#"{"rules":[{"name":"a","when":{"header":{"name":"x-a","in":[]}}}]}"#,
            "rules[0].when.header.in: empty list never matches",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"path":{}}}]}"#,
            "rules[0].when.path: exactly one of prefix, matches is required (found none)",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"path":{"prefix":"v1"}}}]}"#,
            r#"rules[0].when.path.prefix: must start with "/" (got "v1")"#,
        ),
        (
            r#"{"rules":[{"name":"a","when":{"method":{"in":["GET","P OST"]}}}]}"#,
            r#"rules[0].when.method.in[1]: invalid method "P OST""#,
        ),
        (
            r#"{"rules":[{"name":"a","when":{"tenant":{"in":[]}}}]}"#,
            "rules[0].when.tenant.in: empty list never matches",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"hours":{"from":24,"to":3}}}]}"#,
            "rules[0].when.hours.from: 24 is not an hour (0-23)",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"hours":{"from":2,"to":0}}}]}"#,
            "rules[0].when.hours.to: 0 is not an end hour (1-24)",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"hours":{"from":9,"to":9}}}]}"#,
            "rules[0].when.hours: from and to are both 9: the range is empty",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"weekdays":{"from":"mon","to":"funday"}}}]}"#,
            "rules[0].when.weekdays.to: unknown variant `funday`, expected one of `mon`, `tue`, `wed`, `thu`, `fri`, `sat`, `sun` at line 1 column 68",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"percent":12.345}}]}"#,
            "rules[0].when.percent: 12.345 must be 0-100 with at most two decimals",
        ),
        (
            r#"{"rules":[{"name":"a","when":{"percent":101}}]}"#,
            "rules[0].when.percent: 101 must be 0-100 with at most two decimals",
        ),
        (
            r#"{"rules":[{"name":"a","activate":["meterign"]}]}"#,
            r#"rules[0].activate[0]: unknown observer "meterign"; known: audit, metering, cache"#,
        ),
        (
            r#"{"custom_observers":["shadow"],"defaults":["audit","shadw"]}"#,
            r#"defaults[1]: unknown observer "shadw"; known: audit, metering, cache, shadow"#,
        ),
        (
            r#"{"rules":[{"name":"a","activate":["cache"],"deactivate":["audit","cache"]}]}"#,
            r#"rules[0].deactivate[1]: "cache" is also in activate"#,
        ),
        (
            r#"{"rules":[{"name":"same"},{"name":"other"},{"name":"same"}]}"#,
            r#"rules[2].name: duplicate rule name "same" (also rules[0])"#,
        ),
        (
            r#"{"rules":[{"name":"has space"}]}"#,
            r#"rules[0].name: invalid rule name "has space": use 1-64 of [A-Za-z0-9_-]"#,
        ),
        (
            r#"{"rules":[{"priority":1}]}"#,
            "rules[0]: missing field `name` at line 1 column 24",
        ),
        (
            r#"{"rules":[{"name":"a","priority":"high"}]}"#,
            r#"rules[0].priority: invalid type: string "high", expected i32 at line 1 column 39"#,
        ),
        (
            r#"{"custom_observers":["authn_shadow"]}"#,
            r#"custom_observers[0]: "authn_shadow" is reserved: activation turns optional observers on and off, never authentication"#,
        ),
        (
            r#"{"custom_observers":["cache"]}"#,
            r#"custom_observers[0]: duplicate observer "cache""#,
        ),
        (
            r#"{"tenant_header":"x tenant"}"#,
            r#"tenant_header: invalid header name "x tenant""#,
        ),
        (
            r#"{"utc_offset":"+5"}"#,
            r#"utc_offset: invalid offset "+5": use +HH:MM or -HH:MM within ±14:00"#,
        ),
        (
            r#"{"utc_offset":"+14:30"}"#,
            r#"utc_offset: invalid offset "+14:30": use +HH:MM or -HH:MM within ±14:00"#,
        ),
        (
            r#"{"debug_response_header":"yes"}"#,
            r#"debug_response_header: invalid type: string "yes", expected a boolean at line 1 column 30"#,
        ),
        (
            "",
            "configuration: empty; expected a JSON object (use {} for the defaults)",
        ),
        (r#"["rules"]"#, "configuration: expected a JSON object"),
        (
            r#"{"rules":[}"#,
            "rules[0]: expected value at line 1 column 11",
        ),
    ];
    for (input, expected) in cases {
        assert_eq!(error_of(input), *expected, "input: {input}");
    }
}

#[test]
fn too_many_rules_and_too_deep_nesting_are_refused() {
    let rules: Vec<String> = (0..65).map(|i| format!(r#"{{"name":"r{i}"}}"#)).collect();
    let json = format!(r#"{{"rules":[{}]}}"#, rules.join(","));
    assert_eq!(error_of(&json), "rules: at most 64 rules (got 65)");

    let mut cond = r#"{"percent":1}"#.to_string();
    for _ in 0..17 {
        cond = format!(r#"{{"not":{cond}}}"#);
    }
    let json = format!(r#"{{"rules":[{{"name":"deep","when":{cond}}}]}}"#);
    let err = error_of(&json);
    assert!(
        err.starts_with("rules[0].when.not.not.")
            && err.ends_with(": conditions nested deeper than 16"),
        "{err}"
    );
}

#[test]
fn good_configurations_compile() {
    let cases = [
        "{}",
        r#"{"defaults":["audit"],"rules":[]}"#,
        r#"{"custom_observers":["shadow","replay-2"],"defaults":["shadow"],"tenant_header":"X-Org","utc_offset":"-05:30","debug_response_header":true,
            "rules":[{"name":"count_only","when":{"path":{"prefix":"/v1/"}}},
                     {"name":"a","priority":-3,"activate":["replay-2"],"when":{"any":[]}},
                     {"name":"b","when":{"all":[{"hours":{"from":22,"to":6}},{"weekdays":{"from":"fri","to":"mon"}},{"header":{"name":":authority","matches":"^api\\."}}]}}]}"#,
    ];
    for json in cases {
        if let Err(err) = RuleSet::from_json(json.as_bytes()) {
            panic!("{json}: {err}");
        }
    }
    let rules = RuleSet::from_json(cases[2].as_bytes()).unwrap();
    assert_eq!(rules.tenant_header(), "x-org");
    assert_eq!(&*rules.header_names()[0], ":authority");
    assert!(rules.debug_response_header());
}
