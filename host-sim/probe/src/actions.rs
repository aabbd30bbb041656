//! The actions a request asks for in `x-probe-action`, and the ones that
//! complete synchronously (shared data, queue, property reads). Actions
//! that shape the stream (local response, callout, body buffering) are run
//! by the stream itself in `lib.rs`.

use proxy_wasm::hostcalls;
use proxy_wasm::types::{MapType, Status};

/// Shared data key `shared-incr` increments.
const COUNTER_KEY: &str = "probe_counter";
/// Shared data key `cas-stale` writes with a stale CAS.
const STALE_KEY: &str = "probe_stale";
/// Shared data key the singleton increments per dequeued item.
pub(crate) const QUEUE_TOTAL_KEY: &str = "probe_queue_total";
/// Attempts of a CAS increment before giving up.
const MAX_CAS_ATTEMPTS: usize = 10;

/// An action's metric label: `probe_actions_action=<name>`. Actions with a
/// parameter (`local-403`, `property-request.path`) count under their family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    SharedIncr,
    CasStale,
    Enqueue,
    Local,
    Callout,
    BodySize,
    Property,
    SetState,
    ReplaceBody,
    QueueTotal,
    /// Anything not recognised (ignored, logged, counted).
    Unknown,
    LateHeaders,
}

impl Kind {
    /// Every kind, in metric definition order (`kind as usize` indexes it).
    pub(crate) const ALL: [Kind; 12] = [
        Kind::SharedIncr,
        Kind::CasStale,
        Kind::Enqueue,
        Kind::Local,
        Kind::Callout,
        Kind::BodySize,
        Kind::Property,
        Kind::SetState,
        Kind::ReplaceBody,
        Kind::QueueTotal,
        Kind::Unknown,
        Kind::LateHeaders,
    ];

    /// The metric label value (matches `[a-z_-]+`, the stats_tags regex).
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::SharedIncr => "shared-incr",
            Kind::CasStale => "cas-stale",
            Kind::Enqueue => "enqueue",
            Kind::Local => "local",
            Kind::Callout => "callout",
            Kind::BodySize => "body-size",
            Kind::Property => "property",
            Kind::SetState => "set-state",
            Kind::ReplaceBody => "replace-body",
            Kind::QueueTotal => "queue-total",
            Kind::Unknown => "unknown",
            Kind::LateHeaders => "late-headers",
        }
    }
}

/// One parsed action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step<'a> {
    SharedIncr,
    CasStale,
    Enqueue,
    /// `local-<status>`, status 200..=599.
    Local(u32),
    Callout,
    BodySize,
    /// `property-<a.b.c>`: the dotted path.
    Property(&'a str),
    SetState,
    ReplaceBody,
    QueueTotal,
    /// Count the request headers still visible in the response phase.
    LateHeaders,
}

impl<'a> Step<'a> {
    /// Parses one (trimmed) action; `None` for anything unknown or malformed.
    pub(crate) fn parse(action: &'a str) -> Option<Self> {
        Some(match action {
            "shared-incr" => Step::SharedIncr,
            "cas-stale" => Step::CasStale,
            "enqueue" => Step::Enqueue,
            "callout" => Step::Callout,
            "body-size" => Step::BodySize,
            "set-state" => Step::SetState,
            "replace-body" => Step::ReplaceBody,
            "queue-total" => Step::QueueTotal,
            "late-headers" => Step::LateHeaders,
            _ => {
                if let Some(status) = action.strip_prefix("local-") {
                    Step::Local(parse_status(status)?)
                } else if let Some(path) = action.strip_prefix("property-") {
                    valid_property_path(path).then_some(Step::Property(path))?
                } else {
                    return None;
                }
            }
        })
    }

