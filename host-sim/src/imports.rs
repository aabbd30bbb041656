//! The host functions: every `env.proxy_*` import of the Proxy-Wasm ABI
//! 0.2.1 plus the WASI preview1 functions wasip1 modules import. Each one
//! checks its arguments and memory accesses and returns a status: nothing a
//! module does can panic the host. Imports the module has that are not
//! implemented here are provided as stubs returning `Unimplemented` (env) or
//! `ENOSYS` (WASI), so instantiation never fails on a missing import.

use std::collections::HashSet;

use anyhow::Result;
use wasmtime::{Caller, ExternType, Linker, Module, Val, ValType};

use crate::abi::{self, BufferType, Headers, LogLevel, MapType, MetricType, Status};
use crate::vm::{ContextKind, VmState};
use crate::world::{Callout, Event, LocalResponse, Profile};

type C<'a> = Caller<'a, VmState>;

const S_OK: i32 = Status::Ok as i32;

fn st(s: Status) -> i32 {
    s as i32
}

/// Everything a status-returning host function body can fail with.
type R = Result<(), Status>;

fn done(r: R) -> i32 {
    match r {
        Ok(()) => S_OK,
        Err(s) => st(s),
    }
}

/// Counts a call of host function `name` by the current plugin, when
/// counting is on.
fn count_call(c: &C<'_>, name: &'static str) {
    let state = c.data();
    // Never a panic in the host: a call made while the world is borrowed
    // goes uncounted.
    let Ok(mut world) = state.world.try_borrow_mut() else {
        return;
    };
    if let Some(counts) = &mut world.host_calls {
        *counts.entry((state.plugin_name(), name)).or_default() += 1;
    }
}

/// The VM's environment (`KEY=value`), as WASI presents it.
fn environ(state: &VmState) -> Vec<String> {
    state.env.iter().map(|(k, v)| format!("{k}={v}")).collect()
}

// ---- memory helpers ----

fn read(caller: &mut C<'_>, ptr: i32, len: i32) -> Result<Vec<u8>, Status> {
    let memory = caller.data().memory.ok_or(Status::InternalFailure)?;
    let (ptr, len) = (ptr as u32 as usize, len as u32 as usize);
    let data = memory.data(&caller);
    let end = ptr.checked_add(len).ok_or(Status::InvalidMemoryAccess)?;
    data.get(ptr..end)
        .map(<[u8]>::to_vec)
        .ok_or(Status::InvalidMemoryAccess)
}

fn read_str(caller: &mut C<'_>, ptr: i32, len: i32) -> Result<String, Status> {
    Ok(String::from_utf8_lossy(&read(caller, ptr, len)?).into_owned())
}

fn write(caller: &mut C<'_>, ptr: i32, bytes: &[u8]) -> R {
    let memory = caller.data().memory.ok_or(Status::InternalFailure)?;
    let ptr = ptr as u32 as usize;
    let data = memory.data_mut(caller);
    let end = ptr
        .checked_add(bytes.len())
        .ok_or(Status::InvalidMemoryAccess)?;
    data.get_mut(ptr..end)
        .ok_or(Status::InvalidMemoryAccess)?
        .copy_from_slice(bytes);
    Ok(())
}

fn write_u32(caller: &mut C<'_>, ptr: i32, value: u32) -> R {
    write(caller, ptr, &value.to_le_bytes())
}

/// Copies `bytes` into memory the module allocates and writes the pointer
/// and size to the module's return slots (0 and 0 for an empty value).
fn give(caller: &mut C<'_>, bytes: &[u8], ptr_ptr: i32, size_ptr: i32) -> R {
    let mut ptr = 0u32;
    if !bytes.is_empty() {
        let allocate = caller
            .data()
            .allocate
            .clone()
            .ok_or(Status::InternalFailure)?;
        let p = allocate
            .call(&mut *caller, bytes.len() as i32)
            .map_err(|_| Status::InternalFailure)?;
        if p == 0 {
            return Err(Status::InternalFailure);
        }
        write(caller, p, bytes)?;
        ptr = p as u32;
    }
    write_u32(caller, ptr_ptr, ptr)?;
    write_u32(caller, size_ptr, bytes.len() as u32)
}

// ---- header maps ----

/// Runs `f` on the header map `map` addressed from the current context.
fn with_map<T>(
    caller: &mut C<'_>,
    map: i32,
    f: impl FnOnce(&mut Headers) -> T,
) -> Result<T, Status> {
    let map = MapType::from_raw(map).ok_or(Status::BadArgument)?;
    match map {
        MapType::CallResponseHeaders | MapType::CallResponseTrailers => {
            let state = caller.data_mut();
            let response = state.call_response.as_mut().ok_or(Status::BadArgument)?;
            Ok(f(if map == MapType::CallResponseHeaders {
                &mut response.headers
            } else {
                &mut response.trailers
            }))
        }
        MapType::GrpcInitialMetadata | MapType::GrpcTrailingMetadata => Err(Status::BadArgument),
        _ => {
            let (stream, filter) = caller.data().current_stream().ok_or(Status::BadArgument)?;
            let world = caller.data().world.clone();
            let mut world = world.borrow_mut();
            let envoy = world.profile == Profile::Envoy;
            let data = world.streams.get_mut(&stream).ok_or(Status::BadArgument)?;
            if envoy
                && matches!(map, MapType::RequestHeaders | MapType::ResponseHeaders)
                && !data.logging
                && !data
                    .held_headers
                    .contains(&(filter, map == MapType::ResponseHeaders))
            {
                // Envoy: the map is gone once the filter's headers callback
                // returned Continue (`BadArgument`, which the Rust SDK's
                // getters turn into a panic).
                return Err(Status::BadArgument);
            }
            let headers = match map {
                MapType::RequestHeaders => &mut data.request_headers,
                MapType::RequestTrailers => &mut data.request_trailers,
                MapType::ResponseHeaders => {
                    data.response_headers.as_mut().ok_or(Status::BadArgument)?
                }
                _ => &mut data.response_trailers,
            };
            Ok(f(headers))
        }
    }
}

