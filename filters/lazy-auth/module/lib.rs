//! `zerolayer_lazy_auth.wasm`: the lazy-auth stage as a filter of its own.
#![allow(missing_docs)]

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| zerolayer_host::standalone(filter::AuthRoot::default()));
}}