    /// The metric label this action counts under.
    pub(crate) fn kind(self) -> Kind {
        match self {
            Step::SharedIncr => Kind::SharedIncr,
            Step::CasStale => Kind::CasStale,
            Step::Enqueue => Kind::Enqueue,
            Step::Local(_) => Kind::Local,
            Step::Callout => Kind::Callout,
            Step::BodySize => Kind::BodySize,
            Step::Property(_) => Kind::Property,
            Step::SetState => Kind::SetState,
            Step::ReplaceBody => Kind::ReplaceBody,
            Step::QueueTotal => Kind::QueueTotal,
            Step::LateHeaders => Kind::LateHeaders,
        }
    }
}

/// Three decimal digits, 200..=599 (a local reply is a final response).
fn parse_status(text: &str) -> Option<u32> {
    if text.len() != 3 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let status: u32 = text.parse().ok()?;
    (200..=599).contains(&status).then_some(status)
}

/// Dot-separated non-empty segments of `[a-z0-9_-]`, so that the response
/// header name derived from the path is a valid, lower-case token.
fn valid_property_path(path: &str) -> bool {
    path.split('.').all(|segment| {
        !segment.is_empty()
            && segment
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
    })
}

/// The request header `property-<path>` adds: `x-probe-prop-a-b-c`.
pub(crate) fn property_header(path: &str) -> String {
    format!("x-probe-prop-{}", path.replace('.', "-"))
}

/// Reads a property for `property-<path>`, rendered for a header.
pub(crate) fn property(path: &str) -> String {
    match hostcalls::get_property(path.split('.').collect()) {
        Ok(Some(value)) => render_value(&value),
        Ok(None) => "absent".to_string(),
        Err(status) => error(status),
    }
}

/// A host value as a header value: the text if it is printable UTF-8, an
/// 8-byte value as `int:<little-endian i64>`, anything else as `hex:<hex>`.
pub(crate) fn render_value(bytes: &[u8]) -> String {
    if let Ok(text) = std::str::from_utf8(bytes)
        && !text.chars().any(char::is_control)
    {
        return text.to_string();
    }
    if let Ok(word) = <[u8; 8]>::try_from(bytes) {
        return format!("int:{}", i64::from_le_bytes(word));
    }
    let mut out = String::with_capacity(4 + 2 * bytes.len());
    out.push_str("hex:");
    for byte in bytes {
        out.push_str(&format!("{byte:02x}"));
    }
    out
}

/// A failed host call as a header value: `error-CasMismatch`.
pub(crate) fn error(status: Status) -> String {
    format!("error-{status:?}")
}

/// `shared-incr`: the new value of `probe_counter`, or what went wrong.
pub(crate) fn shared_incr() -> String {
    match cas_increment(COUNTER_KEY) {
        Ok(value) => value.to_string(),
        Err(failure) => failure,
    }
}

/// Adds one to the decimal counter under `key` with compare-and-swap,
/// retrying on a CAS mismatch. An absent key counts as 0 and is written
/// without a CAS. Errors: `not-decimal`, `cas-exhausted`, `error-<status>`.
pub(crate) fn cas_increment(key: &str) -> Result<u64, String> {
    for _ in 0..MAX_CAS_ATTEMPTS {
        let (value, cas) = hostcalls::get_shared_data(key).map_err(error)?;
        let current = match value {
            None => 0,
            Some(bytes) => parse_decimal(&bytes).ok_or_else(|| "not-decimal".to_string())?,
        };
        let next = current.saturating_add(1);
        match hostcalls::set_shared_data(key, Some(next.to_string().as_bytes()), cas) {
            Ok(()) => return Ok(next),
            Err(Status::CasMismatch) => continue,
            Err(status) => return Err(error(status)),
        }
    }
    Err("cas-exhausted".to_string())
}

