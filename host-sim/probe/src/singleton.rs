//! The singleton role: owns the shared queue the filters enqueue to and
//! drains it, on `on_queue_ready` and, for hosts that never call that, on
//! every tick.

use proxy_wasm::hostcalls;

use crate::actions::{QUEUE_TOTAL_KEY, cas_increment};
use crate::metrics::Counter;

/// The singleton's state after configuration.
pub(crate) struct Singleton {
    queue: u32,
    queue_name: String,
    items: Counter,
    ticks: Counter,
}

impl Singleton {
    /// Registers the queue `queue_name` and defines the singleton's counters.
    pub(crate) fn register(queue_name: &str) -> Result<Self, String> {
        let queue = hostcalls::register_shared_queue(queue_name)
            .map_err(|status| format!("cannot register queue {queue_name:?}: {status:?}"))?;
        Ok(Singleton {
            queue,
            queue_name: queue_name.to_string(),
            items: Counter::define("probe_queue_items"),
            ticks: Counter::define("probe_singleton_ticks"),
        })
    }

    /// The host says `queue` has items.
    pub(crate) fn queue_ready(&self, queue: u32) {
        if queue == self.queue {
            self.drain("queue ready");
        } else {
            log::warn!("probe: queue ready for unknown queue {queue}");
        }
    }

    /// One tick: counted, then the queue drained.
    pub(crate) fn tick(&self) {
        self.ticks.add(1);
        self.drain("tick");
    }

    /// Dequeues every item: each adds 1 to `probe_queue_items` and to the
    /// shared data counter `probe_queue_total`.
    fn drain(&self, why: &str) {
        let mut count: u64 = 0;
        loop {
            match hostcalls::dequeue_shared_queue(self.queue) {
                Ok(Some(_item)) => {
                    count += 1;
                    self.items.add(1);
                    if let Err(failure) = cas_increment(QUEUE_TOTAL_KEY) {
                        log::warn!("probe: {QUEUE_TOTAL_KEY} not incremented: {failure}");
                    }
                }
                Ok(None) => break,
                Err(status) => {
                    log::warn!(
                        "probe: dequeue from {:?} failed: {status:?}",
                        self.queue_name
                    );
                    break;
                }
            }
        }
        if count > 0 {
            log::info!(
                "probe: drained {count} items from {:?} ({why})",
                self.queue_name
            );
        }
    }
}
