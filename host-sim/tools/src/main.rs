//! `host-sim`: run Proxy-Wasm filters natively.
//!
//! ```text
//! host-sim serve --chain envoy/activation.yaml --upstream http://127.0.0.1:8080 --listen 127.0.0.1:10000
//! host-sim stub --listen 127.0.0.1:18080 --ttft-ms 150 --itl-ms 20
//! host-sim playground --listen 127.0.0.1:8787 --dir target/playground
//! host-sim reconcile --access-log access.log --clickhouse http://127.0.0.1:8123 --out corrections.jsonl
//! host-sim quota-reconcile --config filters/quota/example.json --webdis http://127.0.0.1:7379 --clickhouse http://127.0.0.1:8123
//! host-sim replay --chain envoy/zerolayer.yaml --skip-filter envoy.filters.http.compressor --traffic traffic.jsonl --upstream stub --report report.html
//! host-sim import --from har session.har --out traffic.jsonl
//! host-sim check envoy/zerolayer.yaml envoy/zerolayer-fused.yaml
//! host-sim check --kong kong/kong.yml kong/kong.conf
//! ```

use std::io::{BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use host_sim::Profile;
use host_sim_tools::config_file::ChainFile;
use host_sim_tools::reconcile;
use host_sim_tools::replay::{self, ReplayOptions, Upstream};
use host_sim_tools::serve::{ServeOptions, Server};
use host_sim_tools::{report, traffic};
use zerolayer_stub::{Fault, StubConfig};

const USAGE: &str = "\
usage:
  host-sim serve --chain FILE --upstream URL|stub [--listen ADDR] [--admin ADDR]
                                  [--profile envoy|kong] [--kong-queues NAME,NAME…]
                                  [--kong-body-buffer BYTES] [--skip-filter NAME,NAME…] [--logs]
      Run the chain in FILE (an Envoy bootstrap .yaml: its Wasm http_filters,
      bootstrap singletons, static clusters and routes; or a JSON chain file) as
      a loopback proxy in front of URL (or a built-in GPU backend stub). An HTTP
      filter that is neither Wasm nor the router is an error unless named in
      --skip-filter (then left out on purpose).
      Admin: GET /stats/prometheus, /logs, /ready.
  host-sim stub [--listen ADDR] [--ttft-ms N] [--itl-ms N] [--cache-control V] [--fault F]
      Run the GPU inference backend stub (Anthropic /v1/messages, OpenAI
      /v1/chat/completions; see host-sim/stub/README.md).
  host-sim playground [--listen ADDR] [--dir DIR]
      Serve the rule playground page (`cargo xtask build-playground`; DIR,
      default target/playground) on ADDR (default 127.0.0.1:8787).
  host-sim reconcile --access-log FILE (--sample FILE | --clickhouse URL [--table NAME])
                     [--attribution FILE | --attribution-table NAME]
                     [--threshold FRACTION] [--out FILE]
      Compare the metering sample with the access log per tenant and hour
      (unverified requests billed to the tenant attribution rows name) and
      emit correction rows (`host-sim reconcile --help`).
  host-sim quota-reconcile --config FILE --webdis URL
                           (--attribution FILE | --clickhouse URL [--attribution-table NAME])
                           [--dry-run]
      Charge to their tenant the lazily admitted requests quota's holders
      handed to the store (no verdict in time), once
      (`host-sim quota-reconcile --help`).
  host-sim replay --chain FILE --traffic FILE --upstream stub|recorded|URL
                  [--speed F] [--concurrency N] [--no-baseline] [--out FILE] [--report FILE]
                  [--cluster NAME=IP:PORT]... [--capture CLUSTER]... [--title TEXT]
                  [--profile envoy|kong] [--kong-queues NAME,NAME…] [--no-progress]
                  [--skip-filter NAME,NAME…]
      Replay recorded traffic (JSON Lines, host-sim/tools/REPLAY.md) through the chain
      at its recorded arrival times divided by F (0: no waiting), at most N in
      flight (default 16), then once more straight to the upstream for the
      baseline. Per-request results as JSON Lines to --out (default: none),
      an HTML report to --report, the summary on stdout. --cluster points a
      cluster elsewhere; --capture answers it in-process and keeps what the
      observer ships (the metering sample, compared with the truth).
  host-sim import --from envoy|har FILE [--out FILE]
      Turn Envoy's JSON access log or a HAR file into replay traffic.
  host-sim check [--base DIR] [ENVOY.yaml]... [--kong KONG.yml KONG.conf]...
      Check configurations before a reload or deploy: each zerolayer filter's
      configuration loaded by the filters' own loaders, and what the host must
      provide for it (clusters or callout addresses, the observer's queue and
      vm_id, secrets' environment variables, Wasm files, Kong's shm zones and
      queues). One line per problem (`FILE: FIELD: what is wrong`), `OK FILE`
      for a good file; exits 1 if any problem. Relative Wasm paths resolve
      against DIR (default: the current directory, as Envoy and Kong do).
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("serve") => serve(&args[1..]),
        Some("stub") => stub(&args[1..]),
        Some("playground") => host_sim_tools::playground::main(&args[1..]),
        Some("reconcile") => reconcile(&args[1..]),
        Some("quota-reconcile") => quota_reconcile(&args[1..]),
        Some("replay") => replay(&args[1..]),
        Some("import") => import(&args[1..]),
        Some("check") => return check(&args[1..]),
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

    /// Every value of a repeatable option, in order.
    fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(n, _)| n == name)
            .filter_map(|(_, v)| v.as_deref())
            .collect()
    }

    /// Refuses options not in `known`, and repeats of those not in `repeatable`.
    fn only(&self, known: &[&str], repeatable: &[&str]) -> Result<()> {
        for (i, (name, _)) in self.0.iter().enumerate() {
            if !known.contains(&name.as_str()) {
                bail!("unknown option --{name}\n{USAGE}");
            }
            if !repeatable.contains(&name.as_str()) && self.0[..i].iter().any(|(n, _)| n == name) {
                bail!("--{name} is given twice");
            }
        }
        Ok(())
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

/// `host-sim check`: prints each problem (or `OK FILE`), fails if any.
fn check(args: &[String]) -> ExitCode {
    match run_check(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("host-sim check: {err:#}");
            ExitCode::from(2)
        }
    }
}

