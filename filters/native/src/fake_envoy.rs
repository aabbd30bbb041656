//! Unit tests link without Envoy: these stand in for the callbacks Envoy
//! exports to the module. The tests call no hook that reaches them (they
//! run the configuration with a null handle); one that did would see an
//! Envoy that has nothing and refuses everything.
#![allow(unsafe_code, missing_docs, clippy::missing_safety_doc)]

use crate::abi::{
    BodyKind, Buffer, ConfigEnvoy, FilterEnvoy, Header, HeaderMap, LogLevel, ModuleHeader,
    Scheduler,
};

#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_add_header(
    _: FilterEnvoy,
    _: HeaderMap,
    _: Buffer,
    _: Buffer,
) -> bool {
    false
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_set_header(
    _: FilterEnvoy,
    _: HeaderMap,
    _: Buffer,
    _: Buffer,
) -> bool {
    false
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_get_headers_size(
    _: FilterEnvoy,
    _: HeaderMap,
) -> usize {
    0
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_get_headers(
    _: FilterEnvoy,
    _: HeaderMap,
    _: *mut Header,
) -> bool {
    false
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_get_body_chunks_size(
    _: FilterEnvoy,
    _: BodyKind,
) -> usize {
    0
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_get_body_chunks(
    _: FilterEnvoy,
    _: BodyKind,
    _: *mut Buffer,
) -> bool {
    false
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_append_body(
    _: FilterEnvoy,
    _: BodyKind,
    _: Buffer,
) -> bool {
    false
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_drain_body(
    _: FilterEnvoy,
    _: BodyKind,
    _: usize,
) -> bool {
    false
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_set_filter_state_bytes(
    _: FilterEnvoy,
    _: Buffer,
    _: Buffer,
) -> bool {
    false
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
    _: FilterEnvoy,
    _: u32,
    _: *mut Buffer,
) -> bool {
    false
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_send_response(
    _: FilterEnvoy,
    _: u32,
    _: *const ModuleHeader,
    _: usize,
    _: Buffer,
    _: Buffer,
) {
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_continue_decoding(_: FilterEnvoy) {}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_http_callout(
    _: FilterEnvoy,
    _: *mut u64,
    _: Buffer,
    _: *const ModuleHeader,
    _: usize,
    _: Buffer,
    _: u64,
) -> u32 {
    4
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_scheduler_new(_: FilterEnvoy) -> Scheduler {
    std::ptr::null_mut()
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_scheduler_commit(_: Scheduler, _: u64) {}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_scheduler_delete(_: Scheduler) {}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
    _: ConfigEnvoy,
) -> Scheduler {
    std::ptr::null_mut()
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
    _: Scheduler,
    _: u64,
) {
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(_: Scheduler) {}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_config_define_counter(
    _: ConfigEnvoy,
    _: Buffer,
    _: *const Buffer,
    _: usize,
    _: *mut usize,
) -> u32 {
    3
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
    _: ConfigEnvoy,
    _: Buffer,
    _: *const Buffer,
    _: usize,
    _: *mut usize,
) -> u32 {
    3
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_config_define_histogram(
    _: ConfigEnvoy,
    _: Buffer,
    _: *const Buffer,
    _: usize,
    _: *mut usize,
) -> u32 {
    3
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
    _: ConfigEnvoy,
    _: usize,
    _: *const Buffer,
    _: usize,
    _: u64,
) -> u32 {
    1
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
    _: ConfigEnvoy,
    _: usize,
    _: *const Buffer,
    _: usize,
    _: u64,
) -> u32 {
    1
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_http_filter_config_record_histogram_value(
    _: ConfigEnvoy,
    _: usize,
    _: *const Buffer,
    _: usize,
    _: u64,
) -> u32 {
    1
}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_log(_: LogLevel, _: Buffer) {}
#[unsafe(no_mangle)]
extern "C" fn envoy_dynamic_module_callback_log_enabled(_: LogLevel) -> bool {
    false
}
