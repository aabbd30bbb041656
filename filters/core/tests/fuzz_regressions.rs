//! Every committed fuzz input through its target's invariant checks, on
//! stable Rust: the seed corpus (`fuzz/corpus/<target>/`) and the inputs of
//! crashes found and fixed (`fuzz/regressions/<target>/`). The checks are
//! the fuzz targets' own (`fuzz_checks`), so a crash found by `cargo xtask
//! fuzz` and saved under `fuzz/regressions/` fails here until it is fixed.

mod fuzz_checks;

use std::fs;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use fuzz_checks::TARGETS;

/// The cargo-fuzz project at the repository root.
fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// Files directly under `dir`, sorted; none if `dir` does not exist.
fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|entry| entry.expect("reading a fuzz input folder").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    files
}

/// Folder names under `dir` (the targets that have inputs there).
fn subfolders(dir: &Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .map(|entry| entry.expect("reading a fuzz folder").path())
        .filter(|path| path.is_dir())
        .filter_map(|path| Some(path.file_name()?.to_str()?.to_string()))
        .collect()
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic)".to_string()
    }
}

/// Runs `check` on every input of `target`, then fails naming each input
/// that broke an invariant (all of them, not only the first).
fn run(target: &str) {
    let (_, check) = TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .expect("a known target");
    let fuzz = fuzz_dir();
    let corpus = files(&fuzz.join("corpus").join(target));
    assert!(
        !corpus.is_empty(),
        "fuzz/corpus/{target}/ has no seed inputs"
    );
    let regressions = files(&fuzz.join("regressions").join(target));
    let mut failures = Vec::new();
    for path in corpus.iter().chain(&regressions) {
        let data = fs::read(path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
        if let Err(payload) = panic::catch_unwind(AssertUnwindSafe(|| check(&data))) {
            failures.push(format!("{}: {}", path.display(), panic_message(&*payload)));
        }
    }
    assert!(
        failures.is_empty(),
        "{target}: {} of {} inputs break an invariant:\n{}",
        failures.len(),
        corpus.len() + regressions.len(),
        failures.join("\n")
    );
}

#[test]
fn every_input_folder_is_a_known_target() {
    let fuzz = fuzz_dir();
    for kind in ["corpus", "regressions"] {
        for folder in subfolders(&fuzz.join(kind)) {
            assert!(
                TARGETS.iter().any(|(name, _)| *name == folder),
                "fuzz/{kind}/{folder}/ is not one of the checked targets"
            );
        }
    }
}

#[test]
fn every_fuzz_target_has_a_check() {
    let targets = files(&fuzz_dir().join("fuzz_targets"));
    let names: Vec<String> = targets
        .iter()
        .filter_map(|path| Some(path.file_stem()?.to_str()?.to_string()))
        .collect();
    assert_eq!(names.len(), TARGETS.len(), "fuzz targets: {names:?}");
    for name in &names {
        assert!(
            TARGETS.iter().any(|(target, _)| target == name),
            "fuzz/fuzz_targets/{name}.rs has no check here"
        );
    }
}

#[test]
fn sse_usage() {
    run("sse_usage");
}

#[test]
fn cache_key() {
    run("cache_key");
}

#[test]
fn cache_control() {
    run("cache_control");
}

#[test]
fn jwt() {
    run("jwt");
}

#[test]
fn rules_config() {
    run("rules_config");
}