fn lower(key: &str) -> String {
    key.to_ascii_lowercase()
}

// ---- buffers ----

fn buffer_bytes(caller: &mut C<'_>, kind: BufferType) -> Result<Vec<u8>, Status> {
    match kind {
        BufferType::RequestBody | BufferType::ResponseBody => {
            let (stream, _) = caller.data().current_stream().ok_or(Status::NotFound)?;
            let world = caller.data().world.clone();
            let mut world = world.borrow_mut();
            let data = world.streams.get(&stream).ok_or(Status::NotFound)?;
            if kind == BufferType::RequestBody
                && world.profile == Profile::Kong
                && world
                    .kong_body_buffer_bytes
                    .is_some_and(|limit| data.request_body.len() > limit)
            {
                // nginx wrote it to a file: ngx_wasm_module cannot read it
                // and answers as for no body (the SDK panics on an error).
                world.log(
                    "host-sim",
                    LogLevel::Error,
                    "cannot read request body buffered to file (larger than \
                     client_body_buffer_size)"
                        .into(),
                );
                return Err(Status::NotFound);
            }
            Ok(if kind == BufferType::RequestBody {
                data.request_body.clone()
            } else {
                data.response_body.clone()
            })
        }
        BufferType::CallResponseBody => caller
            .data()
            .call_response
            .as_ref()
            .map(|r| r.body.clone())
            .ok_or(Status::NotFound),
        BufferType::PluginConfiguration | BufferType::VmConfiguration => {
            let state = caller.data();
            let root = state.root_of(state.current).ok_or(Status::NotFound)?;
            let info = state.roots.get(&root).ok_or(Status::NotFound)?;
            Ok(if kind == BufferType::PluginConfiguration {
                info.configuration.clone()
            } else {
                info.vm_configuration.clone()
            })
        }
        _ => Err(Status::NotFound),
    }
}

/// Kong: a request body asked for from a callout's answer, which
/// ngx_wasm_module refuses by trapping (it hands the body over only in the
/// body step and `on_log`).
fn request_body_out_of_step(c: &C<'_>) -> bool {
    let state = c.data();
    state.world.borrow().profile == Profile::Kong
        && state.call_response.is_some()
        && !matches!(state.contexts.get(&state.current), Some(ContextKind::Root))
}

/// Envoy's buffer replace rules: `start == 0 && size == 0` prepends,
/// `start == 0 && size >= len` replaces, `start >= len` appends; anything
/// else is a bad argument.
fn splice(buffer: &mut Vec<u8>, start: usize, size: usize, data: &[u8]) -> R {
    if start == 0 {
        if size == 0 {
            let mut joined = data.to_vec();
            joined.extend_from_slice(buffer);
            *buffer = joined;
            Ok(())
        } else if size >= buffer.len() {
            *buffer = data.to_vec();
            Ok(())
        } else {
            Err(Status::BadArgument)
        }
    } else if start >= buffer.len() {
        buffer.extend_from_slice(data);
        Ok(())
    } else {
        Err(Status::BadArgument)
    }
}

/// A stream call (answer, resume) from a root context: `BadArgument` in
/// Envoy; ngx_wasm_module acts on no request there and crashes its worker
/// (observed: signal 11), so the Kong profile traps the VM instead.
fn kong_root_stream_call(c: &C<'_>, name: &str) -> wasmtime::Result<i32> {
    if c.data().world.borrow().profile == Profile::Kong {
        return Err(wasmtime::Error::msg(format!(
            "{name} from a root context: ngx_wasm_module's set_effective_context does nothing, \
             and this call crashes its worker (Kong profile)"
        )));
    }
    Ok(st(Status::BadArgument))
}

/// ngx_wasm_module's `proxy_set_buffer_bytes` on a body: `(0, 0)` with
/// data prepends; otherwise the body is cut at `start` and `data`, truncated
/// to `size` bytes, appended (`ngx_wasm_chain_append` with `max = size`).
fn splice_ngx(buffer: &mut Vec<u8>, start: usize, size: usize, data: &[u8]) {
    if start == 0 && size == 0 && !data.is_empty() {
        let mut joined = data.to_vec();
        joined.extend_from_slice(buffer);
        *buffer = joined;
        return;
    }
    buffer.truncate(start);
    buffer.extend_from_slice(&data[..data.len().min(size)]);
}

// ---- the linker ----

/// The linker being filled and every import defined on it so far.
struct Imports<'l> {
    linker: &'l mut Linker<VmState>,
    defined: HashSet<(String, String)>,
}

impl Imports<'_> {
    /// Records that `module`.`name` is defined.
    fn mark(&mut self, module: &str, name: &str) {
        self.defined.insert((module.to_string(), name.to_string()));
    }
}

/// Defines Proxy-Wasm host function `$name` on `$imports`. Each host
/// function counts its calls when counting is on (`Host::count_host_calls`):
/// a Proxy-Wasm host call is the unit of cost a real host charges, so
/// counts rank changes before a load run.
macro_rules! env {
    ($imports:ident, $name:literal, |mut $c:ident : $ct:ty $(, $a:ident : $t:ty)* $(,)?| -> $r:ty $body:block) => {
        $imports.linker.func_wrap("env", $name, |mut $c: $ct $(, $a: $t)*| -> $r {
            count_call(&$c, $name);
            $body
        })?;
        $imports.mark("env", $name);
    };
    ($imports:ident, $name:literal, |$c:ident : $ct:ty $(, $a:ident : $t:ty)* $(,)?| -> $r:ty $body:block) => {
        $imports.linker.func_wrap("env", $name, |$c: $ct $(, $a: $t)*| -> $r {
            count_call(&$c, $name);
            $body
        })?;
        $imports.mark("env", $name);
    };
}

