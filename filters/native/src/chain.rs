//! The native chain (`filter_name: zerolayer`): the fused filter's stages —
//! lazy-auth → activation → post-cache → metering — run through the same
//! [`Pipeline`] on a [`NativeHost`], configured by the fused filter's
//! configuration object (a section per stage, the same schemas and errors)
//! and one section of its own, `native`.
//!
//! Threads: Envoy calls a filter's hooks on its worker. Each worker has its
//! own stage roots ([`Worker`]), as each worker has its own Wasm VM, made on
//! its first request from the configuration the main thread checked; shared
//! data is the process's, and so is the quota stage's lease table, which a
//! thread of the module's own syncs ([`crate::quota`]); the observer runs
//! on a thread of its own ([`crate::observer`]). A root's tick runs inside a hook on its worker:
//! when one is due at a request's hooks, and for paused streams (a follower
//! waiting on a cached answer) through their scheduled events, which the
//! module's ticker thread commits while they wait.

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use zerolayer_core::footprint;
use zerolayer_fused::{Pipeline, Stage, StageRoots};
use zerolayer_host::{MetricKind, StreamMap, Wake};
use zerolayer_quota::{Leases, QuotaRoot};

use crate::abi::ConfigEnvoy;
use crate::config::Loaded;
use crate::envoy::StreamEnvoy;
use crate::host::{EnvoyProcess, EnvoyProxy, NativeHost, NativeRoots};
use crate::metrics::Metrics;
use crate::observer::ObserverThread;
use crate::process::{Process, Reporter};
use crate::quota::QuotaSyncer;
use crate::store::{JobQueue, SharedData};
use crate::stream::ChainStream;
use crate::ticker::Ticking;

/// One chain configuration (`envoy_dynamic_module_on_http_filter_config_new`).
pub struct ChainConfig {
    sections: Vec<(Stage, Vec<u8>)>,
    process: Arc<Process>,
    /// The process's lease table (a `quota` section), which every
    /// worker's quota root spends.
    leases: Option<Arc<Leases>>,
    /// The thread syncing it.
    quota: Option<QuotaSyncer>,
    observer: Option<ObserverThread>,
    reporter: Option<Reporter>,
    /// The shortest tick a stage asked for.
    tick: Duration,
}

/// A stream as its worker's roots reach it.
pub(crate) struct Slot {
    /// What the roots did to it, for its next scheduled event.
    pub(crate) woken: RefCell<Vec<Wake>>,
    /// Its scheduled events, once it waited.
    pub(crate) ticking: RefCell<Option<Ticking>>,
}

/// One worker's part of a chain configuration: the stage roots.
pub(crate) struct Worker {
    config: std::sync::Weak<ChainConfig>,
    pub(crate) roots: StageRoots<EnvoyProcess, EnvoyProxy>,
    pub(crate) host: NativeRoots,
    pub(crate) streams: StreamMap<Weak<Slot>>,
    next_id: u32,
}

thread_local! {
    /// This worker's roots, by configuration.
    static WORKERS: RefCell<Vec<Rc<RefCell<Worker>>>> = const { RefCell::new(Vec::new()) };
}

