//! `host-sim quota-reconcile`: makes the charges quota's lease holders gave
//! up on.
//!
//! A request admitted before its credential was verified is charged to the
//! tenant its verification finds; when no verdict comes within 60 s (the
//! verifier down), the holder gives up and hands the charge to the fleet's
//! store instead (`zerolayer_core::quota::late::UnsettledCharge`, a field of
//! the hash `<prefix>unsettled`). This tool reads that hash through webdis,
//! finds each charge's tenant in lazy-auth's attribution rows (the observer
//! writes one when it finds a lazily admitted credential valid), and adds
//! the charge to that tenant's counters as the holder would have
//! (`GatewayQuota::reconciliation`: the same policies, amounts and
//! counters, a budget's window of the request's time). Then the field is
//! deleted.
//!
//! Each counter takes a charge once however often the tool runs: its delta
//! carries an idempotency record of the field's own (sequence 1), so a run
//! that stops between the delta and the delete, or runs twice, adds
//! nothing more. A charge no attribution names (a forged credential, or one
//! not verified yet) stays for a later run; the hash expires 32 days after
//! its last write and holds at most 10,000 charges.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use zerolayer_core::quota::GatewayQuota;
use zerolayer_core::quota::late::UnsettledCharge;
use zerolayer_core::quota::store::{
    Applied, Command, DeltaReply, Reply, hand_off_key, parse_webdis,
};

use crate::reconcile::Attributions;

/// `host-sim quota-reconcile --help`.
pub const USAGE: &str = "\
usage:
  host-sim quota-reconcile --config QUOTA.json --webdis URL
                           (--attribution FILE | --clickhouse URL [--attribution-table NAME])
                           [--dry-run]
      Make the charges quota's lease holders handed to the store because a
      lazily admitted request's verdict did not come in time (the hash
      <store.key_prefix>unsettled): each charge whose credential an
      attribution row names is added to that tenant's counters as the holder
      would have added it, once (a repeated run adds nothing), then removed.
      Charges no row names stay for a later run. One JSON line per charge
      made on stdout, a summary on stderr.

      --config FILE       the quota stage's configuration (its policies and
                          key prefix: the gateways' own)
      --webdis URL        webdis in front of the fleet's Redis
      --attribution FILE  attribution rows, one JSON object per line
                          ({\"credential\",\"tenant\",\"subject\",...})
      --clickhouse URL    or read them from ClickHouse's HTTP interface
      --attribution-table NAME   (default zerolayer_attribution)
      --dry-run           print what would be charged; change nothing
";

/// One charge made (or, with `--dry-run`, to make).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Made {
    /// The hand-off field.
    pub field: String,
    /// The credential's attribution id.
    pub credential: String,
    /// The tenant it was charged to.
    pub tenant: Option<String>,
    /// The subject it was charged to.
    pub subject: Option<String>,
    /// Each counter charged: policy, counter key, amount, and whether this
    /// run added it (false: an earlier run had).
    pub counters: Vec<Counted>,
}

/// One counter of a [`Made`] charge.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Counted {
    /// The policy.
    pub policy: String,
    /// The counter's key.
    pub counter: String,
    /// What was added.
    pub amount: u64,
    /// Whether this run added it (false: an earlier run had, or dry run).
    pub added_now: bool,
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// The charges made.
    pub made: Vec<Made>,
    /// Charges left for a later run: no attribution names their credential.
    pub unattributed: usize,
    /// Fields that are not a charge (left in place, each named on stderr).
    pub unreadable: Vec<String>,
}

impl Report {
    /// The summary line.
    pub fn summary(&self) -> String {
        let counters: usize = self.made.iter().map(|m| m.counters.len()).sum();
        format!(
            "quota-reconcile: {} charge(s) made on {counters} counter(s); {} left for a later \
             run (no attribution names the credential: forged, or not verified yet); {} \
             unreadable",
            self.made.len(),
            self.unattributed,
            self.unreadable.len()
        )
    }
}

/// webdis at a base URL.
pub struct Webdis {
    base: String,
    agent: ureq::Agent,
}

