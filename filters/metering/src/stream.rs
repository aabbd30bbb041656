//! One request through metering: is it an LLM call (request headers), the
//! `include_usage` rewrite (request body), the stream or JSON body's usage
//! as it passes (response), and its record at the end.

use std::rc::Rc;

use zerolayer_core::auth::attribution::{PendingCredential, Resolution};
use zerolayer_core::auth::identity::{UNVERIFIED_TENANT, billing_tenant};
use zerolayer_core::cache::key::Provider;
use zerolayer_core::encoding::{BodyDecoder, ContentCoding};
use zerolayer_core::event::Job;
use zerolayer_core::internal;
use zerolayer_core::metering::UsageRecord;
use zerolayer_core::metering::labels::UNKNOWN as UNKNOWN_TENANT;
use zerolayer_core::metrics::Label;
use zerolayer_core::quota::cut::parse_billed;
use zerolayer_core::usage::{
    INCLUDE_USAGE_MEMBER, Injection, Missing, RequestScan, ResponseFormat, SkipReason,
    StreamedInjection, UsageChunkStripper, UsageExtractor, inject_include_usage,
};
use zerolayer_host::{Action, Body, Callback, Headers, StreamHost, StreamStage};

use crate::Plan;

/// Longest request id kept in a record.
const MAX_REQUEST_ID: usize = 128;

/// One request's metering state.
pub(crate) struct MeteredStream {
    plan: Option<Rc<Plan>>,
    /// The API the request calls (`None`: not an LLM call, not metered).
    provider: Option<Provider>,
    started_us: u64,
    /// `x-request-id` (read with the request headers: Envoy keeps a
    /// filter's request headers only until it lets them through).
    request_id: String,
    /// The tenant header's value, when configured (same reason).
    tenant_header: Option<String>,
    /// What becomes of an OpenAI request's `include_usage`.
    rewrite: Rewrite,
    /// The request body's members as they pass (the model; for a streamed
    /// rewrite, `stream` and where the object ends). `None` once read whole.
    scan: Option<RequestScan>,
    /// An earlier stage of the chain read the whole request body and
    /// shared the model it names ([`StreamHost::shared_request_model`]).
    model_shared: bool,
    /// ngx_wasm_module: the request has a body this filter has not seen
    /// yet. Every filter's request headers run first there, so a request
    /// answered by an earlier filter's body step (a cache hit) never
    /// reaches the backend, and its response is not metered.
    body_pending: bool,
    /// The response's usage chunk is ours, not the client's: remove it.
    stripper: Option<UsageChunkStripper>,
    extractor: Option<UsageExtractor>,
    /// The backend compressed the response anyway: its usage is read
    /// through this (the client's bytes stay as they are).
    decoder: Option<BodyDecoder>,
    status: u16,
    streamed: bool,
    /// The record was made (at the response's end, or in `on_log`).
    recorded: bool,
}

/// How an OpenAI request is made to ask for usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rewrite {
    /// Nothing to do (not OpenAI, not configured, no body, or done).
    None,
    /// The body is held until complete (at most `max_request_bytes`), then
    /// rewritten in place.
    Held,
    /// The body streams through; `include_usage` is appended where the
    /// object closes.
    Streamed,
}

impl MeteredStream {
    pub(crate) fn new(plan: Option<Rc<Plan>>) -> MeteredStream {
        MeteredStream {
            plan,
            provider: None,
            started_us: 0,
            request_id: String::new(),
            tenant_header: None,
            rewrite: Rewrite::None,
            scan: None,
            model_shared: false,
            body_pending: false,
            stripper: None,
            extractor: None,
            decoder: None,
            status: 0,
            streamed: false,
            recorded: false,
        }
    }

    /// Makes the request's record: metrics for every request, the access
    /// log's ground truth, and a full record for the sample.
    fn record(&mut self, host: &mut impl StreamHost) {
        let (Some(plan), Some(_)) = (self.plan.clone(), self.provider) else {
            return;
        };
        if std::mem::replace(&mut self.recorded, true) {
            return;
        }
        let end_us = host.now_us();
        let extracted = self.extractor.as_ref().map(UsageExtractor::finish);
        let (usage, model) = match extracted {
            Some(e) => (e.usage.ok(), e.model),
            None => (None, None),
        };
        // A `stream: hard` response quota cut (it sees the response after
        // metering): the client was billed what it received, recorded so.
        let usage = if self.streamed {
            host.property(internal::CUT_USAGE_PROPERTY)
                .and_then(|v| parse_billed(&v))
                .or(usage)
        } else {
            usage
        };
        // The response names the model it ran; one that names none (an
        // error) is recorded under the model the request asked for.
        let model = model.or_else(|| {
            if self.model_shared {
                return host.shared_request_model().flatten().map(str::to_string);
            }
            self.scan
                .as_ref()
                .and_then(RequestScan::model)
                .map(str::to_string)
        });
        let request_id = std::mem::take(&mut self.request_id);
        let (tenant, credential) = self.tenant(host);
        let rate = plan.sampling.rate(&tenant);
        let in_sample = rate.includes(request_id.as_bytes());
        let record = UsageRecord {
            at_ms: end_us / 1000,
            request_id,
            tenant,
            model: model.unwrap_or_else(|| "unknown".into()),
            input_tokens: usage.map_or(0, |u| u.input_tokens),
            output_tokens: usage.map_or(0, |u| u.output_tokens),
            cache_read_tokens: usage.map_or(0, |u| u.cache_read_tokens),
            cache_creation_tokens: usage.map_or(0, |u| u.cache_creation_tokens),
            usage_missing: usage.is_none(),
            status: self.status,
            latency_ms: u32::try_from(end_us.saturating_sub(self.started_us) / 1000)
                .unwrap_or(u32::MAX),
            streamed: self.streamed,
            rate_bp: rate.basis_points(),
            in_sample,
            credential,
        };
        plan.meters.count(host, &record);
        let entry = record.log_entry();
        host.publish(internal::USAGE_PROPERTY, &entry);
        host.set_ngx_variable(internal::USAGE_NGX_VARIABLE, &entry);
        // Activation's `metering` observer asks for this request's full
        // record even outside the sample (it then weighs 0 in the estimate).
        let mut forced = || {
            host.property(internal::OBSERVERS_PROPERTY)
                .is_some_and(|list| zerolayer_core::observers::listed(&list, "metering"))
        };
        if plan.config.sink.is_some() && (in_sample || forced()) {
            let queued = plan.queue.post(host, &Job::Usage(record).encode());
            plan.meters.record_posted(queued);
        }
    }

    /// The tenant billed: lazy-auth's verified one, `unverified` for an
    /// unverified request (never what it claims), the configured default
    /// for a tenant-less one; the operator's header only when lazy-auth
    /// published nothing (see `auth::identity::billing_tenant`). A request
    /// admitted before verification is billed to the tenant its credential
    /// turned out to have, read from the verdict now; while that is still
    /// pending it is `unverified` with the credential's attribution id
    /// (`auth::attribution`).
    fn tenant(&mut self, host: &mut impl StreamHost) -> (String, Option<String>) {
        let default = self
            .plan
            .as_ref()
            .and_then(|p| p.config.default_tenant.clone());
        let header = self.tenant_header.take();
        let tenant = host.with_identity(|published| {
            billing_tenant(published, header.as_deref(), default.as_deref())
        });
        if tenant != UNVERIFIED_TENANT {
            return (tenant, None);
        }
        // Only lazily admitted requests carry their credential.
        let Some(pending) = host
            .property(internal::CREDENTIAL_PROPERTY)
            .and_then(|v| PendingCredential::parse(&v))
        else {
            return (tenant, None);
        };
        let entry = host
            .shared_get(&pending.verdict_key())
            .0
            .unwrap_or_default();
        match pending.resolve(&entry, host.now_secs()) {
            Resolution::Verified { tenant, .. } => {
                let tenant = tenant
                    .filter(|t| !t.is_empty())
                    .or(default.as_deref())
                    .unwrap_or(UNKNOWN_TENANT);
                (tenant.to_string(), None)
            }
            Resolution::Refused => (tenant, None),
            Resolution::Pending(id) => (tenant, Some(id.render())),
        }
    }

