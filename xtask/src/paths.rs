//! Where the workspace is (defined once, in `zerolayer-layout`, for xtask
//! and the test harness).

pub use zerolayer_layout::root;
