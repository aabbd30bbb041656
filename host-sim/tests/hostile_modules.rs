//! The host never panics on what a module does: bad pointers, unknown
//! imports, traps. Hand-written modules (WAT) do what no SDK would.

use anyhow::{Context, Result};
use host_sim::{Host, PluginSpec};

const ABUSIVE: &str = r#"
(module
  (import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_pairs" (func $pairs (param i32 i32 i32) (result i32)))
  (import "env" "proxy_set_buffer_bytes" (func $setbuf (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_not_in_any_abi" (func $nope (param i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_prestat_get" (func $prestat (param i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "proxy_on_memory_allocate") (param i32) (result i32) (i32.const 4096))
  ;; Writes `value` (< 100) as two ASCII digits at `at`.
  (func $digits (param $value i32) (param $at i32)
    (i32.store8 (local.get $at) (i32.add (i32.const 48) (i32.div_u (local.get $value) (i32.const 10))))
    (i32.store8 (i32.add (local.get $at) (i32.const 1)) (i32.add (i32.const 48) (i32.rem_u (local.get $value) (i32.const 10)))))
  (func (export "proxy_on_configure") (param i32 i32) (result i32)
    ;; Out-of-bounds message pointer: InvalidMemoryAccess (6).
    (call $digits (call $log (i32.const 2) (i32.const 0x7fffffff) (i32.const 100)) (i32.const 100))
    ;; An import no ABI has: Unimplemented (12).
    (call $digits (call $nope (i32.const 1)) (i32.const 102))
    ;; A WASI function the host does not implement: ENOSYS (52).
    (call $digits (call $prestat (i32.const 3) (i32.const 16)) (i32.const 104))
    ;; Header maps from a root context: no pairs, as in Envoy, but the
    ;; out-of-bounds result pointer: InvalidMemoryAccess (6).
    (call $digits (call $pairs (i32.const 0) (i32.const 0x7ffffff0) (i32.const 20)) (i32.const 106))
    ;; Buffer type out of range: BadArgument (2).
    (call $digits (call $setbuf (i32.const 99) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0)) (i32.const 108))
    (drop (call $log (i32.const 2) (i32.const 100) (i32.const 10)))
    (i32.const 1))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) unreachable)
)
"#;

fn module(dir: &tempfile::TempDir, name: &str, wat: &str) -> Result<std::path::PathBuf> {
    let path = dir.path().join(name);
    std::fs::write(&path, wat)?;
    Ok(path)
}

#[test]
fn bad_arguments_get_statuses_not_panics() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut host = Host::new()?;
    let chain = host.add_chain(vec![PluginSpec::new(
        "abusive",
        module(&dir, "abusive.wat", ABUSIVE)?,
    )])?;
    // The statuses, two digits each, as the module logged them: from
    // Envoy's configuration canary, then from the worker's VM.
    assert_eq!(
        host.logs_containing("0612520602").len(),
        2,
        "{:?}",
        host.logs()
    );

    // A trap fails the VM closed: 503 for this stream and the next, host fine.
    for _ in 0..2 {
        let mut s = host.stream(chain)?;
        s.request_headers(
            &[(":method", "GET"), (":path", "/"), (":authority", "x")],
            true,
        );
        assert_eq!(s.client().status(), Some(503));
        assert!(!s.upstream().complete);
    }
    assert_eq!(host.failed_vms().len(), 1);
    assert_eq!(
        host.logs_containing("VM trapped and is now failed").len(),
        1
    );
    Ok(())
}

#[test]
fn a_module_without_an_allocator_is_refused_with_a_reason() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut host = Host::new()?;
    let err = host
        .add_chain(vec![PluginSpec::new(
            "noalloc",
            module(
                &dir,
                "noalloc.wat",
                r#"(module (memory (export "memory") 1))"#,
            )?,
        )])
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(
        err.contains("neither proxy_on_memory_allocate nor malloc"),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_module_that_exits_fails_its_vm_cleanly() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let wat = r#"(module
      (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
      (memory (export "memory") 1)
      (func (export "proxy_on_memory_allocate") (param i32) (result i32) (i32.const 1024))
      (func (export "proxy_on_configure") (param i32 i32) (result i32) (call $exit (i32.const 3)) (i32.const 1)))"#;
    let mut host = Host::new()?;
    let err = host
        .add_chain(vec![PluginSpec::new(
            "exits",
            module(&dir, "exits.wat", wat)?,
        )])
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(err.contains("proc_exit(3)"), "{err}");
    Ok(())
}

#[test]
fn a_module_stuck_in_a_loop_traps_instead_of_hanging_the_host() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let wat = r#"(module
      (memory (export "memory") 1)
      (func (export "proxy_on_memory_allocate") (param i32) (result i32) (i32.const 1024))
      (func (export "proxy_on_configure") (param i32 i32) (result i32) (loop $forever (br $forever)) (i32.const 1)))"#;
    let mut host = Host::new()?;
    let err = host
        .add_chain(vec![PluginSpec::new(
            "loops",
            module(&dir, "loops.wat", wat)?,
        )])
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(err.contains("interrupt"), "{err}");
    Ok(())
}

/// Sets a tick period in `on_vm_start` and again in `on_configure`.
const TICK_TWICE: &str = r#"
(module
  (import "env" "proxy_set_tick_period_milliseconds" (func $tick (param i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "proxy_on_memory_allocate") (param i32) (result i32) (i32.const 1024))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32)
    (drop (call $tick (i32.const 5000)))
    (i32.const 1))
  (func (export "proxy_on_configure") (param i32 i32) (result i32)
    (drop (call $tick (i32.const 200)))
    (i32.const 1))
)
"#;

#[test]
fn a_second_tick_period_is_fine_in_envoy_and_traps_in_kong() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = module(&dir, "tick.wat", TICK_TWICE)?;
    let mut envoy = Host::new()?;
    envoy.add_singleton(PluginSpec::new("tick", &path))?;
    let mut kong = Host::with_options(host_sim::HostOptions {
        profile: host_sim::Profile::Kong,
        ..Default::default()
    })?;
    let err = kong
        .add_chain(vec![PluginSpec::new("tick", &path)])
        .err()
        .context("ngx_wasm_module refuses a second tick period")?;
    assert!(
        format!("{err:#}").contains("tick_period already set"),
        "{err:#}"
    );
    Ok(())
}
