//! Properties: Envoy's attribute paths (`request.path`, `source.address`,
//! `plugin_name`, …) and per-stream filter state written with
//! `set_property`.
//!
//! Value encoding follows Envoy: strings as raw bytes, integers as 8-byte
//! little-endian, booleans as one byte, maps as serialized header pairs.
//!
//! Filter state: under the Envoy profile a path is stored under its raw
//! serialized form; a one-segment path reads back (Envoy keys it
//! `wasm.<segment>`), a multi-segment one does not (checked against Envoy
//! 1.40). Under the Kong profile segments are joined with dots and only
//! host properties are writable: `wasmx.*` as in ngx_wasm_module, or —
//! modelling Kong Gateway's build (`NGX_WASM_HOST_PROPERTY_NAMESPACE=kong`,
//! `HostOptions::kong_gateway`) — `kong.ctx.shared.*`, with `kong.version`
//! readable and `wasmx.*` unknown.

use crate::abi::{Headers, Status, decode_path, encode_pairs};
use crate::vm::VmState;
use crate::world::{Profile, StreamData};

fn header<'a>(headers: &'a Headers, name: &str) -> Option<&'a [u8]> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_slice())
}

fn int(v: i64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// Reads property `path` (NUL-separated segments) from the current context.
pub(crate) fn get(state: &VmState, path: &[u8]) -> Option<Vec<u8>> {
    let segments = decode_path(path);
    let parts: Vec<&str> = segments.iter().map(String::as_str).collect();
    let root = state.root_of(state.current);
    let info = root.and_then(|r| state.roots.get(&r));
    match parts.as_slice() {
        ["plugin_name"] => return info.map(|i| i.plugin_name.as_bytes().to_vec()),
        ["plugin_root_id"] => return info.map(|i| i.root_id.as_bytes().to_vec()),
        ["plugin_vm_id"] => return Some(state.vm_id.as_bytes().to_vec()),
        _ => {}
    }
    let (stream, _) = state.current_stream()?;
    let world = state.world.borrow();
    let data = world.streams.get(&stream)?;
    let profile = world.profile;
    let now = world.clock.now_ns();
    if profile == Profile::Kong && parts.join(".") == NGX_VERSION {
        // nginx variables (`ngx.*`) answer only in a request, as here.
        return Some(NGINX_VERSION.as_bytes().to_vec());
    }
    if profile == Profile::Kong && parts.join(".") == NGX_REQUEST_ID {
        return Some(request_id(stream, data.info.start_ns).into_bytes());
    }
    if profile == Profile::Kong && world.kong_gateway {
        let dotted = parts.join(".");
        if dotted == "kong.version" {
            return Some(KONG_VERSION.as_bytes().to_vec());
        }
        return dotted
            .starts_with(KONG_SHARED)
            .then(|| data.filter_state.get(&dotted).cloned())
            .flatten();
    }
    attribute(data, &parts, now).or_else(|| filter_state(data, profile, path, &parts))
}

/// The nginx variable ngx_wasm_module answers as property `ngx.nginx_version`.
const NGX_VERSION: &str = "ngx.nginx_version";
/// nginx's `$request_id` (32 hex digits, random, one per request).
const NGX_REQUEST_ID: &str = "ngx.request_id";
/// The nginx version of `../shared/ngx-wasm` (what `ngx.nginx_version` answers).
const NGINX_VERSION: &str = "1.27.4";
/// The version Kong Gateway's `kong.version` property answers.
const KONG_VERSION: &str = "3.9.1";
/// Kong Gateway's per-request namespace (`kong.ctx.shared`).
const KONG_SHARED: &str = "kong.ctx.shared.";

/// A request's `$request_id`: 32 hex digits, the same all through the
/// request, different for every request (splitmix64 of its stream and start).
fn request_id(stream: u64, start_ns: u64) -> String {
    let mix = |mut z: u64| {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let a = mix(stream.wrapping_add(0x9e37_79b9_7f4a_7c15));
    let b = mix(a ^ start_ns);
    format!("{a:016x}{b:016x}")
}

fn attribute(data: &StreamData, parts: &[&str], now_ns: u64) -> Option<Vec<u8>> {
    let req = &data.request_headers;
    let path = header(req, ":path").unwrap_or(b"/");
    Some(match parts {
        ["request", "path"] => path.to_vec(),
        ["request", "url_path"] => path.split(|b| *b == b'?').next().unwrap_or(b"").to_vec(),
        ["request", "host"] => header(req, ":authority")?.to_vec(),
        ["request", "scheme"] => header(req, ":scheme").unwrap_or(b"http").to_vec(),
        ["request", "method"] => header(req, ":method")?.to_vec(),
        ["request", "id"] => header(req, "x-request-id")?.to_vec(),
        ["request", "useragent"] => header(req, "user-agent")?.to_vec(),
        ["request", "referer"] => header(req, "referer")?.to_vec(),
        ["request", "protocol"] => b"HTTP/1.1".to_vec(),
        ["request", "time"] => int(data.info.start_ns as i64),
        ["request", "duration"] => int(now_ns.saturating_sub(data.info.start_ns) as i64),
        ["request", "headers"] => encode_pairs(req),
        ["request", "headers", name] => header(req, &name.to_ascii_lowercase())?.to_vec(),
        ["response", "code"] => {
            let status = header(data.response_headers.as_ref()?, ":status")?;
            int(std::str::from_utf8(status).ok()?.parse().ok()?)
        }
        ["response", "headers"] => encode_pairs(data.response_headers.as_ref()?),
        ["response", "headers", name] => {
            header(data.response_headers.as_ref()?, &name.to_ascii_lowercase())?.to_vec()
        }
        ["response", "code_details"] => data.local_response.as_ref()?.details.as_bytes().to_vec(),
        ["source", "address"] => data.info.source.to_string().into_bytes(),
        ["source", "port"] => int(i64::from(data.info.source.port())),
        ["destination", "address"] => data.info.destination.to_string().into_bytes(),
        ["destination", "port"] => int(i64::from(data.info.destination.port())),
        ["connection", "id"] => int(data.info.connection_id as i64),
        ["connection", "mtls"] => vec![0],
        _ => return None,
    })
}

fn filter_state(
    data: &StreamData,
    profile: Profile,
    raw: &[u8],
    parts: &[&str],
) -> Option<Vec<u8>> {
    match profile {
        Profile::Envoy => match parts {
            ["filter_state", key] => data.filter_state.get(*key).cloned(),
            [one] => data.filter_state.get(&format!("wasm.{one}")).cloned(),
            _ => {
                let _ = raw;
                None
            }
        },
        Profile::Kong => data.filter_state.get(&parts.join(".")).cloned(),
    }
}

/// Writes property `path` as filter state of the current stream.
pub(crate) fn set(state: &VmState, path: &[u8], value: Vec<u8>) -> Result<(), Status> {
    let (stream, _) = state.current_stream().ok_or(Status::BadArgument)?;
    let mut world = state.world.borrow_mut();
    let profile = world.profile;
    let host_namespace = if world.kong_gateway {
        KONG_SHARED
    } else {
        "wasmx."
    };
    let data = world.streams.get_mut(&stream).ok_or(Status::NotFound)?;
    let key = match profile {
        // Envoy keys filter state "wasm." + the serialized path, NULs and all.
        Profile::Envoy => format!("wasm.{}", String::from_utf8_lossy(path)),
        Profile::Kong => {
            let dotted = decode_path(path).join(".");
            if !dotted.starts_with(host_namespace) {
                return Err(Status::NotFound);
            }
            dotted
        }
    };
    data.filter_state.insert(key, value);
    Ok(())
}
