//! What the process holds for one chain configuration across Envoy's
//! threads (shared data, the observer's queue, metrics), and the thread
//! that has the metrics reported.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::metrics::Metrics;
use crate::store::{JobQueue, SharedData};

/// What the process holds for one chain configuration, across threads.
pub struct Process {
    /// Shared data.
    pub data: SharedData,
    /// The observer's job queue (none when no stage needs an observer).
    pub queue: Option<JobQueue>,
    /// Metrics, defined when Envoy loaded the configuration.
    pub metrics: Metrics,
    /// `zerolayer_native_shared_refused`: shared-data writes refused at
    /// a purpose's quota, and how many were reported. (Each failed write
    /// is also logged by the host, at most one line a minute.)
    pub(crate) refused: Option<u32>,
    pub(crate) refused_reported: AtomicU64,
}

impl Process {
    /// Reports shared-data refusals since the last report.
    pub(crate) fn report_refused(&self) {
        let Some(id) = self.refused else {
            return;
        };
        let now = self.data.refused();
        let before = self.refused_reported.swap(now, Ordering::Relaxed);
        if now > before {
            self.metrics.add(id, (now - before) as i64);
        }
    }
}

/// The thread asking Envoy's main thread to report the metrics, every
/// [`crate::metrics::REPORT_EVERY`] while they change.
pub(crate) struct Reporter {
    /// Dropped (or sent on) to stop the thread at once, not after its wait.
    stop: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Reporter {
    pub(crate) fn start(process: &Arc<Process>) -> Option<Reporter> {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let process = Arc::downgrade(process);
        let started = std::thread::Builder::new()
            .name("zerolayer-metrics".into())
            .spawn(move || {
                // Waits for the stop, reporting each time the wait runs out.
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(crate::metrics::REPORT_EVERY)
                {
                    match process.upgrade() {
                        Some(process) => process.metrics.commit_if_changed(),
                        None => return,
                    }
                }
            });
        match started {
            Ok(thread) => Some(Reporter { stop, thread }),
            Err(e) => {
                log::error!("zerolayer-native: no metrics thread ({e}); metrics are not reported");
                None
            }
        }
    }

    pub(crate) fn stop(self) {
        // The thread may be gone already (its process was dropped).
        let _ = self.stop.send(());
        if self.thread.join().is_err() {
            log::error!("zerolayer-native: the metrics thread panicked");
        }
    }
}
