//! A request path as the backend will serve it, so that every stage decides
//! on the path that is served and not on its spelling: `//v1/messages`,
//! `/v1/./messages` and `/x/../v1/messages` are `/v1/messages` to a backend
//! that merges slashes and removes dot segments (and to Envoy with
//! `normalize_path` and `merge_slashes` on, as the shipped configurations
//! have it).
//!
//! [`normalize`] does what those two options do: the query (`?…`) and any
//! fragment are dropped; percent-encoded unreserved characters
//! (RFC 3986 §2.3: letters, digits, `-._~`) are decoded, so `%2e%2e` is a dot
//! segment and `%6Dessages` is `messages`; a backslash is a slash (as URL
//! parsers read it); runs of slashes are one; `.` segments are removed and
//! `..` removes the segment before it (never above the root, RFC 3986
//! §5.2.4). An encoded slash or backslash (`%2F`, `%5C`) has no reading every
//! backend shares (some decode it, some keep it inside a segment): the path
//! is [`PathError::EscapedSlash`], refused like Envoy's
//! `path_with_escaped_slashes_action: REJECT_REQUEST`.
//!
//! The common path needs no change and is returned borrowed, without
//! allocating.

use std::borrow::Cow;

/// Why a path has no normal form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// The path has `%2F` or `%5C`, which backends read differently.
    #[error("request path has an encoded slash or backslash")]
    EscapedSlash,
}

/// The part of `path` before its query or fragment.
pub fn without_query(path: &[u8]) -> &[u8] {
    let end = path
        .iter()
        .position(|&b| b == b'?' || b == b'#')
        .unwrap_or(path.len());
    path.get(..end).unwrap_or(path)
}

/// `path` (a request's `:path`) in normal form, query excluded; borrowed
/// when it is normal already.
pub fn normalize(path: &[u8]) -> Result<Cow<'_, [u8]>, PathError> {
    let path = without_query(path);
    if is_normal(path) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(path)?;
    let mut out: Vec<u8> = Vec::with_capacity(decoded.len() + 1);
    for segment in decoded.split(|&b| b == b'/') {
        match segment {
            b"" | b"." => {}
            b".." => {
                let start = out.iter().rposition(|&b| b == b'/').unwrap_or(0);
                out.truncate(start);
            }
            segment => {
                out.push(b'/');
                out.extend_from_slice(segment);
            }
        }
    }
    // A trailing slash or dot segment names a directory: keep its slash.
    let ends_open = decoded.ends_with(b"/")
        || decoded.ends_with(b"/.")
        || decoded.ends_with(b"/..")
        || decoded == b"."
        || decoded == b"..";
    if out.is_empty() || ends_open {
        out.push(b'/');
    }
    Ok(Cow::Owned(out))
}

/// Whether `path` is in normal form already: starts with `/`, no empty, `.`
/// or `..` segment (a trailing slash is allowed), no `%` and no `\`.
fn is_normal(path: &[u8]) -> bool {
    if path.first() != Some(&b'/') {
        return false;
    }
    if path.iter().any(|&b| b == b'%' || b == b'\\') {
        return false;
    }
    if path == b"/" {
        return true;
    }
    let inner = path.get(1..).unwrap_or_default();
    let inner = inner.strip_suffix(b"/").unwrap_or(inner);
    inner
        .split(|&b| b == b'/')
        .all(|segment| !matches!(segment, b"" | b"." | b".."))
}

