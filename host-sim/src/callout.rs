//! Real HTTP for callouts to clusters mapped to loopback servers, on the
//! wire and back to the module as each host does it.
//!
//! A plain HTTP/1.1 exchange written here rather than through an HTTP client
//! library, so that the request carries exactly the headers the real host
//! sends (no `user-agent`, `accept` or `content-length: 0` of a client
//! library's own) and the answer reaches the module with the headers the
//! real host hands it:
//! - Envoy 1.40: `host` from `:authority`, the module's headers,
//!   `x-envoy-internal: true`, `x-envoy-expected-rq-timeout-ms` (the
//!   callout's timeout), `content-length` only for a body. The module sees
//!   the answer's headers lower-cased without hop-by-hop ones
//!   (`transfer-encoding`, `connection`), then `x-envoy-upstream-service-time`;
//!   a refused connection is Envoy's 503 with its text, a timeout no answer.
//! - ngx_wasm_module: `Host`, `Connection: close`, `Content-Length` (always),
//!   then the module's headers (its own `Host`/`Connection` skipped). The
//!   module sees `:status`, `:dispatch_status: ok` and the answer's headers
//!   as sent; a failure is `:dispatch_status` alone (`timeout`,
//!   `broken connection`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::world::{CallResponse, Callout, Profile};

/// Envoy's router's answer when it cannot connect (1.40, `text/plain`).
pub const ENVOY_CONNECT_FAILURE: &str = "upstream connect error or disconnect/reset before headers. reset reason: remote connection failure";

/// Hop-by-hop headers Envoy's codec keeps out of a header map.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
];

/// Why a callout got no answer.
enum Failure {
    Connect,
    Timeout,
    Broken,
}

/// Performs `callout` against `addr` as `profile`'s host does and returns
/// what that host hands the module (see the module docs).
pub fn blocking_http(addr: SocketAddr, callout: &Callout, profile: Profile) -> CallResponse {
    let timeout = if callout.timeout_ms == 0 {
        Duration::from_secs(60)
    } else {
        Duration::from_millis(u64::from(callout.timeout_ms))
    };
    let started = Instant::now();
    match exchange(addr, &request_bytes(callout, profile), timeout) {
        Ok((status, headers, body)) => {
            let mut out = vec![(":status".to_string(), status.to_string().into_bytes())];
            match profile {
                Profile::Envoy => {
                    for (name, value) in headers {
                        let name = name.to_ascii_lowercase();
                        if !HOP_BY_HOP.contains(&name.as_str()) {
                            out.push((name, value));
                        }
                    }
                    out.push((
                        "x-envoy-upstream-service-time".into(),
                        started.elapsed().as_millis().to_string().into_bytes(),
                    ));
                }
                Profile::Kong => {
                    out.push((":dispatch_status".into(), b"ok".to_vec()));
                    out.extend(headers);
                }
            }
            CallResponse {
                headers: out,
                body,
                trailers: vec![],
                failure: None,
            }
        }
        Err(failure) => match (profile, failure) {
            (Profile::Envoy, Failure::Connect) => CallResponse::new(503, ENVOY_CONNECT_FAILURE)
                .header("content-length", &ENVOY_CONNECT_FAILURE.len().to_string())
                .header("content-type", "text/plain"),
            (Profile::Envoy, _) => CallResponse::failure(),
            (Profile::Kong, Failure::Timeout) => CallResponse::failed("timeout"),
            (Profile::Kong, _) => CallResponse::failed("broken connection"),
        },
    }
}

