//! [`ChainStream`]: one request through the native chain, hook by hook:
//! the stages through the [`Pipeline`], the roots' ticks due meanwhile, and
//! what the hook carries out once the stages returned ([`Outcome`]).

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::time::Duration;

use zerolayer_fused::Pipeline;
use zerolayer_host::{Action, Body, CalloutAnswer, Headers, Host, LocalResponse, StageHost, Wake};

use crate::chain::{Slot, Worker};
use crate::envoy::EnvoyStream;
use crate::host::NativeHost;

/// One request through the native chain.
pub struct ChainStream {
    pub(crate) id: u32,
    pub(crate) worker: Rc<RefCell<Worker>>,
    pub(crate) slot: Rc<Slot>,
    pub(crate) pipeline: Pipeline<NativeHost>,
    /// The host the stages share for this stream.
    pub(crate) host: NativeHost,
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

    /// Sends the local response or continues the request through `envoy`,
    /// as the stages asked; returns the hook's verdict. Called once no
    /// reference to the stream is alive (Envoy may re-enter its hooks).
    pub fn finish(self, envoy: &impl EnvoyStream) -> Verdict {
        if let Some(response) = &self.send {
            let headers = response.header_pairs();
            envoy.send_response(response.status, &headers, &response.body);
        } else if self.resume {
            envoy.continue_request();
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
        worker.host.proxy().begin_callback();
        let now = worker.host.now_ms();
        if !flush && !worker.roots.due(now) {
            return;
        }
        worker.roots.tick(&mut worker.host, now, flush);
        worker.host.leave_stream();
        worker.host.proxy().process().report_refused();
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
    fn step(
        &mut self,
        step: impl FnOnce(&mut Pipeline<NativeHost>, &mut NativeHost) -> Action,
    ) -> Outcome {
        self.tick(false);
        self.host.begin_callback();
        let action = step(&mut self.pipeline, &mut self.host);
        self.after_stages(action)
    }

    fn after_stages(&mut self, action: Action) -> Outcome {
        if let Some(response) = self.host.proxy().take_response() {
            self.stop_waiting();
            return Outcome::answer(response);
        }
        if self.host.take_resumed() {
            if self.pipeline.resume(&mut self.host) {
                self.stop_waiting();
                return Outcome::resume();
            }
            if let Some(response) = self.host.proxy().take_response() {
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
            *ticking = self.host.proxy_ref().envoy().start_ticking(self.tick);
        }
    }

    fn stop_waiting(&mut self) {
        if let Some(ticking) = self.slot.ticking.borrow_mut().take() {
            ticking.stop();
        }
    }

    /// The request headers.
    pub fn request_headers(&mut self, end_of_stream: bool) -> Outcome {
        self.step(|p, h| {
            h.read_headers(Headers::Request);
            p.request_headers(h, end_of_stream)
        })
    }

    /// A request body chunk.
    pub fn request_body(&mut self, end_of_stream: bool) -> Outcome {
        self.body(Body::Request, end_of_stream)
    }

    /// The response headers.
    pub fn response_headers(&mut self, end_of_stream: bool) -> Outcome {
        self.step(|p, h| {
            h.read_headers(Headers::Response);
            p.response_headers(h, end_of_stream)
        })
    }

    /// A response body chunk.
    pub fn response_body(&mut self, end_of_stream: bool) -> Outcome {
        self.body(Body::Response, end_of_stream)
    }

    /// A chunk of `body`: the stages see what Envoy buffered for them and
    /// the chunk; once they pause, Envoy keeps this chunk and the next in
    /// its buffer for them.
    fn body(&mut self, body: Body, end_of_stream: bool) -> Outcome {
        let outcome = self.step(|p, h| {
            let size = h.proxy().body_size(body);
            match body {
                Body::Request => p.request_body(h, size, end_of_stream),
                Body::Response => p.response_body(h, size, end_of_stream),
            }
        });
        if outcome.verdict == Verdict::Pause {
            let proxy = self.host.proxy();
            match body {
                Body::Request => proxy.buffering_request = true,
                Body::Response => proxy.buffering_response = true,
            }
        }
        outcome
    }

    /// A callout this stream made has its answer (`status` `None`: it failed).
    pub fn callout_done(&mut self, token: u32, answer: CalloutAnswer) -> Outcome {
        let size = answer.body.len();
        self.host.proxy().set_answer(Some(answer));
        let outcome = self.step(|p, h| {
            p.call_answered(h, token, size);
            Action::Continue
        });
        self.host.proxy().set_answer(None);
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
                    self.host.mark_answered();
                    self.stop_waiting();
                    return Outcome::answer(response);
                }
                Wake::Resume => {
                    self.host.begin_callback();
                    if self.pipeline.resume(&mut self.host) {
                        self.stop_waiting();
                        return Outcome::resume();
                    }
                    if let Some(response) = self.host.proxy().take_response() {
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
        self.host.begin_callback();
        self.pipeline.log(&mut self.host);
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::{Value, json};

    use super::*;
    use crate::chain::ChainConfig;
    use crate::envoy::StreamEnvoy;
    use crate::envoy::recording::RecordingEnvoy;

    fn chain(config: Value) -> Arc<ChainConfig> {
        // SAFETY: a null handle: nothing reaches Envoy's configuration.
        let chain =
            unsafe { ChainConfig::new(std::ptr::null_mut(), config.to_string().as_bytes()) };
        chain.unwrap_or_else(|why| panic!("{why}"))
    }

    fn request() -> RecordingEnvoy {
        RecordingEnvoy::with_request(&[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            (":authority", "gateway"),
            ("x-request-id", "req-1"),
        ])
    }

    #[test]
    fn a_local_response_is_sent_only_once_the_stages_returned() {
        let chain = chain(json!({
            "lazy_auth": {
                "credentials": [{"header": "authorization", "scheme": "Bearer", "kind": "jwt"}],
                "jwt": {
                    "issuers": ["https://idp.test"],
                    "jwks": {"cluster": "idp", "path": "/jwks", "timeout_ms": 500},
                },
                "observer": {"vm_id": "zerolayer", "queue": "zerolayer.jobs", "mode": "singleton"},
            },
            "activation": {"defaults": ["audit"]},
            "native": {"upstreams": {"idp": "127.0.0.1:9"}},
        }));
        let envoy = request();
        let mut stream = chain.stream(StreamEnvoy::Recording(envoy.clone()));
        let outcome = stream.request_headers(false);
        assert!(
            envoy.0.borrow().sent.is_empty(),
            "nothing reaches Envoy while the stages hold the stream"
        );
        assert_eq!(outcome.verdict, Verdict::Answered);
        assert_eq!(outcome.finish(&envoy), Verdict::Answered);
        {
            let recorded = envoy.0.borrow();
            assert_eq!(recorded.sent.len(), 1);
            let sent = &recorded.sent[0];
            assert_eq!(sent.status, 401);
            assert!(
                String::from_utf8_lossy(&sent.body).contains("authentication_error"),
                "{:?}",
                String::from_utf8_lossy(&sent.body)
            );
            assert!(
                sent.headers
                    .iter()
                    .any(|(n, v)| n == "x-request-id" && v == "req-1")
            );
            assert_eq!(recorded.continued, 0);
            assert!(
                !recorded
                    .filter_state
                    .iter()
                    .any(|(k, _)| k.starts_with(b"wasm.wasmx.zerolayer_observers")),
                "activation, after lazy-auth, never saw the refused request"
            );
        }
        // The body that follows a local response is not held.
        assert_eq!(stream.request_body(true).finish(&envoy), Verdict::Continue);
        stream.complete();
        assert_eq!(envoy.0.borrow().sent.len(), 1);
    }

    #[test]
    fn headers_are_read_once_and_hand_offs_become_filter_state() {
        let chain = chain(json!({"activation": {"defaults": ["audit"]}}));
        let envoy = request();
        let mut stream = chain.stream(StreamEnvoy::Recording(envoy.clone()));
        assert_eq!(
            stream.request_headers(true).finish(&envoy),
            Verdict::Continue
        );
        {
            let recorded = envoy.0.borrow();
            assert_eq!(recorded.map_reads, 1, "one read for every stage");
            let observers = recorded
                .filter_state
                .iter()
                .find(|(k, _)| k == b"wasm.wasmx.zerolayer_observers")
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned());
            assert!(
                observers.as_deref().is_some_and(|v| v.contains("audit")),
                "{observers:?}"
            );
            assert!(recorded.sent.is_empty());
        }
        envoy.0.borrow_mut().response_headers = vec![(":status".into(), b"200".to_vec())];
        assert_eq!(
            stream.response_headers(true).finish(&envoy),
            Verdict::Continue
        );
        assert_eq!(envoy.0.borrow().map_reads, 2);
        stream.complete();
    }
}