/// `path` with unreserved characters decoded and `\` read as `/`; other
/// escapes are kept as written.
fn decode_unreserved(path: &[u8]) -> Result<Vec<u8>, PathError> {
    let mut out = Vec::with_capacity(path.len());
    let mut i = 0;
    while let Some(&byte) = path.get(i) {
        i += 1;
        match byte {
            b'\\' => out.push(b'/'),
            b'%' => {
                let decoded = match (path.get(i), path.get(i + 1)) {
                    (Some(&hi), Some(&lo)) => hex(hi).zip(hex(lo)).map(|(hi, lo)| hi << 4 | lo),
                    _ => None,
                };
                match decoded {
                    Some(b'/' | b'\\') => return Err(PathError::EscapedSlash),
                    Some(c)
                        if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~') =>
                    {
                        out.push(c);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            other => out.push(other),
        }
    }
    Ok(out)
}

fn hex(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

/// Whether normal path `path` is `prefix` or under it, segment by segment:
/// `/healthz` is under `/healthz` and `/healthz/live`, not under
/// `/healthzv1`. A `prefix` ending in `/` matches only paths under it.
pub fn under(path: &[u8], prefix: &[u8]) -> bool {
    let Some(rest) = path.strip_prefix(prefix) else {
        return false;
    };
    rest.is_empty() || prefix.ends_with(b"/") || rest.first() == Some(&b'/')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(path: &str) -> Result<String, PathError> {
        normalize(path.as_bytes()).map(|p| String::from_utf8_lossy(&p).into_owned())
    }

    #[test]
    fn paths_as_the_backend_serves_them() {
        for (raw, normal) in [
            ("/v1/messages", "/v1/messages"),
            ("/v1/messages?beta=true", "/v1/messages"),
            ("/v1/messages#x", "/v1/messages"),
            ("//v1/messages", "/v1/messages"),
            ("/v1//messages", "/v1/messages"),
            ("/v1/./messages", "/v1/messages"),
            ("/healthz/../v1/messages", "/v1/messages"),
            ("/healthz/%2e%2e/v1/messages", "/v1/messages"),
            ("/healthz/%2E./v1/messages", "/v1/messages"),
            ("/../../v1/messages", "/v1/messages"),
            ("/v1/%6Dessages", "/v1/messages"),
            ("/v1\\messages", "/v1/messages"),
            ("\\v1\\messages", "/v1/messages"),
            ("v1/messages", "/v1/messages"),
            ("/v1/messages/", "/v1/messages/"),
            ("/v1/messages/.", "/v1/messages/"),
            ("/v1/messages/x/..", "/v1/messages/"),
            ("/a%20b/%zz/%4", "/a%20b/%zz/%4"),
            ("", "/"),
            ("/", "/"),
            ("//", "/"),
            ("/..", "/"),
            ("?/v1/messages", "/"),
        ] {
            assert_eq!(norm(raw).as_deref(), Ok(normal), "{raw}");
        }
        for raw in [
            "/v1%2Fmessages",
            "/v1%2fmessages",
            "/healthz%5C..%5Cv1/messages",
        ] {
            assert_eq!(norm(raw), Err(PathError::EscapedSlash), "{raw}");
        }
    }

    #[test]
    fn a_normal_path_is_borrowed() {
        for raw in ["/v1/messages", "/v1/chat/completions?x=1", "/", "/a/b/"] {
            assert!(
                matches!(normalize(raw.as_bytes()), Ok(Cow::Borrowed(_))),
                "{raw}"
            );
        }
    }

    #[test]
    fn normal_form_is_a_fixed_point() {
        for raw in [
            "//a/./b/../c//",
            "/%2e/x/%2e%2e/y",
            "\\a\\..\\b",
            "/a/b/..",
            "x/../..",
        ] {
            let once = norm(raw).unwrap();
            assert_eq!(norm(&once).unwrap(), once, "{raw}");
        }
    }

    #[test]
    fn prefixes_match_whole_segments() {
        assert!(under(b"/healthz", b"/healthz"));
        assert!(under(b"/healthz/live", b"/healthz"));
        assert!(!under(b"/healthzv1/messages", b"/healthz"));
        assert!(!under(b"/v1/messages", b"/healthz"));
        assert!(under(b"/public/x", b"/public/"));
        assert!(!under(b"/public", b"/public/"));
        assert!(under(b"/anything", b"/"));
    }
}
