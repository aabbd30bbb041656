//! One request through quota: an LLM call and who makes it (request
//! headers), its bound and reservation or its 429 (request body), the
//! rate-limit headers (response headers), its usage as it passes (response
//! body), and its settlement (log).

use std::rc::Rc;

use sha2::{Digest, Sha256};
use zerolayer_core::auth::attribution::PendingCredential;
use zerolayer_core::cache::key::Provider;
use zerolayer_core::encoding::{BodyDecoder, ContentCoding, DecodeError, MAX_DECODED_BYTES};
use zerolayer_core::internal;
use zerolayer_core::metering::logged_usage;
use zerolayer_core::quota::cut::encode_billed;
use zerolayer_core::quota::headers::{refusal_reply, write_rate_limit_headers};
use zerolayer_core::quota::reserve::{with_output_cap, with_output_cap_at};
use zerolayer_core::quota::{
    Identity, LateScope, Refusal, RefusalKind, RequestBound, Settlement, StoreCall, StreamCut,
    StreamVerdict, Ticket, TokenCounts,
};
use zerolayer_core::usage::{
    Missing, RequestScan, ResponseFormat, StreamedInjection, Usage, UsageExtractor,
};
use zerolayer_host::{Action, Body, Callback, Headers, StreamHost, StreamStage};

use crate::{MAX_HELD_BODY, Plan};

/// What replaces a withheld chunk after a cut where a host cannot send an
/// empty one: an SSE comment line, which event parsers skip.
const WITHHELD_CHUNK: &[u8] = b":\n\n";

/// A waiting request asks the store again only with at least this long
/// left of its wait (ms).
const MIN_WAIT_MS: u64 = 10;

/// Who the request is, owned (Envoy keeps a filter's request headers only
/// until it lets them through).
#[derive(Default)]
struct Who {
    verified: bool,
    /// A credential lazy-auth admitted before verifying it (the request is
    /// unverified): its verdict decides, once the response ends, whether
    /// the usage is also charged to the tenant it turns out to have.
    pending: Option<PendingCredential>,
    tenant: Option<String>,
    subject: Option<String>,
    credential: Option<[u8; 32]>,
    route: Option<String>,
    headers: Vec<Option<String>>,
}

/// How the request body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    /// The headers wait for the whole body (Envoy): nothing reaches the
    /// backend before the reservation.
    Whole,
    /// The body streams through, read as it passes; the reservation is
    /// made at its last chunk, which is not forwarded when refused.
    Passing,
}

/// Why a request body's size, and so its input bound, is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unbounded {
    /// A content coding other than gzip and deflate (or several stacked).
    Coding,
    /// It decodes to more than `MAX_DECODED_BYTES`.
    TooLarge,
}

