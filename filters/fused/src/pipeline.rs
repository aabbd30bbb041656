//! One request through the stages, as Envoy would take it through the same
//! stages configured as separate filters: request callbacks in order,
//! response callbacks in reverse, a stage that pauses stops the stages after
//! it until it resumes, and a local response goes back only through the
//! stages that saw the request. A stage that said it is done with a body
//! callback (`StreamHost::done_with`) is no longer called for it: it would return
//! `Continue` and touch nothing.

use zerolayer_host::timing::Span;
use zerolayer_host::{Action, Body, Callback, DoneWith, StageHost, StreamStage};

/// One stage's part of the request.
pub struct StageStream<H> {
    /// The stage's own stream.
    pub stream: Box<dyn StreamStage<H>>,
    /// Whether a pause on request headers also withholds the body, as
    /// Envoy's default for a Wasm filter does; stages configured with
    /// `allow_on_headers_stop_iteration` get the body while paused.
    pub headers_pause_withholds_body: bool,
    /// The callbacks the stage said it is done with for this request.
    pub done: DoneWith,
    /// The stage's timing labels, by [`Column`] (`timing` builds).
    pub labels: &'static [&'static str; 6],
}

/// A callback's place in a stage's timing labels.
#[derive(Clone, Copy)]
pub enum Column {
    /// `on_http_request_headers`.
    RequestHeaders,
    /// `on_http_request_body`.
    RequestBody,
    /// `on_http_response_headers`.
    ResponseHeaders,
    /// `on_http_response_body`.
    ResponseBody,
    /// `on_log`.
    Log,
    /// `on_http_call_response`.
    CallResponse,
}

impl<H: StageHost> StageStream<H> {
    /// The stage's part of a request, every callback wanted so far.
    pub fn new(
        stream: Box<dyn StreamStage<H>>,
        headers_pause_withholds_body: bool,
        labels: &'static [&'static str; 6],
    ) -> StageStream<H> {
        StageStream {
            stream,
            headers_pause_withholds_body,
            done: DoneWith::default(),
            labels,
        }
    }

    /// Runs `f` on the stage's stream, noting what it says it is done with.
    fn call<T>(
        &mut self,
        host: &mut H,
        column: Column,
        f: impl FnOnce(&mut dyn StreamStage<H>, &mut H) -> T,
    ) -> T {
        let span = Span::start();
        // Said outside this stage's callback: nobody's.
        host.take_done();
        let result = f(self.stream.as_mut(), host);
        self.done.add(host.take_done());
        span.end(self.labels[column as usize]);
        result
    }

    /// The request body callback, unless the stage is done with it.
    fn request_body(&mut self, host: &mut H, size: usize, end_of_stream: bool) -> Action {
        if self.done.contains(Callback::RequestBody) {
            return Action::Continue;
        }
        self.call(host, Column::RequestBody, |s, h| {
            s.request_body(h, size, end_of_stream)
        })
    }

    /// The response body callback, unless the stage is done with it.
    fn response_body(&mut self, host: &mut H, size: usize, end_of_stream: bool) -> Action {
        if self.done.contains(Callback::ResponseBody) {
            return Action::Continue;
        }
        self.call(host, Column::ResponseBody, |s, h| {
            s.response_body(h, size, end_of_stream)
        })
    }
}

/// Where request iteration stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// Stage `i` paused on the request headers.
    Headers(usize),
    /// Stage `i` paused on the request body.
    Body(usize),
}

/// The request's progress through the stages.
pub struct Pipeline<H> {
    stages: Vec<StageStream<H>>,
    /// How many stages got the request headers (and so the response).
    decoded: usize,
    stopped: Option<Stop>,
    /// The request headers callback's `end_of_stream`.
    headers_end: bool,
    /// The latest request body callback's arguments, once the body came.
    body: Option<(usize, bool)>,
}

