//! The Proxy-Wasm ABI 0.2.1 vocabulary: status codes, enums and the byte
//! formats host and module exchange (header maps, property paths).

/// Result codes returned by host functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
#[allow(missing_docs)]
pub enum Status {
    Ok = 0,
    NotFound = 1,
    BadArgument = 2,
    SerializationFailure = 3,
    ParseFailure = 4,
    BadExpression = 5,
    InvalidMemoryAccess = 6,
    Empty = 7,
    CasMismatch = 8,
    ResultMismatch = 9,
    InternalFailure = 10,
    BrokenConnection = 11,
    Unimplemented = 12,
}

/// `Continue` / `Pause` as returned by the module's HTTP callbacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Pass the data on to the next filter.
    Continue,
    /// Stop iterating (headers) or buffer (body) until the filter resumes.
    Pause,
}

impl Action {
    /// Decodes the module's return value (anything but 0 pauses).
    pub fn from_raw(raw: i32) -> Action {
        if raw == 0 {
            Action::Continue
        } else {
            Action::Pause
        }
    }
}

/// Header maps a module can address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum MapType {
    RequestHeaders,
    RequestTrailers,
    ResponseHeaders,
    ResponseTrailers,
    GrpcInitialMetadata,
    GrpcTrailingMetadata,
    CallResponseHeaders,
    CallResponseTrailers,
}

impl MapType {
    /// From the ABI value.
    pub fn from_raw(raw: i32) -> Option<MapType> {
        Some(match raw {
            0 => MapType::RequestHeaders,
            1 => MapType::RequestTrailers,
            2 => MapType::ResponseHeaders,
            3 => MapType::ResponseTrailers,
            4 => MapType::GrpcInitialMetadata,
            5 => MapType::GrpcTrailingMetadata,
            6 => MapType::CallResponseHeaders,
            7 => MapType::CallResponseTrailers,
            _ => return None,
        })
    }
}

/// Buffers a module can address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum BufferType {
    RequestBody,
    ResponseBody,
    DownstreamData,
    UpstreamData,
    CallResponseBody,
    GrpcReceiveBuffer,
    VmConfiguration,
    PluginConfiguration,
    CallData,
}

impl BufferType {
    /// From the ABI value.
    pub fn from_raw(raw: i32) -> Option<BufferType> {
        Some(match raw {
            0 => BufferType::RequestBody,
            1 => BufferType::ResponseBody,
            2 => BufferType::DownstreamData,
            3 => BufferType::UpstreamData,
            4 => BufferType::CallResponseBody,
            5 => BufferType::GrpcReceiveBuffer,
            6 => BufferType::VmConfiguration,
            7 => BufferType::PluginConfiguration,
            8 => BufferType::CallData,
            _ => return None,
        })
    }
}

/// Metric kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum MetricType {
    Counter,
    Gauge,
    Histogram,
}

impl MetricType {
    /// From the ABI value.
    pub fn from_raw(raw: i32) -> Option<MetricType> {
        Some(match raw {
            0 => MetricType::Counter,
            1 => MetricType::Gauge,
            2 => MetricType::Histogram,
            _ => return None,
        })
    }
}

/// Log levels, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[allow(missing_docs)]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
    Critical,
}

impl LogLevel {
    /// From the ABI value (out-of-range values read as `Critical`).
    pub fn from_raw(raw: i32) -> LogLevel {
        match raw {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            _ => LogLevel::Critical,
        }
    }

    /// Lower-case name, as Envoy prints it.
    pub fn name(self) -> &'static str {
        match self {
            LogLevel::Trace => "trace",
            LogLevel::Debug => "debug",
            LogLevel::Info => "info",
            LogLevel::Warn => "warning",
            LogLevel::Error => "error",
            LogLevel::Critical => "critical",
        }
    }
}

/// A header map: lower-case names, raw values, in order.
pub type Headers = Vec<(String, Vec<u8>)>;

/// Serializes a header map the way modules read it (Proxy-Wasm's pairs
/// format): the count, then each key's and value's size (u32 LE), then each
/// key and value followed by a NUL byte.
pub fn encode_pairs(pairs: &[(String, Vec<u8>)]) -> Vec<u8> {
    let size = 4 + pairs
        .iter()
        .map(|(k, v)| 8 + k.len() + v.len() + 2)
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (key, value) in pairs {
        out.extend_from_slice(&(key.len() as u32).to_le_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    }
    for (key, value) in pairs {
        out.extend_from_slice(key.as_bytes());
        out.push(0);
        out.extend_from_slice(value);
        out.push(0);
    }
    out
}

/// Parses a serialized header map; `None` when malformed (never panics).
pub fn decode_pairs(bytes: &[u8]) -> Option<Headers> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let read_u32 = |at: usize| -> Option<usize> {
        let b = bytes.get(at..at + 4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let count = read_u32(0)?;
    // Each entry needs at least 10 bytes: cheap guard against huge counts.
    if count > bytes.len() / 10 + 1 {
        return None;
    }
    let mut sizes = Vec::with_capacity(count);
    for i in 0..count {
        sizes.push((read_u32(4 + i * 8)?, read_u32(8 + i * 8)?));
    }
    let mut at = 4 + count * 8;
    let mut out = Vec::with_capacity(count);
    for (ks, vs) in sizes {
        let key = bytes.get(at..at + ks)?;
        at += ks + 1;
        let value = bytes.get(at..at + vs)?;
        at += vs + 1;
        out.push((String::from_utf8_lossy(key).into_owned(), value.to_vec()));
    }
    Some(out)
}

/// Splits a property path (segments separated by NUL bytes).
pub fn decode_path(bytes: &[u8]) -> Vec<String> {
    bytes
        .split(|b| *b == 0)
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_round_trip() {
        let pairs: Headers = vec![
            (":path".into(), b"/v1".to_vec()),
            ("x-empty".into(), vec![]),
            ("x-bin".into(), vec![0xff, 0, 1]),
        ];
        assert_eq!(decode_pairs(&encode_pairs(&pairs)), Some(pairs));
        assert_eq!(decode_pairs(&[]), Some(vec![]));
        assert_eq!(decode_pairs(&[1, 0, 0, 0]), None);
        assert_eq!(decode_pairs(&[255, 255, 255, 255, 0, 0]), None);
    }

    #[test]
    fn paths() {
        assert_eq!(decode_path(b"request\0path"), ["request", "path"]);
        assert_eq!(decode_path(b"wasmx.x"), ["wasmx.x"]);
    }
}