/// Defines WASI preview1 function `$name` on `$imports`.
macro_rules! wasi {
    ($imports:ident, $name:literal, $f:expr) => {
        $imports
            .linker
            .func_wrap("wasi_snapshot_preview1", $name, $f)?;
        $imports.mark("wasi_snapshot_preview1", $name);
    };
}

/// Defines every host function on `linker`, group by group, plus stubs for
/// any other import `module` has.
pub(crate) fn define(linker: &mut Linker<VmState>, module: &Module) -> Result<()> {
    let mut imports = Imports {
        linker,
        defined: HashSet::new(),
    };
    logging_and_time(&mut imports)?;
    buffers(&mut imports)?;
    header_maps(&mut imports)?;
    properties(&mut imports)?;
    shared_data(&mut imports)?;
    shared_queues(&mut imports)?;
    stream_control(&mut imports)?;
    http_callouts(&mut imports)?;
    metrics(&mut imports)?;
    unsupported(&mut imports)?;
    wasi_output_and_environment(&mut imports)?;
    wasi_clock_and_process(&mut imports)?;
    stub_other_imports(&mut imports, module)
}

/// Logging, the clock and the tick period.
fn logging_and_time(imports: &mut Imports<'_>) -> Result<()> {
    env!(imports, "proxy_log", |mut c: C<'_>,
                                level: i32,
                                ptr: i32,
                                len: i32|
     -> i32 {
        match read_str(&mut c, ptr, len) {
            Ok(message) => {
                let plugin = c.data().plugin_name();
                c.data()
                    .world
                    .borrow_mut()
                    .log(&plugin, LogLevel::from_raw(level), message);
                S_OK
            }
            Err(s) => st(s),
        }
    });
    env!(imports, "proxy_get_log_level", |mut c: C<'_>,
                                          ret: i32|
     -> i32 {
        done(write_u32(&mut c, ret, LogLevel::Info as u32))
    });
    // rustfmt splits `C<'_>` of this closure over three lines (and
    // keeps no other layout).
    #[rustfmt::skip]
    env!(
        imports,
        "proxy_get_current_time_nanoseconds",
        |mut c: C<'_>, ret: i32| -> i32 {
            let now = c.data().world.borrow().clock.now_ns();
            done(write(&mut c, ret, &now.to_le_bytes()))
        }
    );
    env!(
        imports,
        "proxy_set_tick_period_milliseconds",
        |mut c: C<'_>, period: i32| -> wasmtime::Result<i32> {
            let state = c.data_mut();
            let Some(root) = state.root_of(state.current) else {
                return Ok(st(Status::BadArgument));
            };
            let kong = state.world.borrow().profile == Profile::Kong;
            if kong && root != state.current {
                // ngx_wasm_module: "can only set tick_period in root context".
                return Err(wasmtime::Error::msg(
                    "proxy_set_tick_period_milliseconds from an HTTP context: ngx_wasm_module traps \
                     (\"can only set tick_period in root context\", Kong profile)",
                ));
            }
            let now = state.world.borrow().clock.now_ns();
            match state.roots.get_mut(&root) {
                Some(info) => {
                    if kong && period != 0 && info.tick_period_ms != 0 {
                        // ngx_wasm_module sets a root's period once.
                        return Err(wasmtime::Error::msg(
                            "proxy_set_tick_period_milliseconds with a period already set: \
                             ngx_wasm_module traps (\"tick_period already set\", Kong profile)",
                        ));
                    }
                    info.tick_period_ms = period as u32;
                    info.next_tick_ns = now + u64::from(period as u32) * 1_000_000;
                    Ok(S_OK)
                }
                None => Ok(st(Status::BadArgument)),
            }
        }
    );
    Ok(())
}

/// Reading and replacing the bodies, the call response and the configurations.
fn buffers(imports: &mut Imports<'_>) -> Result<()> {
    env!(imports, "proxy_get_buffer_bytes", |mut c: C<'_>,
                                             kind: i32,
                                             start: i32,
                                             max: i32,
                                             ptr_ptr: i32,
                                             size_ptr: i32|
     -> wasmtime::Result<
        i32,
    > {
        if kind == 0 && request_body_out_of_step(&c) {
            return Err(wasmtime::Error::msg(
                "proxy_get_buffer_bytes(request body) from a callout's answer: ngx_wasm_module traps, \
                 \"can only get request body during on_request_body, on_log\" (Kong profile)",
            ));
        }
        let r = (|| {
            let kind = BufferType::from_raw(kind).ok_or(Status::BadArgument)?;
            let bytes = buffer_bytes(&mut c, kind)?;
            let start = (start as u32 as usize).min(bytes.len());
            let end = start.saturating_add(max as u32 as usize).min(bytes.len());
            give(&mut c, &bytes[start..end], ptr_ptr, size_ptr)
        })();
        Ok(done(r))
    });
    env!(imports, "proxy_set_buffer_bytes", |mut c: C<'_>,
                                             kind: i32,
                                             start: i32,
                                             size: i32,
                                             ptr: i32,
                                             len: i32|
     -> i32 {
        let r = (|| {
            let kind = BufferType::from_raw(kind).ok_or(Status::BadArgument)?;
            let data = read(&mut c, ptr, len)?;
            let (stream, _) = c.data().current_stream().ok_or(Status::NotFound)?;
            let world = c.data().world.clone();
            let mut world = world.borrow_mut();
            let kong = world.profile == Profile::Kong;
            let s = world.streams.get_mut(&stream).ok_or(Status::NotFound)?;
            let buffer = match kind {
                BufferType::RequestBody => &mut s.request_body,
                BufferType::ResponseBody => &mut s.response_body,
                _ => return Err(Status::BadArgument),
            };
            let (start, size) = (start as u32 as usize, size as u32 as usize);
            if kong {
                splice_ngx(buffer, start, size, &data);
                return Ok(());
            }
            splice(buffer, start, size, &data)
        })();
        done(r)
    });
    Ok(())
}