impl<H: StageHost> Pipeline<H> {
    /// A request about to enter `stages`; every call takes the host they
    /// share for this stream, as a stage's callbacks do.
    pub fn new(stages: Vec<StageStream<H>>) -> Pipeline<H> {
        Pipeline {
            stages,
            decoded: 0,
            stopped: None,
            headers_end: false,
            body: None,
        }
    }

    /// Request headers: every stage in turn until one pauses.
    pub fn request_headers(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        self.headers_end = end_of_stream;
        self.run(host, 0)
    }

    /// Request body: the stages that may see it, then onwards.
    pub fn request_body(&mut self, host: &mut H, body_size: usize, end_of_stream: bool) -> Action {
        if host.answered() {
            // A stage answered already (ngx_wasm_module still hands over
            // the body): holding it would hang the answer.
            return Action::Continue;
        }
        self.body = Some((body_size, end_of_stream));
        if let Some(Stop::Headers(i)) = self.stopped
            && self.stages[i].headers_pause_withholds_body
        {
            // Envoy buffers the body until that stage resumes.
            return Action::Pause;
        }
        self.run(host, 0)
    }

    /// A stage resumed the request: the stages after it run, and whether
    /// the request may now continue to the upstream is returned.
    pub fn resume(&mut self, host: &mut H) -> bool {
        let Some(stop) = self.stopped.take() else {
            return false;
        };
        let next = match stop {
            Stop::Headers(i) => {
                // Withheld until now: the body reaches the resumed stage.
                if self.stages[i].headers_pause_withholds_body
                    && let Some((size, eos)) = self.body
                    && self.stages[i].request_body(host, size, eos) == Action::Pause
                {
                    self.stopped = Some(Stop::Body(i));
                    return false;
                }
                i + 1
            }
            Stop::Body(i) => i + 1,
        };
        self.run(host, next) == Action::Continue
    }

    /// Runs the request callbacks from stage `start` on.
    fn run(&mut self, host: &mut H, start: usize) -> Action {
        for i in start..self.stages.len() {
            let stage = &mut self.stages[i];
            if self.decoded <= i {
                self.decoded = i + 1;
                let eos = self.headers_end;
                if stage.call(host, Column::RequestHeaders, |s, h| {
                    s.request_headers(h, eos)
                }) == Action::Pause
                {
                    self.stopped = Some(Stop::Headers(i));
                    // Paused with the body to come (or withheld): wait.
                    // Otherwise the stage gets the body it paused for.
                    if stage.headers_pause_withholds_body || self.body.is_none() {
                        return Action::Pause;
                    }
                }
            }
            if let Some((size, eos)) = self.body {
                if stage.request_body(host, size, eos) == Action::Pause {
                    self.stopped = Some(Stop::Body(i));
                    if i + 1 < self.stages.len() {
                        let held = host.body_size_after(Body::Request, size);
                        host.hold_request_body(held);
                    }
                    return Action::Pause;
                }
                self.body = Some((host.body_size_after(Body::Request, size), eos));
            }
        }
        self.stopped = None;
        Action::Continue
    }

    /// Response headers: back through the stages that saw the request.
    pub fn response_headers(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        for i in (0..self.decoded).rev() {
            let stage = &mut self.stages[i];
            if stage.call(host, Column::ResponseHeaders, |s, h| {
                s.response_headers(h, end_of_stream)
            }) == Action::Pause
            {
                return Action::Pause;
            }
        }
        Action::Continue
    }

    /// Response body: back through the stages that saw the request.
    pub fn response_body(&mut self, host: &mut H, body_size: usize, end_of_stream: bool) -> Action {
        let mut size = body_size;
        for i in (0..self.decoded).rev() {
            if self.stages[i].response_body(host, size, end_of_stream) == Action::Pause {
                return Action::Pause;
            }
            // What a stage put in the chunk's place is what the next reads
            // (metering releasing held bytes in an empty last chunk, say).
            size = host.body_size_after(Body::Response, size);
        }
        host.note_response_passed(size, end_of_stream);
        Action::Continue
    }