    /// The request headers: is it an LLM call, and may its body need
    /// `include_usage`.
    fn on_request_headers(&mut self, host: &mut impl StreamHost, end_of_stream: bool) -> Action {
        let Some(plan) = &self.plan else {
            return Action::Continue;
        };
        if host.request_header(":method").as_deref() != Some(b"POST") {
            return Action::Continue;
        }
        let Some(provider) = host.provider() else {
            return Action::Continue;
        };
        self.provider = Some(provider);
        // Usage is read from the body as the backend sends it.
        host.ask_identity_encoding();
        self.started_us = host.now_us();
        self.request_id = host
            .request_id()
            .map(|mut id| {
                id.truncate(MAX_REQUEST_ID);
                String::from_utf8_lossy(&id).into_owned()
            })
            .unwrap_or_default();
        self.tenant_header = plan
            .config
            .tenant_header
            .as_deref()
            .and_then(|name| host.request_header(name))
            .and_then(|v| String::from_utf8(v).ok());
        let holds_headers = host.can_hold_headers_for_body();
        if !holds_headers {
            self.body_pending = host
                .request_header("content-length")
                .is_some_and(|l| l != b"0")
                || host.request_header("transfer-encoding").is_some();
        }
        if end_of_stream {
            return Action::Continue;
        }
        // The model the request names, for a response that names none: an
        // earlier stage of the chain may have read it from the whole body.
        self.model_shared = host.shared_request_model().is_some();
        let scan = (!self.model_shared).then(RequestScan::new);
        if !(plan.config.openai_include_usage && provider == Provider::OpenAi) {
            self.scan = scan;
            return Action::Continue;
        }
        let declared = host
            .request_header("content-length")
            .and_then(|l| std::str::from_utf8(&l).ok()?.trim().parse::<u64>().ok());
        if holds_headers && declared.is_some_and(|n| n > u64::from(plan.config.max_request_bytes)) {
            // Too large to hold: it streams through, and the member is
            // appended as it passes, so the length the client declared
            // no longer holds (the backend gets the body chunked).
            self.rewrite = Rewrite::Streamed;
            // Read as it passes, for where its object closes.
            self.scan = Some(RequestScan::new());
            host.remove_header(Headers::Request, "content-length");
            return Action::Continue;
        }
        self.scan = scan;
        // The body may grow: hold the headers until it is rewritten, so
        // content-length can still be set. ngx_wasm_module cannot hold
        // them (it reads the whole body after the headers went on) and
        // takes the body's new length from the rewrite itself.
        self.rewrite = Rewrite::Held;
        if holds_headers {
            return Action::Pause;
        }
        Action::Continue
    }

    /// The request body: its members read as it passes, `include_usage`
    /// once it is complete (held) or where its object closes (streamed).
    fn on_request_body(
        &mut self,
        host: &mut impl StreamHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        self.body_pending = false;
        let Some(plan) = self.plan.clone() else {
            return Action::Continue;
        };
        if self.rewrite == Rewrite::Held {
            if body_size > plan.config.max_request_bytes as usize {
                // A body of unknown length grew past what is held: what is
                // held so far goes on, the rest streams through (read from
                // its start, all of it held until now, for where its object
                // closes).
                self.rewrite = Rewrite::Streamed;
                self.scan.get_or_insert_with(RequestScan::new);
            } else if !end_of_stream {
                return Action::Pause;
            } else {
                return self.rewrite_held(host, &plan, body_size);
            }
        }
        // After a `Continue` the host hands over only the new bytes.
        let Some(scan) = &mut self.scan else {
            return Action::Continue;
        };
        let Some(closed) = host.with_body(Body::Request, body_size, |chunk| {
            (chunk.len() == body_size).then(|| scan.push(chunk))
        }) else {
            self.unreadable(&plan, body_size);
            return Action::Continue;
        };
        let complete = scan.complete();
        if self.rewrite == Rewrite::Streamed
            && let Some(at) = closed
        {
            self.rewrite = Rewrite::None;
            self.append_include_usage(host, &plan, body_size, at);
        }
        if complete || end_of_stream {
            // Everything it names is read: the rest is not ours.
            self.rewrite = Rewrite::None;
        }
        Action::Continue
    }

    /// The whole body is held: make it ask for usage in place.
    fn rewrite_held(
        &mut self,
        host: &mut impl StreamHost,
        plan: &Plan,
        body_size: usize,
    ) -> Action {
        let Some(provider) = self.provider else {
            self.rewrite = Rewrite::None;
            return Action::Continue;
        };
        let scan = &mut self.scan;
        let Some(injection) = host.with_body(Body::Request, body_size, |body| {
            if body.len() != body_size {
                return None;
            }
            if let Some(scan) = scan {
                scan.push(body);
            }
            Some(inject_include_usage(provider, body))
        }) else {
            self.unreadable(plan, body_size);
            return Action::Continue;
        };
        self.rewrite = Rewrite::None;
        // Asked only when there is a body to replace.
        if matches!(injection, Injection::Rewritten(_)) && !host.may_replace_request_body() {
            self.after_a_wait(plan);
            return Action::Continue;
        }
        if let Injection::Refused(message) = &injection {
            // Forwarded, it could stream without the usage chunk: refused
            // (a request the backend never saw is not metered).
            host.send_json_error(400, "invalid_request_error", message);
            self.provider = None;
            return Action::Pause;
        }
        if let Injection::Rewritten(rewritten) = injection {
            if host.set_body(Body::Request, body_size, &rewritten).is_ok() {
                host.set_request_header("content-length", rewritten.len().to_string().as_bytes());
                self.asked_for_usage(host, plan);
            } else {
                // ngx_wasm_module takes no body back from a callout's
                // answer (the fused filter, after an earlier stage's callout).
                log::warn!("metering: could not rewrite the request body; usage may be missing");
                plan.meters.skipped(SkipReason::Unreadable);
            }
        }
        Action::Continue
    }

    /// An earlier filter paused the body step for a callout and this host
    /// would cut a replaced body: it goes on as it is, counted.
    fn after_a_wait(&mut self, plan: &Plan) {
        log::warn!(
            "metering: request {:?}: an earlier filter waited for a callout in the body step, \
             after which ngx_wasm_module cuts a replaced body: include_usage not added, its \
             usage may be missing",
            self.request_id
        );
        plan.meters.skipped(SkipReason::AfterAWait);
    }

