//! `cargo xtask fuzz`: the libFuzzer targets of `fuzz/` (cargo-fuzz), each
//! for a few seconds (CI) or as long as asked (`--seconds 600`).
//!
//! Installs what it needs (the nightly toolchain, cargo-fuzz at a pinned
//! version), builds every target once, then runs each from a copy of the
//! committed corpus under `target/fuzz/` so the repository is never
//! written: inputs libFuzzer finds interesting accumulate there, crash
//! inputs land in `target/fuzz/artifacts/<target>/`. A crash fails the
//! command with the target's name and the input's path; saved under
//! `fuzz/regressions/<target>/`, that input then runs in `cargo test`
//! (`filters/core/tests/fuzz_regressions.rs`).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::{paths, step};

/// The cargo-fuzz version installed when `cargo fuzz` is missing.
const CARGO_FUZZ_VERSION: &str = "0.13.2";

/// Seconds per target unless `--seconds` says otherwise.
const DEFAULT_SECONDS: u64 = 10;

/// Longest one input may run before libFuzzer reports it as a hang.
const INPUT_TIMEOUT_SECS: u64 = 30;

/// Lines of a failed run's libFuzzer log shown (the whole log is kept).
const LOG_TAIL_LINES: usize = 60;

const USAGE: &str = "\
usage: cargo xtask fuzz [--seconds N] [--target NAME] [--seed N]

  --seconds N     run each target for N seconds (default 10)
  --target NAME   run only this target (a file stem in fuzz/fuzz_targets/)
  --seed N        libFuzzer's random seed (CI fixes it, so a failure there
                  can be replayed; default: a new one each run)
";

/// What the command line asked for.
struct Options {
    seconds: u64,
    target: Option<String>,
    seed: Option<u64>,
}

fn parse_args(args: &[String]) -> Result<Options> {
    let mut options = Options {
        seconds: DEFAULT_SECONDS,
        target: None,
        seed: None,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => {
                let value = args.next().context("--seconds needs a value")?;
                options.seconds = value
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .with_context(|| format!("--seconds {value:?}: not a positive integer"))?;
            }
            "--target" => {
                options.target = Some(args.next().context("--target needs a value")?.clone());
            }
            "--seed" => {
                let value = args.next().context("--seed needs a value")?;
                options.seed = Some(
                    value
                        .parse()
                        .with_context(|| format!("--seed {value:?}: not an integer"))?,
                );
            }
            "--help" | "-h" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    Ok(options)
}

/// A `cargo` through rustup's proxy (so `+nightly` works), without the
/// variables `cargo xtask` set for this process's own toolchain.
fn rustup_cargo() -> Command {
    let mut command = Command::new("cargo");
    command
        .env_remove("CARGO")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .current_dir(paths::root());
    command
}

/// Whether `command` runs and exits 0 (its output discarded).
fn succeeds(command: &mut Command) -> bool {
    command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

fn run_checked(command: &mut Command, what: &str) -> Result<()> {
    step(what);
    let status = command
        .status()
        .with_context(|| format!("running {what}"))?;
    if !status.success() {
        bail!("`{what}` failed ({status})");
    }
    Ok(())
}

/// The nightly toolchain (libFuzzer's sanitizer flags need it) and cargo-fuzz.
fn ensure_tools() -> Result<()> {
    if !succeeds(rustup_cargo().args(["+nightly", "--version"])) {
        run_checked(
            Command::new("rustup").args([
                "toolchain",
                "install",
                "nightly",
                "--profile",
                "minimal",
            ]),
            "rustup toolchain install nightly --profile minimal",
        )?;
    }
    if !succeeds(rustup_cargo().args(["fuzz", "--version"])) {
        run_checked(
            rustup_cargo().args([
                "install",
                "cargo-fuzz",
                "--version",
                CARGO_FUZZ_VERSION,
                "--locked",
            ]),
            &format!("cargo install cargo-fuzz --version {CARGO_FUZZ_VERSION} --locked"),
        )?;
    }
    Ok(())
}

/// The targets: file stems of `fuzz/fuzz_targets/*.rs`, sorted.
fn targets(fuzz: &Path) -> Result<Vec<String>> {
    let dir = fuzz.join("fuzz_targets");
    let mut names = Vec::new();
    for entry in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "rs")
            && let Some(stem) = path.file_stem().and_then(|s| s.to_str())
        {
            names.push(stem.to_string());
        }
    }
    names.sort();
    Ok(names)
}

/// Copies the files of `from` (if it exists) into `to`.
fn copy_inputs(from: &Path, to: &Path) -> Result<usize> {
    let Ok(entries) = fs::read_dir(from) else {
        return Ok(0);
    };
    let mut copied = 0;
    for entry in entries {
        let path = entry?.path();
        if let (true, Some(name)) = (path.is_file(), path.file_name()) {
            fs::copy(&path, to.join(name))
                .with_context(|| format!("copying {}", path.display()))?;
            copied += 1;
        }
    }
    Ok(copied)
}