/// Runs the checks; `Ok(false)` when a file has a problem.
fn run_check(args: &[String]) -> Result<bool> {
    use host_sim_tools::check::{Problem, check_envoy, check_kong};
    let mut base = PathBuf::from(".");
    let mut envoy = Vec::new();
    let mut kong = Vec::new();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        match arg.as_str() {
            "--base" => base = PathBuf::from(iter.next().context("--base needs a directory")?),
            "--kong" => {
                let yml = iter.next().context("--kong needs KONG.yml and KONG.conf")?;
                let conf = iter.next().context("--kong needs KONG.yml and KONG.conf")?;
                kong.push((yml.clone(), conf.clone()));
            }
            other if other.starts_with("--") => bail!("unknown option {other}\n{USAGE}"),
            file => envoy.push(file.to_string()),
        }
    }
    if envoy.is_empty() && kong.is_empty() {
        bail!("no configuration to check\n{USAGE}");
    }
    let read =
        |file: &str| std::fs::read_to_string(file).with_context(|| format!("reading {file}"));
    let env = |name: &str| std::env::var(name).ok();
    let mut good = true;
    let mut report = |files: &[&str], problems: Vec<Problem>| {
        for problem in &problems {
            println!("{problem}");
        }
        for file in files {
            if !problems.iter().any(|p| p.file == *file) {
                println!("OK {file}");
            }
        }
        good &= problems.is_empty();
    };
    for file in &envoy {
        let problems = check_envoy(file, &read(file)?, &base, &env);
        report(&[file], problems);
    }
    for (yml, conf) in &kong {
        let problems = check_kong(yml, &read(yml)?, conf, &read(conf)?, &base, &env);
        report(&[yml, conf], problems);
    }
    Ok(good)
}

