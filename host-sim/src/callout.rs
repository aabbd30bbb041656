//! Real HTTP for callouts to clusters mapped to loopback servers.

use std::net::SocketAddr;
use std::time::Duration;

use crate::world::{CallResponse, Callout};

/// Performs `callout` against `addr` with a blocking HTTP/1.1 client; any
/// failure (refused, reset, timeout) becomes [`CallResponse::failure`], as
/// Envoy reports it to the module.
pub fn blocking_http(addr: SocketAddr, callout: &Callout) -> CallResponse {
    let timeout = if callout.timeout_ms == 0 {
        Duration::from_secs(60)
    } else {
        Duration::from_millis(u64::from(callout.timeout_ms))
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_global(Some(timeout))
        .build()
        .into();
    let method = callout.header(":method").unwrap_or("GET").to_string();
    let path = callout.header(":path").unwrap_or("/").to_string();
    let mut request = ureq::http::Request::builder()
        .method(method.as_str())
        .uri(format!("http://{addr}{path}"));
    for (name, value) in &callout.headers {
        if name.starts_with(':') {
            continue;
        }
        request = request.header(name.as_str(), value.as_slice());
    }
    if let Some(authority) = callout.header(":authority") {
        request = request.header("host", authority);
    }
    let Ok(request) = request.body(callout.body.clone()) else {
        return CallResponse::failure();
    };
    match agent.run(request) {
        Ok(mut response) => {
            let mut headers = vec![(
                ":status".to_string(),
                response.status().as_u16().to_string().into_bytes(),
            )];
            for (name, value) in response.headers() {
                headers.push((name.as_str().to_string(), value.as_bytes().to_vec()));
            }
            let body = response.body_mut().read_to_vec().unwrap_or_default();
            CallResponse {
                headers,
                body,
                trailers: vec![],
            }
        }
        Err(_) => CallResponse::failure(),
    }
}
