//! [`ChainStream`]: one request through the native chain, hook by hook:
//! the stages through the [`Pipeline`], the roots' ticks due meanwhile, and
//! what the hook carries out once the stages returned ([`Outcome`]).

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::time::Duration;

use zerolayer_fused::Pipeline;
use zerolayer_host::{Action, Body, CalloutAnswer, Headers, Host, LocalResponse, StageHost, Wake};

use crate::abi::{self, FilterEnvoy};
use crate::chain::{Slot, Worker};
use crate::host::NativeHost;
use crate::ticker;

/// One request through the native chain.
pub struct ChainStream {
    pub(crate) id: u32,
    pub(crate) filter: FilterEnvoy,
    pub(crate) worker: Rc<RefCell<Worker>>,
    pub(crate) slot: Rc<Slot>,
    pub(crate) pipeline: Pipeline<NativeHost>,
    pub(crate) tick: Duration,
}

/// What a hook returns to Envoy after the stages ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Go on.
    Continue,
    /// Stop (headers) / stop and buffer (body) until resumed.
    Pause,
    /// A local response was sent: stop for good (body: without buffering).
    Answered,
}

/// What a hook carries out once the stream is no longer borrowed: Envoy
/// runs the filter's own response hooks inside `send_response` (and may
/// continue the chain inside `continue_decoding`), so neither is called
/// while a hook still holds the stream.
#[must_use]
pub struct Outcome {
    /// What the hook returns.
    pub verdict: Verdict,
    send: Option<LocalResponse>,
    resume: bool,
}

impl Outcome {
    /// Sends `response` (the stream stops for good).
    fn answer(response: LocalResponse) -> Outcome {
        Outcome {
            verdict: Verdict::Answered,
            send: Some(response),
            resume: false,
        }
    }

    /// Continues the request.
    fn resume() -> Outcome {
        Outcome {
            verdict: Verdict::Continue,
            send: None,
            resume: true,
        }
    }

    fn verdict(verdict: Verdict) -> Outcome {
        Outcome {
            verdict,
            send: None,
            resume: false,
        }
    }

    /// Sends the local response or continues the request, as the stages
    /// asked; returns the hook's verdict.
    ///
    /// # Safety
    /// `filter` must be the handle of the hook being run, and no reference
    /// to the stream may be alive.
    pub unsafe fn finish(self, filter: FilterEnvoy) -> Verdict {
        if let Some(response) = &self.send {
            let headers = response.header_pairs();
            // SAFETY: the caller's contract.
            unsafe { abi::send_response(filter, response.status, &headers, &response.body) };
        } else if self.resume {
            // SAFETY: the caller's contract.
            unsafe { abi::continue_request(filter) };
        }
        self.verdict
    }
}

impl ChainStream {
    /// Runs the roots' ticks that are due; `flush`: at the end of a
    /// stream, every root also hands over what it keeps to report (so
    /// nothing waits for the next request to be reported).
    fn tick(&mut self, flush: bool) {
        let Ok(mut worker) = self.worker.try_borrow_mut() else {
            return;
        };
        let worker = &mut *worker;
        // The roots' clock is read afresh for each tick.
        worker.host.begin_callback();
        let now = worker.host.now_ms();
        if !flush && !worker.roots.due(now) {
            return;
        }
        worker.roots.tick(&mut worker.host, now, flush);
        worker.host.leave_stream();
        worker.host.proxy_ref().process().report_refused();
        for (id, woken) in worker.host.take_woken() {
            let Some(slot) = worker.streams.get(&id).and_then(Weak::upgrade) else {
                continue;
            };
            slot.woken.borrow_mut().push(woken);
            if let Some(ticking) = slot.ticking.borrow().as_ref() {
                ticking.wake();
            }
        }
    }

    /// Runs `step` on the pipeline, then says what the stages asked for
    /// meanwhile: a local response, a resume.
    fn step(&mut self, step: impl FnOnce(&mut Pipeline<NativeHost>) -> Action) -> Outcome {
        self.tick(false);
        self.pipeline.host.begin_callback();
        let action = step(&mut self.pipeline);
        self.after_stages(action)
    }