/// Files in `dir` (crash, timeout, OOM and leak inputs libFuzzer wrote).
fn artifacts(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|entry| entry.ok().map(|e| e.path()))
                .filter(|path| path.is_file())
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// What a failed run's log says about the failure: the panic message (not
/// the sanitizer's stack dump) and libFuzzer's summary, or else its tail.
fn failure_summary(log: &str) -> String {
    let mut kept = Vec::new();
    let mut in_panic = false;
    for line in log.lines() {
        if line.contains("panicked at") || line.starts_with("==") && line.contains("ERROR:") {
            in_panic = true;
        } else if line.starts_with("stack backtrace:") || line.starts_with("note: ") {
            in_panic = false;
        }
        if in_panic || line.starts_with("SUMMARY:") || line.contains("Test unit written to") {
            kept.push(line);
        }
    }
    if kept.is_empty() {
        tail(log, LOG_TAIL_LINES)
    } else {
        kept.join("\n")
    }
}

/// libFuzzer's closing `Done N runs in S second(s)` line, if it got there.
fn done_line(log: &str) -> Option<&str> {
    log.lines().rev().find(|line| line.starts_with("Done "))
}

/// Runs one target for `seconds`; on a crash, the error names the target
/// and the input.
fn run_target(root: &Path, target: &str, seconds: u64, seed: Option<u64>) -> Result<()> {
    let scratch = root.join("target/fuzz");
    let corpus = scratch.join("corpus").join(target);
    let artifacts_dir = scratch.join("artifacts").join(target);
    let log_path = scratch.join("logs").join(format!("{target}.log"));
    // Inputs found by earlier runs stay in the scratch corpus; the
    // committed ones are copied over them each time.
    fs::create_dir_all(&corpus)?;
    let _ = fs::remove_dir_all(&artifacts_dir);
    fs::create_dir_all(&artifacts_dir)?;
    fs::create_dir_all(scratch.join("logs"))?;
    let fuzz = root.join("fuzz");
    let seeds = copy_inputs(&fuzz.join("corpus").join(target), &corpus)?
        + copy_inputs(&fuzz.join("regressions").join(target), &corpus)?;
    if seeds == 0 {
        bail!("fuzz/corpus/{target}/ is empty: commit a few seed inputs");
    }

    step(&format!("fuzz {target} for {seconds} s"));
    let log =
        fs::File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
    let started = Instant::now();
    // libFuzzer reads its flags in order: this -artifact_prefix replaces the
    // one cargo-fuzz passes (fuzz/artifacts/, inside the repository).
    let status = rustup_cargo()
        .args([
            "+nightly",
            "fuzz",
            "run",
            "--fuzz-dir",
            "fuzz",
            "--debug-assertions",
        ])
        .arg(target)
        .arg(&corpus)
        .arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .args(seed.map(|seed| format!("-seed={seed}")))
        .arg(format!("-timeout={INPUT_TIMEOUT_SECS}"))
        .arg(format!("-artifact_prefix={}/", artifacts_dir.display()))
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .context("running cargo fuzz run")?;
    let elapsed = started.elapsed().as_secs_f64();
    let output = fs::read_to_string(&log_path).unwrap_or_default();
    if status.success() {
        eprintln!(
            "    {target}: {} ({elapsed:.1} s; log {})",
            done_line(&output).unwrap_or("done"),
            log_path.display()
        );
        return Ok(());
    }
    let found = artifacts(&artifacts_dir);
    eprintln!("{}", failure_summary(&output));
    if found.is_empty() {
        bail!(
            "fuzz target {target} failed ({status}) without a crash input; log: {}",
            log_path.display()
        );
    }
    let inputs: Vec<String> = found.iter().map(|p| p.display().to_string()).collect();
    bail!(
        "fuzz target {target} found a crash: {}\n  reproduce: cargo +nightly fuzz run --fuzz-dir fuzz {target} {}\n  keep it as a test: copy it to fuzz/regressions/{target}/ (run by `cargo test -p zerolayer-core --test fuzz_regressions`)\n  log: {}",
        inputs.join(", "),
        inputs[0],
        log_path.display()
    )
}

/// `cargo xtask fuzz [--seconds N] [--target NAME]`.
pub fn run(args: &[String]) -> Result<()> {
    let options = parse_args(args)?;
    let root = paths::root();
    let all = targets(&root.join("fuzz"))?;
    let selected: Vec<String> = match &options.target {
        Some(name) if all.contains(name) => vec![name.clone()],
        Some(name) => bail!("no fuzz target {name:?}; targets: {}", all.join(", ")),
        None => all,
    };
    ensure_tools()?;

    let started = Instant::now();
    let mut build = rustup_cargo();
    build.args([
        "+nightly",
        "fuzz",
        "build",
        "--fuzz-dir",
        "fuzz",
        "--debug-assertions",
    ]);
    if let Some(name) = &options.target {
        build.arg(name);
    }
    run_checked(&mut build, "cargo +nightly fuzz build --fuzz-dir fuzz")?;
    eprintln!("    built in {:.1} s", started.elapsed().as_secs_f64());

    // Every target runs even after a crash, so one run reports them all.
    let mut failures = Vec::new();
    for target in &selected {
        if let Err(err) = run_target(&root, target, options.seconds, options.seed) {
            eprintln!("xtask: {err:#}");
            failures.push(target.as_str());
        }
    }
    if !failures.is_empty() {
        bail!(
            "fuzzing found crashes in: {} (details above)",
            failures.join(", ")
        );
    }
    step(&format!(
        "fuzzed {} target(s) for {} s each without a crash ({:.0} s in all)",
        selected.len(),
        options.seconds,
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}
