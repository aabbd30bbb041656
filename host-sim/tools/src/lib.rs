//! zerolayer's tools around the [`host_sim`] simulator, behind the
//! `host-sim` binary: the loopback proxy ([`serve`]), replay of recorded
//! traffic ([`replay`], [`traffic`], [`report`]), the metering sample's
//! reconciliation ([`reconcile`]), quota's charges handed off for
//! reconciliation ([`quota_reconcile`]), the rule playground's file server
//! ([`playground`]) and the configuration check run before a deploy
//! ([`check`]). Unlike the simulator they know the product: the
//! filters' hand-off properties and metric names.

pub mod check;
pub mod config_file;
mod loopback;
pub mod playground;
pub mod quota_reconcile;
pub mod reconcile;
pub mod replay;
pub mod report;
pub mod serve;
pub mod traffic;