    /// A callout's answer: each stage checks whether the token is its own.
    pub fn call_answered(&mut self, host: &mut H, token: u32, body_size: usize) {
        for stage in &mut self.stages {
            stage.call(host, Column::CallResponse, |s, h| {
                s.call_answered(h, token, body_size)
            });
        }
    }

    /// The access log: every stage, as Envoy logs every filter.
    pub fn log(&mut self, host: &mut H) {
        for stage in &mut self.stages {
            stage.call(host, Column::Log, |s, h| s.log(h));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::rc::Rc;

    use zerolayer_host::{FakeHost, Respond, StreamHost};

    use super::*;

    const LABELS: &[&str; 6] = &["rh", "rb", "sh", "sb", "log", "call"];

    type Log = Rc<RefCell<Vec<String>>>;

    /// A stage that records its callbacks and does what it is told.
    #[derive(Default)]
    struct Scripted {
        name: &'static str,
        log: Log,
        pause_headers: bool,
        pause_body: bool,
        answer: bool,
        done_with_response_body: bool,
    }

    impl Scripted {
        fn note(&self, what: &str) {
            self.log.borrow_mut().push(format!("{}.{what}", self.name));
        }
    }

    impl StreamStage<FakeHost> for Scripted {
        fn request_headers(&mut self, host: &mut FakeHost, _end_of_stream: bool) -> Action {
            self.note("request_headers");
            if self.done_with_response_body {
                host.done_with(Callback::ResponseBody);
            }
            if self.answer {
                let _ = host.send_response(403, &[], b"refused");
                return Action::Pause;
            }
            if self.pause_headers {
                Action::Pause
            } else {
                Action::Continue
            }
        }

        fn request_body(&mut self, _host: &mut FakeHost, _size: usize, _eos: bool) -> Action {
            self.note("request_body");
            if std::mem::take(&mut self.pause_body) {
                Action::Pause
            } else {
                Action::Continue
            }
        }

        fn response_headers(&mut self, _host: &mut FakeHost, _end_of_stream: bool) -> Action {
            self.note("response_headers");
            Action::Continue
        }

        fn response_body(&mut self, _host: &mut FakeHost, _size: usize, _eos: bool) -> Action {
            self.note("response_body");
            Action::Continue
        }

        fn log(&mut self, _host: &mut FakeHost) {
            self.note("log");
        }
    }

    /// Stages a, b, c; `set_up(i, stage)` adjusts each; `withholds[i]`:
    /// whether a pause on stage i's headers withholds the body.
    fn pipeline(
        withholds: [bool; 3],
        set_up: impl Fn(usize, &mut Scripted),
    ) -> (Pipeline<FakeHost>, FakeHost, Log) {
        let log = Log::default();
        let stages = ["a", "b", "c"]
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let mut stage = Scripted {
                    name,
                    log: log.clone(),
                    ..Scripted::default()
                };
                set_up(i, &mut stage);
                StageStream::new(Box::new(stage), withholds[i], LABELS)
            })
            .collect();
        (Pipeline::new(stages), FakeHost::default(), log)
    }

    fn taken(log: &Log) -> Vec<String> {
        std::mem::take(&mut *log.borrow_mut())
    }

    #[test]
    fn requests_go_through_the_stages_in_order_and_responses_in_reverse() {
        let (mut p, mut h, log) = pipeline([false; 3], |_, _| {});
        assert_eq!(p.request_headers(&mut h, false), Action::Continue);
        assert_eq!(p.request_body(&mut h, 10, true), Action::Continue);
        assert_eq!(p.response_headers(&mut h, false), Action::Continue);
        assert_eq!(p.response_body(&mut h, 5, true), Action::Continue);
        p.log(&mut h);
        assert_eq!(
            taken(&log),
            [
                "a.request_headers",
                "b.request_headers",
                "c.request_headers",
                "a.request_body",
                "b.request_body",
                "c.request_body",
                "c.response_headers",
                "b.response_headers",
                "a.response_headers",
                "c.response_body",
                "b.response_body",
                "a.response_body",
                "a.log",
                "b.log",
                "c.log",
            ]
        );
    }

