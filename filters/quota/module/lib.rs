//! `zerolayer_quota.wasm`: the quota stage as a filter of its own.
#![allow(missing_docs)]

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| zerolayer_host::standalone(filter::QuotaRoot::default()));
}}
