//! `host-sim`: run Proxy-Wasm filters natively.
//!
//! ```text
//! host-sim serve --chain envoy/activation.yaml --upstream http://127.0.0.1:8080 --listen 127.0.0.1:10000
//! host-sim stub --listen 127.0.0.1:18080 --ttft-ms 150 --itl-ms 20
//! host-sim reconcile --access-log access.log --clickhouse http://127.0.0.1:8123 --out corrections.jsonl
//! ```

use std::io::{BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use host_sim::Profile;
use host_sim::config_file::ChainFile;
use host_sim::reconcile;
use host_sim::serve::{ServeOptions, Server};
use zerolayer_stub::{Fault, StubConfig};

const USAGE: &str = "\
usage:
  host-sim serve --chain FILE --upstream URL|stub [--listen ADDR] [--admin ADDR]
                                  [--profile envoy|kong] [--kong-queues NAME,NAME…] [--logs]
      Run the chain in FILE (an Envoy bootstrap .yaml: its Wasm http_filters,
      bootstrap singletons and static clusters; or a JSON chain file) as a
      loopback proxy in front of URL (or a built-in GPU backend stub).
      Admin: GET /stats/prometheus, /logs, /ready.
  host-sim stub [--listen ADDR] [--ttft-ms N] [--itl-ms N] [--cache-control V] [--fault F]
      Run the GPU inference backend stub (Anthropic /v1/messages, OpenAI
      /v1/chat/completions; see host-sim/stub/README.md).
  host-sim reconcile --access-log FILE (--sample FILE | --clickhouse URL [--table NAME])
                     [--threshold FRACTION] [--out FILE]
      Compare the metering sample with the access log per tenant and hour
      and emit correction rows (`host-sim reconcile --help`).
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("serve") => serve(&args[1..]),
        Some("stub") => stub(&args[1..]),
        Some("reconcile") => reconcile(&args[1..]),
        Some("help" | "--help" | "-h") | None => {
            print!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(anyhow::anyhow!("unknown command {other:?}\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("host-sim: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// `--name value` pairs and bare `--flag`s.
struct Args(Vec<(String, Option<String>)>);

impl Args {
    fn parse(args: &[String], flags: &[&str]) -> Result<Args> {
        let mut out = vec![];
        let mut iter = args.iter();
        while let Some(arg) = iter.next() {
            let Some(name) = arg.strip_prefix("--") else {
                bail!("unexpected argument {arg:?}\n{USAGE}");
            };
            if flags.contains(&name) {
                out.push((name.to_string(), None));
            } else {
                let value = iter
                    .next()
                    .with_context(|| format!("--{name} needs a value"))?;
                out.push((name.to_string(), Some(value.clone())));
            }
        }
        Ok(Args(out))
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.as_deref())
    }

    fn flag(&self, name: &str) -> bool {
        self.0.iter().any(|(n, _)| n == name)
    }

    fn addr(&self, name: &str, default: &str) -> Result<SocketAddr> {
        let text = self.get(name).unwrap_or(default);
        text.parse()
            .with_context(|| format!("--{name}: expected IP:PORT, got {text:?}"))
    }
}

fn serve(args: &[String]) -> Result<()> {
    let args = Args::parse(args, &["logs"])?;
    let chain_path = PathBuf::from(args.get("chain").context("--chain FILE is required")?);
    let base = std::env::current_dir()?;
    let chain = ChainFile::load(&chain_path, &base)?;
    let _stub;
    let upstream = match args
        .get("upstream")
        .context("--upstream URL|stub is required")?
    {
        "stub" => {
            let stub = zerolayer_stub::Stub::start(StubConfig::default())?;
            let addr = stub.addr();
            _stub = Some(stub);
            addr
        }
        url => {
            let rest = url.strip_prefix("http://").unwrap_or(url);
            rest.split('/')
                .next()
                .unwrap_or(rest)
                .parse()
                .with_context(|| {
                    format!("--upstream: expected http://IP:PORT or stub, got {url}")
                })?
        }
    };
    let profile = match args.get("profile").unwrap_or("envoy") {
        "envoy" => Profile::Envoy,
        "kong" => Profile::Kong,
        other => bail!("--profile: envoy or kong, not {other:?}"),
    };
    let server = Server::start(ServeOptions {
        chain,
        upstream,
        listen: args.addr("listen", "127.0.0.1:10000")?,
        admin: args.addr("admin", "127.0.0.1:0")?,
        profile,
        echo_logs: args.flag("logs"),
        kong_queues: args
            .get("kong-queues")
            .map(|list| list.split(',').map(str::to_string).collect())
            .unwrap_or_default(),
    })?;
    eprintln!(
        "host-sim: serving {} → {upstream} (admin http://{})",
        server.addr(),
        server.admin()
    );
    server.wait();
    Ok(())
}

fn stub(args: &[String]) -> Result<()> {
    let args = Args::parse(args, &[])?;
    let ms = |name: &str| -> Result<Duration> {
        Ok(Duration::from_millis(match args.get(name) {
            Some(v) => v
                .parse()
                .with_context(|| format!("--{name}: milliseconds"))?,
            None => 0,
        }))
    };
    let mut config = StubConfig::default()
        .ttft(ms("ttft-ms")?)
        .itl(ms("itl-ms")?);
    if let Some(cc) = args.get("cache-control") {
        config = config.cache_control(cc);
    }
    if let Some(fault) = args.get("fault") {
        let fault: Fault = fault.parse().map_err(|e| anyhow::anyhow!("--fault: {e}"))?;
        config = config.fault(Some(fault));
    }
    let addr = args.addr("listen", "127.0.0.1:18080")?;
    eprintln!("host-sim stub: listening on {addr}");
    zerolayer_stub::serve_blocking(addr, config)
}

fn reconcile(args: &[String]) -> Result<()> {
    let args = Args::parse(args, &["help"])?;
    if args.flag("help") {
        print!("{}", reconcile::USAGE);
        return Ok(());
    }
    let known = [
        "access-log",
        "sample",
        "clickhouse",
        "table",
        "threshold",
        "out",
    ];
    for (i, (name, _)) in args.0.iter().enumerate() {
        if !known.contains(&name.as_str()) {
            bail!("unknown option --{name}\n{}", reconcile::USAGE);
        }
        // `get` reads the first: a second one would be ignored silently.
        if args.0[..i].iter().any(|(n, _)| n == name) {
            bail!("--{name} is given twice");
        }
    }
    let open = |path: &str| -> Result<BufReader<std::fs::File>> {
        Ok(BufReader::new(
            std::fs::File::open(path).with_context(|| format!("opening {path}"))?,
        ))
    };
    let log_path = args
        .get("access-log")
        .context("--access-log FILE is required")?;
    let log = reconcile::read_access_log(open(log_path)?).with_context(|| log_path.to_string())?;
    let sample = match (args.get("sample"), args.get("clickhouse")) {
        (Some(_), None) if args.get("table").is_some() => {
            bail!("--table goes with --clickhouse, not --sample")
        }
        (Some(path), None) => {
            reconcile::read_sample(open(path)?).with_context(|| path.to_string())?
        }
        (None, Some(url)) => {
            let table = args.get("table").unwrap_or(reconcile::DEFAULT_TABLE);
            reconcile::fetch_sample(url, table)?
        }
        _ => bail!("give one of --sample FILE and --clickhouse URL"),
    };
    let threshold = match args.get("threshold") {
        Some(text) => text
            .parse::<f64>()
            .ok()
            .filter(|t| t.is_finite() && *t >= 0.0)
            .with_context(|| {
                format!("--threshold: a fraction >= 0 (0.003 = 0.3%), not {text:?}")
            })?,
        None => reconcile::DEFAULT_THRESHOLD,
    };
    let report = reconcile::reconcile(&log.rows, &sample, threshold);
    let mut rows = String::new();
    for correction in &report.corrections {
        rows.push_str(&serde_json::to_string(correction)?);
        rows.push('\n');
    }
    let summary = format!(
        "{}access log lines without usage (not metered), skipped: {}\n",
        report.summary(),
        log.skipped
    );
    // The rows own stdout unless they go to a file, so they can be piped.
    match args.get("out") {
        Some(path) => {
            std::fs::write(path, rows).with_context(|| format!("writing {path}"))?;
            print!("{summary}");
        }
        None => {
            std::io::stdout().write_all(rows.as_bytes())?;
            eprint!("{summary}");
        }
    }
    Ok(())
}
