//! Request bodies read the way the backend will read them, or refused.
//!
//! JSON (RFC 8259 §4) leaves an object naming a member twice open to
//! interpretation: most parsers keep the last value, some the first, some
//! refuse. A stage that read `{"stream": false, "stream": true}` one way
//! while the backend read it the other would decide on a request the backend
//! never serves (a stream without the usage chunk metering asked for, a
//! cache key for another body). So every stage that reads a request body
//! refuses one that names a member twice, at any depth, after unescaping
//! (`"stream"` and `"str\u0065am"` are the same name): [`DuplicateMember`].
//!
//! Numbers: serde reads an integer that fits 64 bits exactly, and any other
//! number as an `f64`. An integer beyond 64 bits cannot be told apart from
//! its neighbours that way, so [`parse_request`] refuses to read it (the
//! cache bypasses such a request; it is never keyed inexactly).

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Why a request body was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// An object names the member twice.
    #[error(transparent)]
    Duplicate(#[from] DuplicateMember),
    /// A number whose value is beyond 64-bit integers (it may be an integer
    /// serde cannot keep exactly).
    #[error("request body has a number beyond 64-bit integers")]
    NumberOutOfRange,
    /// Not valid JSON (serde_json's reason, with its position).
    #[error("request body is not valid JSON: {0}")]
    NotJson(String),
}

/// A request body whose object names a member twice (the name, at most 64
/// bytes of it, for the client's error message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("request body names the member `{0}` twice in one object")]
pub struct DuplicateMember(pub String);

/// Longest member name echoed in [`DuplicateMember`].
const MAX_ECHOED_NAME: usize = 64;

/// Parses `body` into a value, refusing duplicate members and numbers
/// beyond 64-bit integers. Nesting is limited by serde_json (128 levels).
pub fn parse_request(body: &[u8]) -> Result<Value, BodyError> {
    let refused = Refused::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = StrictValue { refused: &refused }
        .deserialize(&mut de)
        .map_err(|err| refused.classify(err))?;
    de.end().map_err(|err| refused.classify(err))?;
    Ok(value)
}

/// Checks that no object of `body` names a member twice, without building
/// the value (one pass; the names of the object being read are kept, borrowed
/// from `body` unless escaped). Bodies that are not JSON are
/// [`BodyError::NotJson`].
pub fn check_unique_members(body: &[u8]) -> Result<(), BodyError> {
    let refused = Refused::default();
    let mut de = serde_json::Deserializer::from_slice(body);
    let mut names = Vec::new();
    UniqueMembers {
        names: &mut names,
        refused: &refused,
    }
    .deserialize(&mut de)
    .map_err(|err| refused.classify(err))?;
    de.end().map_err(|err| refused.classify(err))
}

/// What this module's visitors refused. A visitor can hand serde only an
/// error built from text, which serde_json then decorates: the refusal is
/// kept here, typed, and the error serde carries only stops the parse.
#[derive(Default)]
struct Refused(Cell<Option<BodyError>>);

impl Refused {
    /// Keeps `why` and returns the error that stops the parse.
    fn stop<E: de::Error>(&self, why: BodyError) -> E {
        self.0.set(Some(why));
        E::custom("refused by zerolayer's reader")
    }

    /// A member named twice (at most [`MAX_ECHOED_NAME`] bytes of it).
    fn duplicate<E: de::Error>(&self, name: &str) -> E {
        let mut end = name.len().min(MAX_ECHOED_NAME);
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        let name = name.get(..end).unwrap_or_default().to_string();
        self.stop(BodyError::Duplicate(DuplicateMember(name)))
    }

    /// Why the parse that ended with `err` failed: the visitor's refusal,
    /// else serde_json's own reason.
    fn classify(&self, err: serde_json::Error) -> BodyError {
        self.0
            .take()
            .unwrap_or_else(|| BodyError::NotJson(err.to_string()))
    }
}

/// 2^63: a float at or beyond it in magnitude may be an integer serde read
/// as a float because it did not fit 64 bits.
const BEYOND_I64: f64 = 9_223_372_036_854_775_808.0;

/// Builds a [`Value`] like serde_json's own, but refuses duplicate members
/// and numbers beyond 64-bit integers.
#[derive(Clone, Copy)]
struct StrictValue<'r> {
    refused: &'r Refused,
}

impl<'de> DeserializeSeed<'de> for StrictValue<'_> {
    type Value = Value;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictValue<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        let out_of_range = || self.refused.stop(BodyError::NumberOutOfRange);
        if v.abs() >= BEYOND_I64 {
            return Err(out_of_range());
        }
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(out_of_range)
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = Map::new();
        while let Some(name) = map.next_key::<String>()? {
            if members.contains_key(&name) {
                return Err(self.refused.duplicate(&name));
            }
            let value = map.next_value_seed(self)?;
            members.insert(name, value);
        }
        Ok(Value::Object(members))
    }
}

/// Walks a value checking member names; `names` holds the names of the
/// objects being read (each object's after the ones of those around it).
struct UniqueMembers<'s, 'de> {
    names: &'s mut Vec<Cow<'de, str>>,
    refused: &'s Refused,
}

/// Objects with more members than this are checked by sorting their names
/// rather than by comparing each with every other.
const LINEAR_CHECK: usize = 16;

