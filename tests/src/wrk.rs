//! The load benches' load generator: wrk (Debian's 4.1.0, installed by
//! `cargo xtask setup`), run the one way the benches run it (`-t1`, a
//! Lua script for the request, `--latency` for the percentiles), and its
//! report parsed once for all of them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, anyhow, bail, ensure};

/// What one wrk run reported.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Report {
    /// Connections it kept open (`-c`).
    pub connections: u32,
    /// Responses it completed.
    pub requests: u64,
    /// How long it ran, seconds.
    pub seconds: f64,
    /// `Requests/sec`.
    pub rps: f64,
    /// Median latency, µs.
    pub p50_us: f64,
    /// 99th-percentile latency, µs.
    pub p99_us: f64,
    /// Answers that were not 2xx or 3xx.
    pub non_2xx: u64,
    /// Socket errors (connect, read, write, timeout), summed.
    pub socket_errors: u64,
}

/// `/usr/bin/wrk`, or `wrk` on PATH; the error says how to install it.
pub fn binary() -> Result<PathBuf> {
    let debian = PathBuf::from("/usr/bin/wrk");
    if debian.is_file() {
        return Ok(debian);
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("wrk"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            anyhow!("wrk not found: install it with `cargo xtask setup` (apt-get install wrk)")
        })
}

/// Runs `wrk -t1 -c<connections> -d<secs>s --latency --timeout 5s -s
/// <script> <url>` and parses its report; fails when wrk fails or reports
/// nothing. Non-2xx answers and socket errors are counted in the report,
/// for the caller to judge.
pub fn run(wrk: &Path, url: &str, script: &Path, connections: u32, secs: u64) -> Result<Report> {
    let output = Command::new(wrk)
        .args(["-t1", &format!("-c{connections}"), &format!("-d{secs}s")])
        .args(["--latency", "--timeout", "5s", "-s"])
        .arg(script)
        .arg(url)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", wrk.display()))?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    ensure!(
        output.status.success(),
        "wrk failed ({}):\n{text}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    parse(&text, connections).with_context(|| format!("wrk's report:\n{text}"))
}

/// Parses wrk's report (with `--latency`) of a run over `connections`.
pub fn parse(text: &str, connections: u32) -> Result<Report> {
    let mut report = Report {
        connections,
        p50_us: f64::NAN,
        p99_us: f64::NAN,
        ..Report::default()
    };
    for line in text.lines().map(str::trim) {
        if let Some(n) = line.strip_prefix("Non-2xx or 3xx responses:") {
            report.non_2xx = n.trim().parse().with_context(|| format!("{line:?}"))?;
        } else if let Some(errors) = line.strip_prefix("Socket errors:") {
            // `Socket errors: connect 0, read 3, write 0, timeout 1`
            for part in errors.split(',') {
                let n = part.split_whitespace().last().unwrap_or_default();
                report.socket_errors += n.parse::<u64>().with_context(|| format!("{line:?}"))?;
            }
        } else if let Some(v) = line.strip_prefix("50%") {
            report.p50_us = duration_us(v.trim())?;
        } else if let Some(v) = line.strip_prefix("99%") {
            report.p99_us = duration_us(v.trim())?;
        } else if let Some(v) = line.strip_prefix("Requests/sec:") {
            report.rps = v.trim().parse().with_context(|| format!("{line:?}"))?;
        } else if let Some((n, rest)) = line.split_once(" requests in ") {
            report.requests = n.trim().parse().with_context(|| format!("{line:?}"))?;
            let secs = rest.split(',').next().unwrap_or_default();
            report.seconds = duration_us(secs.trim())? / 1e6;
        }
    }
    ensure!(
        report.requests > 0 && report.p50_us.is_finite() && report.p99_us.is_finite(),
        "incomplete report"
    );
    Ok(report)
}

/// wrk's durations (`123.45us`, `1.20ms`, `5.00s`, `2.00m`) in µs.
pub fn duration_us(text: &str) -> Result<f64> {
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| anyhow!("no unit in {text:?}"))?;
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .with_context(|| format!("parsing {text:?}"))?;
    let scale = match unit {
        "us" => 1.0,
        "ms" => 1e3,
        "s" => 1e6,
        "m" => 60e6,
        "h" => 3600e6,
        other => bail!("unknown unit {other:?} in {text:?}"),
    };
    Ok(number * scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report as wrk 4.1.0 prints it, with errors.
    const REPORT: &str = "\
Running 2s test @ http://127.0.0.1:39033/v1/chat/completions
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   335.41ms   40.12ms 411.20ms   81.00%
    Req/Sec    47.20      9.01    60.00     70.00%
  Latency Distribution
     50%  341.96ms
     75%  352.10ms
     90%  371.00ms
     99%    1.02s
  94 requests in 2.01s, 98.53KB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:     46.79
Transfer/sec:     49.04KB
";

    #[test]
    fn reads_counts_rates_percentiles_and_errors() -> Result<()> {
        let report = parse(REPORT, 16)?;
        assert_eq!(
            report,
            Report {
                connections: 16,
                requests: 94,
                seconds: 2.01,
                rps: 46.79,
                p50_us: 341_960.0,
                p99_us: 1_020_000.0,
                non_2xx: 4,
                socket_errors: 3,
            }
        );
        Ok(())
    }

    #[test]
    fn a_report_without_requests_or_percentiles_is_an_error() {
        assert!(parse("Running 1s test @ http://x\n", 1).is_err());
        let no_latency = REPORT.replace("50%", "5O%");
        assert!(parse(&no_latency, 16).is_err());
    }

    #[test]
    fn durations_in_every_unit() -> Result<()> {
        assert_eq!(duration_us("123.45us")?, 123.45);
        assert_eq!(duration_us("1.20ms")?, 1200.0);
        assert_eq!(duration_us("2.00m")?, 120e6);
        assert!(duration_us("12").is_err());
        assert!(duration_us("1.0ns").is_err());
        Ok(())
    }
}
