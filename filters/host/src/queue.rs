//! The observer's job queue as a filter reaches it.

use std::cell::Cell;

use zerolayer_core::config::ObserverLink;
use zerolayer_core::queue;

use crate::host::Host;

/// The observer's job queue: owned (tick mode, the filter's root
/// registered it) or resolved on first use (singleton mode: the observer
/// service may configure after the filters). In tick mode, posts are
/// bounded by `observer.max_queued_bytes` (see `zerolayer_core::queue`):
/// the host's queue may be a fixed-size ring that traps when full (Kong).
pub struct ObserverQueue {
    link: ObserverLink,
    id: Cell<Option<u32>>,
    /// The backlog counter's shared-data key (tick mode).
    backlog: Option<String>,
    /// Whether a failed resolution was logged already (once per queue:
    /// every post would fail the same way).
    reported: Cell<bool>,
}

impl ObserverQueue {
    /// The queue `filter` reaches through `link`; `owned` when this VM
    /// registered it.
    pub fn new(link: ObserverLink, owned: Option<u32>, filter: &str) -> ObserverQueue {
        let backlog = link.backlog_key(filter);
        ObserverQueue {
            link,
            id: Cell::new(owned),
            backlog,
            reported: Cell::new(false),
        }
    }

    /// The queue id, resolving it if needed (`None` while the observer is
    /// not there).
    pub fn get(&self, host: &mut impl Host) -> Option<u32> {
        if let Some(id) = self.id.get() {
            return Some(id);
        }
        let Some(id) = host.resolve_queue(&self.link.vm_id, &self.link.queue) else {
            // Name what was looked for: an operator matches it against the
            // observer's `vm_id` and `observer.queue` (`host-sim check`).
            if !self.reported.replace(true) {
                log::warn!(
                    "could not find queue {:?} in vm_id {:?} (observer.queue, observer.vm_id): no observer registered it; jobs are lost until one does",
                    self.link.queue,
                    self.link.vm_id
                );
            }
            return None;
        };
        self.id.set(Some(id));
        Some(id)
    }

    /// Posts `job`; returns whether it was queued (not: no observer, or
    /// the queue is at its bound).
    pub fn post(&self, host: &mut impl Host, job: &[u8]) -> bool {
        let Some(q) = self.get(host) else {
            return false;
        };
        if let Some(key) = &self.backlog
            && !reserve_backlog(host, key, job.len(), self.link.max_queued_bytes)
        {
            return false;
        }
        if host.enqueue(q, job).is_ok() {
            return true;
        }
        if let Some(key) = &self.backlog {
            release_backlog(host, key, queue::queued_size(job.len()));
        }
        false
    }
}

/// Counts a job of `len` bytes into the backlog at `key` unless it would
/// pass `max_bytes`; returns whether it was counted.
fn reserve_backlog(host: &mut impl Host, key: &str, len: usize, max_bytes: u64) -> bool {
    host.shared_update_if(key, |current| {
        match queue::admit(queue::decode_backlog(current), len, max_bytes) {
            Some(next) => (Some(queue::encode_backlog(next).to_vec()), true),
            None => (None, false),
        }
    })
    .unwrap_or(false)
}

/// Takes `bytes` off the backlog at `key` (the observer drained them).
pub fn release_backlog(host: &mut impl Host, key: &str, bytes: u64) {
    let _ = host.shared_update(key, |current| {
        let left = queue::decode_backlog(current).saturating_sub(bytes);
        (queue::encode_backlog(left).to_vec(), ())
    });
}