/// One request's quota state.
pub(crate) struct QuotaStream {
    plan: Option<Rc<Plan>>,
    provider: Option<Provider>,
    who: Who,
    hold: Hold,
    scan: RequestScan,
    /// Bytes of the request body, decoded: the input bound.
    body_bytes: u64,
    /// A gzip or deflate request body is decoded as it passes, so its
    /// bound is its decoded size (a small compressed body can hold a
    /// thousand times more prompt) and its members are read.
    decoder: Option<Box<BodyDecoder>>,
    /// The request body has a content coding (decoded or not).
    coded: bool,
    /// Why the body's size cannot be bounded, if it cannot.
    unbounded: Option<Unbounded>,
    /// The size of the body as held when the admitting callback read it
    /// whole (nothing of it forwarded yet): it can still be rewritten.
    whole_body: Option<usize>,
    /// The reservation, until settled. The ticket (~800 bytes for up to
    /// 16 policies), a hard stream's cut and an own extractor are boxed:
    /// inline they made this state a large allocation (~1.9 KB, past the
    /// allocator's per-thread cache) on every request.
    ticket: Option<Box<Ticket>>,
    model: Option<String>,
    output_bound: u64,
    extractor: Option<Box<UsageExtractor>>,
    /// The usage an earlier stage of the chain (metering) reads from this
    /// response and shares (fused, native), as last shared: read from
    /// there, with no `extractor` of this stage's own.
    shared_usage: Option<Result<Usage, Missing>>,
    /// A `stream: hard` response: its output drawn event by event, and
    /// ended cleanly when a draw is not covered.
    cut: Option<Box<StreamCut>>,
    status: u16,
    cache_hit: bool,
    response_bytes: u64,
    response_complete: bool,
    /// The chain counts the response's bytes and metering reads its usage
    /// (fused, native): this stage is not called per chunk, and reads both
    /// at its log.
    passed_by_chain: bool,
    /// Whether the request waited for a grant (one wait at most).
    waited: bool,
    /// Until when (host ms) it may wait for its grant.
    wait_until: u64,
    /// Whether a call it waited for got no answer (a timeout, an error):
    /// it then asks no more.
    wait_failed: bool,
    /// The store calls it waits for, by token.
    waiting: Vec<(u32, StoreCall)>,
    /// The refills a hard stream asked for as its lease ran low (Envoy):
    /// it does not wait for them, their answers fill the lease.
    refills: Vec<(u32, StoreCall)>,
}

impl QuotaStream {
    pub(crate) fn new(plan: Option<Rc<Plan>>) -> QuotaStream {
        QuotaStream {
            plan,
            provider: None,
            who: Who::default(),
            hold: Hold::Passing,
            scan: RequestScan::new(),
            body_bytes: 0,
            decoder: None,
            coded: false,
            unbounded: None,
            whole_body: None,
            ticket: None,
            model: None,
            output_bound: 0,
            extractor: None,
            shared_usage: None,
            cut: None,
            status: 0,
            cache_hit: false,
            response_bytes: 0,
            response_complete: false,
            passed_by_chain: false,
            waited: false,
            wait_until: 0,
            wait_failed: false,
            waiting: Vec::new(),
            refills: Vec::new(),
        }
    }

    /// Who the request is: lazy-auth's verdict (an unreadable or missing one
    /// counts as unverified: a scope is never taken from a claim), the
    /// credential's hash and the route when a policy names them, the
    /// trusted headers' values; for a credential admitted before its
    /// verification, where its verdict will be (only with an `unverified`
    /// budget: without one such a request holds no reservation).
    fn identify(&mut self, host: &mut impl StreamHost, plan: &Plan) {
        let who = &mut self.who;
        host.with_identity(|published| match published.identity() {
            Some(id) if id.state == "verified" => {
                who.verified = true;
                who.tenant.clone_from(&id.tenant);
                who.subject.clone_from(&id.subject);
            }
            // A public path needs no credential: it is nobody's claim.
            Some(id) if id.state == "public" => who.verified = true,
            _ => {}
        });
        if !self.who.verified && plan.config.unverified.is_some() {
            self.who.pending = host
                .property(internal::CREDENTIAL_PROPERTY)
                .and_then(|v| PendingCredential::parse(&v));
        }
        if plan.needs_credential && (self.who.verified || self.who.pending.is_some()) {
            self.who.credential = ["authorization", "x-api-key"]
                .iter()
                .find_map(|name| host.request_header(name))
                .map(|value| Sha256::digest(&value).into());
        }
        if plan.needs_route {
            self.who.route = host
                .property("xds.route_name")
                .and_then(|v| String::from_utf8(v).ok());
        }
        self.who.headers = plan
            .config
            .trusted_headers
            .iter()
            .map(|name| {
                host.request_header(name)
                    .and_then(|v| String::from_utf8(v).ok())
            })
            .collect();
    }

