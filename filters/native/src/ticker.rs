//! Scheduled events for streams that wait. A Proxy-Wasm root ticks on its
//! own; a dynamic module has no per-worker timer, so a paused stream (a
//! follower waiting on a cached answer, a request waiting on a callout)
//! gets a scheduler, and the module's ticker thread commits an event on it
//! every period while it waits: the event runs its worker's root ticks, on
//! that worker, inside that stream's hook. Roots reach a stream the same
//! way ([`Ticking::wake`]). Streams that do not wait cost nothing here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once};
use std::time::Duration;

use crate::abi::{self, FilterEnvoy, Scheduler};

/// The event a stream's scheduler carries (one kind: tick and wake alike).
pub const EVENT: u64 = 1;

/// A stream scheduler the ticker may commit from its thread.
struct Registered {
    scheduler: Scheduler,
    period: Duration,
}

// SAFETY: Envoy's stream scheduler may be committed from any thread; it is
// deleted by its stream's worker only after leaving the registry, under the
// registry's lock, so the ticker never commits a deleted one.
#[allow(unsafe_code)]
unsafe impl Send for Registered {}

static REGISTRY: Mutex<Option<HashMap<u64, Registered>>> = Mutex::new(None);
static NEXT: AtomicU64 = AtomicU64::new(1);
static THREAD: Once = Once::new();

/// Ticks while the period is the shortest a waiting stream asked for.
const IDLE: Duration = Duration::from_millis(50);

/// One waiting stream's scheduled events, until [`Ticking::stop`].
pub struct Ticking {
    key: u64,
    scheduler: Scheduler,
}

/// Starts ticking the stream `filter` every `period`.
///
/// # Safety
/// `filter` must be the handle of the hook being run (on its worker).
#[allow(unsafe_code)]
pub unsafe fn start(filter: FilterEnvoy, period: Duration) -> Option<Ticking> {
    // SAFETY: the caller's contract.
    let scheduler = unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_new(filter) };
    if scheduler.is_null() {
        return None;
    }
    THREAD.call_once(|| {
        let started = std::thread::Builder::new()
            .name("zerolayer-ticker".into())
            .spawn(run);
        if let Err(e) = started {
            log::error!(
                "zerolayer-native: no ticker thread ({e}); waiting streams wake on traffic only"
            );
        }
    });
    let key = NEXT.fetch_add(1, Ordering::Relaxed);
    registry(|r| {
        r.insert(key, Registered { scheduler, period });
    });
    Some(Ticking { key, scheduler })
}

fn registry<T>(f: impl FnOnce(&mut HashMap<u64, Registered>) -> T) -> T {
    let mut guard = REGISTRY.lock().unwrap_or_else(|e| e.into_inner());
    f(guard.get_or_insert_with(HashMap::new))
}

/// The ticker thread: commits an event on every waiting stream each period.
fn run() {
    loop {
        let period = registry(|r| {
            for registered in r.values() {
                // SAFETY: a registered scheduler is live (see `Registered`).
                #[allow(unsafe_code)]
                unsafe {
                    abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(
                        registered.scheduler,
                        EVENT,
                    )
                };
            }
            r.values().map(|r| r.period).min().unwrap_or(IDLE)
        });
        std::thread::sleep(period.clamp(Duration::from_millis(5), IDLE));
    }
}

impl Ticking {
    /// Asks for the stream's event now (a root woke it).
    pub fn wake(&self) {
        // SAFETY: live until `stop`, which takes `self`.
        #[allow(unsafe_code)]
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(self.scheduler, EVENT)
        };
    }

    /// The stream no longer waits.
    pub fn stop(self) {
        drop(self);
    }
}

impl Drop for Ticking {
    fn drop(&mut self) {
        registry(|r| r.remove(&self.key));
        // SAFETY: out of the registry, so no other thread commits it now;
        // deleted once, on its worker.
        #[allow(unsafe_code)]
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_scheduler_delete(self.scheduler)
        };
    }
}