fn serve(args: &[String]) -> Result<()> {
    let args = Args::parse(args, &["logs"])?;
    let chain_path = PathBuf::from(args.get("chain").context("--chain FILE is required")?);
    let base = std::env::current_dir()?;
    let skip: Vec<String> = args
        .get("skip-filter")
        .map(|list| list.split(',').map(str::to_string).collect())
        .unwrap_or_default();
    let chain = ChainFile::load_skipping(&chain_path, &base, &skip)?;
    for name in &chain.skipped {
        eprintln!("host-sim: HTTP filter {name} left out (--skip-filter)");
    }
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
    let profile = profile(&args)?;
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
        kong_body_buffer_bytes: args
            .get("kong-body-buffer")
            .map(|n| n.parse::<usize>())
            .transpose()
            .context("--kong-body-buffer: expected a number of bytes")?,
        records: None,
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
    args.only(
        &[
            "access-log",
            "sample",
            "clickhouse",
            "table",
            "attribution",
            "attribution-table",
            "threshold",
            "out",
            "help",
        ],
        &[],
    )?;
    let open = |path: &str| -> Result<BufReader<std::fs::File>> {
        Ok(BufReader::new(
            std::fs::File::open(path).with_context(|| format!("opening {path}"))?,
        ))
    };
    let log_path = args
        .get("access-log")
        .context("--access-log FILE is required")?;
    let mut log =
        reconcile::read_access_log(open(log_path)?).with_context(|| log_path.to_string())?;
    let mut sample = match (args.get("sample"), args.get("clickhouse")) {
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
    let attributions = match (
        args.get("attribution"),
        args.get("attribution-table"),
        args.get("clickhouse"),
    ) {
        (Some(_), Some(_), _) => bail!("give one of --attribution FILE and --attribution-table"),
        (Some(path), None, _) => {
            reconcile::read_attributions(open(path)?).with_context(|| path.to_string())?
        }
        (None, table, Some(url)) => reconcile::fetch_attributions(
            url,
            table.unwrap_or(reconcile::DEFAULT_ATTRIBUTION_TABLE),
        )?,
        (None, Some(_), None) => bail!("--attribution-table goes with --clickhouse"),
        (None, None, None) => reconcile::Attributions::default(),
    };
    let attributed = attributions.apply(&mut log.rows, &mut sample);
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
        "{}access log lines without usage (not metered), skipped: {}\n\
         unverified requests billed to the tenant their credential turned out to have: {attributed}\n",
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

fn quota_reconcile(args: &[String]) -> Result<()> {
    use host_sim_tools::quota_reconcile::{self, Webdis};
    let args = Args::parse(args, &["help", "dry-run"])?;
    if args.flag("help") {
        print!("{}", quota_reconcile::USAGE);
        return Ok(());
    }
    args.only(
        &[
            "config",
            "webdis",
            "attribution",
            "clickhouse",
            "attribution-table",
            "dry-run",
            "help",
        ],
        &[],
    )?;
    let path = args
        .get("config")
        .context("--config QUOTA.json is required")?;
    let text = std::fs::read(path).with_context(|| format!("reading {path}"))?;
    let config = zerolayer_core::quota::config::QuotaConfig::from_json(&text)
        .map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
    let quota = zerolayer_core::quota::GatewayQuota::new(&config, 0, 0)
        .map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
    let webdis = Webdis::new(args.get("webdis").context("--webdis URL is required")?);
    let attributions = match (
        args.get("attribution"),
        args.get("clickhouse"),
        args.get("attribution-table"),
    ) {
        (Some(file), None, None) => {
            let reader = BufReader::new(
                std::fs::File::open(file).with_context(|| format!("opening {file}"))?,
            );
            reconcile::read_attributions(reader).with_context(|| file.to_string())?
        }
        (None, Some(url), table) => reconcile::fetch_attributions(
            url,
            table.unwrap_or(reconcile::DEFAULT_ATTRIBUTION_TABLE),
        )?,
        _ => {
            bail!("give one of --attribution FILE and --clickhouse URL [--attribution-table NAME]")
        }
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let report =
        quota_reconcile::run(&webdis, &quota, &attributions, now_ms, args.flag("dry-run"))?;
    let mut out = String::new();
    for made in &report.made {
        out.push_str(&serde_json::to_string(made)?);
        out.push('\n');
    }
    std::io::stdout().write_all(out.as_bytes())?;
    eprintln!("{}", report.summary());
    Ok(())
}

fn profile(args: &Args) -> Result<Profile> {
    match args.get("profile").unwrap_or("envoy") {
        "envoy" => Ok(Profile::Envoy),
        "kong" => Ok(Profile::Kong),
        other => bail!("--profile: envoy or kong, not {other:?}"),
    }
}

fn replay(args: &[String]) -> Result<()> {
    let args = Args::parse(args, &["no-baseline", "no-progress"])?;
    args.only(
        &[
            "chain",
            "traffic",
            "upstream",
            "speed",
            "concurrency",
            "no-baseline",
            "out",
            "report",
            "cluster",
            "capture",
            "title",
            "profile",
            "kong-queues",
            "no-progress",
            "skip-filter",
        ],
        &["cluster", "capture"],
    )?;
    let chain_path = args.get("chain").context("--chain FILE is required")?;
    let skip: Vec<String> = args
        .get("skip-filter")
        .map(|list| list.split(',').map(str::to_string).collect())
        .unwrap_or_default();
    let chain =
        ChainFile::load_skipping(&PathBuf::from(chain_path), &std::env::current_dir()?, &skip)?;
    let traffic_path = args.get("traffic").context("--traffic FILE is required")?;
    let file =
        std::fs::File::open(traffic_path).with_context(|| format!("opening {traffic_path}"))?;
    let records = traffic::read(BufReader::new(file)).with_context(|| traffic_path.to_string())?;
    if records.is_empty() {
        bail!("{traffic_path}: no requests to replay");
    }
    let mut options = ReplayOptions::new(chain, records);
    options.upstream = match args
        .get("upstream")
        .context("--upstream stub|recorded|URL is required")?
    {
        "stub" => Upstream::Stub(StubConfig::default()),
        "recorded" => Upstream::Recorded,
        url => Upstream::Addr(
            url.strip_prefix("http://")
                .unwrap_or(url)
                .trim_end_matches('/')
                .parse()
                .with_context(|| {
                    format!("--upstream: stub, recorded or http://IP:PORT, not {url:?}")
                })?,
        ),
    };
    if let Some(speed) = args.get("speed") {
        options.speed = speed
            .parse()
            .ok()
            .filter(|s: &f64| s.is_finite() && *s >= 0.0)
            .with_context(|| format!("--speed: a factor >= 0 (0 = no waiting), not {speed:?}"))?;
    }
    if let Some(n) = args.get("concurrency") {
        options.concurrency = n
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .with_context(|| format!("--concurrency: a count >= 1, not {n:?}"))?;
    }
    options.baseline = !args.flag("no-baseline");
    options.profile = profile(&args)?;
    options.kong_queues = args
        .get("kong-queues")
        .map(|list| list.split(',').map(str::to_string).collect())
        .unwrap_or_default();
    for cluster in args.all("cluster") {
        let (name, addr) = cluster
            .split_once('=')
            .with_context(|| format!("--cluster: NAME=IP:PORT, not {cluster:?}"))?;
        let addr: SocketAddr = addr
            .parse()
            .with_context(|| format!("--cluster {name}: expected IP:PORT, got {addr:?}"))?;
        options.clusters.push((name.to_string(), addr));
    }
    options.capture = args
        .all("capture")
        .into_iter()
        .map(str::to_string)
        .collect();
    options.progress = !args.flag("no-progress");

    let result = replay::run(options)?;
    if let Some(path) = args.get("out") {
        let mut lines = String::new();
        for request in &result.requests {
            lines.push_str(&serde_json::to_string(request)?);
            lines.push('\n');
        }
        std::fs::write(path, lines).with_context(|| format!("writing {path}"))?;
    }
    if let Some(path) = args.get("report") {
        let title = args
            .get("title")
            .map(str::to_string)
            .unwrap_or_else(|| format!("zerolayer replay: {traffic_path} through {chain_path}"));
        std::fs::write(path, report::html(&result, &title))
            .with_context(|| format!("writing {path}"))?;
    }
    print!("{}", result.summary());
    Ok(())
}

fn import(args: &[String]) -> Result<()> {
    let (from, rest) = match args {
        [flag, from, file, rest @ ..] if flag == "--from" => (from.as_str(), (file, rest)),
        _ => bail!("usage: host-sim import --from envoy|har FILE [--out FILE]"),
    };
    let (file, rest) = rest;
    let options = Args::parse(rest, &[])?;
    options.only(&["out"], &[])?;
    let text = std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?;
    let records = match from {
        "envoy" => {
            let (records, without_body) = traffic::import_envoy_access_log(text.as_bytes())
                .with_context(|| file.to_string())?;
            if without_body > 0 {
                eprintln!(
                    "host-sim import: {without_body} of {} requests have no body in the log \
                     (log `request_body` to keep it); they replay with an empty body",
                    records.len()
                );
            }
            records
        }
        "har" => traffic::import_har(&text).with_context(|| file.to_string())?,
        other => bail!("--from: envoy or har, not {other:?}"),
    };
    let lines = traffic::write(&records)?;
    match options.get("out") {
        Some(path) => {
            std::fs::write(path, lines).with_context(|| format!("writing {path}"))?;
            eprintln!("host-sim import: {} requests → {path}", records.len());
        }
        None => std::io::stdout().write_all(lines.as_bytes())?,
    }
    Ok(())
}