    /// The host could not hand the body over: it goes on unread (no model,
    /// and an OpenAI stream's `include_usage` cannot be added), counted.
    fn unreadable(&mut self, plan: &Plan, body_size: usize) {
        self.scan = None;
        if std::mem::replace(&mut self.rewrite, Rewrite::None) != Rewrite::None {
            log::warn!(
                "metering: request {:?}: the host could not hand over its {body_size}-byte body \
                 (ngx_wasm_module: buffered to a file, over client_body_buffer_size): \
                 include_usage not added, its usage may be missing",
                self.request_id
            );
            plan.meters.skipped(SkipReason::Unreadable);
        }
    }

    /// A streamed body's object closes at `at` in the current chunk: append
    /// `include_usage` there if the request streams without asking for it.
    fn append_include_usage(
        &mut self,
        host: &mut impl StreamHost,
        plan: &Plan,
        size: usize,
        at: usize,
    ) {
        let Some(scan) = &self.scan else {
            return;
        };
        match scan.injection() {
            StreamedInjection::Append => {}
            StreamedInjection::Skipped(reason) => {
                log::warn!(
                    "metering: request {:?} ({size} bytes or more) streams without include_usage \
                     and was not held ({}): its usage may be missing",
                    self.request_id,
                    reason.label()
                );
                plan.meters.skipped(reason);
                return;
            }
            StreamedInjection::Pending
            | StreamedInjection::NotApplicable
            | StreamedInjection::ClientAsked => return,
        }
        if !host.may_replace_request_body() {
            self.after_a_wait(plan);
            return;
        }
        let appended = host.with_body(Body::Request, size, |chunk| {
            let (head, tail) = chunk.split_at(at.min(chunk.len()));
            let mut out = Vec::with_capacity(chunk.len() + INCLUDE_USAGE_MEMBER.len());
            out.extend_from_slice(head);
            out.extend_from_slice(INCLUDE_USAGE_MEMBER);
            out.extend_from_slice(tail);
            out
        });
        let length = appended.len();
        if host.set_body(Body::Request, size, &appended).is_ok() {
            if !host.can_hold_headers_for_body() {
                // ngx_wasm_module hands over the whole body at once and
                // sends the length the headers say.
                host.set_request_header("content-length", length.to_string().as_bytes());
            }
            self.asked_for_usage(host, plan);
        } else {
            log::warn!("metering: could not append include_usage; usage may be missing");
        }
    }

    /// The request now asks for usage on the client's behalf: the usage
    /// chunk is ours to remove from the response (and post-cache's, where
    /// it sees the response first).
    fn asked_for_usage(&mut self, host: &mut impl StreamHost, plan: &Plan) {
        self.stripper = Some(UsageChunkStripper::new());
        plan.meters.injected();
        if host.responses_in_chain_order() {
            host.publish(internal::USAGE_HIDDEN_PROPERTY, b"1");
        }
    }
}

impl MeteredStream {
    /// A response the backend compressed although asked for `identity`:
    /// gzip and deflate are decoded for the usage, anything else leaves it
    /// missing. The bytes reach the client as sent, so a usage chunk this
    /// filter asked for cannot be removed from them (logged).
    fn encoded(&mut self, coding: ContentCoding) {
        let Some(plan) = &self.plan else {
            return;
        };
        match BodyDecoder::new(coding) {
            Ok(decoder) => self.decoder = Some(decoder),
            Err(_) => {
                log::warn!(
                    "metering: response {:?} has content-encoding {coding:?}: usage unreadable, recorded as missing",
                    self.request_id
                );
                plan.meters.encoded(false);
                self.extractor = None;
            }
        }
        if self.stripper.take().is_some() {
            log::warn!(
                "metering: response {:?} is compressed: the usage chunk metering asked for reaches the client",
                self.request_id
            );
        }
    }

    /// Decodes a compressed chunk into the usage extractor.
    fn decode_chunk(&mut self, host: &mut impl StreamHost, body_size: usize, end_of_stream: bool) {
        if let (Some(decoder), Some(extractor)) = (&mut self.decoder, &mut self.extractor) {
            let decoded = host.with_body(Body::Response, body_size, |chunk| {
                decoder.push(chunk, |bytes| extractor.push(bytes))
            });
            host.share_usage(extractor.usage());
            if let Err(error) = decoded {
                log::warn!(
                    "metering: response {:?}: {error}: usage recorded as missing",
                    self.request_id
                );
                self.decoder = None;
                self.extractor = None;
                host.share_usage(Err(Missing::Malformed));
                if let Some(plan) = &self.plan {
                    plan.meters.encoded(false);
                }
            }
        }
        if end_of_stream {
            if self.decoder.take().is_some()
                && let Some(plan) = &self.plan
            {
                plan.meters.encoded(true);
            }
            self.record(host);
        }
    }
}

impl<H: StreamHost> StreamStage<H> for MeteredStream {
    fn request_headers(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        let action = self.on_request_headers(host, end_of_stream);
        if self.scan.is_none() && self.rewrite == Rewrite::None && !self.body_pending {
            // Nothing to read or rewrite: the request body is not ours.
            host.done_with(Callback::RequestBody);
        }
        if self.provider.is_none() {
            // Not metered: neither is its response.
            host.done_with(Callback::ResponseBody);
        }
        action
    }

    fn request_body(&mut self, host: &mut H, body_size: usize, end_of_stream: bool) -> Action {
        let action = self.on_request_body(host, body_size, end_of_stream);
        if self.rewrite == Rewrite::None && self.scan.as_ref().is_none_or(RequestScan::complete) {
            host.done_with(Callback::RequestBody);
        }
        action
    }