/// The header and trailer maps of the stream and of a call response.
fn header_maps(imports: &mut Imports<'_>) -> Result<()> {
    env!(imports, "proxy_get_header_map_pairs", |mut c: C<'_>,
                                                 map: i32,
                                                 ptr_ptr: i32,
                                                 size_ptr: i32|
     -> i32 {
        let r = (|| {
            // Envoy answers a map it no longer holds with no pairs, not an error.
            let bytes = match with_map(&mut c, map, |h| abi::encode_pairs(h)) {
                Err(Status::BadArgument) => abi::encode_pairs(&[]),
                other => other?,
            };
            give(&mut c, &bytes, ptr_ptr, size_ptr)
        })();
        done(r)
    });
    env!(imports, "proxy_set_header_map_pairs", |mut c: C<'_>,
                                                 map: i32,
                                                 ptr: i32,
                                                 len: i32|
     -> i32 {
        let r = (|| {
            let bytes = read(&mut c, ptr, len)?;
            let pairs = abi::decode_pairs(&bytes).ok_or(Status::ParseFailure)?;
            with_map(&mut c, map, |h| {
                *h = pairs.into_iter().map(|(k, v)| (lower(&k), v)).collect();
            })
        })();
        done(r)
    });
    env!(imports, "proxy_get_header_map_size", |mut c: C<'_>,
                                                map: i32,
                                                ret: i32|
     -> i32 {
        let r = (|| {
            let size = with_map(&mut c, map, |h| abi::encode_pairs(h).len())?;
            write_u32(&mut c, ret, size as u32)
        })();
        done(r)
    });
    env!(imports, "proxy_get_header_map_value", |mut c: C<'_>,
                                                 map: i32,
                                                 kp: i32,
                                                 kl: i32,
                                                 ptr_ptr: i32,
                                                 size_ptr: i32|
     -> i32 {
        let r = (|| {
            let key = lower(&read_str(&mut c, kp, kl)?);
            let value = with_map(&mut c, map, |h| {
                h.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone())
            })?
            .ok_or(Status::NotFound)?;
            give(&mut c, &value, ptr_ptr, size_ptr)
        })();
        done(r)
    });
    env!(imports, "proxy_replace_header_map_value", |mut c: C<'_>,
                                                     map: i32,
                                                     kp: i32,
                                                     kl: i32,
                                                     vp: i32,
                                                     vl: i32|
     -> i32 {
        let r = (|| {
            let key = lower(&read_str(&mut c, kp, kl)?);
            let value = read(&mut c, vp, vl)?;
            with_map(&mut c, map, |h| {
                match h.iter().position(|(k, _)| *k == key) {
                    Some(first) => {
                        h[first].1 = value;
                        let mut i = 0;
                        h.retain(|(k, _)| {
                            let keep = *k != key || i == first;
                            i += 1;
                            keep
                        });
                    }
                    None => h.push((key, value)),
                }
            })
        })();
        done(r)
    });
    env!(imports, "proxy_add_header_map_value", |mut c: C<'_>,
                                                 map: i32,
                                                 kp: i32,
                                                 kl: i32,
                                                 vp: i32,
                                                 vl: i32|
     -> i32 {
        let r = (|| {
            let key = lower(&read_str(&mut c, kp, kl)?);
            let value = read(&mut c, vp, vl)?;
            with_map(&mut c, map, |h| h.push((key, value)))
        })();
        done(r)
    });
    env!(imports, "proxy_remove_header_map_value", |mut c: C<'_>,
                                                    map: i32,
                                                    kp: i32,
                                                    kl: i32|
     -> i32 {
        let r = (|| {
            let key = lower(&read_str(&mut c, kp, kl)?);
            with_map(&mut c, map, |h| h.retain(|(k, _)| *k != key))
        })();
        done(r)
    });
    Ok(())
}

/// Properties (`proxy_get_property`, `proxy_set_property`).
fn properties(imports: &mut Imports<'_>) -> Result<()> {
    env!(imports, "proxy_get_property", |mut c: C<'_>,
                                         pp: i32,
                                         pl: i32,
                                         ptr_ptr: i32,
                                         size_ptr: i32|
     -> i32 {
        let r = (|| {
            let path = read(&mut c, pp, pl)?;
            let value = crate::properties::get(c.data(), &path).ok_or(Status::NotFound)?;
            give(&mut c, &value, ptr_ptr, size_ptr)
        })();
        done(r)
    });
    env!(imports, "proxy_set_property", |mut c: C<'_>,
                                         pp: i32,
                                         pl: i32,
                                         vp: i32,
                                         vl: i32|
     -> i32 {
        let r = (|| {
            let path = read(&mut c, pp, pl)?;
            let value = read(&mut c, vp, vl)?;
            crate::properties::set(c.data(), &path, value)
        })();
        done(r)
    });
    Ok(())
}