    /// Reserves the request's bound. A request whose lease is being
    /// refilled waits for the grant once (the store calls are sent from its
    /// own context, `Pause`); any other refusal is answered now.
    fn admit(&mut self, host: &mut impl StreamHost, plan: &Plan) -> Action {
        let refusal = match self.reserve(host, plan) {
            Ok(()) => {
                self.cap_output(host, plan);
                return Action::Continue;
            }
            Err(refusal) => refusal,
        };
        if matches!(refusal.kind, RefusalKind::Refilling { .. }) && !self.waited {
            self.waited = true;
            self.wait_until = host.now_ms() + plan.grant_wait.as_millis() as u64;
            plan.send_due(host, plan.grant_wait, true, &mut self.waiting);
            if !self.waiting.is_empty() {
                host.note_body_wait();
                return Action::Pause;
            }
        }
        self.refuse(host, plan, &refusal);
        Action::Pause
    }

    /// The store answered one of the calls this request waits for; with
    /// the last, the request is reserved again and resumed or refused.
    fn store_answered(&mut self, host: &mut impl StreamHost, token: u32, body_size: usize) {
        let Some(plan) = self.plan.clone() else {
            return;
        };
        if let Some(at) = self.refills.iter().position(|(t, _)| *t == token) {
            let (_, call) = self.refills.swap_remove(at);
            let body = host.callout_body(body_size);
            let status = host.callout_status();
            plan.answered(&call, status, &body, host.now_ms());
            return;
        }
        let Some(at) = self.waiting.iter().position(|(t, _)| *t == token) else {
            return;
        };
        let (_, call) = self.waiting.swap_remove(at);
        let status = host.callout_status();
        self.wait_failed |= status != Some(200);
        let body = host.callout_body(body_size);
        plan.answered(&call, status, &body, host.now_ms());
        if !self.waiting.is_empty() {
            return;
        }
        match self.reserve(host, &plan) {
            Ok(()) => {
                if !host.can_rewrite_request_body_from_callout() {
                    // The body goes on as it is (counted): a read from here
                    // would trap the instance.
                    self.whole_body = None;
                }
                self.cap_output(host, &plan);
                host.resume();
            }
            Err(refusal) => {
                // What answered may not have been the grant: an operation
                // already out on the lease (a return of its surplus, say)
                // goes first, and the grant is sent only after it. The
                // request then asks again, within its one wait.
                let left = self.wait_until.saturating_sub(host.now_ms());
                if matches!(refusal.kind, RefusalKind::Refilling { .. })
                    && !self.wait_failed
                    && left >= MIN_WAIT_MS
                {
                    let timeout = std::time::Duration::from_millis(left);
                    plan.send_due(host, timeout, true, &mut self.waiting);
                    if !self.waiting.is_empty() {
                        return;
                    }
                }
                self.refuse(host, &plan, &refusal)
            }
        }
    }

    /// Reserves the request's bound against every policy that scopes it.
    fn reserve(&mut self, host: &mut impl StreamHost, plan: &Plan) -> Result<(), Refusal> {
        let now = host.now_ms();
        plan.last_ms.set(now);
        let bound = RequestBound::scanned(self.body_bytes, &self.scan);
        if self.model.is_none() {
            self.model = self.scan.model().map(str::to_string);
        }
        let headers: Vec<Option<&str>> = self.who.headers.iter().map(Option::as_deref).collect();
        let who = Identity {
            verified: self.who.verified,
            tenant: self.who.tenant.as_deref(),
            subject: self.who.subject.as_deref(),
            credential: self.who.credential.as_ref().map(|c| c.as_slice()),
            model: self.model.as_deref(),
            route: self.who.route.as_deref(),
            headers: &headers,
        };
        let streams = self.scan.streams();
        let ticket = plan.quota().reserve(&who, &bound, streams, now)?;
        self.output_bound = bound.output_tokens(0);
        self.ticket = Some(Box::new(ticket));
        Ok(())
    }

