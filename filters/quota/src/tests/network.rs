//! The stage's own store calls over the network hosts have, by proptest:
//! many requests at once, the root's tick and the waiting requests' copies
//! of its calls (`Plan::send_due`'s in-flight set between them), answers
//! out of order, lost, or applied after the host reported a timeout, and
//! waiting requests whose client went away. Whatever happens, once the
//! network drains and idle leases are returned, the store's counter is
//! exactly what the admitted requests used.

use proptest::prelude::*;

use super::*;

/// Who sent a call, so its answer reaches the context that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    Root,
    Request(usize),
}

#[derive(Debug, Clone, Copy)]
enum Fate {
    Answered,
    AnswerLost,
    AppliedAfterTimeout,
    Lost,
}

#[derive(Debug, Clone)]
enum Step {
    /// A new request (prompt, completion tokens it will use).
    Open(u64, u64),
    /// A running request's response and log.
    Finish(usize),
    /// The root's tick.
    Tick,
    /// One call on the wire delivered with its fate.
    Deliver(usize, Fate),
    /// A copy that reached the store after its timeout lands.
    ApplyLate(usize),
    /// A waiting request's client goes away (its callouts are cancelled;
    /// `reached`: the store had them).
    GiveUp(usize, bool),
    Wait(u64),
}

fn fate() -> impl Strategy<Value = Fate> {
    prop_oneof![
        5 => Just(Fate::Answered),
        1 => Just(Fate::AnswerLost),
        2 => Just(Fate::AppliedAfterTimeout),
        1 => Just(Fate::Lost),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u64..50, 0u64..=100).prop_map(|(p, c)| Step::Open(p, c)),
        3 => any::<usize>().prop_map(Step::Finish),
        2 => Just(Step::Tick),
        6 => (any::<usize>(), fate()).prop_map(|(i, f)| Step::Deliver(i, f)),
        1 => any::<usize>().prop_map(Step::ApplyLate),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(i, r)| Step::GiveUp(i, r)),
        2 => (1u64..400).prop_map(Step::Wait),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    Admitted,
}

struct Request {
    stream: Stream,
    state: State,
    usage: (u64, u64),
}

struct World {
    gw: Gateway,
    requests: Vec<Option<Request>>,
    /// Calls on the wire: owner, token, the webdis path.
    wire: Vec<(Owner, u32, String)>,
    late: Vec<String>,
    used: i64,
}

impl World {
    fn now(&self) -> u64 {
        self.gw.host.clock.as_millis() as u64
    }

    /// Takes what `owner` just dispatched onto the wire.
    fn dispatched_by(&mut self, owner: Owner) {
        for call in std::mem::take(&mut self.gw.host.dispatched) {
            let path = call.header(":path").expect("a path");
            let path = path.strip_prefix('/').expect("under /").to_string();
            self.wire.push((owner, call.token, path));
        }
    }

    /// Notes what a request's callback did: resumed it, answered it (a 429), or neither (still waiting).
    fn note_outcome(&mut self, at: usize, resumes_before: usize) {
        let resumed = self.gw.host.resumes.len() > resumes_before;
        let refused = !self.gw.host.sent.is_empty();
        if refused {
            self.requests[at] = None;
        } else if resumed && let Some(r) = self.requests[at].as_mut() {
            r.state = State::Admitted;
        }
    }

    fn open(&mut self, prompt: u64, completion: u64) {
        let (stream, action) = self.gw.ask(OPENAI, ACME, CHAT);
        let at = self.requests.len();
        let state = if !self.gw.host.sent.is_empty() {
            None
        } else if action == Action::Continue {
            Some(State::Admitted)
        } else {
            Some(State::Waiting)
        };
        self.requests.push(state.map(|state| Request {
            stream,
            state,
            usage: (prompt, completion),
        }));
        self.dispatched_by(Owner::Request(at));
    }

    /// The `index`th (modulo their number) of the requests in `state`.
    fn pick(&self, state: State, index: usize) -> Option<usize> {
        let of_state = |i: &usize| matches!(&self.requests[*i], Some(r) if r.state == state);
        let count = (0..self.requests.len()).filter(of_state).count();
        (0..self.requests.len())
            .filter(of_state)
            .nth(index.checked_rem(count)?)
    }

