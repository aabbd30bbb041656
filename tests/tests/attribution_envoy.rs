//! Billing names the right tenant, in every Envoy form: a tenant that
//! rotates its credentials sends each new one's first request before
//! anyone verified it (lazy-auth admits it `unverified`). Once the observer
//! finds the credential valid, that request is the tenant's: at the
//! response's end if the verdict came first, else through the observer's
//! attribution rows, which reconciliation joins. Forged credentials
//! claiming the same tenant stay `unverified`. Per tenant, the bill equals
//! what the backend reported, request for request.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use host_sim_tools::reconcile::{self, Measure};
use zerolayer_e2e::chain::{
    Chain, ChainOptions, Form, ROTATING_KEY_PREFIX, anthropic, openai, reported_usage,
};
use zerolayer_e2e::tokens::{self, issuer};
use zerolayer_e2e::{in_every_form, wait};

fn rotated_credentials_are_billed_to_their_verified_tenant(form: Form) -> Result<()> {
    let chain = Chain::start(ChainOptions {
        form,
        clickhouse: true,
        ..ChainOptions::default()
    })?;
    let now = tokens::now();
    // (id, credential header, what the backend reported: input, output)
    let mut sent: Vec<(String, &'static str)> = Vec::new();
    let mut reported: HashMap<String, (u64, u64)> = HashMap::new();
    let mut send = |id: String, header: (&str, String), tenant: &'static str| -> Result<()> {
        let (path, body) = if sent.len().is_multiple_of(2) {
            ("/v1/messages", anthropic(&id, false))
        } else {
            ("/v1/chat/completions", openai(&id, false))
        };
        let reply = chain.post(path, &[(header.0, &header.1), ("x-request-id", &id)], &body)?;
        ensure!(reply.status == 200, "{id}: {} {}", reply.status, reply.body);
        reported.insert(id.clone(), reported_usage(&reply.body)?);
        sent.push((id, tenant));
        Ok(())
    };
    for n in 0..5 {
        // A fresh JWT per request (a token rotated every few minutes),
        // each seen for the first time.
        let jwt = issuer().es256(&tokens::claims(&format!("rot-{n}"), "acme", now, 3600));
        send(
            format!("jwt-{n}"),
            ("authorization", format!("Bearer {jwt}")),
            "acme",
        )?;
        // A fresh API key, sent as the SDKs send `api_key=`.
        let key = format!("{ROTATING_KEY_PREFIX}{n}-{now}");
        send(
            format!("key-{n}"),
            ("authorization", format!("Bearer {key}")),
            "globex",
        )?;
    }
    for n in 0..3 {
        // Forged: claims acme, signed by nobody acme trusts.
        let forged = issuer().forged(&tokens::claims("mallory", "acme", now, 3600), n);
        send(
            format!("forged-{n}"),
            ("authorization", format!("Bearer {forged}")),
            "unverified",
        )?;
    }
    let ids: Vec<&str> = sent.iter().map(|(id, _)| id.as_str()).collect();
    let log = chain.wait_access_log_for(&ids)?;
    let mut truth = reconcile::read_access_log(chain.envoy.access_log().as_bytes())?;
    let url = chain.clickhouse()?.url();
    // The observer ships an attribution row for each valid credential whose
    // request was billed `unverified` at its end (and may for the others).
    let pending: Vec<String> = truth
        .rows
        .iter()
        .filter(|r| ids.contains(&r.request_id.as_str()) && r.credential.is_some())
        .map(|r| r.request_id.clone())
        .collect();
    let mut attributions = reconcile::Attributions::default();
    wait::until(
        "the attribution rows of the valid credentials",
        Duration::from_secs(20),
        || {
            attributions =
                reconcile::fetch_attributions(&url, reconcile::DEFAULT_ATTRIBUTION_TABLE)?;
            Ok((attributions.len() >= 10).then_some(()))
        },
    )
    .with_context(|| format!("pending at their end: {pending:?}"))?;
    let mut sample = reconcile::fetch_sample(&url, reconcile::DEFAULT_TABLE)?;
    let joined = attributions.apply(&mut truth.rows, &mut sample);
    eprintln!(
        "{form:?}: {} of {} requests billed to their tenant at their end, {joined} through attribution rows",
        ids.len() - pending.len(),
        ids.len()
    );
    for (id, tenant) in &sent {
        let row = truth
            .rows
            .iter()
            .find(|r| r.request_id == *id)
            .with_context(|| format!("{id}: not in the access log: {:?}", log.get(id)))?;
        ensure!(
            row.tenant == *tenant,
            "{id}: billed to {}, not {tenant}",
            row.tenant
        );
    }
    let report = reconcile::reconcile(&truth.rows, &sample, 0.0);
    for tenant in ["acme", "globex", "unverified"] {
        let (input, output) = sent
            .iter()
            .filter(|(_, t)| *t == tenant)
            .map(|(id, _)| reported[id])
            .fold((0, 0), |(i, o), (a, b)| (i + a, o + b));
        let (logged_in, logged_out) = truth
            .rows
            .iter()
            .filter(|r| r.tenant == tenant && ids.contains(&r.request_id.as_str()))
            .fold((0, 0), |(i, o), r| {
                (i + r.tokens.input, o + r.tokens.output)
            });
        ensure!(
            (logged_in, logged_out) == (input, output),
            "{tenant}: the log bills {logged_in}→{logged_out}, the backend reported {input}→{output}"
        );
        // The report bills exactly the log's truth (the chain's warm-up
        // requests, if any, included).
        let billed = report.billed(tenant, Measure::InputTokens);
        let all: u64 = truth
            .rows
            .iter()
            .filter(|r| r.tenant == tenant)
            .map(|r| r.tokens.input)
            .sum();
        ensure!(
            billed == all as f64,
            "{tenant}: billed {billed}, truth {all}"
        );
    }
    Ok(())
}

in_every_form!(rotated_credentials_are_billed_to_their_verified_tenant);
