//! `zerolayer_fused.wasm`: the whole chain as one filter instance.
#![allow(missing_docs)]

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(filter::FusedRoot::default())
    });
}}