/// The request as `profile`'s host writes it.
fn request_bytes(callout: &Callout, profile: Profile) -> Vec<u8> {
    let method = callout.header(":method").unwrap_or("GET");
    let path = callout.header(":path").unwrap_or("/");
    let authority = callout.header(":authority").unwrap_or(&callout.cluster);
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    let mut line = |name: &str, value: &[u8]| {
        head.push_str(name);
        head.push_str(": ");
        head.push_str(&String::from_utf8_lossy(value));
        head.push_str("\r\n");
    };
    let own = callout
        .headers
        .iter()
        .filter(|(name, _)| !name.starts_with(':'));
    match profile {
        Profile::Envoy => {
            line("host", authority.as_bytes());
            for (name, value) in own {
                if name != "host" {
                    line(name, value);
                }
            }
            line("x-envoy-internal", b"true");
            if callout.timeout_ms > 0 {
                line(
                    "x-envoy-expected-rq-timeout-ms",
                    callout.timeout_ms.to_string().as_bytes(),
                );
            }
            if !callout.body.is_empty() {
                line("content-length", callout.body.len().to_string().as_bytes());
            }
        }
        Profile::Kong => {
            line("Host", authority.as_bytes());
            line("Connection", b"close");
            line("Content-Length", callout.body.len().to_string().as_bytes());
            for (name, value) in own {
                if !name.eq_ignore_ascii_case("host") && !name.eq_ignore_ascii_case("connection") {
                    line(name, value);
                }
            }
        }
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(&callout.body);
    bytes
}

type Answer = (u16, Vec<(String, Vec<u8>)>, Vec<u8>);

/// One request on a fresh connection; the answer's status, headers (as
/// sent) and body (de-chunked).
fn exchange(addr: SocketAddr, request: &[u8], timeout: Duration) -> Result<Answer, Failure> {
    let deadline = Instant::now() + timeout;
    let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(|err| {
        if err.kind() == std::io::ErrorKind::TimedOut {
            Failure::Timeout
        } else {
            Failure::Connect
        }
    })?;
    let _ = stream.set_nodelay(true);
    let io = |err: std::io::Error| match err.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Failure::Timeout,
        _ => Failure::Broken,
    };
    let remaining = || {
        deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or(Failure::Timeout)
    };
    stream.set_write_timeout(Some(remaining()?)).map_err(io)?;
    stream.write_all(request).map_err(io)?;
    stream.set_read_timeout(Some(remaining()?)).map_err(io)?;
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line).map_err(io)?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or(Failure::Broken)?;
    let mut headers = Vec::new();
    loop {
        let mut line = Vec::new();
        reader.read_until(b'\n', &mut line).map_err(io)?;
        if line.is_empty() {
            return Err(Failure::Broken);
        }
        let line = line.strip_suffix(b"\n").unwrap_or(&line);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            break;
        }
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            return Err(Failure::Broken);
        };
        let name = String::from_utf8_lossy(&line[..colon]).trim().to_string();
        let value = line[colon + 1..].trim_ascii().to_vec();
        headers.push((name, value));
    }
    let find = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| String::from_utf8_lossy(v).trim().to_ascii_lowercase())
    };
    let mut body = Vec::new();
    if matches!(status, 100..=199 | 204 | 304) {
        // No body.
    } else if find("transfer-encoding").is_some_and(|te| te.contains("chunked")) {
        loop {
            let mut size_line = String::new();
            reader.read_line(&mut size_line).map_err(io)?;
            let size =
                usize::from_str_radix(size_line.trim().split(';').next().unwrap_or("").trim(), 16)
                    .map_err(|_| Failure::Broken)?;
            if size == 0 {
                // Trailers (ignored) up to the blank line.
                loop {
                    let mut trailer = String::new();
                    if reader.read_line(&mut trailer).map_err(io)? == 0 || trailer.trim().is_empty()
                    {
                        break;
                    }
                }
                break;
            }
            let start = body.len();
            body.resize(start + size, 0);
            reader.read_exact(&mut body[start..]).map_err(io)?;
            let mut crlf = [0u8; 2];
            reader.read_exact(&mut crlf).map_err(io)?;
        }
    } else if let Some(length) = find("content-length") {
        let length: usize = length.parse().map_err(|_| Failure::Broken)?;
        body.resize(length, 0);
        reader.read_exact(&mut body).map_err(io)?;
    } else {
        reader.read_to_end(&mut body).map_err(io)?;
    }
    Ok((status, headers, body))
}
