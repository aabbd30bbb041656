//! Metrics as Envoy's dynamic-module ABI takes them: defined only while
//! Envoy loads the configuration, with label names; counted by id with
//! label values. The stages name a labelled counter as the Wasm forms do,
//! `<metric>_<key>=<value>…` (which the Wasm configs' `stats_tags` turn
//! into labels); here the name is split into its metric and labels once,
//! so `/stats/prometheus` shows the same `metric{key="value"}` (with the
//! runtime flag that strips the module's stat namespace, see the README).
//!
//! Updates are kept in memory and reported on Envoy's main thread (the
//! configuration's scheduled event), at most every [`REPORT_EVERY`]: Envoy's
//! metric callbacks may not be called from the observer's thread, and a
//! worker reports nothing on the request path.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

use zerolayer_host::{MetricKind, Status};

use crate::abi::{self, Buffer, ConfigEnvoy, Scheduler};

/// How often updates are reported at most.
pub const REPORT_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Histogram samples kept between two reports at most (more are dropped,
/// counted in the log line of the report).
const MAX_SAMPLES: usize = 4096;

/// A metric and its labels, split from the stages' name for it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MetricName {
    /// The metric (`zerolayer_auth_decisions`).
    pub metric: String,
    /// Label names, in order (`outcome`).
    pub keys: Vec<String>,
    /// Label values, in order (`valid`).
    pub values: Vec<String>,
}

impl MetricName {
    /// Splits `name` at each `_<key>=` (a key is lower-case letters): the
    /// part before the first is the metric; each value runs to the next.
    pub fn parse(name: &str) -> MetricName {
        let bytes = name.as_bytes();
        let mut starts = Vec::new();
        for (i, &b) in bytes.iter().enumerate() {
            if b != b'_' {
                continue;
            }
            let key_end = bytes[i + 1..]
                .iter()
                .position(|c| !c.is_ascii_lowercase())
                .map(|p| i + 1 + p);
            if let Some(end) = key_end
                && end > i + 1
                && bytes[end] == b'='
            {
                starts.push((i, end));
            }
        }
        let Some(&(first, _)) = starts.first() else {
            return MetricName {
                metric: name.to_string(),
                keys: Vec::new(),
                values: Vec::new(),
            };
        };
        let mut keys = Vec::new();
        let mut values = Vec::new();
        for (n, &(start, eq)) in starts.iter().enumerate() {
            let end = starts.get(n + 1).map_or(name.len(), |next| next.0);
            keys.push(name[start + 1..eq].to_string());
            values.push(name[eq + 1..end].to_string());
        }
        MetricName {
            metric: name[..first].to_string(),
            keys,
            values,
        }
    }
}

/// A metric family Envoy knows: its id and kind.
#[derive(Debug, Clone, Copy)]
struct Family {
    kind: MetricKind,
    id: usize,
    labelled: bool,
}

/// A name the stages defined: its family and label values.
struct Series {
    family: Family,
    values: Vec<String>,
}

