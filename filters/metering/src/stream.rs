//! One request through metering: is it an LLM call (request headers), the
//! `include_usage` rewrite (request body), the stream or JSON body's usage
//! as it passes (response), and its record at the end.

use std::rc::Rc;

use zerolayer_core::auth::identity::billing_tenant;
use zerolayer_core::cache::key::Provider;
use zerolayer_core::encoding::{BodyDecoder, ContentCoding};
use zerolayer_core::event::Job;
use zerolayer_core::internal;
use zerolayer_core::metering::UsageRecord;
use zerolayer_core::usage::{
    Injection, ResponseFormat, UsageChunkStripper, UsageExtractor, inject_include_usage,
};
use zerolayer_host::{Action, Body, Callback, Host, StreamStage};

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
    /// The request body may need `include_usage` (held until complete).
    rewrite_pending: bool,
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

impl MeteredStream {
    pub(crate) fn new(plan: Option<Rc<Plan>>) -> MeteredStream {
        MeteredStream {
            plan,
            provider: None,
            started_us: 0,
            request_id: String::new(),
            tenant_header: None,
            rewrite_pending: false,
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
    fn record(&mut self, host: &mut impl Host) {
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
        let request_id = std::mem::take(&mut self.request_id);
        let tenant = self.tenant(host);
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
        };
        plan.meters.count(host, &record);
        let entry = record.log_entry();
        host.publish(internal::USAGE_PROPERTY, &entry);
        host.set_ngx_variable(internal::USAGE_NGX_VARIABLE, &entry);
        // Activation's `metering` observer asks for this request's full
        // record even outside the sample (it then weighs 0 in the estimate).
        let mut forced = || {
            host.property(internal::OBSERVERS_PROPERTY)
                .is_some_and(|list| list.split(|b| *b == b',').any(|o| o == b"metering"))
        };
        if plan.config.sink.is_some() && (in_sample || forced()) {
            let queued = plan.queue.post(host, &Job::Usage(record).encode());
            plan.meters.record_posted(queued);
        }
    }

    /// The tenant billed: lazy-auth's verified one, `unverified` for an
    /// unverified request (never what it claims), the configured default
    /// for a tenant-less one; the operator's header only when lazy-auth
    /// published nothing (see `auth::identity::billing_tenant`).
    fn tenant(&mut self, host: &mut impl Host) -> String {
        let default = self
            .plan
            .as_ref()
            .and_then(|p| p.config.default_tenant.clone());
        billing_tenant(
            host.property(internal::AUTH_PROPERTY).as_deref(),
            self.tenant_header.take().as_deref(),
            default.as_deref(),
        )
    }

    /// The request headers: is it an LLM call, and may its body need
    /// `include_usage`.
    fn on_request_headers(&mut self, host: &mut impl Host, end_of_stream: bool) -> Action {
        let Some(plan) = &self.plan else {
            return Action::Continue;
        };
        if host.request_header(":method").as_deref() != Some(b"POST") {
            return Action::Continue;
        }
        let Some(provider) = host
            .request_header(":path")
            .as_deref()
            .and_then(|p| std::str::from_utf8(p).ok())
            .and_then(Provider::for_path)
        else {
            return Action::Continue;
        };
        self.provider = Some(provider);
        // Usage is read from the body as the backend sends it.
        host.ask_identity_encoding();
        self.started_us = host.now_us();
        self.request_id = host
            .request_header("x-request-id")
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
        if plan.config.openai_include_usage && provider == Provider::OpenAi && !end_of_stream {
            // The body may grow: hold the headers until it is rewritten, so
            // content-length can still be set. ngx_wasm_module cannot hold
            // them (it reads the body after the headers went on) and takes
            // the body's new length from the rewrite itself.
            self.rewrite_pending = true;
            if holds_headers {
                return Action::Pause;
            }
        }
        Action::Continue
    }

    /// The request body: `include_usage` once it is complete.
    fn on_request_body(
        &mut self,
        host: &mut impl Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        self.body_pending = false;
        if !self.rewrite_pending {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.rewrite_pending = false;
        let (Some(plan), Some(provider)) = (&self.plan, self.provider) else {
            return Action::Continue;
        };
        let injection = host.with_body(Body::Request, body_size, |body| {
            inject_include_usage(provider, body)
        });
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
                self.stripper = Some(UsageChunkStripper::new());
                plan.meters.injected();
                if host.responses_in_chain_order() {
                    host.publish(internal::USAGE_HIDDEN_PROPERTY, b"1");
                }
            } else {
                log::warn!("metering: could not rewrite the request body; usage may be missing");
            }
        }
        Action::Continue
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
    fn decode_chunk(&mut self, host: &mut impl Host, body_size: usize, end_of_stream: bool) {
        if let (Some(decoder), Some(extractor)) = (&mut self.decoder, &mut self.extractor) {
            let decoded = host.with_body(Body::Response, body_size, |chunk| {
                decoder.push(chunk, |bytes| extractor.push(bytes))
            });
            if let Err(error) = decoded {
                log::warn!(
                    "metering: response {:?}: {error}: usage recorded as missing",
                    self.request_id
                );
                self.decoder = None;
                self.extractor = None;
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

impl<H: Host> StreamStage<H> for MeteredStream {
    fn request_headers(&mut self, host: &mut H, end_of_stream: bool) -> Action {
        let action = self.on_request_headers(host, end_of_stream);
        if !self.rewrite_pending && !self.body_pending {
            // No rewrite to make: the request body is not ours.
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
        if !self.rewrite_pending {
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
        self.extractor = Some(UsageExtractor::new(provider, format));
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