    /// `inject_max_tokens`: a body that names no output cap gets the one
    /// its reservation covers, so a backend whose own default is larger
    /// (llama.cpp's: until the context is full) stops within it. Only a body
    /// still held whole can be given it; any other is counted and logged.
    fn cap_output(&mut self, host: &mut impl StreamHost, plan: &Plan) {
        // A body naming a cap is left alone, unless its only cap asks for
        // none (`null`, `-1`): that value is replaced.
        let open = self.scan.open_output_cap();
        if !plan.config.inject_max_tokens
            || (self.scan.names_output_cap() && open.is_none())
            || self.body_bytes == 0
        {
            return;
        }
        let (Some(provider), Some(ticket)) = (self.provider, &self.ticket) else {
            return;
        };
        let Some(cap) = plan.quota().output_cap(ticket) else {
            return;
        };
        let rewritten = match (self.whole_body, self.scan.root_end()) {
            // Not where an earlier filter's wait would have the host cut it.
            (Some(size), Some(end)) if host.may_replace_request_body() => host
                .with_body(Body::Request, size, |body| {
                    (body.len() == size)
                        .then(|| match open {
                            Some(span) => with_output_cap_at(body, span, cap),
                            None => with_output_cap(provider, body, end, cap),
                        })
                        .flatten()
                })
                .map(|bytes| (size, bytes)),
            _ => None,
        };
        let added = match rewritten {
            Some((size, bytes)) => match host.set_body(Body::Request, size, &bytes) {
                Ok(()) => {
                    host.set_request_header("content-length", bytes.len().to_string().as_bytes());
                    true
                }
                Err(status) => {
                    log::warn!("quota: the host took no new request body ({status:?})");
                    false
                }
            },
            None => false,
        };
        if added {
            log::debug!("quota: added an output cap of {cap} tokens to the request body");
        } else {
            // Counted (`zerolayer_quota_max_tokens_not_injected`); per request
            // only at debug, as a large body is not rare enough to warn about.
            log::debug!(
                "quota: request {:?} names no output cap and none could be added (its body went \
                 on unheld or unread): its output may settle above its reservation",
                host.request_id()
                    .map(|id| String::from_utf8_lossy(&id).into_owned())
            );
        }
        plan.quota().count_cap(added);
    }

    /// Answers the request with `refusal`, in its provider's format.
    fn refuse(&mut self, host: &mut impl StreamHost, plan: &Plan, refusal: &Refusal) {
        let quota = plan.quota();
        let (name, tokens) = quota
            .policy(refusal.policy)
            .map_or(("?", false), |p| (p.name.as_str(), p.cost.counts_tokens()));
        let id = host.request_id();
        let reply = refusal_reply(
            self.provider,
            refusal,
            name,
            tokens,
            id.as_deref().and_then(|id| std::str::from_utf8(id).ok()),
            Vec::new(),
        );
        log::debug!(
            "quota: policy {name:?} refused a request: {:?}",
            refusal.kind
        );
        // Audited in the access log: every refusal, with its policy.
        let decision = format!("refused policy={name} reason={}", refusal.kind.label());
        drop(quota);
        host.publish(internal::QUOTA_PROPERTY, decision.as_bytes());
        let headers: Vec<(&str, &str)> = reply
            .headers
            .iter()
            .map(|(name, value)| (*name, value.as_str()))
            .collect();
        if let Err(err) = host.send_response(u32::from(reply.status), &headers, &reply.body) {
            log::error!("quota: could not send a {} response: {err:?}", reply.status);
        }
    }

    /// Feeds `size` bytes of the request body to the scan, decoded first
    /// when it has a coding.
    fn scan_body(&mut self, host: &mut impl StreamHost, size: usize) {
        let (scan, decoder) = (&mut self.scan, &mut self.decoder);
        let decoded = host.with_body(Body::Request, size, |chunk| match decoder {
            None => {
                scan.push(chunk);
                Ok(chunk.len())
            }
            Some(decoder) => {
                let mut decoded = 0;
                decoder
                    .push(chunk, |bytes| {
                        scan.push(bytes);
                        decoded += bytes.len();
                    })
                    .map(|()| decoded)
            }
        });
        match decoded {
            Ok(decoded) => self.body_bytes += decoded as u64,
            Err(DecodeError::TooLarge) => self.unbounded = Some(Unbounded::TooLarge),
            Err(_) => {
                // Corrupt: the backend cannot read it either (it answers an
                // error). Counted as sent from here.
                self.decoder = None;
                self.body_bytes += size as u64;
            }
        }
    }

