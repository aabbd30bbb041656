//! The `log` facade (which the stages log through) into Envoy's log, as
//! its `dynamic_modules` logger: a stage's line reads as it does from the
//! Wasm forms, at the level Envoy is set to.

use log::{Level, LevelFilter, Metadata, Record};

use crate::abi::{self, LogLevel};

struct EnvoyLogger;

static LOGGER: EnvoyLogger = EnvoyLogger;

/// Routes `log` to Envoy (once; later calls do nothing).
pub fn install() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(LevelFilter::Trace);
    }
}

fn level(level: Level) -> LogLevel {
    match level {
        Level::Error => LogLevel::Error,
        Level::Warn => LogLevel::Warn,
        Level::Info => LogLevel::Info,
        Level::Debug => LogLevel::Debug,
        Level::Trace => LogLevel::Trace,
    }
}

impl log::Log for EnvoyLogger {
    fn enabled(&self, _metadata: &Metadata) -> bool {
        true
    }

    fn log(&self, record: &Record) {
        let level = level(record.level());
        // Formatted only when Envoy would print it.
        if abi::log_enabled(level) {
            abi::log(level, &record.args().to_string());
        }
    }

    fn flush(&self) {}
}
