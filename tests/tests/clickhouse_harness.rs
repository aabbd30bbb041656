//! The ClickHouse harness (the metering sample sink): it starts Debian's
//! `clickhouse-server` 18.16 on loopback, takes sample rows over HTTP
//! exactly as the observer posts them, gives them back, and survives a
//! stop/restart with its data and port.

use anyhow::{Result, ensure};
use serde_json::{Value, json};
use zerolayer_e2e::Client;
use zerolayer_e2e::clickhouse::{ClickHouse, INSERT_PATH};

/// Two sample rows as the metering filter writes them: a float weight, 0/1
/// flags, and a weight-0 forced record.
fn sample_rows() -> Vec<Value> {
    vec![
        json!({"at_ms":1764430000123u64,"request_id":"r-1","tenant":"acme","model":"m",
               "input_tokens":12,"output_tokens":34,"cache_read_tokens":0,"cache_creation_tokens":0,
               "usage_missing":0,"status":200,"latency_ms":15,"streamed":1,"sample_weight":100.0}),
        json!({"at_ms":1764430000456u64,"request_id":"r-2","tenant":"globex","model":"m2",
               "input_tokens":7,"output_tokens":0,"cache_read_tokens":5,"cache_creation_tokens":9,
               "usage_missing":1,"status":502,"latency_ms":3,"streamed":0,"sample_weight":0.0}),
    ]
}

/// What the observer sends: one JSON object per line.
fn json_lines(rows: &[Value]) -> String {
    rows.iter().map(|r| format!("{r}\n")).collect()
}

/// Posts `body` to the insert path and returns the status and ClickHouse's answer.
fn insert(ch: &ClickHouse, body: &str) -> Result<(u16, String)> {
    let reply = Client::new().send("POST", &format!("{}{INSERT_PATH}", ch.url()), &[], body)?;
    Ok((reply.status, reply.body))
}

#[test]
fn sample_rows_round_trip_over_http() -> Result<()> {
    let ch = ClickHouse::start()?;
    ensure!(ch.query("SELECT version()")?.trim() == "18.16.1");
    ch.create_tables()?;
    ch.create_tables()?; // idempotent

    let rows = sample_rows();
    let (status, body) = insert(&ch, &json_lines(&rows))?;
    ensure!(status == 200, "insert answered {status}: {body}");

    // rows() asks for numbers, so the rows come back as written (a float
    // weight that is whole comes back as an integer-looking number).
    let back = ch.rows()?;
    ensure!(back.len() == 2, "{back:?}");
    for (sent, got) in rows.iter().zip(&back) {
        for (field, value) in sent.as_object().into_iter().flatten() {
            let same = match (value.as_f64(), got[field].as_f64()) {
                (Some(a), Some(b)) => a == b,
                _ => *value == got[field],
            };
            ensure!(same, "{field}: sent {value}, got {}", got[field]);
        }
    }

    // By default 18.16 quotes 64-bit integers in JSON output; narrower ones
    // and floats stay numbers. Readers of the table must accept both.
    let raw =
        ch.query("SELECT * FROM zerolayer_usage WHERE request_id = 'r-1' FORMAT JSONEachRow")?;
    let raw: Value = serde_json::from_str(raw.trim())?;
    ensure!(raw["at_ms"] == json!("1764430000123"), "{raw}");
    ensure!(raw["input_tokens"] == json!("12"), "{raw}");
    ensure!(
        raw["status"] == json!(200) && raw["streamed"] == json!(1),
        "{raw}"
    );
    ensure!(raw["sample_weight"] == json!(100), "{raw}");
    Ok(())
}

#[test]
fn a_bad_batch_is_rejected_whole_with_a_message() -> Result<()> {
    let ch = ClickHouse::start()?;
    ch.create_tables()?;
    let good = json_lines(&sample_rows()[..1]);
    let unknown_field = format!("{good}{{\"at_ms\":1,\"request_id\":\"x\",\"bogus\":1}}\n");
    let (status, body) = insert(&ch, &unknown_field)?;
    ensure!(status != 200, "unknown field accepted: {body}");
    ensure!(
        body.contains("Unknown field found while parsing JSONEachRow format: bogus"),
        "{body}"
    );
    ensure!(
        ch.rows()?.is_empty(),
        "the good row of a rejected batch was kept"
    );

    // Numeric strings are taken for integer columns (what 18.16 writes out).
    let quoted = "{\"at_ms\":\"1764430000999\",\"request_id\":\"q\",\"tenant\":\"t\",\"input_tokens\":\"5\",\"sample_weight\":100}\n";
    let (status, body) = insert(&ch, quoted)?;
    ensure!(status == 200, "{body}");
    let rows = ch.rows()?;
    ensure!(
        rows.len() == 1 && rows[0]["input_tokens"] == json!(5),
        "{rows:?}"
    );
    ensure!(
        rows[0]["output_tokens"] == json!(0),
        "missing columns default to 0: {rows:?}"
    );
    Ok(())
}