    fn response_headers(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        if self.body_pending {
            // Answered before its body reached this filter: not from the
            // backend (see `body_pending`).
            self.provider = None;
        }
        let Some(provider) = self.provider else {
            host.done_with(Callback::ResponseBody);
            return Action::Continue;
        };
        self.status = host
            .response_header(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let format = host
            .response_header("content-type")
            .as_deref()
            .map_or(ResponseFormat::Json, ResponseFormat::from_content_type);
        self.streamed = format == ResponseFormat::EventStream;
        if !self.streamed {
            // Nothing to strip from a JSON body (the client asked no stream).
            self.stripper = None;
        }
        let extractor = UsageExtractor::new(provider, format);
        // The stages after this one (quota) read the usage from here
        // rather than parsing the body again, where the chain shares it.
        host.share_usage(extractor.usage());
        self.extractor = Some(extractor);
        let coding = ContentCoding::from_header(
            host.response_header("content-encoding")
                .as_deref()
                .map(str::as_bytes),
        );
        if coding != ContentCoding::Identity {
            self.encoded(coding);
        }
        if end_of_stream {
            self.record(host);
        }
        Action::Continue
    }

    fn response_body(&mut self, host: &mut H, body_size: usize, end_of_stream: bool) -> Action {
        if self.decoder.is_some() {
            self.decode_chunk(host, body_size, end_of_stream);
            return Action::Continue;
        }
        let Some(extractor) = &mut self.extractor else {
            return Action::Continue;
        };
        let stripper = &mut self.stripper;
        // The chunk without the usage chunk, when that changed it.
        let stripped = host.with_body(Body::Response, body_size, |chunk| {
            extractor.push(chunk);
            let stripper = stripper.as_mut()?;
            let mut out = Vec::with_capacity(chunk.len());
            stripper.push(chunk, &mut out);
            if end_of_stream {
                stripper.finish(&mut out);
            }
            (out != chunk).then_some(out)
        });
        host.share_usage(extractor.usage());
        if let Some(out) = stripped
            && let Err(status) = host.set_body(Body::Response, body_size, &out)
        {
            log::warn!("metering: could not strip the usage chunk: {status:?}");
        }
        if end_of_stream {
            self.record(host);
        }
        Action::Continue
    }

    fn log(&mut self, host: &mut H) {
        // A response that never ended (client gone, upstream reset) still
        // gets its record: usage missing unless the stream carried it.
        if !self.body_pending {
            self.record(host);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use flate2::Compression;
    use flate2::write::GzEncoder;
    use serde_json::Value;
    use zerolayer_core::event::Job;
    use zerolayer_core::internal;
    use zerolayer_host::{
        Action, Callback, FakeHost, Host, Platform, RootStage, StageHost, StreamStage,
    };

    use crate::MeteringRoot;

    /// The singleton observer's queue (default `observer` link).
    const JOBS: &str = "zerolayer.jobs";
    const OPENAI: &str = "/v1/chat/completions";
    const ANTHROPIC: &str = "/v1/messages";

    /// Every request sampled, records shipped, tenant-less requests billed as `house`.
    const SAMPLED: &str = r#"{"sampling":{"percent":100},"default_tenant":"house",
        "sink":{"cluster":"clickhouse","path":"/"}}"#;

    const REQUEST: &[u8] = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;
    const STREAMED_REQUEST: &[u8] =
        br#"{"model":"gpt-4o","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

    const JSON_200: &[(&str, &str)] = &[(":status", "200"), ("content-type", "application/json")];
    const SSE_200: &[(&str, &str)] = &[(":status", "200"), ("content-type", "text/event-stream")];

    const OPENAI_ANSWER: &[u8] = br#"{"id":"c1","object":"chat.completion","model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"hello"}}],"usage":{"prompt_tokens":11,"completion_tokens":7,"total_tokens":18,"prompt_tokens_details":{"cached_tokens":4}}}"#;
    const ANTHROPIC_ANSWER: &[u8] = br#"{"id":"msg_1","type":"message","role":"assistant","model":"claude-x","content":[{"type":"text","text":"hello"}],"usage":{"input_tokens":20,"cache_read_input_tokens":5,"cache_creation_input_tokens":2,"output_tokens":9}}"#;

    const CONTENT_EVENT: &[u8] = b"data: {\"id\":\"c1\",\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hello\"}}],\"usage\":null}\n\n";
    const USAGE_EVENT: &[u8] = b"data: {\"id\":\"c1\",\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{\"prompt_tokens\":13,\"completion_tokens\":2,\"total_tokens\":15}}\n\n";
    const DONE_EVENT: &[u8] = b"data: [DONE]\n\n";

    type Stream = Box<dyn StreamStage<FakeHost>>;

    fn configured(config: &str) -> (FakeHost, MeteringRoot) {
        let mut host = FakeHost::default();
        // The observer service's queue, which filters resolve.
        host.register_queue(JOBS)
            .expect("the fake registers queues");
        let mut root = MeteringRoot::default();
        assert!(
            RootStage::<FakeHost>::configure(&mut root, &mut host, config.as_bytes()),
            "configuration refused: {config}"
        );
        (host, root)
    }

    /// Stream for `method` on `path` with `extra` headers after its request
    /// headers and (if any) whole body; the two actions returned.
    fn ask(
        root: &MeteringRoot,
        host: &mut FakeHost,
        method: &str,
        path: &str,
        extra: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> (Stream, Action, Action) {
        host.request_headers = [(":method", method), (":path", path)]
            .iter()
            .chain(extra)
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        host.properties.remove(internal::USAGE_PROPERTY);
        let mut stream = RootStage::<FakeHost>::stream(root, 1);
        let headers = stream.request_headers(host, body.is_none());
        let body = match body {
            Some(body) => {
                host.request_body = body.to_vec();
                stream.request_body(host, body.len(), true)
            }
            None => Action::Continue,
        };
        (stream, headers, body)
    }

    /// A POST to `path` whose body is still to come (see `send_body`).
    fn open(
        root: &MeteringRoot,
        host: &mut FakeHost,
        path: &str,
        extra: &[(&str, &str)],
    ) -> (Stream, Action) {
        host.request_headers = [(":method", "POST"), (":path", path)]
            .iter()
            .chain(extra)
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        let mut stream = RootStage::<FakeHost>::stream(root, 1);
        let headers = stream.request_headers(host, false);
        (stream, headers)
    }

    fn post(root: &MeteringRoot, host: &mut FakeHost, path: &str, body: &[u8]) -> Stream {
        ask(root, host, "POST", path, &[], Some(body)).0
    }

    /// The response: `headers`, then `chunks` (the last one ends it); what
    /// the client got of each chunk; then the access log.
    fn complete(
        stream: &mut Stream,
        host: &mut FakeHost,
        headers: &[(&str, &str)],
        chunks: &[&[u8]],
    ) -> Vec<u8> {
        host.respond_with(headers);
        let _ = stream.response_headers(host, chunks.is_empty());
        let mut client = Vec::new();
        for (i, chunk) in chunks.iter().enumerate() {
            host.response_body = chunk.to_vec();
            let _ = stream.response_body(host, chunk.len(), i + 1 == chunks.len());
            client.extend_from_slice(&host.response_body);
        }
        stream.log(host);
        client
    }

    /// The access log's usage entry.
    fn logged(host: &FakeHost) -> Option<Value> {
        let entry = host.properties.get(internal::USAGE_PROPERTY)?;
        Some(serde_json::from_slice(entry).expect("the entry is JSON"))
    }

    fn usage_jobs(host: &FakeHost) -> Vec<zerolayer_core::metering::UsageRecord> {
        host.queued(JOBS)
            .iter()
            .map(|job| match Job::decode(job) {
                Some(Job::Usage(record)) => record,
                _ => panic!("not a usage job"),
            })
            .collect()
    }

    fn counted(root: &mut MeteringRoot, host: &mut FakeHost, name: &str) -> Option<i64> {
        RootStage::<FakeHost>::tick(root, host);
        host.metric(name)
    }

    fn identity(host: &mut FakeHost, value: &str) {
        host.properties
            .insert(internal::AUTH_PROPERTY.into(), value.as_bytes().to_vec());
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = GzEncoder::new(Vec::new(), Compression::default());
        encoder.write_all(bytes).expect("in memory");
        encoder.finish().expect("in memory")
    }

    #[test]
    fn a_request_that_is_not_a_post_is_not_metered() {
        let (mut host, mut root) = configured(SAMPLED);
        let (mut stream, _, _) = ask(&root, &mut host, "GET", OPENAI, &[], None);
        complete(&mut stream, &mut host, JSON_200, &[OPENAI_ANSWER]);
        assert_eq!(logged(&host), None);
        assert!(host.queued(JOBS).is_empty());
        let found = "zerolayer_metering_usage_result=found";
        assert_eq!(counted(&mut root, &mut host, found), Some(0));
    }

    #[test]
    fn a_path_that_is_not_an_llm_call_is_not_metered() {
        let (mut host, root) = configured(SAMPLED);
        let mut stream = post(&root, &mut host, "/v1/embeddings", REQUEST);
        complete(&mut stream, &mut host, JSON_200, &[OPENAI_ANSWER]);
        assert_eq!(logged(&host), None);
        assert!(host.queued(JOBS).is_empty());
        assert_eq!(host.request_header_value("accept-encoding"), None);
    }

    #[test]
    fn an_openai_json_usage_reaches_the_access_log() {
        let (mut host, root) = configured(SAMPLED);
        identity(&mut host, "verified tenant=acme subject=u1");
        let mut stream = post(&root, &mut host, OPENAI, REQUEST);
        assert_eq!(
            host.request_header_value("accept-encoding").as_deref(),
            Some("identity")
        );
        let half = OPENAI_ANSWER.len() / 2;
        let chunks = [&OPENAI_ANSWER[..half], &OPENAI_ANSWER[half..]];
        complete(&mut stream, &mut host, JSON_200, &chunks);
        let entry = logged(&host).expect("a usage entry");
        assert_eq!(entry["tenant"], "acme");
        assert_eq!(entry["model"], "gpt-4o");
        assert_eq!(entry["input_tokens"], 11);
        assert_eq!(entry["output_tokens"], 7);
        assert_eq!(entry["cache_read_tokens"], 4);
        assert_eq!(entry["usage_missing"], 0);
        assert_eq!(entry["status"], 200);
        assert_eq!(entry["streamed"], 0);
    }

    #[test]
    fn an_anthropic_json_usage_reaches_the_access_log() {
        let (mut host, root) = configured(SAMPLED);
        identity(&mut host, "verified tenant=acme subject=u1");
        let mut stream = post(&root, &mut host, ANTHROPIC, REQUEST);
        complete(&mut stream, &mut host, JSON_200, &[ANTHROPIC_ANSWER]);
        let entry = logged(&host).expect("a usage entry");
        assert_eq!(entry["model"], "claude-x");
        assert_eq!(entry["input_tokens"], 20);
        assert_eq!(entry["output_tokens"], 9);
        assert_eq!(entry["cache_read_tokens"], 5);
        assert_eq!(entry["cache_creation_tokens"], 2);
        assert_eq!(entry["usage_missing"], 0);
    }

    #[test]
    fn usage_is_counted_per_tenant_and_model_on_tick() {
        let (mut host, mut root) = configured(SAMPLED);
        identity(&mut host, "verified tenant=acme subject=u1");
        for _ in 0..2 {
            let mut stream = post(&root, &mut host, OPENAI, REQUEST);
            complete(&mut stream, &mut host, JSON_200, &[OPENAI_ANSWER]);
        }
        let series = "_tenant=acme_model=gpt-4o";
        let requests = format!("zerolayer_metering_requests{series}");
        assert_eq!(host.metric(&requests), Some(0), "defined, not yet flushed");
        assert_eq!(counted(&mut root, &mut host, &requests), Some(2));
        for (kind, tokens) in [("input", 22), ("output", 14), ("cache_read", 8)] {
            let name = format!("zerolayer_metering_tokens{series}_kind={kind}");
            assert_eq!(host.metric(&name), Some(tokens), "{name}");
        }
        let found = "zerolayer_metering_usage_result=found";
        assert_eq!(host.metric(found), Some(2));
    }

    #[test]
    fn a_streams_usage_is_read_across_chunks() {
        let (mut host, root) = configured(SAMPLED);
        let mut stream = post(&root, &mut host, OPENAI, STREAMED_REQUEST);
        let events = [CONTENT_EVENT, USAGE_EVENT, DONE_EVENT].concat();
        // Cut inside the usage event, twice.
        let at = CONTENT_EVENT.len() + 30;
        let chunks = [&events[..at], &events[at..at + 40], &events[at + 40..]];
        let client = complete(&mut stream, &mut host, SSE_200, &chunks);
        assert_eq!(
            client, events,
            "nothing stripped: metering asked for nothing"
        );
        let entry = logged(&host).expect("a usage entry");
        assert_eq!(entry["input_tokens"], 13);
        assert_eq!(entry["output_tokens"], 2);
        assert_eq!(entry["model"], "gpt-4o");
        assert_eq!(entry["streamed"], 1);
        assert_eq!(entry["usage_missing"], 0);
    }

    #[test]
    fn a_stream_quota_cut_is_recorded_as_billed_not_as_the_backend_reported() {
        let (mut host, root) = configured(SAMPLED);
        let mut stream = post(&root, &mut host, OPENAI, STREAMED_REQUEST);
        host.respond_with(SSE_200);
        let _ = stream.response_headers(&mut host, false);
        host.response_body = CONTENT_EVENT.to_vec();
        let _ = stream.response_body(&mut host, CONTENT_EVENT.len(), false);
        // quota, after metering in the response's order, cut the stream
        // there: the rest never reaches the client.
        host.properties
            .insert(internal::CUT_USAGE_PROPERTY.into(), b"13 5 0 0".to_vec());
        let rest = [USAGE_EVENT, DONE_EVENT].concat();
        host.response_body = rest.clone();
        let _ = stream.response_body(&mut host, rest.len(), true);
        stream.log(&mut host);
        let entry = logged(&host).expect("a usage entry");
        assert_eq!(entry["input_tokens"], 13);
        assert_eq!(entry["output_tokens"], 5, "what the client was billed");
        assert_eq!(entry["usage_missing"], 0);
    }

    fn tenant_billed(config: &str, auth: Option<&str>, header: Option<&str>) -> Value {
        let (mut host, root) = configured(config);
        if let Some(auth) = auth {
            identity(&mut host, auth);
        }
        let extra: Vec<(&str, &str)> = header.map(|t| ("x-tenant-id", t)).into_iter().collect();
        let (mut stream, _, _) = ask(&root, &mut host, "POST", OPENAI, &extra, Some(REQUEST));
        complete(&mut stream, &mut host, JSON_200, &[OPENAI_ANSWER]);
        logged(&host).expect("a usage entry")["tenant"].clone()
    }

    #[test]
    fn the_tenant_is_lazy_auths_verified_one_not_the_header() {
        let with_header = r#"{"tenant_header":"x-tenant-id","default_tenant":"house"}"#;
        let verified = Some("verified tenant=acme subject=u1");
        assert_eq!(tenant_billed(with_header, verified, Some("globex")), "acme");
    }

    #[test]
    fn an_unverified_identity_is_billed_as_unverified() {
        let claimed = Some("unverified tenant=acme");
        assert_eq!(tenant_billed(SAMPLED, claimed, None), "unverified");
    }

    /// A lazily admitted request's usage entry when its credential's
    /// verdict is `verdict` (none: still pending) as its response ends.
    fn lazily_admitted(verdict: Option<bool>) -> Value {
        use zerolayer_core::auth::attribution::PendingCredential;
        use zerolayer_core::auth::credential::{CredentialKind, TokenHash};
        use zerolayer_core::auth::verdict::Verdict;
        let (mut host, root) = configured(SAMPLED);
        identity(&mut host, "unverified tenant=mallory");
        let hash = TokenHash::credential(CredentialKind::ApiKey, b"sk-new");
        let pending = PendingCredential { hash, slots: 16 };
        host.properties
            .insert(internal::CREDENTIAL_PROPERTY.into(), pending.render());
        let now = host.now_secs();
        match verdict {
            Some(true) => {
                let v = Verdict::valid(&hash, now, None, 300, Some("acme".into()), None);
                host.shared_put(&pending.verdict_key(), &v.encode());
            }
            Some(false) => {
                let v = Verdict::invalid(&hash, now, 60, "inactive");
                host.shared_put(&pending.verdict_key(), &v.encode());
            }
            None => {}
        }
        let (mut stream, _, _) = ask(&root, &mut host, "POST", OPENAI, &[], Some(REQUEST));
        complete(&mut stream, &mut host, JSON_200, &[OPENAI_ANSWER]);
        let entry = logged(&host).expect("a usage entry");
        // The sample's record says the same as the access log.
        let shipped = usage_jobs(&host);
        assert_eq!(shipped[0].tenant, entry["tenant"].as_str().unwrap());
        assert_eq!(
            shipped[0].credential.as_deref(),
            entry["credential"].as_str()
        );
        entry
    }

    #[test]
    fn a_lazily_admitted_request_is_billed_to_the_tenant_verification_found() {
        let verified = lazily_admitted(Some(true));
        assert_eq!(verified["tenant"], "acme", "never the claimed mallory");
        assert_eq!(verified.get("credential"), None);
        // Refused: unverified for good, nothing to attribute later.
        let refused = lazily_admitted(Some(false));
        assert_eq!(refused["tenant"], "unverified");
        assert_eq!(refused.get("credential"), None);
        // Still pending: unverified, with the id an attribution record names.
        let pending = lazily_admitted(None);
        assert_eq!(pending["tenant"], "unverified");
        let id = pending["credential"].as_str().expect("an attribution id");
        assert_eq!(id.len(), 32);
    }

    #[test]
    fn a_request_without_identity_is_billed_to_the_default_tenant() {
        assert_eq!(tenant_billed(SAMPLED, None, None), "house");
        assert_eq!(tenant_billed("{}", None, None), "unknown");
        // Without lazy-auth in the chain, the operator's header counts.
        let with_header = r#"{"tenant_header":"x-tenant-id"}"#;
        assert_eq!(tenant_billed(with_header, None, Some("globex")), "globex");
    }

    #[test]
    fn every_record_is_shipped_at_a_full_sampling_rate() {
        let (mut host, mut root) = configured(SAMPLED);
        for id in ["r-1", "r-2", "r-3"] {
            let extra = [("x-request-id", id)];
            let (mut stream, _, _) = ask(&root, &mut host, "POST", OPENAI, &extra, Some(REQUEST));
            complete(&mut stream, &mut host, JSON_200, &[OPENAI_ANSWER]);
        }
        let records = usage_jobs(&host);
        let ids: Vec<&str> = records.iter().map(|r| r.request_id.as_str()).collect();
        assert_eq!(ids, ["r-1", "r-2", "r-3"]);
        assert!(records.iter().all(|r| r.in_sample && r.rate_bp == 10_000));
        assert_eq!(records[0].input_tokens, 11);
        let queued = "zerolayer_metering_records_outcome=queued";
        assert_eq!(counted(&mut root, &mut host, queued), Some(3));
    }

    const UNSAMPLED: &str =
        r#"{"sampling":{"percent":0},"sink":{"cluster":"clickhouse","path":"/"}}"#;

    #[test]
    fn no_record_is_shipped_at_a_zero_sampling_rate() {
        let (mut host, root) = configured(UNSAMPLED);
        let mut stream = post(&root, &mut host, OPENAI, REQUEST);
        complete(&mut stream, &mut host, JSON_200, &[OPENAI_ANSWER]);
        assert!(host.queued(JOBS).is_empty());
        // The access log has it all the same.
        assert_eq!(logged(&host).expect("a usage entry")["input_tokens"], 11);
    }

    #[test]
    fn activations_metering_observer_forces_a_record_outside_the_sample() {
        let (mut host, root) = configured(UNSAMPLED);
        host.properties.insert(
            internal::OBSERVERS_PROPERTY.into(),
            b"cache,metering".to_vec(),
        );
        let mut stream = post(&root, &mut host, OPENAI, REQUEST);
        complete(&mut stream, &mut host, JSON_200, &[OPENAI_ANSWER]);
        let records = usage_jobs(&host);
        assert_eq!(records.len(), 1);
        assert!(!records[0].in_sample);
        assert_eq!(records[0].rate_bp, 0);
    }

    #[test]
    fn a_record_the_queue_refuses_is_counted_lost() {
        let (mut host, mut root) = configured(SAMPLED);
        host.refuse_enqueue = true;
        let mut stream = post(&root, &mut host, OPENAI, REQUEST);
        complete(&mut stream, &mut host, JSON_200, &[OPENAI_ANSWER]);
        let lost = "zerolayer_metering_records_outcome=lost";
        assert_eq!(counted(&mut root, &mut host, lost), Some(1));
    }

    const INCLUDE_USAGE: &str = r#"{"openai_include_usage":true}"#;

    fn streamed_openai(root: &MeteringRoot, host: &mut FakeHost) -> (Stream, Action, Action) {
        let length = STREAMED_REQUEST.len().to_string();
        let extra = [("content-length", length.as_str())];
        ask(root, host, "POST", OPENAI, &extra, Some(STREAMED_REQUEST))
    }

    #[test]
    fn include_usage_is_added_to_a_streamed_openai_request() {
        // Alone, and in a chain whose quota shared the model it read.
        for shared in [false, true] {
            let (mut host, mut root) = configured(INCLUDE_USAGE);
            host.fused = shared;
            host.shared_request_model = shared.then(|| Some("gpt-4o".into()));
            let (_stream, headers, body) = streamed_openai(&root, &mut host);
            assert_eq!(headers, Action::Pause, "held until the body is rewritten");
            assert_eq!(body, Action::Continue);
            let rewritten: Value = serde_json::from_slice(&host.request_body).expect("JSON");
            assert_eq!(rewritten["stream_options"]["include_usage"], true);
            assert_eq!(rewritten["model"], "gpt-4o");
            assert_eq!(
                host.request_header_value("content-length"),
                Some(host.request_body.len().to_string())
            );
            let injected = "zerolayer_metering_include_usage_injected";
            assert_eq!(counted(&mut root, &mut host, injected), Some(1));
            // Envoy runs responses in reverse: post-cache needs no telling.
            assert!(
                !host
                    .properties
                    .contains_key(internal::USAGE_HIDDEN_PROPERTY)
            );
        }
    }

    #[test]
    fn after_an_earlier_filters_wait_in_ngx_wasm_the_body_goes_on_unchanged_and_is_counted() {
        // ngx_wasm_module's separate filters: an earlier filter (quota
        // waiting for its grant) paused the body step; a body replaced
        // after that reached the backend cut to its old length.
        for waited in [false, true] {
            let (mut host, mut root) = configured(INCLUDE_USAGE);
            host.platform = Platform::NgxWasm;
            if waited {
                host.properties
                    .insert(internal::BODY_WAITED_PROPERTY.into(), b"1".to_vec());
            }
            let (_stream, _, body) = streamed_openai(&root, &mut host);
            assert_eq!(body, Action::Continue);
            let sent: Value = serde_json::from_slice(&host.request_body).expect("JSON");
            let asked = sent["stream_options"]["include_usage"] == true;
            assert_eq!(asked, !waited, "rewritten only without a wait before");
            if waited {
                assert_eq!(host.request_body, STREAMED_REQUEST);
            }
            let skipped = "zerolayer_metering_include_usage_skipped_reason=after_a_wait";
            assert_eq!(
                counted(&mut root, &mut host, skipped),
                Some(i64::from(waited))
            );
        }
        // Envoy keeps a body replaced after another filter's wait: the
        // property (which only ngx_wasm_module's filters publish) changes
        // nothing there.
        let (mut host, root) = configured(INCLUDE_USAGE);
        host.properties
            .insert(internal::BODY_WAITED_PROPERTY.into(), b"1".to_vec());
        let _ = streamed_openai(&root, &mut host);
        let sent: Value = serde_json::from_slice(&host.request_body).expect("JSON");
        assert_eq!(sent["stream_options"]["include_usage"], true);
    }

    /// A streamed OpenAI request of `content` bytes of text.
    fn large_streamed_request(content: usize, extra: &str) -> Vec<u8> {
        format!(
            r#"{{"messages":[{{"role":"user","content":"{}"}}],"model":"gpt-4o","stream":true{extra}}}"#,
            "x".repeat(content)
        )
        .into_bytes()
    }

    /// Sends `body` in `chunk`-byte pieces as Envoy does: while the stage
    /// pauses the body is buffered (each callback sees all of it so far),
    /// after it continues each callback sees only the new bytes. Returns
    /// the bytes that went on and each callback's action.
    fn send_body(
        stream: &mut Stream,
        host: &mut FakeHost,
        body: &[u8],
        chunk: usize,
    ) -> (Vec<u8>, Vec<Action>) {
        let (mut forwarded, mut actions, mut buffered) = (Vec::new(), Vec::new(), Vec::new());
        let pieces: Vec<&[u8]> = body.chunks(chunk).collect();
        for (i, piece) in pieces.iter().enumerate() {
            buffered.extend_from_slice(piece);
            host.request_body = buffered.clone();
            let action = stream.request_body(host, buffered.len(), i + 1 == pieces.len());
            actions.push(action);
            if action == Action::Continue {
                forwarded.extend_from_slice(&host.request_body);
                buffered.clear();
            }
        }
        (forwarded, actions)
    }

    const SMALL_HOLD: &str = r#"{"openai_include_usage":true,"max_request_bytes":1024}"#;

    #[test]
    fn a_body_declared_over_max_request_bytes_streams_with_include_usage_appended() {
        // Alone, and in a chain whose quota shared the model it read.
        for shared in [false, true] {
            let (mut host, mut root) = configured(SMALL_HOLD);
            host.fused = shared;
            host.shared_request_model = shared.then(|| Some("gpt-4o".into()));
            let body = large_streamed_request(5000, "");
            let length = body.len().to_string();
            let extra = [("content-length", length.as_str())];
            let (mut stream, headers) = open(&root, &mut host, OPENAI, &extra);
            assert_eq!(headers, Action::Continue, "never held");
            assert_eq!(
                host.request_header_value("content-length"),
                None,
                "it grows"
            );
            let (forwarded, actions) = send_body(&mut stream, &mut host, &body, 700);
            assert!(
                actions.iter().all(|a| *a == Action::Continue),
                "{actions:?}"
            );
            let sent: Value = serde_json::from_slice(&forwarded).expect("JSON");
            assert_eq!(sent["stream_options"]["include_usage"], true);
            assert_eq!(
                forwarded.len(),
                body.len() + zerolayer_core::usage::INCLUDE_USAGE_MEMBER.len()
            );
            assert!(forwarded.starts_with(&body[..body.len() - 1]));
            let injected = "zerolayer_metering_include_usage_injected";
            assert_eq!(counted(&mut root, &mut host, injected), Some(1));
            // The usage chunk it asked for is the gateway's, not the client's.
            let chunks = [CONTENT_EVENT, USAGE_EVENT, DONE_EVENT];
            let client = complete(&mut stream, &mut host, SSE_200, &chunks);
            assert_eq!(client, [CONTENT_EVENT, DONE_EVENT].concat());
            assert_eq!(logged(&host).expect("a usage entry")["output_tokens"], 2);
        }
    }

    #[test]
    fn a_body_of_unknown_length_is_held_until_it_outgrows_max_request_bytes() {
        // Alone, and in a chain whose quota shared the model it read.
        for shared in [false, true] {
            let (mut host, root) = configured(SMALL_HOLD);
            host.fused = shared;
            host.shared_request_model = shared.then(|| Some("gpt-4o".into()));
            let body = large_streamed_request(3000, "");
            let (mut stream, headers) = open(&root, &mut host, OPENAI, &[]);
            assert_eq!(headers, Action::Pause, "held while it may be small");
            assert!(
                !host.take_done().contains(Callback::RequestBody),
                "the body is still to be rewritten"
            );
            let (forwarded, actions) = send_body(&mut stream, &mut host, &body, 400);
            // Held for the first two pieces (800 bytes), released with the third.
            assert_eq!(
                actions[..3],
                [Action::Pause, Action::Pause, Action::Continue]
            );
            let sent: Value = serde_json::from_slice(&forwarded).expect("JSON");
            assert_eq!(sent["stream_options"]["include_usage"], true);
            assert_eq!(
                sent["messages"][0]["content"].as_str().map(str::len),
                Some(3000)
            );
        }
    }

    #[test]
    fn a_streamed_body_that_cannot_ask_for_usage_goes_on_unchanged_and_is_counted() {
        let (mut host, mut root) = configured(SMALL_HOLD);
        let body = large_streamed_request(2000, r#","stream_options":{"include_usage":false}"#);
        let length = body.len().to_string();
        let extra = [("content-length", length.as_str())];
        let (mut stream, _) = open(&root, &mut host, OPENAI, &extra);
        let (forwarded, _) = send_body(&mut stream, &mut host, &body, 1000);
        assert_eq!(forwarded, body);
        let skipped = "zerolayer_metering_include_usage_skipped_reason=stream_options";
        assert_eq!(counted(&mut root, &mut host, skipped), Some(1));
        let chunks = [CONTENT_EVENT, DONE_EVENT];
        assert_eq!(
            complete(&mut stream, &mut host, SSE_200, &chunks),
            chunks.concat()
        );
        assert_eq!(logged(&host).expect("a usage entry")["usage_missing"], 1);
    }

    #[test]
    fn a_body_the_host_cannot_hand_over_goes_on_unread_and_is_counted() {
        let (mut host, mut root) = configured(SMALL_HOLD);
        // ngx_wasm_module: nginx buffered the body to a file, and the
        // filter gets nothing for its 5000 bytes.
        host.platform = Platform::NgxWasm;
        let (mut stream, headers) = open(&root, &mut host, OPENAI, &[("content-length", "5000")]);
        assert_eq!(headers, Action::Continue);
        host.request_body.clear();
        assert_eq!(stream.request_body(&mut host, 5000, true), Action::Continue);
        assert!(host.request_body.is_empty(), "left as it is");
        let unreadable = "zerolayer_metering_include_usage_skipped_reason=unreadable";
        assert_eq!(counted(&mut root, &mut host, unreadable), Some(1));
    }

    /// The backend's 429 in Anthropic's format, which names no model.
    fn answer_rate_limited(stream: &mut Stream, host: &mut FakeHost) {
        let error =
            br#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#;
        complete(
            stream,
            host,
            &[(":status", "429"), ("content-type", "application/json")],
            &[error],
        );
    }

    #[test]
    fn an_error_without_a_model_is_recorded_under_the_model_the_request_named() {
        let (mut host, root) = configured(SAMPLED);
        let body =
            br#"{"max_tokens":5,"messages":[{"role":"user","content":"hi"}],"model":"claude-x"}"#;
        let (mut stream, _) = open(&root, &mut host, ANTHROPIC, &[]);
        let _ = send_body(&mut stream, &mut host, body, 16);
        answer_rate_limited(&mut stream, &mut host);
        let entry = logged(&host).expect("a usage entry");
        assert_eq!(entry["model"], "claude-x");
        assert_eq!(entry["status"], 429);
        assert_eq!(entry["usage_missing"], 1);
    }

    #[test]
    fn a_model_an_earlier_stage_shared_is_recorded_without_reading_the_body_again() {
        let (mut host, root) = configured(SAMPLED);
        host.fused = true;
        host.shared_request_model = Some(Some("claude-shared".into()));
        let (mut stream, _) = open(&root, &mut host, ANTHROPIC, &[]);
        // Were it read, this body would name another model.
        let body = br#"{"max_tokens":5,"model":"claude-x"}"#;
        let reads = host.body_reads;
        let _ = send_body(&mut stream, &mut host, body, 16);
        assert_eq!(host.body_reads, reads, "metering read the body again");
        answer_rate_limited(&mut stream, &mut host);
        let entry = logged(&host).expect("a usage entry");
        assert_eq!(entry["model"], "claude-shared");
    }

    #[test]
    fn the_usage_chunk_asked_for_is_stripped_from_the_response() {
        let (mut host, root) = configured(INCLUDE_USAGE);
        let (mut stream, _, _) = streamed_openai(&root, &mut host);
        let chunks = [CONTENT_EVENT, USAGE_EVENT, DONE_EVENT];
        let client = complete(&mut stream, &mut host, SSE_200, &chunks);
        assert_eq!(client, [CONTENT_EVENT, DONE_EVENT].concat());
        let entry = logged(&host).expect("a usage entry");
        assert_eq!(entry["input_tokens"], 13);
        assert_eq!(entry["output_tokens"], 2);
    }

    #[test]
    fn ngx_wasm_module_tells_post_cache_the_usage_chunk_is_hidden() {
        let (mut host, root) = configured(INCLUDE_USAGE);
        host.platform = Platform::NgxWasm;
        let (_stream, headers, _) = streamed_openai(&root, &mut host);
        assert_eq!(
            headers,
            Action::Continue,
            "ngx_wasm_module cannot hold them"
        );
        assert_eq!(
            host.properties
                .get(internal::USAGE_HIDDEN_PROPERTY)
                .map(Vec::as_slice),
            Some(&b"1"[..])
        );
    }

    #[test]
    fn a_refused_injection_is_a_400_and_not_metered() {
        let (mut host, root) = configured(INCLUDE_USAGE);
        let ambiguous: &[u8] = br#"{"model":"gpt-4o","stream":"yes","messages":[]}"#;
        let (mut stream, _, body) = ask(&root, &mut host, "POST", OPENAI, &[], Some(ambiguous));
        assert_eq!(body, Action::Pause);
        assert_eq!(host.sent.len(), 1);
        assert_eq!(host.sent[0].status, 400);
        assert!(host.sent[0].text().contains("invalid_request_error"));
        stream.log(&mut host);
        assert_eq!(logged(&host), None);
    }

    #[test]
    fn a_response_that_never_ended_is_recorded_on_log_with_usage_missing() {
        let (mut host, mut root) = configured(SAMPLED);
        let mut stream = post(&root, &mut host, OPENAI, STREAMED_REQUEST);
        host.respond_with(SSE_200);
        let _ = stream.response_headers(&mut host, false);
        host.response_body = CONTENT_EVENT.to_vec();
        let _ = stream.response_body(&mut host, CONTENT_EVENT.len(), false);
        assert_eq!(logged(&host), None, "not before the log");
        stream.log(&mut host);
        let entry = logged(&host).expect("a usage entry");
        assert_eq!(entry["usage_missing"], 1);
        assert_eq!(entry["input_tokens"], 0);
        assert_eq!(entry["status"], 200);
        let missing = "zerolayer_metering_usage_result=missing";
        assert_eq!(counted(&mut root, &mut host, missing), Some(1));
    }

    #[test]
    fn a_gzip_response_is_decoded_for_its_usage() {
        let (mut host, mut root) = configured(SAMPLED);
        let mut stream = post(&root, &mut host, ANTHROPIC, REQUEST);
        let compressed = gzip(ANTHROPIC_ANSWER);
        let half = compressed.len() / 2;
        let chunks = [&compressed[..half], &compressed[half..]];
        let headers = [
            (":status", "200"),
            ("content-type", "application/json"),
            ("content-encoding", "gzip"),
        ];
        let client = complete(&mut stream, &mut host, &headers, &chunks);
        assert_eq!(client, compressed, "the client's bytes are left as sent");
        let entry = logged(&host).expect("a usage entry");
        assert_eq!(entry["input_tokens"], 20);
        assert_eq!(entry["output_tokens"], 9);
        assert_eq!(entry["usage_missing"], 0);
        let decoded = "zerolayer_metering_encoded_responses_result=decoded";
        assert_eq!(counted(&mut root, &mut host, decoded), Some(1));
    }

    #[test]
    fn an_unreadable_coding_leaves_the_usage_missing() {
        let (mut host, mut root) = configured(SAMPLED);
        let mut stream = post(&root, &mut host, ANTHROPIC, REQUEST);
        let headers = [(":status", "200"), ("content-encoding", "br")];
        complete(&mut stream, &mut host, &headers, &[b"\x0b\x02\x80"]);
        assert_eq!(logged(&host).expect("a usage entry")["usage_missing"], 1);
        let unreadable = "zerolayer_metering_encoded_responses_result=unreadable";
        assert_eq!(counted(&mut root, &mut host, unreadable), Some(1));
    }

    fn ngx_request_with_body(root: &MeteringRoot, host: &mut FakeHost) -> Stream {
        host.platform = Platform::NgxWasm;
        host.request_headers = vec![
            (":method".into(), b"POST".to_vec()),
            (":path".into(), OPENAI.as_bytes().to_vec()),
            (
                "content-length".into(),
                REQUEST.len().to_string().into_bytes(),
            ),
        ];
        let mut stream = RootStage::<FakeHost>::stream(root, 1);
        assert_eq!(stream.request_headers(host, false), Action::Continue);
        stream
    }

    #[test]
    fn ngx_wasm_module_does_not_meter_a_request_answered_before_its_body() {
        let (mut host, root) = configured(SAMPLED);
        let mut stream = ngx_request_with_body(&root, &mut host);
        // An earlier filter's body step answered (a cache hit): the
        // response comes before this filter saw the body.
        complete(&mut stream, &mut host, JSON_200, &[OPENAI_ANSWER]);
        assert_eq!(logged(&host), None);
        assert!(host.queued(JOBS).is_empty());
    }

    #[test]
    fn ngx_wasm_module_meters_a_request_whose_body_went_upstream() {
        let (mut host, root) = configured(SAMPLED);
        let mut stream = ngx_request_with_body(&root, &mut host);
        host.request_body = REQUEST.to_vec();
        let _ = stream.request_body(&mut host, REQUEST.len(), true);
        complete(&mut stream, &mut host, JSON_200, &[OPENAI_ANSWER]);
        assert_eq!(logged(&host).expect("a usage entry")["input_tokens"], 11);
        // ngx_wasm_module's access log reads the nginx variable.
        assert!(host.properties.contains_key(internal::USAGE_NGX_VARIABLE));
    }
}