    /// Refuses a request whose body's size cannot be bounded while a
    /// policy counts tokens: its input could be anything.
    fn refuse_unbounded(&mut self, host: &mut impl StreamHost, plan: &Plan, why: Unbounded) {
        let (status, message) = match why {
            Unbounded::Coding => (
                415,
                "request body content-encoding cannot be read by the gateway's quota: send it \
                 uncompressed, gzip or deflate"
                    .to_string(),
            ),
            Unbounded::TooLarge => (
                413,
                format!("request body decodes to more than {MAX_DECODED_BYTES} bytes"),
            ),
        };
        log::debug!("quota: refused a request whose body cannot be bounded ({why:?})");
        plan.quota().count_unbounded();
        host.publish(internal::QUOTA_PROPERTY, b"refused reason=unbounded_body");
        host.send_json_error(status, "invalid_request_error", &message);
    }

    /// What the response came to, for the settlement: the usage read as
    /// it passed, else what metering recorded (`handed_off`: in Envoy's
    /// separate filters metering sees the response first, and removes the
    /// usage chunk it asked an OpenAI stream for).
    fn settlement(&self, handed_off: Option<Usage>) -> Settlement {
        let provider = self.provider.unwrap_or(Provider::OpenAi);
        let usage = match (self.read_usage(), handed_off) {
            (Some(Ok(u)), _) => Some(Ok(u)),
            (_, Some(u)) => Some(Ok(u)),
            (other, None) => other,
        };
        if self.cache_hit {
            let usage = usage
                .and_then(Result::ok)
                .map(|u| TokenCounts::from_usage(&u, provider));
            return Settlement::CacheHit { usage };
        }
        if let Some(cut) = self.cut.as_ref().filter(|c| c.is_cut()) {
            // Billed for what it received (what metering recorded too).
            return match cut.reported_input() {
                Some(_) => Settlement::Usage(TokenCounts::from_usage(&cut.billed(0), provider)),
                None => Settlement::Partial {
                    input: None,
                    delivered_output: cut.output(),
                },
            };
        }
        // The output delivered of a stream that ended early: a hard stream's
        // count, else what the stream reported, else its bytes (a token
        // covers at least one byte of what the client got).
        let delivered = |reported: Option<u64>| match &self.cut {
            Some(cut) => cut.output(),
            None => reported.unwrap_or(self.response_bytes.min(self.output_bound)),
        };
        match usage {
            Some(Ok(u)) => Settlement::Usage(TokenCounts::from_usage(&u, provider)),
            // An error the backend (or a later filter) answered, whole:
            // the request, no tokens.
            _ if self.status >= 400 && self.response_complete => {
                Settlement::Usage(TokenCounts::default())
            }
            // Cut short: its input, and what was delivered (a token covers
            // at least one byte of what the client got).
            Some(Err(Missing::Incomplete(partial))) if !self.response_complete => {
                Settlement::Partial {
                    input: partial.input_tokens,
                    delivered_output: delivered(partial.output_tokens),
                }
            }
            Some(Err(_)) if !self.response_complete && self.status != 0 => Settlement::Partial {
                input: None,
                delivered_output: delivered(None),
            },
            _ => Settlement::Unknown,
        }
    }

    /// The usage read from the response: by this stage, or by the chain's
    /// metering and shared.
    fn read_usage(&self) -> Option<Result<Usage, Missing>> {
        match &self.extractor {
            Some(extractor) => Some(extractor.usage()),
            None => self.shared_usage,
        }
    }

