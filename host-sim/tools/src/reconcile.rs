//! `host-sim reconcile`: checks the metering sample against the access log
//! and emits correction rows.
//!
//! The metering filter ships a hash-chosen sample of requests as full records
//! (to ClickHouse), each with `sample_weight = 10000 / rate_bp`, and writes
//! every request's usage into Envoy's access log. Per (tenant, hour) and per
//! measure (requests, input, output, cache-read and cache-creation tokens):
//!
//! - estimate = Σ `sample_weight` × value over the sample (requests: Σ
//!   `sample_weight`); weight-0 rows (records forced by activation for
//!   requests outside the sample) do not count;
//! - truth = Σ value over the access log's usage records;
//! - a correction row `{"tenant","hour","measure","estimate","truth",
//!   "correction"}` with `correction = truth - estimate` is emitted when
//!   `|estimate - truth| > threshold × truth` (or truth is 0 and the estimate
//!   is not).
//!
//! Billed = estimate + corrections. Groups within the threshold keep their
//! estimate (the sample's error is accepted there); with threshold 0 every
//! deviating group is corrected and the billed totals equal the truth
//! exactly. Hours are UTC, `at_ms / 3_600_000`, from the `at_ms` the filter
//! sets in both records, so both sides bucket a request alike.
//!
//! Sample rows with the same non-empty `request_id` and `at_ms` count once:
//! shipping is at-least-once, and a batch whose answer was lost is sent again.
//!
//! Before that, rows billed `unverified` whose `credential` an attribution
//! row names ([`Attributions`]) are billed to that row's tenant: requests a
//! gateway admitted before verifying their credential, which verification
//! then found valid. Per tenant, the bill is then exact.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::io::BufRead;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::{Map, Value};

/// The sample table the metering filter writes to.
pub const DEFAULT_TABLE: &str = "zerolayer_usage";

/// The attribution table lazy-auth's observer writes to.
pub const DEFAULT_ATTRIBUTION_TABLE: &str = "zerolayer_attribution";

/// The default relative deviation tolerated before a group is corrected (0.3%).
pub const DEFAULT_THRESHOLD: f64 = 0.003;

