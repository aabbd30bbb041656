//! ClickHouse for tests: Debian's `clickhouse-server` 18.16 (installed by
//! `cargo xtask setup`) on free loopback ports with its data in a temp dir,
//! the metering filter's sample sink. Stopped by PID when dropped; can be
//! stopped and restarted on the same port with its data, so a test can take
//! the sink down for a while.
//!
//! 18.16 quirks the callers meet: JSON output quotes 64-bit integers
//! (`"input_tokens":"12"`) unless `output_format_json_quote_64bit_integers=0`;
//! `JSONEachRow` input rejects unknown fields (`input_format_skip_unknown_fields`
//! is off) but takes numeric strings and `true`/`false` for integers; a
//! batch with one bad row is rejected whole (a batch up to
//! `max_insert_block_size`, ~1M rows, is one block); errors come back as
//! 400, 404 or 500 with `Code: N, e.displayText() = …` as the body.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::client::Client;
use crate::model::free_port;
use crate::wait;

/// The metering sample table.
pub const USAGE_TABLE: &str = "zerolayer_usage";

/// The path (with query) the observer posts sample rows to, JSON lines as the body.
pub const INSERT_PATH: &str = "/?query=INSERT%20INTO%20zerolayer_usage%20FORMAT%20JSONEachRow";

/// The attribution table lazy-auth's observer writes (reconciliation joins it).
pub const ATTRIBUTION_TABLE: &str = "zerolayer_attribution";

/// The path (with query) the observer posts attribution rows to.
pub const ATTRIBUTION_INSERT_PATH: &str =
    "/?query=INSERT%20INTO%20zerolayer_attribution%20FORMAT%20JSONEachRow";

/// The sample table, columns in the sample row's order (`credential`: the
/// attribution id of a request whose verification was pending, else empty).
const USAGE_TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS zerolayer_usage (\
     at_ms UInt64, request_id String, tenant String, model String, \
     input_tokens UInt64, output_tokens UInt64, cache_read_tokens UInt64, \
     cache_creation_tokens UInt64, usage_missing UInt8, status UInt16, \
     latency_ms UInt32, streamed UInt8, sample_weight Float64, \
     credential String DEFAULT '') \
     ENGINE = MergeTree ORDER BY (tenant, at_ms)";

/// The attribution table: one row per lazily admitted credential found valid.
const ATTRIBUTION_TABLE_DDL: &str = "CREATE TABLE IF NOT EXISTS zerolayer_attribution (\
     credential String, tenant Nullable(String), subject Nullable(String), at_ms UInt64) \
     ENGINE = MergeTree ORDER BY (credential, at_ms)";

/// How long the server may take to answer `/ping` (about 0.1 s when idle).
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Attempts to start when a picked port is taken before the server binds it.
const START_ATTEMPTS: usize = 3;

/// Where Debian puts the binary; not on a non-root user's PATH.
const DEBIAN_BINARY: &str = "/usr/sbin/clickhouse-server";

/// What to tell someone whose machine lacks the server.
const INSTALL_HINT: &str = "install with `cargo xtask setup` (the test command does)";

/// A ClickHouse server on 127.0.0.1.
pub struct ClickHouse {
    /// `None` while stopped.
    child: Option<Child>,
    binary: PathBuf,
    http_port: u16,
    dir: tempfile::TempDir,
    client: Client,
}

impl ClickHouse {
    /// Starts a server with an empty database on free ports and waits until
    /// `GET /ping` answers `Ok.`. Fails, never skips, when the server is not
    /// installed or does not come up, with the end of its log.
    pub fn start() -> Result<ClickHouse> {
        let binary = binary()?;
        let mut attempt = 1;
        loop {
            let dir = tempfile::Builder::new()
                .prefix("zerolayer-clickhouse-")
                .tempdir()?;
            let http_port = free_port()?;
            write_config(dir.path(), http_port, free_port()?)?;
            let mut server = ClickHouse {
                child: None,
                binary: binary.clone(),
                http_port,
                dir,
                client: Client::new(),
            };
            match server.launch() {
                Ok(()) => return Ok(server),
                // Another process took a port between our probe and the bind.
                Err(err)
                    if attempt < START_ATTEMPTS
                        && server.log().contains("Address already in use") =>
                {
                    eprintln!("clickhouse: retrying on other ports: {err:#}");
                    attempt += 1;
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// The HTTP interface's base URL, `http://127.0.0.1:PORT` (no trailing slash).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr())
    }

    /// The HTTP interface's address (the Envoy cluster the observer posts to).
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.http_port))
    }

    /// Runs `sql` (sent as the POST body) and returns the output; an error
    /// with ClickHouse's message when it answers anything but 200.
    pub fn query(&self, sql: &str) -> Result<String> {
        let reply = self
            .client
            .send("POST", &format!("{}/", self.url()), &[], sql)?;
        if reply.status != 200 {
            bail!(
                "ClickHouse answered {} to {sql:?}: {}",
                reply.status,
                reply.body.trim()
            );
        }
        Ok(reply.body)
    }

    /// Creates the metering sample table [`USAGE_TABLE`] and the
    /// attribution table [`ATTRIBUTION_TABLE`] (idempotent).
    pub fn create_tables(&self) -> Result<()> {
        self.query(USAGE_TABLE_DDL)?;
        self.query(ATTRIBUTION_TABLE_DDL).map(drop)
    }

