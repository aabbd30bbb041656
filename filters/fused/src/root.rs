//! [`FusedRoot`]: the fused Proxy-Wasm filter (`zerolayer_fused.wasm`),
//! the stages' roots and their streams through the [`Pipeline`] on
//! [`FusedHost`] (feature `wasm`).

use std::cell::RefCell;
use std::rc::{Rc, Weak};

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType};
use zerolayer_host::timing::{self, Span};
use zerolayer_host::{
    FusedHost, FusedRoots, Headers, Host, Respond, RootHost, StageHost, StreamMap, Wake, WasmHost,
};

use crate::{Pipeline, StageRoots, sections};

/// Streams by context id, so that a stage resuming one from its root (a
/// post-cache follower) reaches the stages after it.
type Streams = Rc<RefCell<StreamMap<Weak<RefCell<StreamChain>>>>>;

/// One request's progress through the stages and the host they share.
struct StreamChain {
    pipeline: Pipeline<FusedHost>,
    host: FusedHost,
}

/// The fused filter's root context: the stages' roots.
pub struct FusedRoot {
    roots: StageRoots<WasmHost, WasmHost>,
    streams: Streams,
    /// The host the stages' roots see.
    host: FusedRoots,
}

impl Default for FusedRoot {
    fn default() -> Self {
        FusedRoot {
            roots: StageRoots::default(),
            streams: Streams::default(),
            host: FusedRoots::new(WasmHost),
        }
    }
}

impl FusedRoot {
    /// Carries on the streams the stages' roots resumed or answered.
    fn wake_streams(&mut self) {
        self.host.leave_stream();
        for (id, wake) in self.host.take_woken() {
            let pipeline = self.streams.borrow().get(&id).and_then(Weak::upgrade);
            let Some(pipeline) = pipeline else {
                continue;
            };
            // The host calls below act on that stream.
            if WasmHost.set_effective_context(id).is_err() {
                continue;
            }
            match wake {
                Wake::Answer(response) => {
                    let headers = response.header_pairs();
                    if let Err(status) =
                        WasmHost.send_local_response(response.status, &headers, &response.body)
                    {
                        log::error!("zerolayer: could not answer a waiting request: {status:?}");
                    }
                    pipeline.borrow_mut().host.mark_answered();
                }
                Wake::Resume => resume(&pipeline),
            }
        }
    }
}

/// A stage resumed the current stream: the stages after it run, then the
/// stream continues if none of them paused it again.
fn resume(chain: &RefCell<StreamChain>) {
    let go = {
        let mut chain = chain.borrow_mut();
        let chain = &mut *chain;
        chain.host.refresh_clock();
        chain.pipeline.resume(&mut chain.host)
    };
    if go {
        WasmHost.continue_request();
    }
}

impl Context for FusedRoot {
    fn on_http_call_response(&mut self, token: u32, _: usize, body_size: usize, _: usize) {
        self.roots.call_answered(&mut self.host, token, body_size);
        self.wake_streams();
    }

    fn on_done(&mut self) -> bool {
        self.roots.done(&mut self.host);
        true
    }
}

impl RootContext for FusedRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = WasmHost.plugin_configuration();
        let sections = match sections(&config) {
            Ok(sections) => sections,
            Err(err) => {
                log::error!("zerolayer: invalid configuration: {err}");
                return false;
            }
        };
        let mut roots = StageRoots::default();
        for (stage, section) in sections {
            // The stage logs its own error, naming the field.
            if !roots.add(stage, section, &mut self.host) {
                log::error!(
                    "zerolayer: invalid configuration: {}: refused (see the line above)",
                    stage.section()
                );
                return false;
            }
        }
        log::info!(
            "zerolayer: fused filter with stages {}",
            roots.names().join(" → ")
        );
        if let Some(tick) = roots.shortest_tick()
            && let Err(status) = WasmHost.set_tick_period(tick)
        {
            log::warn!("zerolayer: no tick ({status:?}); counters flush at shutdown only");
        }
        self.roots = roots;
        true
    }

    fn on_tick(&mut self) {
        let now = self.host.now_ms();
        self.roots.tick(&mut self.host, now, false);
        self.wake_streams();
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        let span = Span::start();
        let stages = self.roots.streams(context_id);
        let pipeline = Rc::new(RefCell::new(StreamChain {
            pipeline: Pipeline::new(stages),
            host: FusedHost::stream(WasmHost),
        }));
        self.streams
            .borrow_mut()
            .insert(context_id, Rc::downgrade(&pipeline));
        span.end("fused.create");
        Some(Box::new(FusedStream {
            id: context_id,
            pipeline,
            streams: self.streams.clone(),
        }))
    }
}

/// One request through the stages.
struct FusedStream {
    id: u32,
    pipeline: Rc<RefCell<StreamChain>>,
    streams: Streams,
}

impl FusedStream {
    /// Runs `step` on the pipeline as this stream, then continues the
    /// stream if a stage resumed it meanwhile (a callout answered).
    fn step<T>(
        &mut self,
        label: &'static str,
        step: impl FnOnce(&mut Pipeline<FusedHost>, &mut FusedHost) -> T,
    ) -> T {
        let span = Span::start();
        let mut chain = self.pipeline.borrow_mut();
        let parts = &mut *chain;
        // Bodies are read per callback: the next one may carry a new chunk.
        parts.host.begin_callback();
        let result = step(&mut parts.pipeline, &mut parts.host);
        let resumed = parts.host.take_resumed();
        drop(chain);
        if resumed {
            resume(&self.pipeline);
        }
        span.end(label);
        result
    }
}

impl Drop for FusedStream {
    fn drop(&mut self) {
        let span = Span::start();
        self.streams.borrow_mut().remove(&self.id);
        span.end("fused.drop");
        timing::stream_ended();
    }
}

impl Context for FusedStream {
    fn on_http_call_response(&mut self, token: u32, _: usize, body_size: usize, _: usize) {
        self.step("fused.call_response", |p, h| {
            p.call_answered(h, token, body_size)
        });
    }
}

impl HttpContext for FusedStream {
    fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        self.step("fused.request_headers", |p, h| {
            // One read of the headers for every stage (they ask for ~a dozen).
            let span = Span::start();
            h.read_headers(Headers::Request);
            span.end("fused.read_request_headers");
            p.request_headers(h, end_of_stream)
        })
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.step("fused.request_body", |p, h| {
            p.request_body(h, body_size, end_of_stream)
        })
    }

    fn on_http_response_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
        self.step("fused.response_headers", |p, h| {
            let span = Span::start();
            h.read_headers(Headers::Response);
            span.end("fused.read_response_headers");
            p.response_headers(h, end_of_stream)
        })
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.step("fused.response_body", |p, h| {
            p.response_body(h, body_size, end_of_stream)
        })
    }

    fn on_log(&mut self) {
        self.step("fused.log", |p, h| p.log(h));
    }
}