/// `host-sim reconcile --help`.
pub const USAGE: &str = "\
usage:
  host-sim reconcile --access-log FILE (--sample FILE | --clickhouse URL [--table NAME])
                     [--attribution FILE | --attribution-table NAME]
                     [--threshold FRACTION] [--out FILE]
      Compare the metering sample with the access log's usage (the ground
      truth) per tenant and UTC hour, for requests, input_tokens,
      output_tokens, cache_read_tokens and cache_creation_tokens:
        estimate = sum of sample_weight x value (weight-0 forced rows ignored)
        truth    = sum of value over the access log's \"usage\" records
      and emit one correction row (JSON line)
        {\"tenant\",\"hour\",\"measure\",\"estimate\",\"truth\",\"correction\"}
      with correction = truth - estimate wherever
      |estimate - truth| > FRACTION x truth (or truth is 0 and the estimate is not).
      Billed = estimate + corrections: groups within the threshold keep the
      estimate; --threshold 0 corrects every deviating group, so billed
      totals equal the truth exactly.

      --access-log FILE   Envoy JSON access log; lines whose \"usage\" is
                          absent, null or \"-\" are skipped and counted
      --sample FILE       sample rows, one JSON object per line
      --clickhouse URL    or read them from ClickHouse's HTTP interface
      --table NAME        the sample table (default zerolayer_usage)
      --attribution FILE  attribution rows (one JSON object per line:
                          {\"credential\",\"tenant\",...}); with --clickhouse
                          they are read from --attribution-table NAME
                          (default zerolayer_attribution). Unverified rows
                          whose credential one names are that tenant's.
      --threshold F       tolerated relative deviation (default 0.003 = 0.3%)
      --out FILE          write the correction rows there (default: stdout,
                          and the summary goes to stderr)
";

/// A measure reconciled per group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Measure {
    /// Number of requests.
    Requests,
    /// `input_tokens`.
    InputTokens,
    /// `output_tokens`.
    OutputTokens,
    /// `cache_read_tokens`.
    CacheReadTokens,
    /// `cache_creation_tokens`.
    CacheCreationTokens,
}

impl Measure {
    /// Every measure, in report order.
    pub const ALL: [Measure; 5] = [
        Measure::Requests,
        Measure::InputTokens,
        Measure::OutputTokens,
        Measure::CacheReadTokens,
        Measure::CacheCreationTokens,
    ];

    /// The name in correction rows (the record's field name for token counts).
    pub fn name(self) -> &'static str {
        match self {
            Measure::Requests => "requests",
            Measure::InputTokens => "input_tokens",
            Measure::OutputTokens => "output_tokens",
            Measure::CacheReadTokens => "cache_read_tokens",
            Measure::CacheCreationTokens => "cache_creation_tokens",
        }
    }

    /// What one request with `tokens` contributes to this measure.
    pub fn value(self, tokens: &Tokens) -> u64 {
        match self {
            Measure::Requests => 1,
            Measure::InputTokens => tokens.input,
            Measure::OutputTokens => tokens.output,
            Measure::CacheReadTokens => tokens.cache_read,
            Measure::CacheCreationTokens => tokens.cache_creation,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One request's token counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    /// `input_tokens`.
    pub input: u64,
    /// `output_tokens`.
    pub output: u64,
    /// `cache_read_tokens`.
    pub cache_read: u64,
    /// `cache_creation_tokens`.
    pub cache_creation: u64,
}

/// One request's usage from the access log (the ground truth).
#[derive(Debug, Clone, PartialEq)]
pub struct TruthRow {
    /// The tenant billed.
    pub tenant: String,
    /// When the filter recorded it (unix milliseconds).
    pub at_ms: u64,
    /// The request id.
    pub request_id: String,
    /// Its token counts.
    pub tokens: Tokens,
    /// The attribution id of an `unverified` request's credential, when
    /// its verdict was pending as its response ended (see [`Attributions`]).
    pub credential: Option<String>,
}

/// One record from the sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleRow {
    /// The tenant billed.
    pub tenant: String,
    /// When the filter recorded it (unix milliseconds).
    pub at_ms: u64,
    /// The request id.
    pub request_id: String,
    /// Its token counts.
    pub tokens: Tokens,
    /// How many requests it stands for; 0 for a forced record outside the sample.
    pub sample_weight: f64,
    /// As [`TruthRow::credential`].
    pub credential: Option<String>,
}

/// The observer's attribution rows: which tenant each lazily admitted
/// credential turned out to have. Rows billed `unverified` whose
/// credential is here are that tenant's (`zerolayer_core::auth::attribution`):
/// their request reached the backend before verification and with a valid
/// credential. A forged credential never has a row.
#[derive(Debug, Clone, Default)]
pub struct Attributions {
    tenants: HashMap<String, String>,
    /// The verified identity each row names: (tenant, subject), as given.
    identities: HashMap<String, (Option<String>, Option<String>)>,
}

/// The tenant a verified credential without one is billed as (metering's
/// default when no `default_tenant` is configured).
const TENANTLESS: &str = "unknown";

impl Attributions {
    /// How many credentials it attributes.
    pub fn len(&self) -> usize {
        self.tenants.len()
    }

    /// Whether it attributes none.
    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }

    /// The verified tenant and subject a row names for `credential` (an
    /// attribution id), `None` when no row names it.
    pub fn identity(&self, credential: &str) -> Option<(Option<&str>, Option<&str>)> {
        self.identities
            .get(credential)
            .map(|(tenant, subject)| (tenant.as_deref(), subject.as_deref()))
    }

    /// Bills each `unverified` row whose credential is attributed to that
    /// credential's tenant; returns how many rows of `truth` moved.
    pub fn apply(&self, truth: &mut [TruthRow], sample: &mut [SampleRow]) -> usize {
        let mut moved = 0;
        let retenant = |tenant: &mut String, credential: Option<&str>| {
            if tenant != UNVERIFIED {
                return false;
            }
            match credential.and_then(|c| self.tenants.get(c)) {
                Some(found) => {
                    *tenant = found.clone();
                    true
                }
                None => false,
            }
        };
        for row in truth.iter_mut() {
            moved += usize::from(retenant(&mut row.tenant, row.credential.as_deref()));
        }
        for row in sample.iter_mut() {
            retenant(&mut row.tenant, row.credential.as_deref());
        }
        moved
    }
}

/// The tenant of a request admitted before verification.
const UNVERIFIED: &str = "unverified";

/// Reads attribution rows (`{"credential","tenant",…}`, one JSON object
/// per line); an unparsable line is an error naming its number.
pub fn read_attributions(reader: impl BufRead) -> Result<Attributions> {
    let mut out = Attributions::default();
    for (n, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("reading line {}", n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = || -> Result<(String, Option<String>, Option<String>)> {
            let Value::Object(row) = serde_json::from_str(&line).context("not JSON")? else {
                bail!("not a JSON object");
            };
            let given = |field: &str| match row.get(field) {
                Some(Value::String(t)) if !t.is_empty() => Some(t.clone()),
                _ => None,
            };
            Ok((text(&row, "credential")?, given("tenant"), given("subject")))
        };
        let (credential, tenant, subject) = parsed().with_context(|| format!("line {}", n + 1))?;
        out.tenants.insert(
            credential.clone(),
            tenant.clone().unwrap_or_else(|| TENANTLESS.to_string()),
        );
        out.identities.insert(credential, (tenant, subject));
    }
    Ok(out)
}

/// Reads the attribution table from ClickHouse's HTTP interface at `url`.
pub fn fetch_attributions(url: &str, table: &str) -> Result<Attributions> {
    let sql = format!(
        "SELECT credential, tenant, subject FROM {} FORMAT JSONEachRow",
        table_name(table)?
    );
    read_attributions(clickhouse_query(url, &sql)?)
        .with_context(|| format!("ClickHouse's answer from {url}"))
}

/// The usage records of an access log.
#[derive(Debug, Clone, Default)]
pub struct AccessLog {
    /// One per metered request.
    pub rows: Vec<TruthRow>,
    /// Lines without usage (requests that were not metered).
    pub skipped: usize,
}

/// The totals of one measure over a (tenant, hour) group.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Totals {
    /// Σ value over the access log.
    pub truth: u64,
    /// Σ sample_weight × value over the sample.
    pub estimate: f64,
    /// Whether the group gets a correction row for this measure.
    pub corrected: bool,
}

impl Totals {
    /// What is billed: the truth when corrected, else the estimate.
    pub fn billed(&self) -> f64 {
        // The truth itself rather than estimate + (truth - estimate), which
        // can be off by a rounding step when the estimate is fractional.
        if self.corrected {
            self.truth as f64
        } else {
            self.estimate
        }
    }
}

/// One tenant's hour.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// The tenant.
    pub tenant: String,
    /// Hours since the unix epoch (`at_ms / 3_600_000`).
    pub hour: u64,
    /// Per measure, indexed in [`Measure::ALL`] order.
    pub totals: [Totals; 5],
}