    /// A hard stream's body chunk: each event's output drawn as it passes;
    /// when a draw is not covered, the chunk is cut right after that event
    /// and the provider's end follows; nothing after reaches the client.
    fn draw_body(&mut self, host: &mut impl StreamHost, body_size: usize, end_of_stream: bool) {
        let (Some(plan), Some(cut), Some(ticket)) = (&self.plan, &mut self.cut, &mut self.ticket)
        else {
            return;
        };
        if cut.is_cut() {
            // What follows the provider's end is withheld: emptied, or an
            // SSE comment every client's event parser skips where a host
            // cannot send an empty chunk.
            let withheld: &[u8] = if host.can_empty_response_chunks() {
                b""
            } else {
                WITHHELD_CHUNK
            };
            if body_size > 0
                && let Err(status) = host.set_body(Body::Response, body_size, withheld)
            {
                log::warn!("quota: could not withhold a cut stream's chunk: {status:?}");
            }
            return;
        }
        // In a response's last callback metering, which sees it first, has
        // made its record already: cut now, the client would be billed
        // other than recorded. It ends here anyway: it goes on whole.
        let may_cut = !(end_of_stream && host.property(internal::USAGE_PROPERTY).is_some());
        let now = host.now_ms();
        plan.last_ms.set(now);
        let model = self.model.as_deref();
        let input_bound = ticket.input_bound();
        let extractor = &mut self.extractor;
        let mut passed = body_size;
        let mut quota = plan.quota();
        let cut_body = host.with_body(Body::Response, body_size, |chunk| {
            let at = cut.push(chunk, |output| {
                quota.draw(ticket, model, output, now) == StreamVerdict::Cut && may_cut
            });
            let delivered = at.and_then(|at| chunk.get(..at)).unwrap_or(chunk);
            passed = delivered.len();
            if let Some(extractor) = extractor {
                extractor.push(delivered);
            }
            at.map(|_| {
                let mut out = Vec::with_capacity(delivered.len() + 512);
                out.extend_from_slice(delivered);
                cut.end(input_bound, &mut out);
                out
            })
        });
        // A lease this stream drains below its low watermark is refilled
        // now, not at the holder's next tick: a stream outrunning the ticks
        // is then cut at the fleet's limit rather than where its lease ran
        // dry (Envoy; ngx_wasm_module makes no callout from a response).
        let refill = cut_body.is_none()
            && self.refills.is_empty()
            && quota.refill_due(ticket, now)
            && host.can_call_out_from_response();
        drop(quota);
        if refill {
            let timeout =
                std::time::Duration::from_millis(u64::from(plan.config.store.endpoint.timeout_ms));
            plan.send_due(host, timeout, false, &mut self.refills);
        }
        self.response_bytes += passed as u64;
        let Some(out) = cut_body else {
            return;
        };
        if let Err(status) = host.set_body(Body::Response, body_size, &out) {
            log::warn!("quota: could not end a cut stream: {status:?}");
        }
        let billed = cut.billed(input_bound);
        host.publish(
            internal::CUT_USAGE_PROPERTY,
            encode_billed(&billed).as_bytes(),
        );
        host.publish(internal::QUOTA_PROPERTY, b"cut");
        log::debug!(
            "quota: stream cut after {} output tokens (input {})",
            billed.output_tokens,
            billed.input_tokens
        );
    }

    /// Settles the reservation (once); a lazily admitted request's as its
    /// credential's `verdict` (the verdict store's entry, if read) decides.
    fn settle(&mut self, now_ms: u64, handed_off: Option<Usage>, verdict: Option<&[u8]>) {
        let (Some(plan), Some(ticket)) = (self.plan.clone(), self.ticket.take()) else {
            return;
        };
        let settlement = self.settlement(handed_off);
        let Some(credential) = self.who.pending else {
            plan.quota()
                .settle(*ticket, self.model.as_deref(), settlement, now_ms);
            return;
        };
        let scope = LateScope {
            credential: self.who.credential,
            model: self.model.take(),
            route: self.who.route.take(),
            headers: std::mem::take(&mut self.who.headers),
        };
        plan.quota()
            .settle_lazily(*ticket, settlement, credential, scope, verdict, now_ms);
    }
}