    /// Every row of [`USAGE_TABLE`], ordered by `at_ms` then `request_id`,
    /// with 64-bit integers as JSON numbers (not 18.16's default strings).
    pub fn rows(&self) -> Result<Vec<serde_json::Value>> {
        let url = format!("{}/?output_format_json_quote_64bit_integers=0", self.url());
        let sql =
            format!("SELECT * FROM {USAGE_TABLE} ORDER BY at_ms, request_id FORMAT JSONEachRow");
        let reply = self.client.send("POST", &url, &[], &sql)?;
        if reply.status != 200 {
            bail!(
                "ClickHouse answered {} to {sql:?}: {}",
                reply.status,
                reply.body.trim()
            );
        }
        reply
            .body
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).with_context(|| format!("ClickHouse row {l:?}")))
            .collect()
    }

    /// Kills the server (as a crash would), keeping its data and port:
    /// requests to [`url`](Self::url) fail until [`restart`](Self::restart).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGKILL, not SIGTERM: a graceful stop takes ~2 s and an INSERT
            // that was answered 200 is already on disk either way.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and data dir (stopping it
    /// first if it runs) and waits until it answers `/ping`.
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.launch()
    }

    /// Whether the server process is running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// The server process's id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's log so far (its own log file, then what it printed).
    pub fn log(&self) -> String {
        let read =
            |name: &str| std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
        format!("{}{}", read("server.log"), read("console.log"))
    }

    /// Spawns the server from the config in the data dir and waits for `/ping`.
    fn launch(&mut self) -> Result<()> {
        let console = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("console.log"))?;
        let child = Command::new(&self.binary)
            .arg(format!(
                "--config-file={}",
                self.dir.path().join("config.xml").display()
            ))
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::from(console.try_clone()?))
            .stderr(Stdio::from(console))
            .spawn()
            .with_context(|| format!("starting {} ({INSTALL_HINT})", self.binary.display()))?;
        self.child = Some(child);
        if let Err(err) = self.wait_ready() {
            self.stop();
            bail!(
                "clickhouse-server did not come up on {}: {err:#}\n\
                 --- clickhouse-server log (tail) ---\n{}",
                self.addr(),
                tail(&self.log(), 30)
            );
        }
        Ok(())
    }

    fn wait_ready(&mut self) -> Result<()> {
        let url = format!("{}/ping", self.url());
        wait::until("`Ok.` from /ping", READY_TIMEOUT, || {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("it exited with {status}");
            }
            Ok(self
                .client
                .get(&url, &[])
                .is_ok_and(|r| r.status == 200 && r.body.trim() == "Ok.")
                .then_some(()))
        })
    }

    /// Waits until the usage table holds at least `n` rows; returns them.
    pub fn wait_rows(&self, n: usize, timeout: Duration) -> Result<Vec<serde_json::Value>> {
        let mut seen = 0;
        wait::until(&format!("{n} usage rows in ClickHouse"), timeout, || {
            let rows = self.rows()?;
            seen = rows.len();
            Ok((rows.len() >= n).then_some(rows))
        })
        .with_context(|| format!("{seen} rows arrived"))
    }
}

impl Drop for ClickHouse {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `clickhouse-server` from PATH or Debian's place, or an error saying how
/// to install it.
fn binary() -> Result<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("clickhouse-server"))
            .find(|p| p.is_file())
    });
    match on_path {
        Some(path) => Ok(path),
        None if Path::new(DEBIAN_BINARY).is_file() => Ok(PathBuf::from(DEBIAN_BINARY)),
        None => bail!(
            "clickhouse-server is not installed (not on PATH, not at {DEBIAN_BINARY}): {INSTALL_HINT}"
        ),
    }
}

/// Writes `config.xml` and `users.xml` into `dir`: loopback only, everything
/// the server writes under `dir`, one `default` user without a password
/// that only localhost may use.
fn write_config(dir: &Path, http_port: u16, tcp_port: u16) -> Result<()> {
    let d = dir.display();
    // 18.16 refuses to start without mark_cache_size ("Not found:
    // mark_cache_size"); Debian's sample sets 5 GiB, a test needs little.
    let config = format!(
        r#"<?xml version="1.0"?>
<yandex>
    <logger>
        <level>information</level>
        <log>{d}/server.log</log>
        <errorlog>{d}/server.err.log</errorlog>
        <console>0</console>
    </logger>
    <listen_host>127.0.0.1</listen_host>
    <http_port>{http_port}</http_port>
    <tcp_port>{tcp_port}</tcp_port>
    <path>{d}/data/</path>
    <tmp_path>{d}/tmp/</tmp_path>
    <user_files_path>{d}/user_files/</user_files_path>
    <format_schema_path>{d}/format_schemas/</format_schema_path>
    <users_config>{d}/users.xml</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <mark_cache_size>67108864</mark_cache_size>
    <uncompressed_cache_size>67108864</uncompressed_cache_size>
</yandex>
"#
    );
    let users = r#"<?xml version="1.0"?>
<yandex>
    <profiles><default/></profiles>
    <users>
        <default>
            <password></password>
            <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
            <profile>default</profile>
            <quota>default</quota>
        </default>
    </users>
    <quotas><default/></quotas>
</yandex>
"#;
    std::fs::write(dir.join("config.xml"), config).context("writing ClickHouse's config.xml")?;
    std::fs::write(dir.join("users.xml"), users).context("writing ClickHouse's users.xml")?;
    Ok(())
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