    fn after_stages(&mut self, action: Action) -> Outcome {
        if let Some(response) = self.pipeline.host.proxy().take_response() {
            self.stop_waiting();
            return Outcome::answer(response);
        }
        if self.pipeline.host.take_resumed() {
            if self.pipeline.resume() {
                self.stop_waiting();
                return Outcome::resume();
            }
            if let Some(response) = self.pipeline.host.proxy().take_response() {
                self.stop_waiting();
                return Outcome::answer(response);
            }
        }
        match action {
            Action::Pause => {
                self.wait();
                Outcome::verdict(Verdict::Pause)
            }
            _ => Outcome::verdict(Verdict::Continue),
        }
    }

    /// The stream waits (a callout, a cached answer): its scheduled events
    /// carry the roots' ticks and wakes to it meanwhile.
    fn wait(&mut self) {
        let mut ticking = self.slot.ticking.borrow_mut();
        if ticking.is_none() {
            // SAFETY: this stream's handle, inside its hook.
            *ticking = unsafe { ticker::start(self.filter, self.tick) };
        }
    }

    fn stop_waiting(&mut self) {
        if let Some(ticking) = self.slot.ticking.borrow_mut().take() {
            ticking.stop();
        }
    }

    /// The request headers.
    pub fn request_headers(&mut self, end_of_stream: bool) -> Outcome {
        self.step(|p| {
            p.host.read_headers(Headers::Request);
            p.request_headers(end_of_stream)
        })
    }

    /// A request body chunk.
    pub fn request_body(&mut self, end_of_stream: bool) -> Outcome {
        let outcome = self.step(|p| {
            let size = p.host.proxy().body_size(Body::Request);
            p.request_body(size, end_of_stream)
        });
        if outcome.verdict == Verdict::Pause {
            // Envoy keeps this chunk and the next in its buffer for us.
            self.pipeline.host.proxy().buffering_request = true;
        }
        outcome
    }

    /// The response headers.
    pub fn response_headers(&mut self, end_of_stream: bool) -> Outcome {
        self.step(|p| {
            p.host.read_headers(Headers::Response);
            p.response_headers(end_of_stream)
        })
    }

    /// A response body chunk.
    pub fn response_body(&mut self, end_of_stream: bool) -> Outcome {
        let outcome = self.step(|p| {
            let size = p.host.proxy().body_size(Body::Response);
            p.response_body(size, end_of_stream)
        });
        if outcome.verdict == Verdict::Pause {
            self.pipeline.host.proxy().buffering_response = true;
        }
        outcome
    }

    /// A callout this stream made has its answer (`status` `None`: it failed).
    pub fn callout_done(&mut self, token: u32, answer: CalloutAnswer) -> Outcome {
        let size = answer.body.len();
        self.pipeline.host.proxy().set_answer(Some(answer));
        let outcome = self.step(|p| {
            p.call_answered(token, size);
            Action::Continue
        });
        self.pipeline.host.proxy().set_answer(None);
        Outcome {
            // Nothing to return from this hook; a pause stays a pause.
            verdict: Verdict::Continue,
            ..outcome
        }
    }

    /// A scheduled event: the roots' tick, and what they did to this stream.
    pub fn scheduled(&mut self) -> Outcome {
        self.tick(false);
        let woken: Vec<Wake> = std::mem::take(&mut *self.slot.woken.borrow_mut());
        for woken in woken {
            match woken {
                Wake::Answer(response) => {
                    self.pipeline.host.mark_answered();
                    self.stop_waiting();
                    return Outcome::answer(response);
                }
                Wake::Resume => {
                    self.pipeline.host.begin_callback();
                    if self.pipeline.resume() {
                        self.stop_waiting();
                        return Outcome::resume();
                    }
                    if let Some(response) = self.pipeline.host.proxy().take_response() {
                        self.stop_waiting();
                        return Outcome::answer(response);
                    }
                }
            }
        }
        Outcome::verdict(Verdict::Continue)
    }

    /// The request is over: the stages' log step, then the roots hand over
    /// what they keep to report.
    pub fn complete(&mut self) {
        self.pipeline.host.begin_callback();
        self.pipeline.log();
        self.tick(true);
    }
}

impl Drop for ChainStream {
    fn drop(&mut self) {
        self.stop_waiting();
        if let Ok(mut worker) = self.worker.try_borrow_mut() {
            worker.streams.remove(&self.id);
        }
    }
}