/// Shared data per `vm_id`, with CAS.
fn shared_data(imports: &mut Imports<'_>) -> Result<()> {
    env!(imports, "proxy_get_shared_data", |mut c: C<'_>,
                                            kp: i32,
                                            kl: i32,
                                            ptr_ptr: i32,
                                            size_ptr: i32,
                                            cas_ptr: i32|
     -> i32 {
        let r = (|| {
            let key = read_str(&mut c, kp, kl)?;
            let (value, cas) = {
                let state = c.data();
                let world = state.world.borrow();
                world.get_shared(&state.vm_id, &key)?
            };
            give(&mut c, &value, ptr_ptr, size_ptr)?;
            write_u32(&mut c, cas_ptr, cas)
        })();
        done(r)
    });
    env!(imports, "proxy_set_shared_data", |mut c: C<'_>,
                                            kp: i32,
                                            kl: i32,
                                            vp: i32,
                                            vl: i32,
                                            cas: i32|
     -> i32 {
        let r = (|| {
            let key = read_str(&mut c, kp, kl)?;
            let value = read(&mut c, vp, vl)?;
            let state = c.data();
            let status =
                state
                    .world
                    .borrow_mut()
                    .set_shared(&state.vm_id, &key, &value, cas as u32);
            if status == Status::Ok {
                Ok(())
            } else {
                Err(status)
            }
        })();
        done(r)
    });
    Ok(())
}

/// Shared queues: register, resolve, enqueue, dequeue.
fn shared_queues(imports: &mut Imports<'_>) -> Result<()> {
    env!(
        imports,
        "proxy_register_shared_queue",
        |mut c: C<'_>, np: i32, nl: i32, ret: i32| -> wasmtime::Result<i32> {
            let mut undeclared = None;
            let r = (|| {
                let name = read_str(&mut c, np, nl)?;
                let state = c.data();
                let root = state.root_of(state.current).ok_or(Status::BadArgument)?;
                let registered = state.world.borrow_mut().register_queue(
                    &state.vm_id,
                    &name,
                    (state.index, root),
                );
                match registered {
                    Ok(id) => write_u32(&mut c, ret, id),
                    Err(message) => {
                        undeclared = Some(message);
                        Err(Status::InternalFailure)
                    }
                }
            })();
            if let Some(message) = undeclared {
                // ngx_wasm_module fails the filter: an undeclared queue traps.
                return Err(wasmtime::Error::msg(message));
            }
            Ok(done(r))
        }
    );
    env!(
        imports,
        "proxy_resolve_shared_queue",
        |mut c: C<'_>, vp: i32, vl: i32, np: i32, nl: i32, ret: i32| -> wasmtime::Result<i32> {
            if c.data().world.borrow().profile == Profile::Kong {
                // ngx_wasm_module: "NYI: proxy_wasm hfunc", a host trap.
                return Err(wasmtime::Error::msg(
                    "proxy_resolve_shared_queue is not implemented by ngx_wasm_module (Kong profile)",
                ));
            }
            let r = (|| {
                let vm_id = read_str(&mut c, vp, vl)?;
                let name = read_str(&mut c, np, nl)?;
                let id = c
                    .data()
                    .world
                    .borrow()
                    .resolve_queue(&vm_id, &name)
                    .ok_or(Status::NotFound)?;
                write_u32(&mut c, ret, id)
            })();
            Ok(done(r))
        }
    );
    env!(imports, "proxy_dequeue_shared_queue", |mut c: C<'_>,
                                                 id: i32,
                                                 ptr_ptr: i32,
                                                 size_ptr: i32|
     -> i32 {
        let r = (|| {
            let item = {
                let world = c.data().world.clone();
                let mut world = world.borrow_mut();
                let queue = world.queue_mut(id as u32).ok_or(Status::NotFound)?;
                queue.items.pop_front().ok_or(Status::Empty)?
            };
            give(&mut c, &item, ptr_ptr, size_ptr)
        })();
        done(r)
    });
    env!(
        imports,
        "proxy_enqueue_shared_queue",
        |mut c: C<'_>, id: i32, ptr: i32, len: i32| -> wasmtime::Result<i32> {
            let mut full = None;
            let r = (|| {
                let item = read(&mut c, ptr, len)?;
                match c.data().world.borrow_mut().enqueue(id as u32, &item) {
                    Ok(Status::Ok) => Ok(()),
                    Ok(status) => Err(status),
                    Err(message) => {
                        full = Some(message);
                        Err(Status::InternalFailure)
                    }
                }
            })();
            if let Some(message) = full {
                // ngx_wasm_module traps the filter on a full queue.
                return Err(wasmtime::Error::msg(message));
            }
            Ok(done(r))
        }
    );
    Ok(())
}