impl<H: StreamHost> StreamStage<H> for QuotaStream {
    fn request_headers(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        if !host.with_header(Headers::Request, ":method", |m| m == Some(b"POST")) {
            return Action::Continue;
        }
        self.provider = host.provider();
        if self.provider.is_none() {
            return Action::Continue;
        }
        // Usage is read from the body as the backend sends it.
        host.ask_identity_encoding();
        self.identify(host, &plan);
        let coding = host.with_header(
            Headers::Request,
            "content-encoding",
            ContentCoding::from_header,
        );
        if coding != ContentCoding::Identity {
            self.coded = true;
            self.decoder = BodyDecoder::new(coding).ok().map(Box::new);
            if self.decoder.is_none() {
                self.unbounded = Some(Unbounded::Coding);
            }
        }
        if end_of_stream {
            return self.admit(host, &plan);
        }
        let declared = host.with_header(Headers::Request, "content-length", |l| {
            std::str::from_utf8(l?).ok()?.trim().parse::<usize>().ok()
        });
        if host.can_hold_headers_for_body() && declared.is_none_or(|n| n <= MAX_HELD_BODY) {
            self.hold = Hold::Whole;
            return Action::Pause;
        }
        Action::Continue
    }

    fn request_body(&mut self, host: &mut H, body_size: usize, end_of_stream: bool) -> Action {
        let (Some(plan), Some(_)) = (self.plan.clone(), self.provider) else {
            return Action::Continue;
        };
        if self.ticket.is_some() {
            return Action::Continue;
        }
        if self.waited {
            // Waiting for the grant, or refused: nothing more goes on.
            return Action::Pause;
        }
        if self.hold == Hold::Whole {
            if !end_of_stream && body_size <= MAX_HELD_BODY {
                return Action::Pause;
            }
            // Whole (or grown past what is held): read what is buffered;
            // after a `Continue` the host hands over only new bytes.
            self.hold = Hold::Passing;
        }
        self.scan_body(host, body_size);
        if end_of_stream && self.scan.complete() {
            // Metering, after this stage on the request, then reads the
            // model from here instead of scanning the body again.
            host.share_request_model(self.scan.model());
        }
        if !end_of_stream {
            return Action::Continue;
        }
        if let Some(why) = self.unbounded
            && plan.bounds_input
        {
            self.waited = true;
            self.refuse_unbounded(host, &plan, why);
            return Action::Pause;
        }
        if !self.coded && self.body_bytes == body_size as u64 {
            self.whole_body = Some(body_size);
        }
        self.admit(host, &plan)
    }

