//! Authentication of requests: token verification the filters share.

pub mod attribution;
pub mod budget;
pub mod config;
pub mod credential;
pub mod escalation;
pub mod exposure;
pub mod identity;
pub mod introspection;
pub mod jwt;
pub mod policy;
pub mod verdict;