/// Strict unsigned decimal: digits only, no sign, no whitespace.
fn parse_decimal(bytes: &[u8]) -> Option<u64> {
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

/// `cas-stale`: writes `probe_stale` twice with the same CAS and reports
/// both outcomes, `ok,mismatch` on a correct host.
pub(crate) fn cas_stale() -> String {
    let cas = match hostcalls::get_shared_data(STALE_KEY) {
        Ok((Some(_), cas)) => cas,
        Ok((None, _)) => {
            if let Err(status) = hostcalls::set_shared_data(STALE_KEY, Some(b"0"), None) {
                return error(status);
            }
            match hostcalls::get_shared_data(STALE_KEY) {
                Ok((_, cas)) => cas,
                Err(status) => return error(status),
            }
        }
        Err(status) => return error(status),
    };
    let first = hostcalls::set_shared_data(STALE_KEY, Some(b"1"), cas);
    let second = hostcalls::set_shared_data(STALE_KEY, Some(b"2"), cas);
    format!("{},{}", set_outcome(first), set_outcome(second))
}

fn set_outcome(result: Result<(), Status>) -> String {
    match result {
        Ok(()) => "ok".to_string(),
        Err(Status::CasMismatch) => "mismatch".to_string(),
        Err(status) => error(status),
    }
}

/// `enqueue`: puts the request's `:path` on the singleton's queue.
/// `ok`, `not-found` (no such queue) or `error-<status>`.
pub(crate) fn enqueue(vm_id: &str, queue_name: &str) -> String {
    let queue = match hostcalls::resolve_shared_queue(vm_id, queue_name) {
        Ok(Some(queue)) => queue,
        Ok(None) => return "not-found".to_string(),
        Err(status) => return error(status),
    };
    let path = match hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, ":path") {
        Ok(Some(path)) => path,
        _ => Vec::new(),
    };
    match hostcalls::enqueue_shared_queue(queue, Some(&path)) {
        Ok(()) => "ok".to_string(),
        Err(status) => error(status),
    }
}

/// `queue-total`: the singleton's count of dequeued items, `absent` before
/// the first one.
pub(crate) fn queue_total() -> String {
    match hostcalls::get_shared_data(QUEUE_TOTAL_KEY) {
        Ok((Some(value), _)) => render_value(&value),
        Ok((None, _)) => "absent".to_string(),
        Err(status) => error(status),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_actions() {
        assert_eq!(Step::parse("shared-incr"), Some(Step::SharedIncr));
        assert_eq!(Step::parse("local-403"), Some(Step::Local(403)));
        assert_eq!(Step::parse("local-99"), None);
        assert_eq!(Step::parse("local-600"), None);
        assert_eq!(Step::parse("local-+40"), None);
        assert_eq!(
            Step::parse("property-request.path"),
            Some(Step::Property("request.path"))
        );
        assert_eq!(Step::parse("property-"), None);
        assert_eq!(Step::parse("property-a..b"), None);
        assert_eq!(Step::parse("property-Request.path"), None);
        assert_eq!(Step::parse("Shared-incr"), None);
        assert_eq!(property_header("request.path"), "x-probe-prop-request-path");
    }

    #[test]
    fn kind_names_match_the_stats_tag_regex() {
        for (index, kind) in Kind::ALL.iter().enumerate() {
            assert_eq!(*kind as usize, index);
            assert!(
                kind.name()
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_' || b == b'-')
            );
        }
    }

    #[test]
    fn renders_values() {
        assert_eq!(render_value(b"/probe"), "/probe");
        assert_eq!(render_value(&42i64.to_le_bytes()), "int:42");
        assert_eq!(render_value(&[0xff, 0x00]), "hex:ff00");
        assert_eq!(render_value(b"a\nb"), "hex:610a62");
        assert_eq!(render_value(b""), "");
    }

    #[test]
    fn decimals_are_strict() {
        assert_eq!(parse_decimal(b"41"), Some(41));
        assert_eq!(parse_decimal(b"+1"), None);
        assert_eq!(parse_decimal(b""), None);
        assert_eq!(parse_decimal(b"1 "), None);
    }
}