    fn response_headers(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        let (Some(plan), Some(provider)) = (self.plan.clone(), self.provider) else {
            return Action::Continue;
        };
        let Some(ticket) = &self.ticket else {
            return Action::Continue;
        };
        self.response_complete = end_of_stream;
        // One look at the map (no copy of each value; one host call in a
        // filter of its own).
        let (status, cache_hit, format) = host.with_headers(Headers::Response, |h| {
            let text = |name| h.get(name).and_then(|v| std::str::from_utf8(v).ok());
            (
                text(":status").and_then(|s| s.parse().ok()).unwrap_or(0),
                text("x-cache") == Some("HIT"),
                text("content-type")
                    .map_or(ResponseFormat::Json, ResponseFormat::from_content_type),
            )
        });
        self.status = status;
        self.cache_hit = cache_hit;
        let now = host.now_ms();
        let quota = plan.quota();
        if format == ResponseFormat::EventStream
            && (200..300).contains(&self.status)
            && !self.cache_hit
            && quota.draws(ticket)
        {
            let asked = self.scan.injection() == StreamedInjection::ClientAsked;
            self.cut = Some(Box::new(StreamCut::new(provider, asked)));
        }
        // Metering, before this stage in the response, shares what it
        // reads where the chain runs in one filter: no second parse. A
        // hard stream still reads each event itself, to draw as it goes.
        self.shared_usage = host.shared_usage().filter(|_| self.cut.is_none());
        if self.shared_usage.is_none() {
            self.extractor = Some(Box::new(UsageExtractor::new(provider, format)));
        } else if host.response_passed().is_some() {
            // Nothing left to do per chunk: what passed and the usage are
            // read at the log (a stream dropped unlogged, at shutdown,
            // settles what it saw by then).
            self.passed_by_chain = true;
            host.done_with(Callback::ResponseBody);
        }
        if !plan.config.rate_limit_headers {
            return Action::Continue;
        }
        let shown = quota.shown(ticket, now);
        drop(quota);
        write_rate_limit_headers(Some(provider), &shown, now, |name, value| {
            host.set_response_header(name, value);
        });
        Action::Continue
    }

    fn response_body(&mut self, host: &mut H, body_size: usize, end_of_stream: bool) -> Action {
        if self.cut.is_some() {
            self.draw_body(host, body_size, end_of_stream);
            if end_of_stream {
                self.response_complete = true;
            }
            return Action::Continue;
        }
        if let Some(extractor) = &mut self.extractor {
            host.with_body(Body::Response, body_size, |chunk| extractor.push(chunk));
            self.response_bytes += body_size as u64;
        } else if self.shared_usage.is_some() {
            // Metering saw this chunk first: its usage is current.
            self.shared_usage = host.shared_usage();
            self.response_bytes += body_size as u64;
        }
        if end_of_stream {
            self.response_complete = true;
        }
        Action::Continue
    }

    fn call_answered(&mut self, host: &mut H, token: u32, body_size: usize) {
        self.store_answered(host, token, body_size);
    }

    fn log(&mut self, host: &mut H) {
        if self.ticket.is_none() {
            return;
        }
        if self.status == 0 {
            // Answered locally by a later stage without this stage seeing
            // the response (natively Envoy runs a local reply past the
            // module's own response hook): what the client got is still
            // readable, whole.
            self.status = host
                .response_header(":status")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            self.cache_hit = host.response_header("x-cache").as_deref() == Some("HIT");
            self.response_complete = self.status != 0;
        }
        if self.passed_by_chain
            && let Some((passed, complete)) = host.response_passed()
        {
            self.response_bytes = passed;
            self.response_complete |= complete;
            self.shared_usage = host.shared_usage().or(self.shared_usage);
        }
        let now = host.now_ms();
        // Metering's record is read (and parsed) only when the response's
        // own usage is not at hand (a usage chunk metering removed from a
        // stream before this stage saw it, in separate filters).
        let handed_off = if matches!(self.read_usage(), Some(Ok(_))) {
            None
        } else {
            host.property(internal::USAGE_PROPERTY)
                .and_then(|entry| logged_usage(&entry))
        };
        // A lazily admitted request's credential is usually verified by
        // now (lazy-auth verifies it as the request goes on).
        let verdict = self
            .who
            .pending
            .and_then(|p| host.shared_get(&p.verdict_key()).0);
        self.settle(now, handed_off, verdict.as_deref());
    }
}

impl Drop for QuotaStream {
    fn drop(&mut self) {
        // A stream the host never logged still gives its reservation back
        // (as unknown usage: charged as reserved).
        let now = self.plan.as_ref().map_or(0, |p| p.last_ms.get());
        if let Some(plan) = &self.plan {
            // Calls whose answers went with the stream are asked again.
            for (_, call) in self.waiting.drain(..).chain(self.refills.drain(..)) {
                plan.withdrawn(&call);
            }
        }
        if self.ticket.is_some() {
            self.settle(now, None, None);
        }
    }
}
