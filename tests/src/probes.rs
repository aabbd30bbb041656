//! The floor probes as Envoy HTTP filters: the Wasm probe (`host-sim/probe`)
//! in one of its roles, and zerolayer-native's probes (`filters/native`,
//! feature `probes`), which do the same work in an Envoy dynamic module.

use anyhow::Result;
use serde_json::json;
use serde_yaml::Value;

use crate::paths;

/// The Wasm probe in `role` (`trivial`, `chain`) as filter (and VM) `name`.
pub fn wasm(name: &str, role: &str) -> Result<Value> {
    let filter = json!({
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": name,
                "vm_config": {
                    "vm_id": name,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": paths::wasm("probe")?.display().to_string()}},
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": format!(r#"{{"role":"{role}"}}"#),
                },
            },
        },
    });
    Ok(serde_yaml::to_value(filter)?)
}

/// zerolayer-native's filter `filter_name` (`probe_trivial`, `probe_chain`),
/// which only the probes' build of `libzerolayer_native.so` has: the
/// Envoy that runs it needs `ENVOY_DYNAMIC_MODULES_SEARCH_PATH` set to
/// [`paths::native_probe_modules`] (the shipped module refuses the name).
pub fn native(filter_name: &str) -> Result<Value> {
    paths::native_probe_modules()?;
    let filter = json!({
        "name": format!("native.{filter_name}"),
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": "zerolayer_native", "do_not_close": true},
            "filter_name": filter_name,
            "filter_config": {
                "@type": "type.googleapis.com/google.protobuf.StringValue",
                "value": "",
            },
        },
    });
    Ok(serde_yaml::to_value(filter)?)
}