impl Group {
    /// The totals of `measure`.
    pub fn get(&self, measure: Measure) -> &Totals {
        &self.totals[measure.index()]
    }

    /// Whether any measure of the group is corrected.
    pub fn corrected(&self) -> bool {
        self.totals.iter().any(|t| t.corrected)
    }
}

/// A correction row: `billed = estimate + correction`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Correction {
    /// The tenant.
    pub tenant: String,
    /// The hour, `2026-11-29T15:00:00Z`.
    pub hour: String,
    /// The measure's name ([`Measure::name`]).
    pub measure: &'static str,
    /// Σ sample_weight × value.
    pub estimate: f64,
    /// Σ value over the access log.
    pub truth: u64,
    /// `truth - estimate`.
    pub correction: f64,
}

/// The outcome of [`reconcile`].
#[derive(Debug, Clone)]
pub struct Report {
    /// The relative deviation tolerated.
    pub threshold: f64,
    /// Every (tenant, hour) seen on either side, by tenant then hour.
    pub groups: Vec<Group>,
    /// The correction rows, in group then measure order.
    pub corrections: Vec<Correction>,
    /// Sample rows counted in the estimate.
    pub sample_rows: usize,
    /// Sample rows with weight 0 (forced records), not counted.
    pub forced_rows: usize,
    /// Sample rows dropped as repeats of an earlier row (same `request_id` and `at_ms`).
    pub duplicate_rows: usize,
    /// Usage records in the access log.
    pub truth_rows: usize,
}

/// One tenant's totals over all its hours.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantTotals {
    /// The tenant.
    pub tenant: String,
    /// Its hours.
    pub groups: usize,
    /// Its hours with at least one correction.
    pub corrected_groups: usize,
    /// Per measure ([`Measure::ALL`] order): truth, estimate, billed, hours corrected.
    pub measures: [(u64, f64, f64, usize); 5],
}

/// Compares the sample's estimate with the truth per (tenant, hour) and
/// measure; see the module doc for the rule.
pub fn reconcile(truth: &[TruthRow], sample: &[SampleRow], threshold: f64) -> Report {
    let mut groups: BTreeMap<(&str, u64), [Totals; 5]> = BTreeMap::new();
    for row in truth {
        let totals = groups.entry((&row.tenant, hour_of(row.at_ms))).or_default();
        for m in Measure::ALL {
            totals[m.index()].truth += m.value(&row.tokens);
        }
    }
    let mut seen: HashSet<(&str, u64)> = HashSet::new();
    let (mut sample_rows, mut forced_rows, mut duplicate_rows) = (0, 0, 0);
    for row in sample {
        if row.sample_weight == 0.0 {
            forced_rows += 1;
            continue;
        }
        if !row.request_id.is_empty() && !seen.insert((&row.request_id, row.at_ms)) {
            duplicate_rows += 1;
            continue;
        }
        sample_rows += 1;
        let totals = groups.entry((&row.tenant, hour_of(row.at_ms))).or_default();
        for m in Measure::ALL {
            totals[m.index()].estimate += row.sample_weight * m.value(&row.tokens) as f64;
        }
    }
    let mut corrections = vec![];
    let groups = groups
        .into_iter()
        .map(|((tenant, hour), mut totals)| {
            for m in Measure::ALL {
                let t = &mut totals[m.index()];
                let truth = t.truth as f64;
                t.corrected = if t.truth == 0 {
                    t.estimate != 0.0
                } else {
                    (t.estimate - truth).abs() > threshold * truth
                };
                if t.corrected {
                    corrections.push(Correction {
                        tenant: tenant.to_string(),
                        hour: hour_label(hour),
                        measure: m.name(),
                        estimate: t.estimate,
                        truth: t.truth,
                        correction: truth - t.estimate,
                    });
                }
            }
            Group {
                tenant: tenant.to_string(),
                hour,
                totals,
            }
        })
        .collect();
    Report {
        threshold,
        groups,
        corrections,
        sample_rows,
        forced_rows,
        duplicate_rows,
        truth_rows: truth.len(),
    }
}

impl Report {
    /// What `tenant` is billed for `measure`, summed over its hours.
    pub fn billed(&self, tenant: &str, measure: Measure) -> f64 {
        self.groups
            .iter()
            .filter(|g| g.tenant == tenant)
            .map(|g| g.get(measure).billed())
            .sum()
    }

    /// Per tenant, in name order.
    pub fn tenants(&self) -> Vec<TenantTotals> {
        let mut out: Vec<TenantTotals> = vec![];
        for group in &self.groups {
            if out.last().is_none_or(|t| t.tenant != group.tenant) {
                out.push(TenantTotals {
                    tenant: group.tenant.clone(),
                    groups: 0,
                    corrected_groups: 0,
                    measures: [(0, 0.0, 0.0, 0); 5],
                });
            }
            let Some(tenant) = out.last_mut() else {
                continue;
            };
            tenant.groups += 1;
            tenant.corrected_groups += usize::from(group.corrected());
            for (sum, t) in tenant.measures.iter_mut().zip(&group.totals) {
                sum.0 += t.truth;
                sum.1 += t.estimate;
                sum.2 += t.billed();
                sum.3 += usize::from(t.corrected);
            }
        }
        out
    }