/// Stream control: resume, close, local responses, the effective context.
fn stream_control(imports: &mut Imports<'_>) -> Result<()> {
    // rustfmt splits `wasmtime::Result<i32>` of this closure over three lines.
    #[rustfmt::skip]
    env!(
        imports,
        "proxy_continue_stream",
        |c: C<'_>, kind: i32| -> wasmtime::Result<i32> {
            let Some((stream, filter)) = c.data().current_stream() else {
                return kong_root_stream_call(&c, "proxy_continue_stream");
            };
            if kind == 0
                && c.data().world.borrow().profile == Profile::Kong
                && c.data().call_response.is_some()
            {
                // ngx_wasm_module resumes the step itself once the last
                // answer is in; a resume from the answer (the SDK's
                // http_auth_random) only marks the request to go on, which
                // it does then. Checked in ngx_wasm_module 3bed278
                // (tests/tests/foreign_filters.rs).
                return Ok(S_OK);
            }
            let response = match kind {
                0 => false,
                1 => {
                    if c.data().world.borrow().profile == Profile::Kong {
                        // ngx_wasm_module cannot resume response phases.
                        return Ok(st(Status::Unimplemented));
                    }
                    true
                }
                _ => return Ok(st(Status::BadArgument)),
            };
            c.data().world.borrow_mut().events.push_back(Event::Resume {
                stream,
                filter,
                response,
            });
            Ok(S_OK)
        }
    );
    env!(imports, "proxy_close_stream", |c: C<'_>,
                                         _kind: i32|
     -> i32 {
        let Some((stream, _)) = c.data().current_stream() else {
            return st(Status::BadArgument);
        };
        c.data()
            .world
            .borrow_mut()
            .events
            .push_back(Event::Reset { stream });
        S_OK
    });
    env!(
        imports,
        "proxy_send_local_response",
        |mut c: C<'_>,
         status: i32,
         dp: i32,
         dl: i32,
         bp: i32,
         bl: i32,
         hp: i32,
         hl: i32,
         grpc: i32|
         -> wasmtime::Result<i32> {
            if c.data().current_stream().is_none() {
                return kong_root_stream_call(&c, "proxy_send_local_response");
            }
            let r = (|| {
                let details = read_str(&mut c, dp, dl)?;
                let body = read(&mut c, bp, bl)?;
                let headers =
                    abi::decode_pairs(&read(&mut c, hp, hl)?).ok_or(Status::ParseFailure)?;
                let (stream, filter) = c.data().current_stream().ok_or(Status::BadArgument)?;
                let world = c.data().world.clone();
                let mut world = world.borrow_mut();
                world.streams.get(&stream).ok_or(Status::NotFound)?;
                let mut body = body;
                if world.profile == Profile::Kong && !body.is_empty() {
                    // ngx_wasm_module appends a line feed to every local
                    // response body (ngx_http_wasm_stash_local_response).
                    body.push(b'\n');
                }
                let data = world.streams.get_mut(&stream).ok_or(Status::NotFound)?;
                data.local_response = Some(LocalResponse {
                    status: u16::try_from(status).map_err(|_| Status::BadArgument)?,
                    details,
                    headers: headers.into_iter().map(|(k, v)| (lower(&k), v)).collect(),
                    body,
                    grpc_status: u32::try_from(grpc).ok(),
                });
                world
                    .events
                    .push_back(Event::LocalResponse { stream, filter });
                Ok(())
            })();
            Ok(done(r))
        }
    );
    env!(imports, "proxy_set_effective_context", |mut c: C<'_>,
                                                  context: i32|
     -> i32 {
        if c.data().world.borrow().profile == Profile::Kong {
            // ngx_wasm_module: a no-op that answers Ok; host calls keep
            // acting on the context that is running.
            return S_OK;
        }
        let state = c.data_mut();
        if state.contexts.contains_key(&(context as u32)) {
            state.current = context as u32;
            S_OK
        } else {
            st(Status::BadArgument)
        }
    });
    env!(imports, "proxy_done", |_c: C<'_>| -> i32 { S_OK });
    Ok(())
}

/// HTTP callouts to the host's clusters.
fn http_callouts(imports: &mut Imports<'_>) -> Result<()> {
    env!(imports, "proxy_http_call", |mut c: C<'_>,
                                      up: i32,
                                      ul: i32,
                                      hp: i32,
                                      hl: i32,
                                      bp: i32,
                                      bl: i32,
                                      tp: i32,
                                      tl: i32,
                                      timeout: i32,
                                      ret: i32|
     -> wasmtime::Result<i32> {
        {
            let state = c.data();
            if state.world.borrow().profile == Profile::Kong && state.in_response_phase {
                // ngx_wasm_module traps the instance: "can only send HTTP
                // dispatch during on_request_headers, on_request_body,
                // on_tick, on_dispatch_response".
                return Err(wasmtime::Error::msg(
                    "proxy_http_call from a response phase or on_log: ngx_wasm_module traps (Kong profile)",
                ));
            }
            if state.world.borrow().profile == Profile::Kong && state.in_configure {
                // The same refusal: the filter fails to configure and, in
                // ngx_wasm_module, its worker exits and is not respawned.
                return Err(wasmtime::Error::msg(
                    "proxy_http_call from on_vm_start or on_configure: ngx_wasm_module traps (Kong profile)",
                ));
            }
            if state.world.borrow().profile == Profile::Kong
                && state.call_response.is_some()
                && matches!(state.contexts.get(&state.current), Some(ContextKind::Root))
            {
                // ngx_wasm_module hands the new call the answered call's
                // fake request, freed when the answer returns: the worker
                // crashes (signal 11) when the new call connects. Trapping
                // makes the deterministic host fail where the real one
                // fails at random.
                return Err(wasmtime::Error::msg(
                    "proxy_http_call from a root context's on_http_call_response: ngx_wasm_module runs it on the answered call's freed request and the worker crashes (Kong profile)",
                ));
            }
        }
        let r = (|| {
            let cluster = read_str(&mut c, up, ul)?;
            let headers = abi::decode_pairs(&read(&mut c, hp, hl)?).ok_or(Status::ParseFailure)?;
            let body = read(&mut c, bp, bl)?;
            let trailers = abi::decode_pairs(&read(&mut c, tp, tl)?).ok_or(Status::ParseFailure)?;
            let headers: Headers = headers.into_iter().map(|(k, v)| (lower(&k), v)).collect();
            for required in [":method", ":path", ":authority"] {
                if !headers.iter().any(|(k, _)| k == required) {
                    return Err(Status::BadArgument);
                }
            }
            let state = c.data();
            let token = {
                let mut world = state.world.borrow_mut();
                // Envoy refuses a cluster it does not know; ngx_wasm_module
                // takes any `host[:port]` and fails the call later (its
                // answer says why in `:dispatch_status`).
                if world.profile == Profile::Envoy && !world.clusters.contains(&cluster) {
                    return Err(Status::BadArgument);
                }
                let now = world.clock.now_ns();
                world.dispatch(Callout {
                    token: 0,
                    cluster,
                    headers,
                    body,
                    trailers,
                    timeout_ms: timeout as u32,
                    dispatched_at_ns: now,
                    vm: state.index,
                    context: state.current,
                })
            };
            write_u32(&mut c, ret, token)
        })();
        Ok(done(r))
    });
    Ok(())
}