impl ChainConfig {
    /// Checks `config` (every field, as the fused filter does), defines the
    /// metrics with Envoy and starts the observer; `Err` is the one line
    /// naming the field.
    ///
    /// # Safety
    /// `config_envoy` must be null (unit tests) or the handle of the
    /// `config_new` being run.
    pub unsafe fn new(
        config_envoy: ConfigEnvoy,
        config: &[u8],
    ) -> Result<Arc<ChainConfig>, String> {
        // Each byte is read once here to find the sections, and each section
        // parsed once more by whoever needs it: its stage, and (lazy-auth,
        // post-cache, metering) the observer's configuration with shared
        // data's footprint, parsed together (`crate::config::load`).
        let Loaded {
            native,
            sections,
            spaces,
            observer: observer_config,
            upstreams,
            quota,
        } = crate::config::load(config)?;
        // SAFETY: the caller's contract.
        let metrics = unsafe { Metrics::new(config_envoy) };
        let (queue, jobs) = match &observer_config {
            Some(config) => {
                let (queue, jobs) = JobQueue::new(&config.link().queue, native.queue_capacity);
                (Some(queue), Some(jobs))
            }
            None => (None, None),
        };
        let refused = metrics
            .id(MetricKind::Counter, "zerolayer_native_shared_refused")
            .ok();
        log::info!("zerolayer-native: {}", footprint::describe(&spaces));
        let process = Arc::new(Process {
            data: SharedData::new(&spaces),
            queue,
            metrics,
            refused,
            refused_reported: AtomicU64::new(0),
        });
        // Configured once here for the errors and the metrics (Envoy takes
        // metric definitions only now); each worker configures its own.
        let mut host = NativeRoots::new(EnvoyProcess::new(process.clone()));
        // The process's one lease table, which every worker's quota root
        // spends and the quota thread syncs.
        let leases = match &quota {
            Some((section, _)) => Some(
                Leases::configure(&mut host, section)
                    .ok_or("quota: refused (see the line above)")?,
            ),
            None => None,
        };
        let mut roots = StageRoots::<EnvoyProcess, EnvoyProxy>::default();
        for &(stage, section) in &sections {
            if !add_root(&mut roots, stage, section, leases.as_ref(), &mut host) {
                return Err(format!("{}: refused (see the line above)", stage.section()));
            }
        }
        let second = Duration::from_secs(1);
        let tick = roots.shortest_tick().map_or(second, |t| t.min(second));
        process.metrics.define_dynamic_families();
        let observer = match (observer_config, jobs, &process.queue) {
            (Some(config), Some(jobs), Some(queue)) => Some(ObserverThread::start(
                config,
                upstreams,
                process.clone(),
                queue.clone(),
                jobs,
            )?),
            _ => None,
        };
        process.metrics.freeze();
        // Started once the metrics are defined: its root only looks up
        // the families the check above defined on this thread.
        let quota = match (quota, &leases) {
            (Some((section, (cluster, address))), Some(leases)) => Some(QuotaSyncer::start(
                section.to_vec(),
                leases.clone(),
                cluster,
                address,
                process.clone(),
            )?),
            _ => None,
        };
        let names: Vec<&str> = sections.iter().map(|(s, _)| s.section()).collect();
        log::info!(
            "zerolayer-native: chain with stages {} (observer {}{})",
            names.join(" → "),
            if observer.is_some() {
                "on its thread"
            } else {
                "none"
            },
            if quota.is_some() {
                "; quota leases synced on their thread"
            } else {
                ""
            }
        );
        let reporter = Reporter::start(&process);
        Ok(Arc::new(ChainConfig {
            // Each worker configures its roots from the same bytes.
            sections: sections
                .into_iter()
                .map(|(stage, section)| (stage, section.to_vec()))
                .collect(),
            process,
            leases,
            quota,
            observer,
            reporter,
            tick,
        }))
    }

    /// The configuration is going away: the observer stops first, then
    /// metrics are no longer reported.
    pub fn shut_down(&mut self) {
        // Its last step gives idle leases back and exports the counts.
        if let Some(quota) = &mut self.quota {
            quota.stop();
        }
        if let Some(observer) = &mut self.observer {
            observer.stop();
        }
        if let Some(reporter) = self.reporter.take() {
            reporter.stop();
        }
        self.process.metrics.stop();
    }

    /// The process's lease table (a `quota` section).
    #[cfg(test)]
    pub(crate) fn leases(&self) -> Option<&Arc<Leases>> {
        self.leases.as_ref()
    }

    /// The configuration's scheduled event (Envoy's main thread): reports
    /// the metrics.
    pub fn scheduled(&self) {
        self.process.metrics.report();
    }

