//! The post-cache fleet tier for tests: a real `redis-server` and `webdis`
//! (Debian packages, installed by `cargo xtask setup`) on free loopback
//! ports, started together and stopped by PID when dropped.

use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::client::Client;
use crate::model::free_port;
use crate::wait;

/// How long each server may take to accept connections.
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// What to tell someone whose machine lacks the servers.
const INSTALL_HINT: &str = "install with `cargo xtask setup` (the test command does)";

/// Redis with webdis in front of it.
pub struct RedisFleet {
    redis: Child,
    /// `None` while stopped.
    webdis: Option<Child>,
    webdis_addr: SocketAddr,
    redis_addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl RedisFleet {
    /// Starts both and waits until webdis answers `GET /PING`, webdis
    /// allowing only what the post-cache fleet tier uses. Fails, never
    /// skips, when they are not installed or do not come up.
    pub fn start() -> Result<RedisFleet> {
        RedisFleet::start_allowing(&["GET", "SETEX", "TTL", "PING", "DBSIZE"])
    }

    /// [`RedisFleet::start`] with webdis allowing what the quota stage's
    /// observer sends: its two scripts (`EVALSHA`, `EVAL`, `SCRIPT LOAD`).
    pub fn start_for_quota() -> Result<RedisFleet> {
        RedisFleet::start_allowing(&["EVAL", "EVALSHA", "SCRIPT", "PING", "DBSIZE"])
    }

    /// Starts both, webdis allowing only the commands `enabled`.
    fn start_allowing(enabled: &[&str]) -> Result<RedisFleet> {
        let dir = tempfile::Builder::new()
            .prefix("zerolayer-redis-")
            .tempdir()?;
        let redis_port = free_port()?;
        let mut redis = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &redis_port.to_string()])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--logfile")
            .arg(dir.path().join("redis.log"))
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting redis-server ({INSTALL_HINT})"))?;
        if let Err(err) = wait_tcp(redis_port, &mut redis) {
            let _ = redis.kill();
            let log = std::fs::read_to_string(dir.path().join("redis.log")).unwrap_or_default();
            bail!("redis-server did not come up: {err:#}\n{log}");
        }
        let webdis_port = free_port()?;
        let config = serde_json::json!({
            "redis_host": "127.0.0.1",
            "redis_port": redis_port,
            "http_host": "127.0.0.1",
            "http_port": webdis_port,
            "threads": 1,
            "daemonize": false,
            "database": 0,
            "verbosity": 3,
            "logfile": dir.path().join("webdis.log"),
            // Only what the stage uses; nothing that could wipe or reconfigure Redis.
            "acl": [{"disabled": ["*"]}, {"enabled": enabled}],
        });
        let config_path = dir.path().join("webdis.json");
        std::fs::write(&config_path, config.to_string())?;
        let mut fleet = RedisFleet {
            redis,
            webdis: None,
            webdis_addr: SocketAddr::from(([127, 0, 0, 1], webdis_port)),
            redis_addr: SocketAddr::from(([127, 0, 0, 1], redis_port)),
            dir,
        };
        fleet.start_webdis()?;
        Ok(fleet)
    }

    /// Spawns webdis from its config and waits until it answers `/PING`.
    fn start_webdis(&mut self) -> Result<()> {
        let mut webdis = Command::new("webdis")
            .arg(self.dir.path().join("webdis.json"))
            .current_dir(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting webdis ({INSTALL_HINT})"))?;
        let addr = self.webdis_addr;
        let ready = wait_tcp(addr.port(), &mut webdis).and_then(|()| {
            // webdis listens before its own connection to Redis is up and
            // answers 503 until it is: asked again until it says PONG.
            let mut last = None;
            let pinged = wait::until("webdis answering /PING", READY_TIMEOUT, || {
                let reply = Client::new().get(&format!("http://{addr}/PING"), &[])?;
                if reply.status == 200 {
                    return Ok(Some(()));
                }
                last = Some((reply.status, reply.body));
                Ok(None)
            });
            pinged.map_err(|err| match last {
                Some((status, body)) => {
                    err.context(format!("webdis last answered /PING with {status}: {body}"))
                }
                None => err,
            })
        });
        self.webdis = Some(webdis);
        if let Err(err) = ready {
            self.stop_webdis();
            bail!(
                "webdis did not come up: {err:#}\n{}",
                std::fs::read_to_string(self.dir.path().join("webdis.log")).unwrap_or_default()
            );
        }
        Ok(())
    }

    /// Kills webdis (as a crash would): the fleet tier is unreachable until
    /// [`restart_webdis`](Self::restart_webdis). Redis keeps its data.
    pub fn stop_webdis(&mut self) {
        if let Some(mut child) = self.webdis.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Blackholes the store as a hung server or a dropped route would:
    /// webdis is stopped (`SIGSTOP`), so connections still open (the
    /// kernel accepts them) and no call is ever answered, until
    /// [`resume_webdis`](Self::resume_webdis). Not a refusal: a caller
    /// learns nothing but its own timeout.
    pub fn pause_webdis(&self) -> Result<()> {
        self.signal_webdis("-STOP")
    }

    /// Lets a paused webdis answer again (`SIGCONT`): what it accepted
    /// meanwhile is then served.
    pub fn resume_webdis(&self) -> Result<()> {
        self.signal_webdis("-CONT")
    }

    fn signal_webdis(&self, signal: &str) -> Result<()> {
        let pid = self
            .webdis
            .as_ref()
            .context("webdis is not running")?
            .id()
            .to_string();
        let status = Command::new("kill").args([signal, &pid]).status()?;
        anyhow::ensure!(status.success(), "kill {signal} {pid} failed: {status}");
        Ok(())
    }

    /// Starts webdis again on the same port.
    pub fn restart_webdis(&mut self) -> Result<()> {
        self.stop_webdis();
        self.start_webdis()
    }

    /// Redis's own address (RESP), for what a test checks behind webdis.
    pub fn redis(&self) -> SocketAddr {
        self.redis_addr
    }

    /// webdis's address (the Envoy cluster the fleet tier calls).
    pub fn webdis(&self) -> SocketAddr {
        self.webdis_addr
    }

    /// Runs one command on Redis itself (RESP over a plain socket).
    pub fn command(&self, args: &[&str]) -> Result<zerolayer_core::quota::store::Reply> {
        use std::io::{Read, Write};
        use zerolayer_core::quota::store::{StoreError, parse_resp};
        let mut stream = std::net::TcpStream::connect(self.redis())?;
        stream.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
        let command = zerolayer_core::quota::store::Command::new(args.iter().copied());
        stream.write_all(&command.resp())?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = stream.read(&mut chunk)?;
            if n == 0 {
                anyhow::bail!("redis closed the connection answering {args:?}");
            }
            buf.extend_from_slice(&chunk[..n]);
            match parse_resp(&buf) {
                Ok(reply) => return Ok(reply),
                // Incomplete: read more.
                Err(StoreError::Malformed(_)) => continue,
                Err(e) => anyhow::bail!("{args:?}: {e}"),
            }
        }
    }

    /// The sum of the quota budget counters whose keys start with `prefix`
    /// (their idempotency records left out).
    pub fn budget_total(&self, prefix: &str) -> Result<i64> {
        use zerolayer_core::quota::store::Reply;
        let mut total = 0;
        for key in self.keys_under(prefix)? {
            if key.contains(":i:") {
                continue;
            }
            if let Reply::Bulk(Some(v)) = self.command(&["GET", &key])? {
                total += String::from_utf8_lossy(&v).parse::<i64>()?;
            }
        }
        Ok(total)
    }

    /// The keys that start with `prefix`.
    fn keys_under(&self, prefix: &str) -> Result<Vec<String>> {
        use zerolayer_core::quota::store::Reply;
        let Reply::Array(Some(keys)) = self.command(&["KEYS", &format!("{prefix}*")])? else {
            anyhow::bail!("KEYS {prefix}* did not answer an array");
        };
        Ok(keys
            .into_iter()
            .filter_map(|key| match key {
                Reply::Bulk(Some(key)) => Some(String::from_utf8_lossy(&key).into_owned()),
                _ => None,
            })
            .collect())
    }

    /// Every key under `prefix` with what it holds (a counter's value, an
    /// idempotency record's fields), one per line: for a failure's message.
    pub fn dump(&self, prefix: &str) -> String {
        use zerolayer_core::quota::store::Reply;
        let text = |r: &Reply| match r {
            Reply::Bulk(Some(b)) => String::from_utf8_lossy(b).into_owned(),
            Reply::Integer(i) => i.to_string(),
            other => format!("{other:?}"),
        };
        let keys = match self.keys_under(prefix) {
            Ok(keys) => keys,
            Err(e) => return format!("{e:#}"),
        };
        let mut lines: Vec<String> = keys
            .into_iter()
            .map(|key| {
                let held = if key.contains(":i:") {
                    match self.command(&["HGETALL", &key]) {
                        Ok(Reply::Array(Some(fields))) => fields
                            .chunks(2)
                            .map(|f| {
                                format!(
                                    "{}={}",
                                    text(&f[0]),
                                    f.get(1).map(text).unwrap_or_default()
                                )
                            })
                            .collect::<Vec<_>>()
                            .join(" "),
                        other => format!("{other:?}"),
                    }
                } else {
                    match self.command(&["GET", &key]) {
                        Ok(reply) => text(&reply),
                        Err(e) => format!("{e:#}"),
                    }
                };
                format!("{key} {held}")
            })
            .collect();
        lines.sort();
        lines.join("\n")
    }

    /// Number of keys in Redis.
    pub fn keys(&self) -> Result<u64> {
        let reply = Client::new().get(&format!("http://{}/DBSIZE", self.webdis_addr), &[])?;
        let doc: serde_json::Value = serde_json::from_str(&reply.body)
            .with_context(|| format!("DBSIZE answered {}", reply.body))?;
        doc["DBSIZE"]
            .as_u64()
            .with_context(|| format!("DBSIZE answered {}", reply.body))
    }
}

impl Drop for RedisFleet {
    fn drop(&mut self) {
        self.stop_webdis();
        let _ = self.redis.kill();
        let _ = self.redis.wait();
    }
}

/// Waits until something accepts on `port`, or `child` exits.
fn wait_tcp(port: u16, child: &mut Child) -> Result<()> {
    wait::until(&format!("a listener on port {port}"), READY_TIMEOUT, || {
        if let Some(status) = child.try_wait()? {
            bail!("exited with {status}");
        }
        Ok(TcpStream::connect(("127.0.0.1", port))
            .is_ok()
            .then_some(()))
    })
}
