//! http_auth_random, as the SDK's example: every request waits for a
//! callout (`GET /bytes/1` on the `httpbin` upstream, or the one the plugin
//! configuration names), then goes on if the first byte of the answer is
//! even and is refused with 403 otherwise. It also logs the callout answer's
//! headers, to show what the host hands a filter.
// The SDK's entry-point macro defines an undocumented `_initialize`.
#![allow(missing_docs)]

use std::time::Duration;

use log::info;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> {
        Box::new(HttpAuthRandomRoot { upstream: "httpbin".into() })
    });
}}

struct HttpAuthRandomRoot {
    upstream: String,
}

impl Context for HttpAuthRandomRoot {}

impl RootContext for HttpAuthRandomRoot {
    fn on_configure(&mut self, _: usize) -> bool {
        if let Some(config) = self.get_plugin_configuration()
            && !config.is_empty()
        {
            self.upstream = String::from_utf8(config).unwrap();
        }
        true
    }

    fn create_http_context(&self, _: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(HttpAuthRandom {
            upstream: self.upstream.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct HttpAuthRandom {
    upstream: String,
}

impl HttpContext for HttpAuthRandom {
    fn on_http_request_headers(&mut self, _: usize, _: bool) -> Action {
        self.dispatch_http_call(
            &self.upstream,
            vec![
                (":method", "GET"),
                (":path", "/bytes/1"),
                (":authority", "httpbin.org"),
            ],
            None,
            vec![],
            Duration::from_secs(1),
        )
        .unwrap();
        Action::Pause
    }

    fn on_http_response_headers(&mut self, _: usize, _: bool) -> Action {
        self.set_http_response_header("Powered-By", Some("proxy-wasm"));
        Action::Continue
    }
}

impl Context for HttpAuthRandom {
    fn on_http_call_response(&mut self, _: u32, _: usize, body_size: usize, _: usize) {
        for (name, value) in self.get_http_call_response_headers() {
            info!("callout answer header {name}: {value}");
        }
        if let Some(body) = self.get_http_call_response_body(0, body_size)
            && !body.is_empty()
            && body[0] % 2 == 0
        {
            info!("Access granted.");
            self.resume_http_request();
            return;
        }
        info!("Access forbidden.");
        self.send_http_response(
            403,
            vec![("Powered-By", "proxy-wasm")],
            Some(b"Access forbidden.\n"),
        );
    }
}
