//! [`StageRoots`]: the configured stages' roots of a chain that runs in one
//! filter, each at its own tick, as the fused filter's root and each of the
//! native module's workers run them.

use std::time::Duration;

use zerolayer_host::{Chain, Host, PipelineHost, PipelineRoots, Proxy, RootStage};

use crate::{Stage, StageStream};

/// A configured stage's root and its tick.
struct StageRoot<R, S> {
    stage: Stage,
    root: Box<dyn RootStage<Chain<R, S>>>,
    tick: Option<Duration>,
    next_tick_ms: u64,
}

/// The stages' roots, in chain order: on roots over `R`, making streams
/// over `S`.
pub struct StageRoots<R, S> {
    roots: Vec<StageRoot<R, S>>,
}

impl<R, S> Default for StageRoots<R, S> {
    fn default() -> Self {
        StageRoots { roots: Vec::new() }
    }
}

impl<R: Host + 'static, S: Proxy + 'static> StageRoots<R, S> {
    /// Configures a root of `stage` from its `section` on `host` and adds it
    /// (also when it refuses: a refused stage still refuses its requests);
    /// returns whether it took the configuration (it logged why not).
    pub fn add(&mut self, stage: Stage, section: &[u8], host: &mut PipelineRoots<R>) -> bool {
        self.add_root(stage, stage.root(), section, host)
    }

    /// [`StageRoots::add`] with a root the caller made (the native module's
    /// quota roots share the process's lease table).
    pub fn add_root(
        &mut self,
        stage: Stage,
        mut root: Box<dyn RootStage<Chain<R, S>>>,
        section: &[u8],
        host: &mut PipelineRoots<R>,
    ) -> bool {
        let ok = root.configure(host, section);
        self.roots.push(StageRoot {
            stage,
            root,
            tick: host.take_tick(),
            next_tick_ms: 0,
        });
        ok
    }

    /// The stages' sections, in chain order.
    pub fn names(&self) -> Vec<&'static str> {
        self.roots.iter().map(|r| r.stage.section()).collect()
    }

    /// The shortest tick a stage asked for.
    pub fn shortest_tick(&self) -> Option<Duration> {
        self.roots.iter().filter_map(|r| r.tick).min()
    }

    /// Whether a root's tick is due at `now_ms`.
    pub fn due(&self, now_ms: u64) -> bool {
        self.roots
            .iter()
            .any(|r| r.tick.is_some() && now_ms >= r.next_tick_ms)
    }

    /// Ticks the roots whose tick is due at `now_ms`; `flush`: every other
    /// root hands over what it keeps to report ([`RootStage::flush`]).
    pub fn tick(&mut self, host: &mut PipelineRoots<R>, now_ms: u64, flush: bool) {
        for r in &mut self.roots {
            match r.tick {
                Some(tick) if now_ms >= r.next_tick_ms => {
                    r.next_tick_ms = now_ms + tick.as_millis() as u64;
                    r.root.tick(host);
                }
                _ if flush => r.root.flush(host),
                _ => {}
            }
        }
    }

    /// A callout a root made has an answer: each root knows its own
    /// callouts and ignores the others.
    pub fn call_answered(&mut self, host: &mut PipelineRoots<R>, token: u32, body_size: usize) {
        for r in &mut self.roots {
            r.root.call_answered(host, token, body_size);
        }
    }

    /// The filter is going away: every root reports what is pending.
    pub fn done(&mut self, host: &mut PipelineRoots<R>) {
        for r in &mut self.roots {
            r.root.done(host);
        }
    }

    /// The stages' parts of a new request (`context_id` is the stream's).
    pub fn streams(&self, context_id: u32) -> Vec<StageStream<PipelineHost<S>>> {
        self.roots
            .iter()
            .map(|r| {
                StageStream::new(
                    r.root.stream(context_id),
                    r.stage.headers_pause_withholds_body(),
                    r.stage.labels(),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use zerolayer_host::{FakeHost, PipelineRoots};

    use super::*;

    #[test]
    fn each_root_ticks_at_its_own_period_and_a_refused_stage_stays_in_the_chain() {
        let mut host = PipelineRoots::new(FakeHost::default());
        let mut roots = StageRoots::<FakeHost, FakeHost>::default();
        assert!(!roots.add(Stage::LazyAuth, b"not json", &mut host));
        assert!(roots.add(Stage::Activation, br#"{"rules":[]}"#, &mut host));
        assert_eq!(roots.names(), ["lazy_auth", "activation"]);
        assert_eq!(
            roots.streams(1).len(),
            2,
            "a refused stage still answers its requests"
        );
        // Activation flushes its counters every second.
        assert_eq!(roots.shortest_tick(), Some(Duration::from_secs(1)));
        assert!(roots.due(5_000), "never ticked: due");
        roots.tick(&mut host, 5_000, false);
        assert!(!roots.due(5_999));
        assert!(roots.due(6_000));
    }

    #[test]
    fn a_chain_without_ticks_is_never_due() {
        let roots = StageRoots::<FakeHost, FakeHost>::default();
        assert_eq!(roots.shortest_tick(), None);
        assert!(!roots.due(u64::MAX));
    }
}