    fn finish(&mut self, index: usize) {
        let Some(at) = self.pick(State::Admitted, index) else {
            return;
        };
        let mut r = self.requests[at].take().expect("admitted");
        let (prompt, completion) = r.usage;
        self.gw.answer(
            &mut r.stream,
            json!({"prompt_tokens": prompt, "completion_tokens": completion}),
        );
        self.used += (prompt + completion) as i64;
    }

    fn tick(&mut self) {
        RootStage::<FakeHost>::tick(&mut self.gw.root, &mut self.gw.host);
        self.dispatched_by(Owner::Root);
    }

    fn deliver(&mut self, index: usize, fate: Fate) {
        if self.wire.is_empty() {
            return;
        }
        let (owner, token, path) = self.wire.remove(index % self.wire.len());
        let now = self.now();
        match fate {
            Fate::Answered => {
                let body = self.gw.store.answer_webdis(path.as_bytes(), now);
                self.gw.host.answer_with(Some(200), &body);
            }
            Fate::AnswerLost => {
                self.gw.store.answer_webdis(path.as_bytes(), now);
                self.gw.host.answer_with(None, b"");
            }
            Fate::AppliedAfterTimeout => {
                self.late.push(path);
                self.gw.host.answer_with(None, b"");
            }
            Fate::Lost => self.gw.host.answer_with(None, b""),
        }
        let size = self.gw.host.answer.body.len();
        match owner {
            Owner::Root => RootStage::<FakeHost>::call_answered(
                &mut self.gw.root,
                &mut self.gw.host,
                token,
                size,
            ),
            Owner::Request(at) => {
                let Some(r) = self.requests[at].as_mut() else {
                    return;
                };
                self.gw.host.sent.clear();
                let resumes = self.gw.host.resumes.len();
                r.stream.call_answered(&mut self.gw.host, token, size);
                self.note_outcome(at, resumes);
                self.dispatched_by(Owner::Request(at));
            }
        }
    }

    fn apply_late(&mut self, index: usize) {
        if self.late.is_empty() {
            return;
        }
        let path = self.late.remove(index % self.late.len());
        let now = self.now();
        self.gw.store.answer_webdis(path.as_bytes(), now);
    }

    fn give_up(&mut self, index: usize, reached: bool) {
        let Some(at) = self.pick(State::Waiting, index) else {
            return;
        };
        // The host cancels its callouts: no answer will come.
        let (theirs, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.wire)
            .into_iter()
            .partition(|(owner, _, _)| *owner == Owner::Request(at));
        self.wire = rest;
        if reached {
            self.late
                .extend(theirs.into_iter().map(|(_, _, path)| path));
        }
        drop(self.requests[at].take());
    }

    /// Everything on the wire answered (and what it sets off), every
    /// admitted request finished, every late copy landed.
    fn drain(&mut self) {
        // An answer may resume a request that then asks again: all on the wire.
        while !self.wire.is_empty() {
            self.deliver(0, Fate::Answered);
        }
        while !self.late.is_empty() {
            self.apply_late(0);
        }
        while self.pick(State::Admitted, 0).is_some() {
            self.finish(0);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_counter_ends_at_what_was_used_whatever_the_network_does(
        steps in proptest::collection::vec(step(), 1..300),
    ) {
        // Small leases (1 % of 20,000): requests wait for grants, leases
        // are refilled and give surplus back all along.
        let mut config = daily(20_000);
        config["store"]["lease"] = json!({"max_percent": 1});
        let mut gw = Gateway::new(&config);
        gw.answer_store();
        let mut world = World { gw, requests: Vec::new(), wire: Vec::new(), late: Vec::new(), used: 0 };
        for s in steps {
            match s {
                Step::Open(p, c) => world.open(p, c),
                Step::Finish(i) => world.finish(i),
                Step::Tick => world.tick(),
                Step::Deliver(i, f) => world.deliver(i, f),
                Step::ApplyLate(i) => world.apply_late(i),
                Step::GiveUp(i, reached) => world.give_up(i, reached),
                Step::Wait(ms) => world.gw.host.advance(Duration::from_millis(ms)),
            }
        }
        world.drain();
        // Whoever still waits (its calls answered, nothing resumed it) gives up.
        for at in 0..world.requests.len() {
            world.requests[at] = None;
        }
        for _ in 0..4 {
            world.tick();
            world.drain();
        }
        world.gw.host.advance(Duration::from_millis(61_000));
        for _ in 0..4 {
            world.tick();
            world.drain();
        }
        prop_assert_eq!(world.gw.counter("daily"), world.used, "no drift");
    }
}