    /// The plain-text summary: per tenant and overall, each measure's
    /// truth, estimate, deviation and corrected hours.
    pub fn summary(&self) -> String {
        let mut text = String::new();
        let _ = writeln!(
            text,
            "reconcile: {} usage records in the access log; {} sample rows counted, \
             {} forced (weight 0) ignored, {} duplicates dropped; threshold {}%",
            self.truth_rows,
            self.sample_rows,
            self.forced_rows,
            self.duplicate_rows,
            self.threshold * 100.0
        );
        let tenants = self.tenants();
        let mut overall = TenantTotals {
            tenant: "overall".into(),
            groups: 0,
            corrected_groups: 0,
            measures: [(0, 0.0, 0.0, 0); 5],
        };
        for tenant in &tenants {
            let _ = writeln!(
                text,
                "\ntenant {}: {} hours, {} corrected",
                tenant.tenant, tenant.groups, tenant.corrected_groups
            );
            write_measures(&mut text, tenant);
            overall.groups += tenant.groups;
            overall.corrected_groups += tenant.corrected_groups;
            for (sum, m) in overall.measures.iter_mut().zip(&tenant.measures) {
                sum.0 += m.0;
                sum.1 += m.1;
                sum.2 += m.2;
                sum.3 += m.3;
            }
        }
        let _ = writeln!(
            text,
            "\noverall: {} tenants, {} tenant-hours, {} corrected, {} correction rows",
            tenants.len(),
            overall.groups,
            overall.corrected_groups,
            self.corrections.len()
        );
        write_measures(&mut text, &overall);
        text
    }
}

fn write_measures(text: &mut String, totals: &TenantTotals) {
    let _ = writeln!(
        text,
        "  {:<22} {:>16} {:>18} {:>10} {:>18} {:>10}",
        "measure", "truth", "estimate", "deviation", "billed", "corrected"
    );
    for (m, (truth, estimate, billed, corrected)) in Measure::ALL.iter().zip(&totals.measures) {
        let deviation = if *truth == 0 {
            if *estimate == 0.0 {
                "0.00%".into()
            } else {
                "n/a".into()
            }
        } else {
            format!(
                "{:+.2}%",
                (estimate - *truth as f64) / *truth as f64 * 100.0
            )
        };
        let _ = writeln!(
            text,
            "  {:<22} {:>16} {:>18.1} {:>10} {:>18.1} {:>10}",
            m.name(),
            truth,
            estimate,
            deviation,
            billed,
            format!("{corrected}/{}", totals.groups)
        );
    }
}

/// Hours since the unix epoch.
fn hour_of(at_ms: u64) -> u64 {
    at_ms / 3_600_000
}

/// An hour since the unix epoch as `YYYY-MM-DDTHH:00:00Z`.
pub fn hour_label(hour: u64) -> String {
    let (y, m, d) = zerolayer_core::quota::window::civil_from_days((hour / 24) as i64);
    format!("{y:04}-{m:02}-{d:02}T{:02}:00:00Z", hour % 24)
}

/// The usage record in one access-log line, or `None` when the line has no
/// usage (`"usage"` absent, null, `"-"` or empty). `usage` may be an object
/// or a string holding the object's JSON (Envoy's `FILTER_STATE` gives either).
pub fn parse_access_log_line(line: &str) -> Result<Option<TruthRow>> {
    let entry: Value = serde_json::from_str(line).context("not JSON")?;
    let Value::Object(entry) = entry else {
        bail!("not a JSON object");
    };
    let usage = match entry.get("usage") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) if s.trim().is_empty() || s.trim() == "-" => return Ok(None),
        Some(Value::String(s)) => {
            serde_json::from_str(s).context("\"usage\" is a string but not JSON")?
        }
        Some(other) => other.clone(),
    };
    let Value::Object(usage) = usage else {
        bail!("\"usage\" is not an object: {usage}");
    };
    let row = usage_row(&usage).context("in \"usage\"")?;
    Ok(Some(row))
}

/// The usage record metering published for one request (its
/// `wasmx.zerolayer_usage` hand-off, parsed) as a truth row.
pub fn usage_truth(usage: &Value) -> Result<TruthRow> {
    let Value::Object(usage) = usage else {
        bail!("usage: not a JSON object");
    };
    usage_row(usage)
}

/// One sample row (a JSON object; 64-bit integers may be numeric strings,
/// as ClickHouse 18.16 writes them).
pub fn parse_sample_line(line: &str) -> Result<SampleRow> {
    let Value::Object(row) = serde_json::from_str(line).context("not JSON")? else {
        bail!("not a JSON object");
    };
    let sample_weight = float(&row, "sample_weight")?;
    if !sample_weight.is_finite() || sample_weight < 0.0 {
        bail!("sample_weight: expected a finite number >= 0, got {sample_weight}");
    }
    Ok(SampleRow {
        tenant: text(&row, "tenant")?,
        at_ms: uint(&row, "at_ms")?,
        request_id: text(&row, "request_id")?,
        tokens: tokens(&row)?,
        sample_weight,
        credential: credential(&row),
    })
}