#[test]
fn stop_and_restart_keep_data_and_port() -> Result<()> {
    let mut ch = ClickHouse::start()?;
    ch.create_tables()?;
    let url = ch.url();
    let (status, body) = insert(&ch, &json_lines(&sample_rows()))?;
    ensure!(status == 200, "{body}");

    ch.stop();
    ensure!(!ch.is_running());
    // The sink is down: an insert fails at the connection, as the observer's would.
    ensure!(insert(&ch, &json_lines(&sample_rows()[..1])).is_err());

    ch.restart()?;
    ensure!(ch.is_running());
    ensure!(ch.url() == url);
    let late = json!({"at_ms":1764430001000u64,"request_id":"r-3","tenant":"acme","model":"m",
        "input_tokens":1,"output_tokens":2,"cache_read_tokens":0,"cache_creation_tokens":0,
        "usage_missing":0,"status":200,"latency_ms":1,"streamed":0,"sample_weight":100.0});
    let (status, body) = insert(&ch, &json_lines(&[late]))?;
    ensure!(status == 200, "{body}");
    let ids: Vec<Value> = ch.rows()?.iter().map(|r| r["request_id"].clone()).collect();
    ensure!(ids == [json!("r-1"), json!("r-2"), json!("r-3")], "{ids:?}");

    // A restart of a running server works too.
    ch.restart()?;
    ensure!(ch.rows()?.len() == 3);
    Ok(())
}

#[test]
fn only_loopback_and_the_default_user() -> Result<()> {
    let ch = ClickHouse::start()?;
    // 18.16 has no currentUser(): the query sees itself in system.processes.
    ensure!(ch.query("SELECT user FROM system.processes")?.trim() == "default");
    // A user that does not exist is refused (no anonymous fallback).
    let reply = Client::new().send(
        "POST",
        &format!("{}/?user=nobody", ch.url()),
        &[],
        "SELECT 1",
    )?;
    ensure!(reply.status != 200, "{}", reply.body);
    // Every socket it listens on for HTTP is 127.0.0.1's.
    let listening = listeners(ch.addr().port())?;
    ensure!(listening == ["0100007F"], "listening on {listening:?}");
    Ok(())
}

/// The local addresses (kernel hex) of listening TCP sockets on `port`.
fn listeners(port: u16) -> Result<Vec<String>> {
    let mut out = vec![];
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // fields[1] is ADDR:PORT in hex, fields[3] the state (0A = LISTEN).
            let Some((addr, p)) = fields.get(1).and_then(|f| f.split_once(':')) else {
                continue;
            };
            if fields.get(3) == Some(&"0A") && u16::from_str_radix(p, 16) == Ok(port) {
                out.push(addr.to_string());
            }
        }
    }
    Ok(out)
}

#[test]
fn reconcile_reads_the_sample_from_clickhouse() -> Result<()> {
    use host_sim_tools::reconcile::{self, Measure};
    let ch = ClickHouse::start()?;
    ch.create_tables()?;
    let (status, body) = insert(&ch, &json_lines(&sample_rows()))?;
    ensure!(status == 200, "{body}");
    // ClickHouse quotes the 64-bit columns; the reader takes them as numbers.
    let sample = reconcile::fetch_sample(&ch.url(), "zerolayer_usage")?;
    ensure!(sample.len() == 2, "{sample:?}");
    ensure!(sample[0].at_ms == 1764430000123 && sample[0].tokens.output == 34);
    ensure!(sample[0].sample_weight == 100.0 && sample[1].sample_weight == 0.0);

    // The access log saw 100 requests of acme in that hour, 3400 output
    // tokens in all: the estimate (100 × 34) is right on, input is not.
    let usage = |i: u64, input: u64| {
        json!({"usage": json!({"at_ms": 1764430000000u64 + i, "request_id": format!("q-{i}"),
            "tenant": "acme", "model": "m", "input_tokens": input, "output_tokens": 34,
            "cache_read_tokens": 0, "cache_creation_tokens": 0, "usage_missing": 0,
            "status": 200, "streamed": 1}).to_string()})
    };
    let log: Vec<Value> = (0..100)
        .map(|i| usage(i, if i == 0 { 20 } else { 12 }))
        .collect();
    let log = reconcile::read_access_log(json_lines(&log).as_bytes())?;
    let report = reconcile::reconcile(&log.rows, &sample, 0.003);
    let found: Vec<(&str, &str, f64)> = report
        .corrections
        .iter()
        .map(|c| (c.tenant.as_str(), c.measure, c.correction))
        .collect();
    // globex's only row is a forced one: no group, no correction.
    ensure!(found == [("acme", "input_tokens", 8.0)], "{found:?}");
    ensure!(report.groups[0].get(Measure::OutputTokens).estimate == 3400.0);

    ensure!(
        reconcile::fetch_sample(&ch.url(), "zerolayer_usage; DROP TABLE x").is_err(),
        "table names are checked"
    );
    let err = format!(
        "{:#}",
        reconcile::fetch_sample(&ch.url(), "missing").unwrap_err()
    );
    ensure!(
        err.contains("answered 404") && err.contains("doesn't exist"),
        "{err}"
    );
    Ok(())
}
