//! A filter whose observer queue cannot be found says which queue it
//! looked for, once: an operator matches the name and `vm_id` against the
//! observer's configuration (`host-sim check` does it before a deploy).

use std::sync::Mutex;

use zerolayer_core::config::ObserverLink;
use zerolayer_host::{FakeHost, ObserverQueue};

/// Warnings logged during the test.
static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        if record.level() <= log::Level::Warn {
            LINES
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(record.args().to_string());
        }
    }
    fn flush(&self) {}
}

#[test]
fn an_unresolved_queue_is_named_once() {
    log::set_logger(&Capture).expect("the only logger");
    log::set_max_level(log::LevelFilter::Warn);
    let mut host = FakeHost::default();
    let link = ObserverLink {
        queue: "zerolayer.usage".into(),
        ..ObserverLink::default()
    };
    let queue = ObserverQueue::new(link, None, "metering");
    assert!(!queue.post(&mut host, b"job"));
    assert!(!queue.post(&mut host, b"job"));
    let lines = LINES.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert_eq!(
        lines,
        [
            "could not find queue \"zerolayer.usage\" in vm_id \"zerolayer\" (observer.queue, observer.vm_id): no observer registered it; jobs are lost until one does"
        ]
    );
}