/// Metrics: define, increment, record, read.
fn metrics(imports: &mut Imports<'_>) -> Result<()> {
    env!(imports, "proxy_define_metric", |mut c: C<'_>,
                                          kind: i32,
                                          np: i32,
                                          nl: i32,
                                          ret: i32|
     -> i32 {
        let r = (|| {
            let kind = MetricType::from_raw(kind).ok_or(Status::BadArgument)?;
            let name = read_str(&mut c, np, nl)?;
            let id = c.data().world.borrow_mut().define_metric(kind, &name);
            write_u32(&mut c, ret, id)
        })();
        done(r)
    });
    env!(imports, "proxy_increment_metric", |c: C<'_>,
                                             id: i32,
                                             offset: i64|
     -> i32 {
        if c.data()
            .world
            .borrow_mut()
            .metrics
            .increment(id as u32, offset)
        {
            S_OK
        } else {
            st(Status::NotFound)
        }
    });
    env!(imports, "proxy_record_metric", |c: C<'_>,
                                          id: i32,
                                          value: i64|
     -> i32 {
        if c.data()
            .world
            .borrow_mut()
            .metrics
            .record(id as u32, value as u64)
        {
            S_OK
        } else {
            st(Status::NotFound)
        }
    });
    env!(imports, "proxy_get_metric", |mut c: C<'_>,
                                       id: i32,
                                       ret: i32|
     -> i32 {
        let value = c.data().world.borrow().metrics.get(id as u32);
        match value {
            Some(v) => done(write(&mut c, ret, &v.to_le_bytes())),
            None => st(Status::NotFound),
        }
    });
    Ok(())
}

/// What this host does not support: gRPC, foreign functions, `proxy_get_status`.
fn unsupported(imports: &mut Imports<'_>) -> Result<()> {
    env!(imports, "proxy_grpc_call", |_c: C<'_>,
                                      _a: i32,
                                      _b: i32,
                                      _d: i32,
                                      _e: i32,
                                      _f: i32,
                                      _g: i32,
                                      _h: i32,
                                      _i: i32,
                                      _j: i32,
                                      _k: i32,
                                      _l: i32,
                                      _m: i32|
     -> i32 {
        st(Status::Unimplemented)
    });
    env!(imports, "proxy_grpc_stream", |_c: C<'_>,
                                        _a: i32,
                                        _b: i32,
                                        _d: i32,
                                        _e: i32,
                                        _f: i32,
                                        _g: i32,
                                        _h: i32,
                                        _i: i32,
                                        _j: i32|
     -> i32 {
        st(Status::Unimplemented)
    });
    env!(imports, "proxy_grpc_send", |_c: C<'_>,
                                      _t: i32,
                                      _p: i32,
                                      _l: i32,
                                      _e: i32|
     -> i32 {
        st(Status::Unimplemented)
    });
    env!(imports, "proxy_grpc_cancel", |_c: C<'_>, _t: i32| -> i32 {
        st(Status::Unimplemented)
    });
    env!(imports, "proxy_grpc_close", |_c: C<'_>, _t: i32| -> i32 {
        st(Status::Unimplemented)
    });
    env!(imports, "proxy_get_status", |_c: C<'_>,
                                       _a: i32,
                                       _b: i32,
                                       _d: i32|
     -> i32 {
        st(Status::Unimplemented)
    });
    env!(imports, "proxy_call_foreign_function", |_c: C<'_>,
                                                  _a: i32,
                                                  _b: i32,
                                                  _d: i32,
                                                  _e: i32,
                                                  _f: i32,
                                                  _g: i32|
     -> i32 {
        st(Status::NotFound)
    });
    Ok(())
}

/// WASI preview1, part one: output (as log lines), the plugin's
/// environment, no arguments.
fn wasi_output_and_environment(imports: &mut Imports<'_>) -> Result<()> {
    wasi!(imports, "fd_write", |mut c: C<'_>,
                                fd: i32,
                                iovs: i32,
                                count: i32,
                                written: i32|
     -> i32 {
        let r: Result<u32, Status> = (|| {
            let mut out = Vec::new();
            for i in 0..count.max(0) {
                let iov = read(&mut c, iovs + i * 8, 8)?;
                let ptr = i32::from_le_bytes([iov[0], iov[1], iov[2], iov[3]]);
                let len = i32::from_le_bytes([iov[4], iov[5], iov[6], iov[7]]);
                out.extend(read(&mut c, ptr, len)?);
            }
            let level = if fd == 2 {
                LogLevel::Error
            } else {
                LogLevel::Info
            };
            let plugin = c.data().plugin_name();
            let text = String::from_utf8_lossy(&out);
            for line in text.lines().filter(|l| !l.is_empty()) {
                c.data()
                    .world
                    .borrow_mut()
                    .log(&plugin, level, line.to_string());
            }
            Ok(out.len() as u32)
        })();
        match r {
            Ok(n) => match write_u32(&mut c, written, n) {
                Ok(()) => 0,
                Err(_) => 21, // EFAULT
            },
            Err(_) => 21,
        }
    });
    wasi!(imports, "environ_sizes_get", |mut c: C<'_>,
                                         count: i32,
                                         size: i32|
     -> i32 {
        let env = environ(c.data());
        let bytes: usize = env.iter().map(|e| e.len() + 1).sum();
        match write_u32(&mut c, count, env.len() as u32).and(write_u32(&mut c, size, bytes as u32))
        {
            Ok(()) => 0,
            Err(_) => 21,
        }
    });
    wasi!(imports, "environ_get", |mut c: C<'_>,
                                   pointers: i32,
                                   buffer: i32|
     -> i32 {
        // `KEY=value\0` strings packed in `buffer`, one pointer each.
        let env = environ(c.data());
        let mut at = buffer;
        for (i, entry) in env.iter().enumerate() {
            let mut bytes = entry.clone().into_bytes();
            bytes.push(0);
            if write_u32(&mut c, pointers + 4 * i as i32, at as u32)
                .and(write(&mut c, at, &bytes))
                .is_err()
            {
                return 21;
            }
            at += bytes.len() as i32;
        }
        0
    });
    wasi!(imports, "args_sizes_get", |mut c: C<'_>,
                                      count: i32,
                                      size: i32|
     -> i32 {
        if write_u32(&mut c, count, 0)
            .and(write_u32(&mut c, size, 0))
            .is_ok()
        {
            0
        } else {
            21
        }
    });
    wasi!(imports, "args_get", |_c: C<'_>, _a: i32, _b: i32| -> i32 {
        0
    });
    Ok(())
}