impl<'de> DeserializeSeed<'de> for UniqueMembers<'_, 'de> {
    type Value = ();
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for UniqueMembers<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq
            .next_element_seed(UniqueMembers {
                names: &mut *self.names,
                refused: self.refused,
            })?
            .is_some()
        {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let start = self.names.len();
        while let Some(name) = map.next_key_seed(MemberName)? {
            let ours = self.names.get(start..).unwrap_or_default();
            if ours.len() < LINEAR_CHECK && ours.contains(&name) {
                return Err(self.refused.duplicate(&name));
            }
            self.names.push(name);
            map.next_value_seed(UniqueMembers {
                names: &mut *self.names,
                refused: self.refused,
            })?;
            // The value's own objects put their names back before returning.
        }
        if let Some(ours) = self.names.get_mut(start..)
            && ours.len() > LINEAR_CHECK
        {
            ours.sort_unstable();
            if let Some(pair) = ours.windows(2).find(|pair| pair[0] == pair[1]) {
                return Err(self.refused.duplicate(&pair[0]));
            }
        }
        self.names.truncate(start);
        Ok(())
    }
}

/// A member name, borrowed from the body when it has no escapes.
struct MemberName;

impl<'de> DeserializeSeed<'de> for MemberName {
    type Value = Cow<'de, str>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Cow<'de, str>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for MemberName {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Borrowed(v))
    }
    fn visit_str<E>(self, v: &str) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Cow<'de, str>, E> {
        Ok(Cow::Owned(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dup(name: &str) -> BodyError {
        BodyError::Duplicate(DuplicateMember(name.to_string()))
    }

    #[test]
    fn duplicate_members_at_any_depth_are_refused_by_both_readers() {
        let many: String = {
            let members: Vec<String> = (0..40).map(|i| format!("\"k{i}\":{i}")).collect();
            format!("{{{},\"k7\":0}}", members.join(","))
        };
        let cases: &[(&str, Result<(), BodyError>)] = &[
            (r#"{"stream":false,"stream":true}"#, Err(dup("stream"))),
            (r#"{"stream":true,"str\u0065am":false}"#, Err(dup("stream"))),
            (
                r#"{"stream_options":{"include_usage":false,"include_usage":true}}"#,
                Err(dup("include_usage")),
            ),
            (
                r#"{"messages":[{"role":"user","content":"a","content":"b"}]}"#,
                Err(dup("content")),
            ),
            (&many, Err(dup("k7"))),
            // The same name in different objects is no duplicate.
            (r#"{"a":{"a":{"a":1}},"b":[{"a":1},{"a":2}]}"#, Ok(())),
            (r#"{"a":1,"A":2,"a ":3}"#, Ok(())),
            ("[1,2,{}]", Ok(())),
            ("{}", Ok(())),
        ];
        for (body, expected) in cases {
            assert_eq!(
                &check_unique_members(body.as_bytes()),
                expected,
                "check {body}"
            );
            assert_eq!(
                &parse_request(body.as_bytes()).map(|_| ()),
                expected,
                "parse {body}"
            );
        }
        for body in [&b"{\"a\":"[..], b"{} x", b"", b"\xff"] {
            assert!(matches!(
                check_unique_members(body),
                Err(BodyError::NotJson(_))
            ));
            assert!(matches!(parse_request(body), Err(BodyError::NotJson(_))));
        }
    }

    #[test]
    fn the_strict_value_is_serde_jsons_value() {
        let body =
            br#"{"model":"m","n":[1,-2,0.5,1e2,16.0,null,true,"\u00e9"],"o":{"z":1,"a":{}}}"#;
        assert_eq!(
            parse_request(body).unwrap(),
            serde_json::from_slice::<Value>(body).unwrap()
        );
    }

    #[test]
    fn integers_beyond_64_bits_are_not_read() {
        for body in [
            "18446744073709551616",
            "-9223372036854775809",
            r#"{"seed":100000000000000000000}"#,
            "1e300",
        ] {
            assert_eq!(
                parse_request(body.as_bytes()),
                Err(BodyError::NumberOutOfRange),
                "{body}"
            );
        }
        for body in ["18446744073709551615", "-9223372036854775808", "9.2e18"] {
            assert!(parse_request(body.as_bytes()).is_ok(), "{body}");
        }
    }

    #[test]
    fn a_duplicate_name_is_echoed_as_written_whatever_it_says() {
        // The name reaches the error as a value, never through serde_json's
        // message text (which appends its own " at line L column C").
        for name in [
            "x at line 2 column 3",
            "request body is not valid JSON",
            " at line ",
        ] {
            let body = format!(r#"{{"{name}":1,"{name}":2}}"#);
            assert_eq!(check_unique_members(body.as_bytes()), Err(dup(name)));
            assert_eq!(parse_request(body.as_bytes()).map(|_| ()), Err(dup(name)));
        }
    }

    #[test]
    fn a_long_duplicate_name_is_echoed_cut() {
        let name = "é".repeat(100);
        let body = format!(r#"{{"{name}":1,"{name}":2}}"#);
        let Err(BodyError::Duplicate(DuplicateMember(echoed))) =
            check_unique_members(body.as_bytes())
        else {
            panic!("not refused");
        };
        assert!(echoed.len() <= MAX_ECHOED_NAME && name.starts_with(&echoed));
    }
}
