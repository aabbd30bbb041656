//! Metrics as Envoy's dynamic-module ABI takes them: defined only while
//! Envoy loads the configuration, with label names; counted by id with
//! label values. The stages name a series by its metric and labels
//! ([`MetricName`]), which map to Envoy's family and label values as they
//! are, so `/stats/prometheus` shows the same `metric{key="value"}` as the
//! Wasm forms' flattened names with their `stats_tags` (with the runtime
//! flag that strips the module's stat namespace, see the README).
//!
//! Updates are kept in memory and reported on Envoy's main thread (the
//! configuration's scheduled event), at most every [`REPORT_EVERY`]: Envoy's
//! metric callbacks may not be called from the observer's thread, and a
//! worker reports nothing on the request path. This is the counters' only
//! batch: each counter's pending count is a [`SharedCounter`] the stages
//! add to directly (`zerolayer_host::Counters`), from any worker or the
//! observer's thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

use zerolayer_core::metrics::{MetricName, SharedCounter};
use zerolayer_host::{MetricId, MetricKind, Status};

use crate::abi::{self, Buffer, ConfigEnvoy, Scheduler};

/// How often updates are reported at most.
pub const REPORT_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Histogram samples kept between two reports at most (more are dropped,
/// counted in the log line of the report).
const MAX_SAMPLES: usize = 4096;

/// A metric family Envoy knows: its id and kind.
#[derive(Debug, Clone, Copy)]
struct Family {
    kind: MetricKind,
    id: usize,
    labelled: bool,
}

/// A series the stages defined: its family, label values and what is
/// not reported yet.
struct Series {
    family: Family,
    values: Vec<String>,
    /// Counter increments not reported yet.
    pending: SharedCounter,
    /// The gauge value not reported yet (`u64::MAX`: none).
    gauge: AtomicU64,
}

/// A series as the stages name it: kind, metric, labels.
type SeriesKey = (u8, String, Vec<(String, String)>);

/// The metrics of one chain configuration.
pub struct Metrics {
    config: ConfigEnvoy,
    families: RwLock<HashMap<(String, Vec<String>), Family>>,
    /// By the id the stages hold (index).
    series: RwLock<Vec<Series>>,
    by_name: RwLock<HashMap<SeriesKey, u32>>,
    samples: Mutex<Vec<(u32, u64)>>,
    dropped_samples: AtomicU64,
    frozen: AtomicBool,
    /// Whether anything changed since the last report.
    dirty: AtomicBool,
    scheduler: Mutex<Option<SendScheduler>>,
}

/// The configuration's scheduler, committed from any thread.
struct SendScheduler(Scheduler);

// SAFETY: Envoy's configuration scheduler may be committed from any thread
// ("safe to call from any thread"); it is deleted once, on the main thread.
#[allow(unsafe_code)]
unsafe impl Send for SendScheduler {}

// SAFETY: `config` is only used on Envoy's main thread (definitions in
// `config_new`, reports in the scheduled event); the rest is synchronised.
#[allow(unsafe_code)]
unsafe impl Send for Metrics {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for Metrics {}

fn kind_code(kind: MetricKind) -> u8 {
    match kind {
        MetricKind::Counter => 0,
        MetricKind::Gauge => 1,
        MetricKind::Histogram => 2,
    }
}

/// The families the metering stage defines per tenant and model at run
/// time, declared up front (Envoy takes definitions only at load).
const RUNTIME_FAMILIES: &[(&str, &[&str])] = &[
    ("zerolayer_metering_requests", &["tenant", "model"]),
    ("zerolayer_metering_tokens", &["tenant", "model", "kind"]),
];

impl Metrics {
    /// The metrics of the configuration Envoy is loading (`config`; null
    /// in unit tests: nothing is defined with Envoy then).
    ///
    /// # Safety
    /// `config` must be null or the handle of the `config_new` being run.
    #[allow(unsafe_code)]
    pub unsafe fn new(config: ConfigEnvoy) -> Metrics {
        let scheduler = if config.is_null() {
            None
        } else {
            // SAFETY: the caller's contract.
            let scheduler = unsafe {
                abi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(config)
            };
            (!scheduler.is_null()).then_some(SendScheduler(scheduler))
        };
        Metrics {
            config,
            families: RwLock::default(),
            series: RwLock::default(),
            by_name: RwLock::default(),
            samples: Mutex::default(),
            dropped_samples: AtomicU64::new(0),
            frozen: AtomicBool::new(false),
            dirty: AtomicBool::new(false),
            scheduler: Mutex::new(scheduler),
        }
    }

    /// Declares the families defined at run time (before [`Metrics::freeze`]).
    pub fn define_dynamic_families(&self) {
        for (metric, keys) in RUNTIME_FAMILIES {
            let _ = self.family(MetricKind::Counter, metric, keys);
        }
    }

    /// Envoy takes no more definitions: later names must be of a family
    /// declared already.
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::Release);
    }

    /// The family of `metric` with `keys`, defined with Envoy if new.
    fn family(&self, kind: MetricKind, metric: &str, keys: &[&str]) -> Result<Family, Status> {
        let key = (
            metric.to_string(),
            keys.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
        );
        if let Some(family) = read(&self.families).get(&key) {
            return Ok(*family);
        }
        if self.frozen.load(Ordering::Acquire) {
            return Err(Status::NotFound);
        }
        let id = if self.config.is_null() {
            read(&self.families).len() + 1
        } else {
            let names: Vec<Buffer> = keys.iter().map(|k| Buffer::of(k.as_bytes())).collect();
            let mut id = 0usize;
            let define = match kind {
                MetricKind::Counter => {
                    abi::envoy_dynamic_module_callback_http_filter_config_define_counter
                }
                MetricKind::Gauge => {
                    abi::envoy_dynamic_module_callback_http_filter_config_define_gauge
                }
                MetricKind::Histogram => {
                    abi::envoy_dynamic_module_callback_http_filter_config_define_histogram
                }
            };
            // SAFETY: inside `config_new` (not frozen yet), with its handle;
            // the buffers live for the call.
            #[allow(unsafe_code)]
            let result = unsafe {
                define(
                    self.config,
                    Buffer::of(metric.as_bytes()),
                    names.as_ptr(),
                    names.len(),
                    &mut id,
                )
            };
            if result != abi::METRICS_SUCCESS {
                log::warn!("zerolayer-native: metric {metric} not defined (result {result})");
                return Err(Status::InternalFailure);
            }
            id
        };
        let family = Family {
            kind,
            id,
            labelled: !keys.is_empty(),
        };
        write(&self.families).insert(key, family);
        Ok(family)
    }

    /// The id of series `name` (defined with Envoy if its family is new).
    pub fn id<'a>(&self, kind: MetricKind, name: impl Into<MetricName<'a>>) -> Result<u32, Status> {
        self.define(kind, name.into()).map(|m| m.id)
    }

    /// Series `name` as a host gives it to the stages: its id and, for a
    /// counter, its pending count, which the stages add to directly.
    pub fn define(&self, kind: MetricKind, name: MetricName<'_>) -> Result<MetricId, Status> {
        let key: SeriesKey = (
            kind_code(kind),
            name.metric.to_string(),
            name.labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        let known = read(&self.by_name).get(&key).copied();
        let id = match known {
            Some(id) => id,
            None => {
                let keys: Vec<&str> = name.labels.iter().map(|(k, _)| *k).collect();
                let family = self.family(kind, name.metric, &keys)?;
                let mut series = write(&self.series);
                let mut by_name = write(&self.by_name);
                // Another thread may have defined it meanwhile.
                match by_name.get(&key) {
                    Some(id) => *id,
                    None => {
                        let id = series.len() as u32;
                        series.push(Series {
                            family,
                            values: key.2.iter().map(|(_, v)| v.clone()).collect(),
                            pending: SharedCounter::default(),
                            gauge: AtomicU64::new(u64::MAX),
                        });
                        by_name.insert(key, id);
                        id
                    }
                }
            }
        };
        let shared = match kind {
            MetricKind::Counter => read(&self.series)
                .get(id as usize)
                .map(|s| s.pending.clone()),
            MetricKind::Gauge | MetricKind::Histogram => None,
        };
        Ok(MetricId { id, shared })
    }

    /// Adds `delta` to counter `id`, reported on the main thread (a
    /// counter only grows: a negative delta is ignored).
    pub fn add(&self, id: u32, delta: i64) {
        if let (Some(series), Ok(delta)) =
            (read(&self.series).get(id as usize), u64::try_from(delta))
        {
            series.pending.add(delta);
        }
    }

    /// Sets gauge `id` / records a histogram sample, reported on the main thread.
    pub fn record(&self, id: u32, value: u64) {
        let series = read(&self.series);
        let Some(s) = series.get(id as usize) else {
            return;
        };
        match s.family.kind {
            MetricKind::Gauge => s.gauge.store(value.min(u64::MAX - 1), Ordering::Relaxed),
            MetricKind::Histogram => {
                let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
                if samples.len() < MAX_SAMPLES {
                    samples.push((id, value));
                } else {
                    self.dropped_samples.fetch_add(1, Ordering::Relaxed);
                }
            }
            MetricKind::Counter => return,
        }
        self.ask_report();
    }

    /// Something changed: the next report has work.
    fn ask_report(&self) {
        self.dirty.store(true, Ordering::Release);
    }

    /// Asks Envoy's main thread for a report if anything changed since the
    /// last (the configuration's reporter thread, every [`REPORT_EVERY`]):
    /// a gauge or sample recorded, or a counter with increments pending
    /// (read here, so an increment costs the stages one add and no flag).
    pub fn commit_if_changed(&self) {
        if !self.changed() {
            return;
        }
        let scheduler = self.scheduler.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(scheduler) = scheduler.as_ref() {
            // SAFETY: committing is allowed from any thread; the scheduler
            // is deleted under this lock only.
            #[allow(unsafe_code)]
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                    scheduler.0,
                    0,
                )
            };
        }
    }

    /// Whether a report has work (and the recorded flag is cleared).
    fn changed(&self) -> bool {
        let recorded = self.dirty.swap(false, Ordering::AcqRel);
        recorded || read(&self.series).iter().any(|s| s.pending.pending())
    }

    /// Reports what is pending to Envoy: on the main thread, in the
    /// configuration's scheduled event.
    pub fn report(&self) {
        self.drain(|series, update| self.update(series, update));
    }

    /// Takes every pending update, handing each to `emit`.
    fn drain(&self, mut emit: impl FnMut(&Series, Update)) {
        let series = read(&self.series);
        for s in series.iter() {
            let delta = s.pending.take();
            if delta > 0 {
                emit(s, Update::Add(delta));
            }
            let value = s.gauge.swap(u64::MAX, Ordering::Relaxed);
            if value != u64::MAX {
                emit(s, Update::Set(value));
            }
        }
        let samples = std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()));
        for (id, value) in samples {
            if let Some(s) = series.get(id as usize) {
                emit(s, Update::Record(value));
            }
        }
        let dropped = self.dropped_samples.swap(0, Ordering::Relaxed);
        if dropped > 0 {
            log::warn!("zerolayer-native: {dropped} histogram samples dropped between two reports");
        }
    }

    fn update(&self, series: &Series, update: Update) {
        if self.config.is_null() {
            return;
        }
        let values: Vec<Buffer> = if series.family.labelled {
            series
                .values
                .iter()
                .map(|v| Buffer::of(v.as_bytes()))
                .collect()
        } else {
            Vec::new()
        };
        let (call, value) = match update {
            Update::Add(n) => (
                abi::envoy_dynamic_module_callback_http_filter_config_increment_counter
                    as unsafe extern "C" fn(ConfigEnvoy, usize, *const Buffer, usize, u64) -> u32,
                n,
            ),
            Update::Set(v) => (
                abi::envoy_dynamic_module_callback_http_filter_config_set_gauge as _,
                v,
            ),
            Update::Record(v) => (
                abi::envoy_dynamic_module_callback_http_filter_config_record_histogram_value as _,
                v,
            ),
        };
        // SAFETY: on the main thread (the scheduled event), with the
        // configuration's handle; the buffers live for the call.
        #[allow(unsafe_code)]
        unsafe {
            call(
                self.config,
                series.family.id,
                values.as_ptr(),
                values.len(),
                value,
            )
        };
    }

    /// The configuration is going away: no more reports.
    pub fn stop(&self) {
        if let Some(scheduler) = self
            .scheduler
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            // SAFETY: created in `config_new`, deleted once.
            #[allow(unsafe_code)]
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(scheduler.0)
            };
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Update {
    Add(u64),
    Set(u64),
    Record(u64),
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics() -> Metrics {
        // SAFETY: a null handle: nothing reaches Envoy.
        #[allow(unsafe_code)]
        unsafe {
            Metrics::new(std::ptr::null_mut())
        }
    }

    /// Every pending update as (family id, label values, update).
    fn drained(metrics: &Metrics) -> Vec<(usize, Vec<String>, Update)> {
        let mut seen = Vec::new();
        metrics.drain(|s, update| seen.push((s.family.id, s.values.clone(), update)));
        seen
    }

    #[test]
    fn a_name_maps_to_its_family_and_label_values_as_given() {
        let metrics = metrics();
        let labels = [
            ("tenant", "acme-1"),
            ("model", "claude_3"),
            ("kind", "cache_read"),
        ];
        let tokens = metrics
            .id(
                MetricKind::Counter,
                MetricName::new("zerolayer_metering_tokens", &labels),
            )
            .unwrap();
        let plain = metrics
            .id(MetricKind::Counter, "zerolayer_cache_stored")
            .unwrap();
        metrics.add(tokens, 2);
        metrics.add(plain, 1);
        let families = read(&metrics.families);
        let family = families[&(
            "zerolayer_metering_tokens".to_string(),
            vec!["tenant".into(), "model".into(), "kind".into()],
        )];
        assert!(family.labelled);
        assert!(!families[&("zerolayer_cache_stored".to_string(), vec![])].labelled);
        drop(families);
        let seen = drained(&metrics);
        assert_eq!(
            seen[0],
            (
                family.id,
                vec!["acme-1".into(), "claude_3".into(), "cache_read".into()],
                Update::Add(2)
            )
        );
        assert_eq!(seen[1].1, Vec::<String>::new());
        assert_eq!(seen[1].2, Update::Add(1));
    }

    #[test]
    fn names_of_one_family_share_it_and_a_frozen_registry_takes_only_known_families() {
        let metrics = metrics();
        let outcome = |value| MetricName::new("m", std::slice::from_ref(value));
        let valid = metrics
            .id(MetricKind::Counter, outcome(&("outcome", "valid")))
            .unwrap();
        let lazy = metrics
            .id(MetricKind::Counter, outcome(&("outcome", "lazy")))
            .unwrap();
        assert_ne!(valid, lazy);
        assert_eq!(
            metrics.id(MetricKind::Counter, outcome(&("outcome", "valid"))),
            Ok(valid)
        );
        metrics.define_dynamic_families();
        metrics.freeze();
        assert!(
            metrics
                .id(MetricKind::Counter, outcome(&("outcome", "invalid")))
                .is_ok()
        );
        assert!(
            metrics
                .id(
                    MetricKind::Counter,
                    MetricName::new(
                        "zerolayer_metering_requests",
                        &[("tenant", "t"), ("model", "m")]
                    )
                )
                .is_ok()
        );
        assert_eq!(
            metrics.id(MetricKind::Counter, "other_total"),
            Err(Status::NotFound)
        );
    }

    #[test]
    fn a_counter_is_batched_once_here_and_every_increment_reported_once() {
        let metrics = std::sync::Arc::new(metrics());
        let name = MetricName::new("m", &[("outcome", "valid")]);
        let counter = metrics.define(MetricKind::Counter, name).unwrap();
        let shared = counter.shared.clone().expect("a counter's cell");
        let gauge = metrics
            .define(MetricKind::Gauge, MetricName::plain("g"))
            .unwrap();
        assert!(gauge.shared.is_none(), "a gauge is set, not batched");
        assert!(!metrics.changed(), "nothing to report yet");
        metrics.add(counter.id, 5);
        metrics.add(counter.id, -3);
        assert!(metrics.changed(), "increments pending ask for a report");
        // Workers and the observer add to the cell directly, while the
        // main thread reports.
        let adders: Vec<_> = (0..4)
            .map(|_| {
                let shared = shared.clone();
                std::thread::spawn(move || (0..1000).for_each(|_| shared.add(1)))
            })
            .collect();
        let mut reported = 0;
        let mut take = || {
            for (_, values, update) in drained(&metrics) {
                assert_eq!(values, ["valid"]);
                match update {
                    Update::Add(n) => reported += n,
                    other => panic!("a counter reported {other:?}"),
                }
            }
        };
        while adders.iter().any(|a| !a.is_finished()) {
            take();
        }
        for adder in adders {
            adder.join().unwrap();
        }
        // What the last drain during the adds left.
        take();
        assert_eq!(
            reported, 4005,
            "each increment once; a negative delta ignored"
        );
        assert!(!metrics.changed());
        assert!(drained(&metrics).is_empty());
        metrics.record(gauge.id, 7);
        assert!(metrics.changed(), "a gauge set asks for a report");
        let seen = drained(&metrics);
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].2, Update::Set(7));
    }
}