/// WASI preview1, part two: the clock, deterministic randomness, exit,
/// yield.
fn wasi_clock_and_process(imports: &mut Imports<'_>) -> Result<()> {
    wasi!(imports, "clock_time_get", |mut c: C<'_>,
                                      _id: i32,
                                      _precision: i64,
                                      ret: i32|
     -> i32 {
        let now = c.data().world.borrow().clock.now_ns();
        if write(&mut c, ret, &now.to_le_bytes()).is_ok() {
            0
        } else {
            21
        }
    });
    wasi!(imports, "clock_res_get", |mut c: C<'_>,
                                     _id: i32,
                                     ret: i32|
     -> i32 {
        if write(&mut c, ret, &1u64.to_le_bytes()).is_ok() {
            0
        } else {
            21
        }
    });
    wasi!(imports, "random_get", |mut c: C<'_>,
                                  ptr: i32,
                                  len: i32|
     -> i32 {
        // Deterministic (xorshift): runs repeat exactly; nothing here is secret.
        let mut bytes = vec![0u8; len.max(0) as usize];
        let mut x = c.data().rng;
        for b in bytes.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        c.data_mut().rng = x;
        if write(&mut c, ptr, &bytes).is_ok() {
            0
        } else {
            21
        }
    });
    wasi!(imports, "proc_exit", |mut c: C<'_>,
                                 code: i32|
     -> wasmtime::Result<()> {
        c.data_mut().exited = Some(code);
        Err(wasmtime::Error::msg(format!(
            "the module called proc_exit({code})"
        )))
    });
    wasi!(imports, "sched_yield", |_c: C<'_>| -> i32 { 0 });
    Ok(())
}

/// Anything else `module` imports: a stub that reports "unsupported"
/// (`Unimplemented` in `env`, `ENOSYS` elsewhere), so instantiation never
/// fails on a missing import.
fn stub_other_imports(imports: &mut Imports<'_>, module: &Module) -> Result<()> {
    for import in module.imports() {
        let key = (import.module().to_string(), import.name().to_string());
        if imports.defined.contains(&key) {
            continue;
        }
        let ExternType::Func(ty) = import.ty() else {
            continue;
        };
        let unsupported = if import.module() == "env" {
            st(Status::Unimplemented)
        } else {
            52 /* ENOSYS */
        };
        let results: Vec<ValType> = ty.results().collect();
        imports.linker.func_new(
            import.module(),
            import.name(),
            ty.clone(),
            move |_c, _args, out| {
                for (slot, ty) in out.iter_mut().zip(&results) {
                    *slot = match ty {
                        ValType::I32 => Val::I32(unsupported),
                        ValType::I64 => Val::I64(i64::from(unsupported)),
                        ValType::F32 => Val::F32(0),
                        ValType::F64 => Val::F64(0),
                        _ => Val::I32(0),
                    };
                }
                Ok(())
            },
        )?;
        imports.defined.insert(key);
    }
    Ok(())
}

/// Names of the host functions this host implements (for the support table test).
pub const IMPLEMENTED: &[&str] = &[
    "proxy_log",
    "proxy_get_log_level",
    "proxy_get_current_time_nanoseconds",
    "proxy_set_tick_period_milliseconds",
    "proxy_get_buffer_bytes",
    "proxy_set_buffer_bytes",
    "proxy_get_header_map_pairs",
    "proxy_set_header_map_pairs",
    "proxy_get_header_map_size",
    "proxy_get_header_map_value",
    "proxy_replace_header_map_value",
    "proxy_add_header_map_value",
    "proxy_remove_header_map_value",
    "proxy_get_property",
    "proxy_set_property",
    "proxy_get_shared_data",
    "proxy_set_shared_data",
    "proxy_register_shared_queue",
    "proxy_resolve_shared_queue",
    "proxy_dequeue_shared_queue",
    "proxy_enqueue_shared_queue",
    "proxy_continue_stream",
    "proxy_close_stream",
    "proxy_send_local_response",
    "proxy_set_effective_context",
    "proxy_done",
    "proxy_http_call",
    "proxy_define_metric",
    "proxy_increment_metric",
    "proxy_record_metric",
    "proxy_get_metric",
    "proxy_grpc_call",
    "proxy_grpc_stream",
    "proxy_grpc_send",
    "proxy_grpc_cancel",
    "proxy_grpc_close",
    "proxy_get_status",
    "proxy_call_foreign_function",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_buffer_rules() {
        let mut b = b"world".to_vec();
        splice(&mut b, 0, 0, b"hello ").unwrap();
        assert_eq!(b, b"hello world");
        let len = b.len();
        splice(&mut b, len, 0, b"!").unwrap();
        assert_eq!(b, b"hello world!");
        let len = b.len();
        splice(&mut b, 0, len, b"replaced").unwrap();
        assert_eq!(b, b"replaced");
        assert_eq!(splice(&mut b, 2, 1, b"x"), Err(Status::BadArgument));
        assert_eq!(splice(&mut b, 0, 3, b"x"), Err(Status::BadArgument));
    }
}