/// Reads an access log; an unparsable line is an error naming its number.
pub fn read_access_log(reader: impl BufRead) -> Result<AccessLog> {
    let mut log = AccessLog::default();
    for (n, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("reading line {}", n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        match parse_access_log_line(&line).with_context(|| format!("line {}", n + 1))? {
            Some(row) => log.rows.push(row),
            None => log.skipped += 1,
        }
    }
    Ok(log)
}

/// Reads sample rows, one JSON object per line; an unparsable line is an
/// error naming its number.
pub fn read_sample(reader: impl BufRead) -> Result<Vec<SampleRow>> {
    let mut rows = vec![];
    for (n, line) in reader.lines().enumerate() {
        let line = line.with_context(|| format!("reading line {}", n + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        rows.push(parse_sample_line(&line).with_context(|| format!("line {}", n + 1))?);
    }
    Ok(rows)
}

/// Reads the sample table from ClickHouse's HTTP interface at `url` (the
/// query goes in the POST body, so `url` may carry `?user=…` parameters).
pub fn fetch_sample(url: &str, table: &str) -> Result<Vec<SampleRow>> {
    let sql = format!(
        "SELECT tenant, at_ms, request_id, input_tokens, output_tokens, cache_read_tokens, \
         cache_creation_tokens, sample_weight, credential FROM {} FORMAT JSONEachRow",
        table_name(table)?
    );
    read_sample(clickhouse_query(url, &sql)?)
        .with_context(|| format!("ClickHouse's answer from {url}"))
}

/// `table` if it is a plain identifier (optionally `db.table`): the name
/// goes into SQL.
fn table_name(table: &str) -> Result<&str> {
    let valid_name = |part: &str| {
        part.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && part.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    if !table.split('.').all(valid_name) || table.split('.').count() > 2 {
        bail!("table: expected NAME or DATABASE.NAME (letters, digits, _), got {table:?}");
    }
    Ok(table)
}

/// The answer to `sql` from ClickHouse's HTTP interface at `url` (the
/// query goes in the POST body, so `url` may carry `?user=…` parameters).
fn clickhouse_query(url: &str, sql: &str) -> Result<impl BufRead + use<>> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_connect(Some(Duration::from_secs(10)))
        .timeout_recv_response(Some(Duration::from_secs(300)))
        .build()
        .into();
    let mut response = agent
        .post(url)
        .send(sql)
        .with_context(|| format!("POST {url}"))?;
    if response.status() != 200 {
        let body = response.body_mut().read_to_string().unwrap_or_default();
        bail!(
            "ClickHouse at {url} answered {} to {sql:?}: {}",
            response.status(),
            body.trim()
        );
    }
    // Streamed, not read into one string: a sample table can exceed the
    // client's 10 MB default for whole bodies.
    Ok(std::io::BufReader::new(response.into_body().into_reader()))
}

fn usage_row(usage: &Map<String, Value>) -> Result<TruthRow> {
    Ok(TruthRow {
        tenant: text(usage, "tenant")?,
        at_ms: uint(usage, "at_ms")?,
        request_id: text(usage, "request_id")?,
        tokens: tokens(usage)?,
        credential: credential(usage),
    })
}

/// A row's `credential`: absent or empty (ClickHouse's default) is none.
fn credential(obj: &Map<String, Value>) -> Option<String> {
    match obj.get("credential") {
        Some(Value::String(c)) if !c.is_empty() => Some(c.clone()),
        _ => None,
    }
}

fn tokens(obj: &Map<String, Value>) -> Result<Tokens> {
    Ok(Tokens {
        input: uint(obj, "input_tokens")?,
        output: uint(obj, "output_tokens")?,
        cache_read: uint(obj, "cache_read_tokens")?,
        cache_creation: uint(obj, "cache_creation_tokens")?,
    })
}

fn text(obj: &Map<String, Value>, field: &str) -> Result<String> {
    match obj.get(field) {
        Some(Value::String(s)) => Ok(s.clone()),
        None => bail!("missing field {field}"),
        Some(other) => bail!("{field}: expected a string, got {other}"),
    }
}

/// An unsigned integer given as a JSON number or a numeric string.
fn uint(obj: &Map<String, Value>, field: &str) -> Result<u64> {
    let parsed = match obj.get(field) {
        Some(Value::Number(n)) => n.as_u64(),
        Some(Value::String(s)) => s.trim().parse().ok(),
        None => bail!("missing field {field}"),
        Some(_) => None,
    };
    parsed.with_context(|| {
        format!(
            "{field}: expected an unsigned integer, got {}",
            obj.get(field).unwrap_or(&Value::Null)
        )
    })
}

/// A number given as a JSON number or a numeric string.
fn float(obj: &Map<String, Value>, field: &str) -> Result<f64> {
    let parsed = match obj.get(field) {
        Some(Value::Number(n)) => n.as_f64(),
        Some(Value::String(s)) => s.trim().parse().ok(),
        None => bail!("missing field {field}"),
        Some(_) => None,
    };
    parsed.with_context(|| {
        format!(
            "{field}: expected a number, got {}",
            obj.get(field).unwrap_or(&Value::Null)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerolayer_core::sampling::{BUCKETS, Rate, bucket};

    /// 2025-11-29T15:26:40.123Z.
    const AT: u64 = 1_764_430_000_123;
    const HOUR_MS: u64 = 3_600_000;

    fn truth(tenant: &str, at_ms: u64, id: &str, input: u64, output: u64) -> TruthRow {
        TruthRow {
            tenant: tenant.into(),
            at_ms,
            request_id: id.into(),
            tokens: Tokens {
                input,
                output,
                cache_read: input / 2,
                cache_creation: 0,
            },
            credential: None,
        }
    }

    fn sampled(row: &TruthRow, sample_weight: f64) -> SampleRow {
        SampleRow {
            tenant: row.tenant.clone(),
            at_ms: row.at_ms,
            request_id: row.request_id.clone(),
            tokens: row.tokens,
            sample_weight,
            credential: row.credential.clone(),
        }
    }

    fn log() -> Vec<TruthRow> {
        vec![
            truth("acme", AT, "r-1", 12, 34),
            truth("acme", AT + 1, "r-2", 100, 7),
            truth("acme", AT + HOUR_MS, "r-3", 5, 5),
            truth("globex", AT, "r-4", 40, 400),
        ]
    }

    #[test]
    fn an_exact_sample_at_weight_one_needs_no_correction() {
        let log = log();
        let sample: Vec<SampleRow> = log.iter().map(|r| sampled(r, 1.0)).collect();
        let report = reconcile(&log, &sample, 0.0);
        assert_eq!(report.corrections, vec![]);
        assert_eq!(report.groups.len(), 3, "acme has two hours, globex one");
        assert_eq!(report.billed("acme", Measure::InputTokens), 117.0);
        assert_eq!(report.billed("acme", Measure::Requests), 3.0);
        assert_eq!(report.sample_rows, 4);
    }

    #[test]
    fn a_dropped_record_is_corrected_by_its_tokens() {
        let log = log();
        // r-2 never reached the sink.
        let sample: Vec<SampleRow> = log
            .iter()
            .filter(|r| r.request_id != "r-2")
            .map(|r| sampled(r, 1.0))
            .collect();
        let report = reconcile(&log, &sample, 0.003);
        let found: Vec<(&str, &str, f64)> = report
            .corrections
            .iter()
            .map(|c| (c.hour.as_str(), c.measure, c.correction))
            .collect();
        assert_eq!(
            found,
            vec![
                ("2025-11-29T15:00:00Z", "requests", 1.0),
                ("2025-11-29T15:00:00Z", "input_tokens", 100.0),
                ("2025-11-29T15:00:00Z", "output_tokens", 7.0),
                ("2025-11-29T15:00:00Z", "cache_read_tokens", 50.0),
            ]
        );
        assert!(report.corrections.iter().all(|c| c.tenant == "acme"));
        assert_eq!(report.corrections[1].estimate, 12.0);
        assert_eq!(report.corrections[1].truth, 112);
        assert_eq!(report.billed("acme", Measure::InputTokens), 117.0);
    }

    #[test]
    fn forced_weight_zero_rows_are_ignored() {
        let log = log();
        let mut sample: Vec<SampleRow> = log.iter().map(|r| sampled(r, 1.0)).collect();
        // Forced full records of requests outside the sample, one of them in
        // an hour nothing else falls into.
        sample.push(sampled(&log[0], 0.0));
        sample.push(sampled(&truth("acme", AT + 5 * HOUR_MS, "r-9", 9, 9), 0.0));
        let report = reconcile(&log, &sample, 0.0);
        assert_eq!(report.corrections, vec![]);
        assert_eq!(report.forced_rows, 2);
        assert_eq!(report.sample_rows, 4);
        assert_eq!(report.groups.len(), 3);
    }

    #[test]
    fn repeated_deliveries_count_once() {
        let log = log();
        let mut sample: Vec<SampleRow> = log.iter().map(|r| sampled(r, 1.0)).collect();
        sample.push(sampled(&log[1], 1.0));
        let report = reconcile(&log, &sample, 0.0);
        assert_eq!(report.duplicate_rows, 1);
        assert_eq!(report.corrections, vec![]);
    }

    #[test]
    fn the_threshold_is_exclusive() {
        let log = vec![truth("acme", AT, "r-1", 0, 1000)];
        let with_output = |output: u64| {
            let mut row = sampled(&log[0], 1.0);
            row.tokens.output = output;
            vec![row]
        };
        let output_corrections = |output: u64, threshold: f64| {
            reconcile(&log, &with_output(output), threshold)
                .corrections
                .into_iter()
                .filter(|c| c.measure == "output_tokens")
                .map(|c| c.correction)
                .collect::<Vec<_>>()
        };
        // 0.3% of 1000 is 3: a deviation of exactly 3 keeps the estimate.
        assert_eq!(output_corrections(1003, 0.003), Vec::<f64>::new());
        assert_eq!(output_corrections(997, 0.003), Vec::<f64>::new());
        assert_eq!(output_corrections(1004, 0.003), vec![-4.0]);
        assert_eq!(output_corrections(996, 0.003), vec![4.0]);
        assert_eq!(output_corrections(1001, 0.0), vec![-1.0]);
        assert_eq!(output_corrections(1000, 0.0), Vec::<f64>::new());
        // Within the threshold the estimate is billed, not the truth.
        let report = reconcile(&log, &with_output(1002), 0.003);
        assert_eq!(report.billed("acme", Measure::OutputTokens), 1002.0);

        // A zero truth is corrected whatever the threshold; zero on both sides is not.
        let nothing = vec![truth("acme", AT, "r-1", 0, 0)];
        let mut row = sampled(&nothing[0], 1.0);
        row.tokens.output = 1;
        let report = reconcile(&nothing, &[row], 10.0);
        let measures: Vec<&str> = report.corrections.iter().map(|c| c.measure).collect();
        assert_eq!(measures, vec!["output_tokens"]);
        // And a sampled hour the log does not have at all.
        let report = reconcile(&[], &[sampled(&log[0], 2.0)], 0.5);
        assert_eq!(report.corrections.len(), 2);
        assert_eq!(report.corrections[0].correction, -2.0);
        assert_eq!(report.corrections[1].correction, -2000.0);
    }

    #[test]
    fn sample_rows_accept_quoted_64_bit_integers() {
        let as_written = r#"{"at_ms":1764430000123,"request_id":"r-1","tenant":"acme","model":"m","input_tokens":12,"output_tokens":34,"cache_read_tokens":0,"cache_creation_tokens":0,"usage_missing":0,"status":200,"latency_ms":15,"streamed":1,"sample_weight":100.0}"#;
        // What ClickHouse 18.16 gives back by default.
        let from_clickhouse = r#"{"at_ms":"1764430000123","request_id":"r-1","tenant":"acme","model":"m","input_tokens":"12","output_tokens":"34","cache_read_tokens":"0","cache_creation_tokens":"0","usage_missing":0,"status":200,"latency_ms":15,"streamed":1,"sample_weight":100}"#;
        let a = parse_sample_line(as_written).unwrap();
        let b = parse_sample_line(from_clickhouse).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.tokens.output, 34);
        assert_eq!(a.sample_weight, 100.0);

        let bad = [
            (
                r#"{"tenant":"t","at_ms":"-1","sample_weight":1}"#,
                "at_ms: expected an unsigned integer, got \"-1\"",
            ),
            (
                r#"{"tenant":"t","at_ms":1.5,"sample_weight":1}"#,
                "at_ms: expected an unsigned integer, got 1.5",
            ),
            (
                r#"{"tenant":"t","at_ms":1,"request_id":"r","sample_weight":"x"}"#,
                "sample_weight: expected a number",
            ),
            (
                r#"{"tenant":"t","at_ms":1,"request_id":"r","sample_weight":-1}"#,
                "sample_weight: expected a finite number >= 0",
            ),
            (
                r#"{"tenant":"t","at_ms":1,"request_id":"r","sample_weight":1}"#,
                "missing field input_tokens",
            ),
            ("[1]", "not a JSON object"),
        ];
        for (line, message) in bad {
            let err = format!("{:#}", parse_sample_line(line).unwrap_err());
            assert!(err.contains(message), "{line}: {err}");
        }
    }

    #[test]
    fn attributed_credentials_bill_their_unverified_rows_to_their_tenant() {
        let attributions = read_attributions(
            concat!(
                r#"{"credential":"c-valid","tenant":"acme","subject":"u","at_ms":1}"#,
                "\n",
                r#"{"credential":"c-tenantless","tenant":null,"subject":"svc","at_ms":2}"#,
                "\n"
            )
            .as_bytes(),
        )
        .unwrap();
        assert_eq!(attributions.len(), 2);
        let mut rows = vec![
            truth("unverified", AT, "r-1", 10, 1),
            truth("unverified", AT, "r-2", 20, 2),
            truth("unverified", AT, "r-3", 30, 3),
            truth("unverified", AT, "r-4", 40, 4),
            truth("globex", AT, "r-5", 50, 5),
        ];
        rows[0].credential = Some("c-valid".into());
        rows[1].credential = Some("c-forged".into());
        rows[2].credential = Some("c-tenantless".into());
        // A verified row naming a credential is never moved.
        rows[4].credential = Some("c-valid".into());
        let mut sample: Vec<SampleRow> = rows.iter().map(|r| sampled(r, 1.0)).collect();
        assert_eq!(attributions.apply(&mut rows, &mut sample), 2);
        let tenants: Vec<&str> = rows.iter().map(|r| r.tenant.as_str()).collect();
        assert_eq!(
            tenants,
            ["acme", "unverified", "unknown", "unverified", "globex"]
        );
        assert_eq!(sample[0].tenant, "acme");
        let report = reconcile(&rows, &sample, 0.0);
        assert_eq!(report.billed("acme", Measure::InputTokens), 10.0);
        assert_eq!(report.billed("unverified", Measure::InputTokens), 60.0);
        assert!(report.corrections.is_empty());
    }

    #[test]
    fn usage_may_be_an_object_or_a_string() {
        let usage = r#"{"at_ms":1764430000123,"request_id":"r-1","tenant":"acme","model":"m","input_tokens":12,"output_tokens":34,"cache_read_tokens":3,"cache_creation_tokens":4,"usage_missing":0,"status":200,"streamed":1}"#;
        let object = format!(r#"{{"response_code":200,"usage":{usage}}}"#);
        let string = serde_json::json!({"response_code": 200, "usage": usage}).to_string();
        let a = parse_access_log_line(&object).unwrap().unwrap();
        let b = parse_access_log_line(&string).unwrap().unwrap();
        assert_eq!(a, b);
        assert_eq!(
            a.tokens,
            Tokens {
                input: 12,
                output: 34,
                cache_read: 3,
                cache_creation: 4
            }
        );
        for unmetered in [
            r#"{"usage":"-"}"#,
            r#"{"usage":null}"#,
            r#"{"usage":""}"#,
            r#"{"response_code":404}"#,
        ] {
            assert_eq!(
                parse_access_log_line(unmetered).unwrap(),
                None,
                "{unmetered}"
            );
        }

        let text = format!("{object}\n{{\"usage\":\"-\"}}\n\n{{\"usage\":\"{{oops\"}}\n");
        let err = format!("{:#}", read_access_log(text.as_bytes()).unwrap_err());
        assert!(
            err.starts_with("line 4: \"usage\" is a string but not JSON"),
            "{err}"
        );
        let text = format!("{string}\n{{\"usage\":\"-\"}}\n\n{{\"usage\":{{\"tenant\":\"t\"}}}}\n");
        let err = format!("{:#}", read_access_log(text.as_bytes()).unwrap_err());
        assert_eq!(err, "line 4: in \"usage\": missing field at_ms");
        let log = read_access_log(format!("{string}\n{{\"usage\":\"-\"}}\n\n").as_bytes()).unwrap();
        assert_eq!((log.rows.len(), log.skipped), (1, 1));
        let err = format!(
            "{:#}",
            read_access_log("{}\nnot json\n".as_bytes()).unwrap_err()
        );
        assert!(err.starts_with("line 2: not JSON"), "{err}");
    }

    #[test]
    fn hours_are_utc_labels() {
        assert_eq!(hour_label(0), "1970-01-01T00:00:00Z");
        assert_eq!(hour_label(AT / HOUR_MS), "2025-11-29T15:00:00Z");
        // 2000-02-29 (a leap day in a century year) 23:00.
        assert_eq!(hour_label(951_782_400 / 3600 + 23), "2000-02-29T23:00:00Z");
        assert_eq!(hour_label(951_782_400 / 3600 + 24), "2000-03-01T00:00:00Z");
        assert_eq!(hour_label(1_798_761_600 / 3600), "2027-01-01T00:00:00Z");
    }

    #[test]
    fn correction_rows_and_summary() {
        let log = log();
        let report = reconcile(&log, &[sampled(&log[0], 1.0)], 0.0);
        let row = serde_json::to_string(&report.corrections[0]).unwrap();
        assert_eq!(
            row,
            r#"{"tenant":"acme","hour":"2025-11-29T15:00:00Z","measure":"requests","estimate":1.0,"truth":2,"correction":1.0}"#
        );
        let summary = report.summary();
        assert!(
            summary.contains("tenant acme: 2 hours, 2 corrected"),
            "{summary}"
        );
        assert!(
            summary.contains("tenant globex: 1 hours, 1 corrected"),
            "{summary}"
        );
        assert!(
            summary.contains("overall: 2 tenants, 3 tenant-hours, 3 corrected"),
            "{summary}"
        );
        assert!(summary.contains("-75.00%"), "acme's requests: {summary}");
    }

    /// splitmix64: deterministic test data without a dependency.
    fn next(state: &mut u64) -> u64 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    #[test]
    fn a_one_percent_hash_sample_estimates_within_its_error_and_corrects_exactly() {
        const REQUESTS: u64 = 200_000;
        let tenants = ["acme", "globex", "initech", "umbrella"];
        let rate = Rate::from_percent(1.0).unwrap();
        let weight = f64::from(BUCKETS) / f64::from(rate.basis_points());
        let mut state = 7;
        let mut log = vec![];
        let mut sample = vec![];
        for i in 0..REQUESTS {
            let id = format!("req-{i}");
            let row = TruthRow {
                tenant: tenants[(next(&mut state) % 4) as usize].into(),
                // Spread over six hours.
                at_ms: AT + next(&mut state) % (6 * HOUR_MS),
                tokens: Tokens {
                    input: 1 + next(&mut state) % 4000,
                    output: 1 + next(&mut state) % 2000,
                    cache_read: next(&mut state) % 2 * (next(&mut state) % 3000),
                    cache_creation: next(&mut state) % 10 / 9 * (next(&mut state) % 500),
                },
                request_id: id,
                credential: None,
            };
            assert_eq!(
                rate.includes(row.request_id.as_bytes()),
                bucket(row.request_id.as_bytes()) < 100
            );
            if rate.includes(row.request_id.as_bytes()) {
                sample.push(sampled(&row, weight));
            }
            log.push(row);
        }
        let report = reconcile(&log, &sample, 0.0);

        // Each request is in the sample with p = 1%, so the estimate
        // Σ y/p over the sample has variance Σ y² (1-p)/p.
        let p = 0.01;
        let check = |m: Measure| {
            let truth: u64 = log.iter().map(|r| m.value(&r.tokens)).sum();
            let squares: f64 = log
                .iter()
                .map(|r| (m.value(&r.tokens) as f64).powi(2))
                .sum();
            let standard_error = (squares * (1.0 - p) / p).sqrt();
            let estimate: f64 = report.groups.iter().map(|g| g.get(m).estimate).sum();
            let off = (estimate - truth as f64).abs();
            assert!(
                off < 4.0 * standard_error,
                "{}: estimate {estimate}, truth {truth}, {off} off, 4 SE = {}",
                m.name(),
                4.0 * standard_error
            );
        };
        check(Measure::OutputTokens);
        check(Measure::Requests);
        let sampled_share = sample.len() as f64 / REQUESTS as f64;
        assert!((0.008..0.012).contains(&sampled_share), "{sampled_share}");

        // Six hours from 15:26 straddle seven clock hours; with threshold 0
        // every tenant is billed its truth exactly.
        assert_eq!(report.groups.len(), 4 * 7);
        assert!(!report.corrections.is_empty());
        for tenant in report.tenants() {
            for (m, (truth, _, billed, _)) in Measure::ALL.iter().zip(tenant.measures) {
                let exact: u64 = log
                    .iter()
                    .filter(|r| r.tenant == tenant.tenant)
                    .map(|r| m.value(&r.tokens))
                    .sum();
                assert_eq!(truth, exact);
                assert_eq!(billed, exact as f64, "{} {}", tenant.tenant, m.name());
            }
        }
        // Also as a consumer of the rows computes it: estimate + correction.
        let corrected: f64 = report
            .groups
            .iter()
            .map(|g| g.get(Measure::OutputTokens).estimate)
            .sum::<f64>()
            + report
                .corrections
                .iter()
                .filter(|c| c.measure == "output_tokens")
                .map(|c| c.correction)
                .sum::<f64>();
        let truth: u64 = log.iter().map(|r| r.tokens.output).sum();
        assert_eq!(corrected, truth as f64);
    }
}