    #[test]
    fn a_pause_on_headers_holds_the_stages_after_it_and_the_body_until_resumed() {
        let (mut p, mut h, log) = pipeline([true; 3], |i, s| s.pause_headers = i == 1);
        assert_eq!(p.request_headers(&mut h, false), Action::Pause);
        assert_eq!(taken(&log), ["a.request_headers", "b.request_headers"]);
        // Withheld, as Envoy withholds it from a paused Wasm filter.
        assert_eq!(p.request_body(&mut h, 10, true), Action::Pause);
        assert!(taken(&log).is_empty());
        assert!(p.resume(&mut h), "the request may go on");
        assert_eq!(
            taken(&log),
            ["b.request_body", "c.request_headers", "c.request_body"]
        );
        assert!(!p.resume(&mut h), "nothing left to resume");
    }

    #[test]
    fn a_stage_allowed_the_body_while_paused_gets_it() {
        let (mut p, mut h, log) = pipeline([false; 3], |i, s| s.pause_headers = i == 1);
        assert_eq!(p.request_headers(&mut h, false), Action::Pause);
        assert_eq!(taken(&log), ["a.request_headers", "b.request_headers"]);
        assert_eq!(p.request_body(&mut h, 10, true), Action::Continue);
        assert_eq!(
            taken(&log),
            [
                "a.request_body",
                "b.request_body",
                "c.request_headers",
                "c.request_body"
            ]
        );
    }

    #[test]
    fn a_pause_on_the_body_holds_the_stages_after_it_until_resumed() {
        let (mut p, mut h, log) = pipeline([false; 3], |i, s| s.pause_body = i == 1);
        assert_eq!(p.request_headers(&mut h, false), Action::Continue);
        assert_eq!(p.request_body(&mut h, 10, true), Action::Pause);
        assert_eq!(
            taken(&log)[3..],
            ["a.request_body", "b.request_body"],
            "c waits for b"
        );
        assert!(p.resume(&mut h));
        assert_eq!(taken(&log), ["c.request_body"]);
    }

    #[test]
    fn an_answered_request_gets_no_body_callbacks() {
        let (mut p, mut h, log) = pipeline([true; 3], |i, s| s.answer = i == 0);
        assert_eq!(p.request_headers(&mut h, false), Action::Pause);
        assert_eq!(h.sent.len(), 1);
        // ngx_wasm_module still hands over the body: it must not hang the answer.
        assert_eq!(p.request_body(&mut h, 10, true), Action::Continue);
        assert_eq!(taken(&log), ["a.request_headers"]);
    }

    #[test]
    fn the_response_goes_back_only_through_the_stages_that_saw_the_request() {
        let (mut p, mut h, log) = pipeline([true; 3], |i, s| s.pause_headers = i == 1);
        assert_eq!(p.request_headers(&mut h, true), Action::Pause);
        taken(&log);
        assert_eq!(p.response_headers(&mut h, false), Action::Continue);
        assert_eq!(taken(&log), ["b.response_headers", "a.response_headers"]);
    }

    #[test]
    fn a_stage_done_with_response_bodies_is_not_called_for_them() {
        let (mut p, mut h, log) = pipeline([false; 3], |i, s| s.done_with_response_body = i == 1);
        assert_eq!(p.request_headers(&mut h, true), Action::Continue);
        taken(&log);
        for _ in 0..3 {
            assert_eq!(p.response_body(&mut h, 5, false), Action::Continue);
        }
        assert_eq!(
            taken(&log),
            ["c.response_body", "a.response_body"].repeat(3),
            "b said it is done with response bodies"
        );
    }
}