/// The metrics of one chain configuration.
pub struct Metrics {
    config: ConfigEnvoy,
    families: RwLock<HashMap<(String, Vec<String>), Family>>,
    /// By the id the stages hold (index).
    series: RwLock<Vec<Series>>,
    by_name: RwLock<HashMap<(u8, String), u32>>,
    /// Counter deltas not reported yet, by series.
    pending: RwLock<Vec<AtomicI64>>,
    /// Gauge values not reported yet (`u64::MAX`: none), by series.
    gauges: RwLock<Vec<AtomicU64>>,
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
            pending: RwLock::default(),
            gauges: RwLock::default(),
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
            let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
            let _ = self.family(MetricKind::Counter, metric, &keys);
        }
    }

    /// Envoy takes no more definitions: later names must be of a family
    /// declared already.
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::Release);
    }

    /// The family of `metric` with `keys`, defined with Envoy if new.
    fn family(&self, kind: MetricKind, metric: &str, keys: &[String]) -> Result<Family, Status> {
        let key = (metric.to_string(), keys.to_vec());
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

    /// The id the stages hold for `name` (`<metric>_<key>=<value>…`).
    pub fn id(&self, kind: MetricKind, name: &str) -> Result<u32, Status> {
        let key = (kind_code(kind), name.to_string());
        if let Some(id) = read(&self.by_name).get(&key) {
            return Ok(*id);
        }
        let parsed = MetricName::parse(name);
        let family = self.family(kind, &parsed.metric, &parsed.keys)?;
        let mut series = write(&self.series);
        let id = series.len() as u32;
        series.push(Series {
            family,
            values: parsed.values,
        });
        write(&self.pending).push(AtomicI64::new(0));
        write(&self.gauges).push(AtomicU64::new(u64::MAX));
        write(&self.by_name).insert(key, id);
        Ok(id)
    }

    /// Adds `delta` to counter `id`, reported on the main thread.
    pub fn add(&self, id: u32, delta: i64) {
        if let Some(pending) = read(&self.pending).get(id as usize) {
            pending.fetch_add(delta, Ordering::Relaxed);
            self.ask_report();
        }
    }

    /// Sets gauge `id` / records a histogram sample, reported on the main thread.
    pub fn record(&self, id: u32, value: u64) {
        let kind = read(&self.series).get(id as usize).map(|s| s.family.kind);
        match kind {
            Some(MetricKind::Gauge) => {
                if let Some(gauge) = read(&self.gauges).get(id as usize) {
                    gauge.store(value.min(u64::MAX - 1), Ordering::Relaxed);
                }
            }
            Some(MetricKind::Histogram) => {
                let mut samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
                if samples.len() < MAX_SAMPLES {
                    samples.push((id, value));
                } else {
                    self.dropped_samples.fetch_add(1, Ordering::Relaxed);
                }
            }
            _ => return,
        }
        self.ask_report();
    }

    /// Something changed: the next report has work.
    fn ask_report(&self) {
        self.dirty.store(true, Ordering::Release);
    }

    /// Asks Envoy's main thread for a report if anything changed since the
    /// last (the configuration's reporter thread, every [`REPORT_EVERY`]).
    pub fn commit_if_changed(&self) {
        if !self.dirty.swap(false, Ordering::AcqRel) {
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

    /// Reports what is pending to Envoy: on the main thread, in the
    /// configuration's scheduled event.
    pub fn report(&self) {
        let series = read(&self.series);
        let pending = read(&self.pending);
        let gauges = read(&self.gauges);
        for (id, s) in series.iter().enumerate() {
            let delta = pending[id].swap(0, Ordering::Relaxed);
            if delta > 0 {
                self.update(s, Update::Add(delta as u64));
            }
            let value = gauges[id].swap(u64::MAX, Ordering::Relaxed);
            if value != u64::MAX {
                self.update(s, Update::Set(value));
            }
        }
        let samples = std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()));
        for (id, value) in samples {
            if let Some(s) = series.get(id as usize) {
                self.update(s, Update::Record(value));
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

    #[test]
    fn a_labelled_name_splits_into_its_metric_and_labels() {
        let name = MetricName::parse("zerolayer_auth_decisions_outcome=valid");
        assert_eq!(name.metric, "zerolayer_auth_decisions");
        assert_eq!(name.keys, ["outcome"]);
        assert_eq!(name.values, ["valid"]);
        let name = MetricName::parse(
            "zerolayer_metering_tokens_tenant=acme-1_model=claude_3_kind=cache_read",
        );
        assert_eq!(name.metric, "zerolayer_metering_tokens");
        assert_eq!(name.keys, ["tenant", "model", "kind"]);
        assert_eq!(name.values, ["acme-1", "claude_3", "cache_read"]);
        let plain = MetricName::parse("zerolayer_cache_stored");
        assert_eq!(plain.metric, "zerolayer_cache_stored");
        assert!(plain.keys.is_empty());
    }

    #[test]
    fn names_of_one_family_share_it_and_a_frozen_registry_takes_only_known_families() {
        // SAFETY: a null handle: nothing reaches Envoy.
        #[allow(unsafe_code)]
        let metrics = unsafe { Metrics::new(std::ptr::null_mut()) };
        let valid = metrics.id(MetricKind::Counter, "m_outcome=valid").unwrap();
        let lazy = metrics.id(MetricKind::Counter, "m_outcome=lazy").unwrap();
        assert_ne!(valid, lazy);
        assert_eq!(
            metrics.id(MetricKind::Counter, "m_outcome=valid"),
            Ok(valid)
        );
        metrics.define_dynamic_families();
        metrics.freeze();
        assert!(metrics.id(MetricKind::Counter, "m_outcome=invalid").is_ok());
        assert!(
            metrics
                .id(
                    MetricKind::Counter,
                    "zerolayer_metering_requests_tenant=t_model=m"
                )
                .is_ok()
        );
        assert_eq!(
            metrics.id(MetricKind::Counter, "other_total"),
            Err(Status::NotFound)
        );
    }
}