    /// A new stream on this worker.
    pub fn stream(self: &Arc<ChainConfig>, envoy: StreamEnvoy) -> ChainStream {
        let worker = self.worker();
        let mut w = worker.borrow_mut();
        w.next_id = w.next_id.wrapping_add(1).max(1);
        let id = w.next_id;
        let stages = w.roots.streams(id);
        let slot = Rc::new(Slot {
            woken: RefCell::new(Vec::new()),
            ticking: RefCell::new(None),
        });
        w.streams.insert(id, Rc::downgrade(&slot));
        drop(w);
        ChainStream {
            id,
            worker,
            slot,
            pipeline: Pipeline::new(stages),
            host: NativeHost::stream(EnvoyProxy::stream(self.process.clone(), envoy)),
            tick: self.tick,
        }
    }

    /// This worker's roots for this configuration, configured on first use.
    fn worker(self: &Arc<ChainConfig>) -> Rc<RefCell<Worker>> {
        WORKERS.with(|workers| {
            let mut workers = workers.borrow_mut();
            // Configurations Envoy destroyed leave their workers' roots.
            workers.retain(|w| w.try_borrow().map_or(true, |w| w.config.strong_count() > 0));
            let mine = Arc::downgrade(self);
            if let Some(worker) = workers
                .iter()
                .find(|w| w.try_borrow().is_ok_and(|w| w.config.ptr_eq(&mine)))
            {
                return worker.clone();
            }
            let mut host = NativeRoots::new(EnvoyProcess::new(self.process.clone()));
            let mut roots = StageRoots::<EnvoyProcess, EnvoyProxy>::default();
            for (stage, section) in &self.sections {
                // Checked on the main thread already: the same bytes.
                if !add_root(&mut roots, *stage, section, self.leases.as_ref(), &mut host) {
                    log::error!(
                        "zerolayer-native: {} refused on a worker (see the line above)",
                        stage.section()
                    );
                }
            }
            let worker = Rc::new(RefCell::new(Worker {
                config: mine,
                roots,
                host,
                streams: StreamMap::default(),
                next_id: 0,
            }));
            workers.push(worker.clone());
            worker
        })
    }
}

/// Configures a root of `stage` into `roots`: quota's spends the process's
/// lease table `leases`, the others are the stages' own.
fn add_root(
    roots: &mut StageRoots<EnvoyProcess, EnvoyProxy>,
    stage: Stage,
    section: &[u8],
    leases: Option<&Arc<Leases>>,
    host: &mut NativeRoots,
) -> bool {
    match (stage, leases) {
        (Stage::Quota, Some(leases)) => {
            let root = Box::new(QuotaRoot::sharing(leases.clone()));
            roots.add_root(stage, root, section, host)
        }
        _ => roots.add(stage, section, host),
    }
}

