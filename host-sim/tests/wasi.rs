//! WASI preview1 as wasip1 modules use it: the environment (how secrets
//! reach a module without being in its configuration) and stdout logging.

use anyhow::Result;
use host_sim::{Host, PluginSpec};

#[test]
fn environment_variables_reach_the_module() -> Result<()> {
    // Logs the first environment string it gets through environ_get.
    let wat = r#"(module
      (import "wasi_snapshot_preview1" "environ_sizes_get" (func $sizes (param i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "environ_get" (func $get (param i32 i32) (result i32)))
      (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
      (memory (export "memory") 1)
      (func (export "proxy_on_memory_allocate") (param i32) (result i32) (i32.const 4096))
      (func (export "proxy_on_configure") (param i32 i32) (result i32)
        (drop (call $sizes (i32.const 0) (i32.const 4)))
        (drop (call $get (i32.const 100) (i32.const 200)))
        ;; iovec at 300: pointer = first env pointer, length = total size - 1 (drop the NUL)
        (i32.store (i32.const 300) (i32.load (i32.const 100)))
        (i32.store (i32.const 304) (i32.sub (i32.load (i32.const 4)) (i32.const 1)))
        (drop (call $write (i32.const 1) (i32.const 300) (i32.const 1) (i32.const 400)))
        (i32.const 1)))"#;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("env.wat");
    std::fs::write(&path, wat)?;
    let mut host = Host::new()?;
    host.add_chain(vec![
        PluginSpec::new("env", &path).env("ZEROLAYER_SECRET", "s3cr3t"),
    ])?;
    // Envoy's configuration canary and the worker's VM both see it.
    assert_eq!(
        host.logs_containing("ZEROLAYER_SECRET=s3cr3t").len(),
        2,
        "{:?}",
        host.logs()
    );
    Ok(())
}
