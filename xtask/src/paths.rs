//! Where the workspace is, found from xtask's own manifest (the test
//! crate keeps its own `paths` for its harness).

use std::path::PathBuf;

/// The workspace root: the parent of xtask's directory.
pub fn root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}