impl Drop for ChainConfig {
    fn drop(&mut self) {
        self.shut_down();
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn refused(config: Value) -> String {
        // SAFETY: a null handle: nothing reaches Envoy.
        match unsafe { ChainConfig::new(std::ptr::null_mut(), config.to_string().as_bytes()) } {
            Ok(_) => String::from("accepted"),
            Err(why) => why,
        }
    }

    fn lazy_auth(mode: &str) -> Value {
        json!({
            "credentials": [{"header": "authorization", "scheme": "Bearer", "kind": "jwt"}],
            "jwt": {
                "issuers": ["https://idp.test"],
                "jwks": {"cluster": "idp", "path": "/jwks", "timeout_ms": 500},
            },
            "observer": {"vm_id": "zerolayer", "queue": "zerolayer.jobs", "mode": mode},
        })
    }

    #[test]
    fn a_stage_section_is_checked_as_the_fused_filter_checks_it() {
        let why = refused(
            json!({"activation": {"rules": [{"name": "r", "when": {"path": {"matches": "("}}}]}}),
        );
        assert!(why.starts_with("activation: refused"), "{why}");
    }

    #[test]
    fn the_observer_runs_on_its_own_thread_so_tick_mode_is_refused_naming_the_field() {
        let why = refused(json!({
            "lazy_auth": lazy_auth("tick"),
            "native": {"upstreams": {"idp": "127.0.0.1:9"}},
        }));
        assert!(why.starts_with("lazy_auth.observer.mode:"), "{why}");
    }

    #[test]
    fn a_section_the_observer_reads_is_refused_naming_its_full_path() {
        let mut section = lazy_auth("singleton");
        section["unknown"] = json!("maybe");
        let why = refused(json!({
            "lazy_auth": section,
            "native": {"upstreams": {"idp": "127.0.0.1:9"}},
        }));
        assert!(
            why.starts_with(
                "lazy_auth.unknown: unknown variant `maybe`, expected `lazy` or `sync`"
            ),
            "{why}"
        );
        let why = refused(json!({"metering": {"sampling": {"percent": "all"}}}));
        assert!(
            why.starts_with("metering.sampling.percent: invalid type"),
            "{why}"
        );
        let why = refused(json!({"metering": 5}));
        assert_eq!(why, "metering: expected a JSON object");
    }

    #[test]
    fn a_cap_below_what_the_stages_may_hold_is_refused_naming_the_field() {
        let why = refused(json!({
            "lazy_auth": lazy_auth("singleton"),
            "native": {"upstreams": {"idp": "127.0.0.1:9"}, "shared_max_entries": 1000},
        }));
        assert!(
            why.starts_with("native.shared_max_entries: 1000 is less than the 143619 keys"),
            "{why}"
        );
        assert!(why.contains("verdicts 65536 keys"), "{why}");
    }

    #[test]
    fn every_cluster_the_observer_calls_needs_an_upstream_address() {
        let why = refused(json!({"lazy_auth": lazy_auth("singleton")}));
        assert!(
            why.starts_with(
                "native.upstreams: no address for cluster \"idp\" (lazy_auth.jwt.jwks.cluster)"
            ),
            "{why}"
        );
        let why = refused(json!({
            "lazy_auth": lazy_auth("singleton"),
            "native": {"upstreams": {"idp": "localhost"}},
        }));
        assert!(
            why.starts_with("native.upstreams.idp: \"localhost\" is not host:port"),
            "{why}"
        );
    }

    #[test]
    fn the_quota_store_needs_an_upstream_address_for_the_quota_thread() {
        let quota = json!({"store": {"cluster": "webdis", "path": "/"}});
        let why = refused(json!({"quota": quota}));
        assert!(
            why.starts_with(
                "native.upstreams: no address for cluster \"webdis\" (quota.store.cluster)"
            ),
            "{why}"
        );
        let why = refused(json!({
            "quota": {"store": {"cluster": "webdis", "path": "/", "sync_interval_ms": 1}},
            "native": {"upstreams": {"webdis": "127.0.0.1:9"}},
        }));
        assert!(why.starts_with("quota.store.sync_interval_ms"), "{why}");
    }

    #[test]
    fn a_chain_without_observer_work_starts_no_observer() {
        // SAFETY: a null handle: nothing reaches Envoy.
        let chain =
            unsafe { ChainConfig::new(std::ptr::null_mut(), br#"{"activation":{"rules":[]}}"#) };
        let chain = chain.unwrap_or_else(|why| panic!("{why}"));
        assert!(chain.observer.is_none());
        assert!(chain.process.queue.is_none());
    }

    #[test]
    fn the_observer_thread_starts_with_the_chain_and_stops_with_it() {
        let config = json!({
            "lazy_auth": lazy_auth("singleton"),
            "native": {"upstreams": {"idp": "127.0.0.1:9"}},
        });
        // SAFETY: a null handle: nothing reaches Envoy.
        let chain =
            unsafe { ChainConfig::new(std::ptr::null_mut(), config.to_string().as_bytes()) };
        let chain = chain.unwrap_or_else(|why| panic!("{why}"));
        assert!(chain.observer.is_some());
        let queue = chain.process.queue.clone().expect("the observer's queue");
        assert_eq!(queue.name(), "zerolayer.jobs");
        assert!(queue.post(b"not a job").is_ok());
        // Joins the thread: a hang here is a thread that does not stop.
        drop(chain);
        assert!(
            queue.post(b"after").is_err(),
            "the observer stopped draining"
        );
    }
}