impl Webdis {
    /// webdis at `base` (`http://127.0.0.1:7379`).
    pub fn new(base: &str) -> Webdis {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .proxy(None)
            .timeout_global(Some(Duration::from_secs(10)))
            .build()
            .into();
        Webdis {
            base: base.trim_end_matches('/').to_string(),
            agent,
        }
    }

    /// `command`'s JSON answer (`{"VERB": …}`), as text.
    fn call_text(&self, command: &Command) -> Result<String> {
        let path = String::from_utf8(command.webdis_body()).context("webdis path")?;
        let url = format!("{}/{path}", self.base);
        let mut response = self
            .agent
            .get(&url)
            .call()
            .with_context(|| format!("webdis at {}", self.base))?;
        let body = response
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .with_context(|| format!("webdis at {}: reading the answer", self.base))?;
        if response.status() != 200 {
            bail!(
                "webdis at {} answered {} to {}: {}",
                self.base,
                response.status(),
                command.verb(),
                body.trim()
            );
        }
        Ok(body)
    }

    /// `command`'s reply.
    pub fn call(&self, command: &Command) -> Result<Reply> {
        let body = self.call_text(command)?;
        parse_webdis(body.as_bytes(), &command.verb())
            .map_err(|e| anyhow::anyhow!("webdis at {}: {e}", self.base))
    }

    /// The fields and values of hash `key`. Read by a script: the fleet's
    /// webdis lets through only `EVAL`, `EVALSHA` and `SCRIPT`.
    pub fn hash(&self, key: &str) -> Result<Vec<(String, String)>> {
        let body = self.call_text(&Command::new([
            "EVAL",
            "return redis.call('HGETALL', KEYS[1])",
            "1",
            key,
        ]))?;
        let value: serde_json::Value =
            serde_json::from_str(&body).context("webdis's HGETALL answer: not JSON")?;
        let fields = match value.get("EVAL") {
            // A flat array: field, value, field, value…
            Some(serde_json::Value::Array(items)) => items
                .chunks(2)
                .filter_map(|pair| match pair {
                    [k, v] => Some((
                        k.as_str()?.to_string(),
                        v.as_str().unwrap_or_default().to_string(),
                    )),
                    _ => None,
                })
                .collect(),
            _ => bail!("webdis's answer to HGETALL: unexpected {body}"),
        };
        Ok(fields)
    }
}

/// Makes the handed-off charges of `quota`'s store (its key prefix) that
/// `attributions` name, at `now_ms`; `dry_run`: computes, changes nothing.
pub fn run(
    webdis: &Webdis,
    quota: &GatewayQuota,
    attributions: &Attributions,
    now_ms: u64,
    dry_run: bool,
) -> Result<Report> {
    let key = hand_off_key(quota.prefix());
    let mut report = Report::default();
    for (field, value) in webdis.hash(&key)? {
        let charge: UnsettledCharge = match serde_json::from_str(&value) {
            Ok(charge) => charge,
            Err(e) => {
                eprintln!("quota-reconcile: {key} {field}: not a charge ({e}); left in place");
                report.unreadable.push(field);
                continue;
            }
        };
        let Some((tenant, subject)) = attributions.identity(&charge.credential) else {
            report.unattributed += 1;
            continue;
        };
        let corrections = quota.reconciliation(&field, &charge, tenant, subject, now_ms);
        let mut counters = Vec::with_capacity(corrections.len());
        for c in corrections {
            let added_now = if dry_run {
                false
            } else {
                let reply = webdis.call(&c.command)?;
                let delta = DeltaReply::from_reply(&reply)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", c.counter))?;
                delta.status == Applied::Now
            };
            counters.push(Counted {
                policy: c.policy,
                counter: c.counter,
                amount: c.amount,
                added_now,
            });
        }
        if !dry_run {
            // Every counter has it (now or before): the charge is made.
            webdis.call(&Command::new([
                "EVAL",
                "return redis.call('HDEL', KEYS[1], ARGV[1])",
                "1",
                key.as_str(),
                field.as_str(),
            ]))?;
        }
        report.made.push(Made {
            field,
            credential: charge.credential,
            tenant: tenant.map(str::to_string),
            subject: subject.map(str::to_string),
            counters,
        });
    }
    Ok(report)
}
