//! The fleet store's protocol as data: the Redis commands the observer
//! sends (as argument lists, encoded for webdis's `POST /` or as RESP for a
//! native client), the two Lua scripts that keep the counters, their
//! replies parsed into typed results, a bounded buffer of deltas waiting
//! for the store, and [`ModelStore`], the scripts' semantics in Rust (the
//! reference the tests replay deltas against).
//!
//! **Keys.** A counter is `<prefix>{<policy>:<scope digest>[:<window>]}`:
//! the scope digest is the first 16 bytes of SHA-256 over the policy and the
//! scope key (the same on every gateway, never a client's raw value), and a
//! budget's key carries its window's label, so a new window starts at 0.
//! Each lease holder's idempotency record for that counter is
//! `<counter>:i:<instance>`, in the same hash slot (the braces), so a
//! script touching both works in Redis Cluster.
//!
//! **Idempotency.** Every operation carries the holder's instance id
//! (random at start, so a restarted holder never reuses a sequence number)
//! and a sequence number, increasing per holder. The record keeps the
//! highest sequence number applied to the counter and that operation's
//! result: an operation at or below it is not applied again (a replay of
//! the last one answers what it answered). A holder sends at most one
//! operation per counter at a time and repeats it, same number, until it is
//! answered, so the numbers reach each counter in order and a late or
//! duplicated copy is always one already applied.
//!
//! **Expiry.** A budget's counter and records expire at the window's end
//! plus [`EXPIRY_SLACK_SECS`], set once when the key is created (`EXPIREAT`
//! only when the key has no expiry: a write never extends it). A rate's
//! state is refreshed for one period plus the slack: after a period without
//! writes the level has drained to 0 anyway, which is what a missing key
//! means.

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use super::window::RateBucket;

/// How long a budget's keys outlive their window, seconds (late
/// settlements still land; reconciliation can still read them).
pub const EXPIRY_SLACK_SECS: i64 = 86_400;
/// Deepest nesting of a RESP reply accepted (the scripts return flat arrays).
const MAX_DEPTH: usize = 4;
/// Most elements of a RESP array accepted.
const MAX_ELEMENTS: usize = 64;

/// The grant script. `KEYS`: counter, record. `ARGV`: kind (`b` budget,
/// `r` rate), limit, expire-at (budget, Unix s) or period (rate, ms), seq,
/// force, asked, rate TTL (ms). Charges `force` unconditionally (debt),
/// then grants `min(asked, limit − counter)`; returns `{remaining,
/// granted, status}` (status 0 applied, 1 a replay of the last seq, whose
/// result it repeats, 2 an older seq).
pub const GRANT_SCRIPT: &str = r#"
local function s(x) return string.format('%.0f', x) end
local seq = tonumber(ARGV[4])
local rec = redis.call('HMGET', KEYS[2], 's', 'r', 'g')
local last = tonumber(rec[1] or '0')
if seq <= last then
  if seq == last then return {tonumber(rec[2] or '0'), tonumber(rec[3] or '0'), 1} end
  return {tonumber(rec[2] or '0'), 0, 2}
end
local limit = tonumber(ARGV[2])
local force = tonumber(ARGV[5])
local asked = tonumber(ARGV[6])
local remaining, grant
if ARGV[1] == 'b' then
  local used = tonumber(redis.call('INCRBY', KEYS[1], s(force)))
  grant = math.max(0, math.min(asked, limit - used))
  if grant > 0 then used = tonumber(redis.call('INCRBY', KEYS[1], s(grant))) end
  remaining = limit - used
  if redis.call('TTL', KEYS[1]) == -1 then redis.call('EXPIREAT', KEYS[1], ARGV[3]) end
  redis.call('HSET', KEYS[2], 's', s(seq), 'r', s(remaining), 'g', s(grant))
  if redis.call('TTL', KEYS[2]) == -1 then redis.call('EXPIREAT', KEYS[2], ARGV[3]) end
else
  local period = tonumber(ARGV[3])
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local st = redis.call('HMGET', KEYS[1], 'l', 't')
  local level = tonumber(st[1] or '0')
  local at = tonumber(st[2] or s(now))
  if now > at then level = math.max(0, level - (now - at) * limit); at = now end
  level = level + force * period
  local cap = limit * period
  grant = math.max(0, math.min(asked, math.floor((cap - level) / period)))
  level = level + grant * period
  remaining = math.floor((cap - level) / period)
  redis.call('HSET', KEYS[1], 'l', s(level), 't', s(at))
  redis.call('PEXPIRE', KEYS[1], ARGV[7])
  redis.call('HSET', KEYS[2], 's', s(seq), 'r', s(remaining), 'g', s(grant))
  redis.call('PEXPIRE', KEYS[2], ARGV[7])
end
return {remaining, grant, 0}
"#;

/// The delta script. `KEYS`: counter, record. `ARGV`: kind, limit,
/// expire-at or period, seq, delta (signed), rate TTL. Adds `delta` to the
/// counter (a budget's never below 0, a rate's level never below empty)
/// unless `seq` was already applied; returns `{remaining, status}`
/// (status 0 applied, 1 already applied).
pub const DELTA_SCRIPT: &str = r#"
local function s(x) return string.format('%.0f', x) end
local seq = tonumber(ARGV[4])
local rec = redis.call('HMGET', KEYS[2], 's', 'r')
if seq <= tonumber(rec[1] or '0') then return {tonumber(rec[2] or '0'), 1} end
local limit = tonumber(ARGV[2])
local delta = tonumber(ARGV[5])
local remaining
if ARGV[1] == 'b' then
  local used = tonumber(redis.call('INCRBY', KEYS[1], s(delta)))
  if used < 0 then redis.call('SET', KEYS[1], '0', 'KEEPTTL'); used = 0 end
  remaining = limit - used
  if redis.call('TTL', KEYS[1]) == -1 then redis.call('EXPIREAT', KEYS[1], ARGV[3]) end
  redis.call('HSET', KEYS[2], 's', s(seq), 'r', s(remaining))
  if redis.call('TTL', KEYS[2]) == -1 then redis.call('EXPIREAT', KEYS[2], ARGV[3]) end
else
  local period = tonumber(ARGV[3])
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local st = redis.call('HMGET', KEYS[1], 'l', 't')
  local level = tonumber(st[1] or '0')
  local at = tonumber(st[2] or s(now))
  if now > at then level = math.max(0, level - (now - at) * limit); at = now end
  level = math.max(0, level + delta * period)
  remaining = math.floor((limit * period - level) / period)
  redis.call('HSET', KEYS[1], 'l', s(level), 't', s(at))
  redis.call('PEXPIRE', KEYS[1], ARGV[7])
  redis.call('HSET', KEYS[2], 's', s(seq), 'r', s(remaining))
  redis.call('PEXPIRE', KEYS[2], ARGV[7])
end
return {remaining, 0}
"#;

/// The hand-off script. `KEYS`: the hand-off hash
/// ([`hand_off_key`]). `ARGV`: field, value, most fields kept, TTL (s).
/// Stores a charge a holder could not make for reconciliation to make
/// (once per field) unless the hash is full, and keeps the hash for the TTL
/// past its last write; returns 1 when the field is there (stored now or
/// before), 0 when the hash was full.
pub const HAND_OFF_SCRIPT: &str = r#"
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"#;

/// Most charges the hand-off hash keeps: with [`MAX_HAND_OFF_BYTES`] each,
/// at most 40 MiB of Redis however many credentials a client mints while
/// the verifier is down.
pub const MAX_HANDED_OFF: u64 = 10_000;

/// Largest hand-off value stored (bytes of JSON); a larger one is counted
/// as lost.
pub const MAX_HAND_OFF_BYTES: usize = 4096;

/// How long the hand-off hash outlives its last write, seconds: a month's
/// budget window and a day, so reconciliation run monthly still finds it.
pub const HAND_OFF_TTL_SECS: u64 = 32 * 86_400;

/// The hand-off hash under `prefix`: lazily admitted requests' charges to
/// their tenant that no holder could make, awaiting reconciliation.
pub fn hand_off_key(prefix: &str) -> String {
    format!("{prefix}unsettled")
}

/// The hand-off call: store `value` under `field` in [`hand_off_key`] (its
/// script sent whole: it is rare, so never loaded).
pub fn hand_off_command(prefix: &str, field: &str, value: &str) -> Command {
    Command::new([
        "EVAL".to_string(),
        HAND_OFF_SCRIPT.to_string(),
        "1".to_string(),
        hand_off_key(prefix),
        field.to_string(),
        value.to_string(),
        MAX_HANDED_OFF.to_string(),
        HAND_OFF_TTL_SECS.to_string(),
    ])
}

/// What the hand-off script answered: stored (1, now or before), or the
/// hash was full (0).
pub fn hand_off_stored(reply: &Reply) -> Result<bool, StoreError> {
    match reply {
        Reply::Integer(1) => Ok(true),
        Reply::Integer(0) => Ok(false),
        Reply::Error(e) => Err(StoreError::Redis(e.clone())),
        other => Err(malformed(format!(
            "hand-off: expected 0 or 1, got {other:?}"
        ))),
    }
}

/// Which script.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Script {
    /// [`GRANT_SCRIPT`].
    Grant,
    /// [`DELTA_SCRIPT`].
    Delta,
}

impl Script {
    /// The script's source.
    pub fn source(self) -> &'static str {
        match self {
            Script::Grant => GRANT_SCRIPT,
            Script::Delta => DELTA_SCRIPT,
        }
    }
}

/// The SHA-1s Redis gave for the scripts (`SCRIPT LOAD`'s answer): with
/// one, a call is an `EVALSHA` (40 bytes instead of the script); without,
/// an `EVAL`. A `NOSCRIPT` error (Redis restarted) forgets it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScriptShas {
    grant: Option<String>,
    delta: Option<String>,
}

impl ScriptShas {
    /// The SHA-1 known for `script`.
    pub fn get(&self, script: Script) -> Option<&str> {
        match script {
            Script::Grant => self.grant.as_deref(),
            Script::Delta => self.delta.as_deref(),
        }
    }

    /// Records `SCRIPT LOAD`'s answer for `script` (40 hex digits; anything
    /// else is ignored).
    pub fn learn(&mut self, script: Script, sha: &str) {
        if sha.len() != 40 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
            return;
        }
        let slot = match script {
            Script::Grant => &mut self.grant,
            Script::Delta => &mut self.delta,
        };
        *slot = Some(sha.to_ascii_lowercase());
    }

    /// Forgets every SHA (after `NOSCRIPT`).
    pub fn forget(&mut self) {
        *self = ScriptShas::default();
    }
}

/// A Redis command: its arguments, the first being the command's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Command {
    /// The arguments, binary-safe.
    pub args: Vec<Vec<u8>>,
}

impl Command {
    /// A command of `args`.
    pub fn new<I, A>(args: I) -> Command
    where
        I: IntoIterator<Item = A>,
        A: Into<Vec<u8>>,
    {
        Command {
            args: args.into_iter().map(Into::into).collect(),
        }
    }

    /// `SCRIPT LOAD <source>`.
    pub fn script_load(script: Script) -> Command {
        Command::new(["SCRIPT", "LOAD", script.source()])
    }

    /// The command's name as webdis keys its JSON answer (`EVALSHA`).
    pub fn verb(&self) -> String {
        self.args
            .first()
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .unwrap_or_default()
    }

    /// The command in RESP (an array of bulk strings), for a native client.
    pub fn resp(&self) -> Vec<u8> {
        let mut out =
            Vec::with_capacity(16 + self.args.iter().map(|a| a.len() + 16).sum::<usize>());
        out.extend_from_slice(format!("*{}\r\n", self.args.len()).as_bytes());
        for arg in &self.args {
            out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
            out.extend_from_slice(arg);
            out.extend_from_slice(b"\r\n");
        }
        out
    }

    /// The body of a webdis `POST` to its base path: the arguments
    /// percent-encoded (all but unreserved characters) and joined by `/`,
    /// as webdis splits and decodes them.
    pub fn webdis_body(&self) -> Vec<u8> {
        let mut out = String::new();
        for (i, arg) in self.args.iter().enumerate() {
            if i > 0 {
                out.push('/');
            }
            for &b in arg {
                if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                    out.push(char::from(b));
                } else {
                    let _ = write!(out, "%{b:02X}");
                }
            }
        }
        out.into_bytes()
    }

    /// The command in a webdis request's path after the store's prefix
    /// (the inverse of [`Command::webdis_body`]); `None` when an escape is
    /// not two hex digits.
    pub fn from_webdis(path: &[u8]) -> Option<Command> {
        let mut args = Vec::new();
        for arg in path.split(|&b| b == b'/') {
            let mut out = Vec::with_capacity(arg.len());
            let mut i = 0;
            while i < arg.len() {
                if arg[i] == b'%' {
                    let hex = std::str::from_utf8(arg.get(i + 1..i + 3)?).ok()?;
                    out.push(u8::from_str_radix(hex, 16).ok()?);
                    i += 3;
                } else {
                    out.push(arg[i]);
                    i += 1;
                }
            }
            args.push(out);
        }
        Some(Command::new(args))
    }
}

/// A counter's two keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CounterKeys {
    /// The counter.
    pub counter: String,
    /// This holder's idempotency record for it.
    pub record: String,
}

/// The digest naming a scope key in the store: SHA-256 over the policy's
/// name, a NUL and the scope key's bytes, first 16 bytes.
pub fn scope_digest(policy: &str, scope_key: &[u8]) -> [u8; 16] {
    let mut hasher = Sha256::new();
    hasher.update(policy.as_bytes());
    hasher.update([0]);
    hasher.update(scope_key);
    let full = hasher.finalize();
    let mut out = [0; 16];
    out.copy_from_slice(&full[..16]);
    out
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

impl CounterKeys {
    /// The keys of `policy`'s counter for the scope `digest` (a budget's
    /// `window` label, `None` for a rate), for holder `instance`.
    pub fn new(
        prefix: &str,
        policy: &str,
        digest: &[u8; 16],
        window: Option<u64>,
        instance: u64,
    ) -> CounterKeys {
        let counter = match window {
            Some(label) => format!("{prefix}{{{policy}:{}:{label}}}", hex(digest)),
            None => format!("{prefix}{{{policy}:{}}}", hex(digest)),
        };
        let record = format!("{counter}:i:{instance:016x}");
        CounterKeys { counter, record }
    }
}

/// What a counter is, as the scripts' first arguments say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CounterKind {
    /// A budget's counter for one window, expiring at `expire_at` (Unix s).
    Budget {
        /// The window's amount.
        limit: u64,
        /// Window end + slack, Unix seconds.
        expire_at: i64,
    },
    /// A rate's draining level.
    Rate {
        /// Units per period.
        limit: u64,
        /// The period, ms.
        period_ms: u64,
    },
}

impl CounterKind {
    /// `ARGV[1..=3]` and `ARGV[7]` of the scripts.
    fn args(self) -> ([u8; 1], u64, String, String) {
        match self {
            CounterKind::Budget { limit, expire_at } => {
                (*b"b", limit, expire_at.to_string(), "0".into())
            }
            CounterKind::Rate { limit, period_ms } => (
                *b"r",
                limit,
                period_ms.to_string(),
                (period_ms + EXPIRY_SLACK_SECS as u64 * 1000).to_string(),
            ),
        }
    }
}

fn script_call(
    script: Script,
    shas: &ScriptShas,
    keys: &CounterKeys,
    kind: CounterKind,
    seq: u64,
    a: String,
    b: Option<String>,
) -> Command {
    let (k, limit, third, ttl) = kind.args();
    let mut args: Vec<Vec<u8>> = Vec::with_capacity(11);
    match shas.get(script) {
        Some(sha) => {
            args.push(b"EVALSHA".to_vec());
            args.push(sha.as_bytes().to_vec());
        }
        None => {
            args.push(b"EVAL".to_vec());
            args.push(script.source().as_bytes().to_vec());
        }
    }
    args.push(b"2".to_vec());
    args.push(keys.counter.as_bytes().to_vec());
    args.push(keys.record.as_bytes().to_vec());
    args.push(k.to_vec());
    args.push(limit.to_string().into_bytes());
    args.push(third.into_bytes());
    args.push(seq.to_string().into_bytes());
    args.push(a.into_bytes());
    // The delta script has no sixth argument of its own: keep the TTL at
    // ARGV[7] for both.
    args.push(b.unwrap_or_else(|| "0".into()).into_bytes());
    args.push(ttl.into_bytes());
    Command { args }
}

/// The grant call: charge `force`, grant up to `asked`.
pub fn grant_command(
    shas: &ScriptShas,
    keys: &CounterKeys,
    kind: CounterKind,
    seq: u64,
    force: u64,
    asked: u64,
) -> Command {
    script_call(
        Script::Grant,
        shas,
        keys,
        kind,
        seq,
        force.to_string(),
        Some(asked.to_string()),
    )
}

/// The delta call: add `delta` (signed) to the counter, once.
pub fn delta_command(
    shas: &ScriptShas,
    keys: &CounterKeys,
    kind: CounterKind,
    seq: u64,
    delta: i64,
) -> Command {
    script_call(
        Script::Delta,
        shas,
        keys,
        kind,
        seq,
        delta.to_string(),
        None,
    )
}

/// A Redis reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `:n`.
    Integer(i64),
    /// `$n` (`None`: the nil bulk string).
    Bulk(Option<Vec<u8>>),
    /// `+OK`.
    Status(String),
    /// `-ERR …`.
    Error(String),
    /// `*n` (`None`: the nil array).
    Array(Option<Vec<Reply>>),
}

impl Reply {
    /// The reply as webdis writes it in its JSON answer.
    pub fn webdis_json(&self) -> serde_json::Value {
        use serde_json::{Value, json};
        match self {
            Reply::Integer(n) => json!(n),
            Reply::Bulk(None) | Reply::Array(None) => Value::Null,
            Reply::Bulk(Some(b)) => json!(String::from_utf8_lossy(b)),
            Reply::Status(s) => json!([true, s]),
            Reply::Error(e) => json!([false, e]),
            Reply::Array(Some(items)) => {
                Value::Array(items.iter().map(Reply::webdis_json).collect())
            }
        }
    }
}

/// Why a store answer could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The bytes are not a reply of the expected shape.
    #[error("malformed store reply: {0}")]
    Malformed(String),
    /// Redis answered an error.
    #[error("store error: {0}")]
    Redis(String),
    /// The script is not loaded (Redis restarted): send it again with `EVAL`.
    #[error("store has no such script (NOSCRIPT)")]
    NoScript,
    /// No answer (timeout, connection refused, HTTP error).
    #[error("store unreachable: {0}")]
    Unreachable(String),
}

fn malformed(what: impl Into<String>) -> StoreError {
    StoreError::Malformed(what.into())
}

/// Parses one complete RESP reply (`bytes` must hold exactly one).
pub fn parse_resp(bytes: &[u8]) -> Result<Reply, StoreError> {
    let (reply, rest) = resp_value(bytes, 0)?;
    if !rest.is_empty() {
        return Err(malformed(format!("{} bytes after the reply", rest.len())));
    }
    Ok(reply)
}

fn resp_line(bytes: &[u8]) -> Result<(&[u8], &[u8]), StoreError> {
    let end = bytes
        .windows(2)
        .position(|w| w == b"\r\n")
        .ok_or_else(|| malformed("line without CRLF"))?;
    Ok((&bytes[..end], &bytes[end + 2..]))
}

fn resp_int(line: &[u8]) -> Result<i64, StoreError> {
    std::str::from_utf8(line)
        .ok()
        .and_then(|t| t.parse::<i64>().ok())
        .ok_or_else(|| malformed(format!("not an integer: {}", String::from_utf8_lossy(line))))
}

fn resp_value(bytes: &[u8], depth: usize) -> Result<(Reply, &[u8]), StoreError> {
    let (&kind, rest) = bytes
        .split_first()
        .ok_or_else(|| malformed("empty reply"))?;
    let (line, rest) = resp_line(rest)?;
    let text = || String::from_utf8_lossy(line).into_owned();
    match kind {
        b'+' => Ok((Reply::Status(text()), rest)),
        b'-' => Ok((Reply::Error(text()), rest)),
        b':' => Ok((Reply::Integer(resp_int(line)?), rest)),
        b'$' => {
            let len = resp_int(line)?;
            if len == -1 {
                return Ok((Reply::Bulk(None), rest));
            }
            let len = usize::try_from(len).map_err(|_| malformed("negative length"))?;
            if rest.len() < len.saturating_add(2) || rest.get(len..len + 2) != Some(b"\r\n") {
                return Err(malformed("bulk string shorter than its length"));
            }
            Ok((Reply::Bulk(Some(rest[..len].to_vec())), &rest[len + 2..]))
        }
        b'*' => {
            let n = resp_int(line)?;
            if n == -1 {
                return Ok((Reply::Array(None), rest));
            }
            let n = usize::try_from(n).map_err(|_| malformed("negative length"))?;
            if n > MAX_ELEMENTS || depth >= MAX_DEPTH {
                return Err(malformed("array too large or too deep"));
            }
            let mut items = Vec::with_capacity(n);
            let mut rest = rest;
            for _ in 0..n {
                let (item, r) = resp_value(rest, depth + 1)?;
                items.push(item);
                rest = r;
            }
            Ok((Reply::Array(Some(items)), rest))
        }
        other => Err(malformed(format!("unknown reply type byte 0x{other:02x}"))),
    }
}

/// Parses webdis's JSON answer to `verb` (`{"EVALSHA":[5,10,0]}`; an error
/// is `[false,"message"]`, a status `[true,"OK"]`).
pub fn parse_webdis(bytes: &[u8], verb: &str) -> Result<Reply, StoreError> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| malformed(format!("not JSON: {e}")))?;
    let inner = value
        .as_object()
        .and_then(|o| o.get(verb))
        .ok_or_else(|| malformed(format!("no {verb:?} member")))?;
    webdis_value(inner, 0)
}

fn webdis_value(value: &serde_json::Value, depth: usize) -> Result<Reply, StoreError> {
    use serde_json::Value;
    match value {
        Value::Null => Ok(Reply::Bulk(None)),
        Value::Number(n) => n
            .as_i64()
            .map(Reply::Integer)
            .ok_or_else(|| malformed(format!("not an integer: {n}"))),
        Value::String(s) => Ok(Reply::Bulk(Some(s.clone().into_bytes()))),
        Value::Array(items) => match items.as_slice() {
            [Value::Bool(false), Value::String(m)] => Ok(Reply::Error(m.clone())),
            [Value::Bool(true), Value::String(m)] => Ok(Reply::Status(m.clone())),
            _ if items.len() > MAX_ELEMENTS || depth >= MAX_DEPTH => {
                Err(malformed("array too large or too deep"))
            }
            _ => items
                .iter()
                .map(|v| webdis_value(v, depth + 1))
                .collect::<Result<Vec<_>, _>>()
                .map(|v| Reply::Array(Some(v))),
        },
        Value::Bool(_) | Value::Object(_) => Err(malformed("unexpected JSON value")),
    }
}

/// The grant script's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrantReply {
    /// `limit − counter` after the grant (negative past the limit).
    pub remaining: i64,
    /// Units granted.
    pub granted: u64,
    /// How the store treated the sequence number.
    pub status: Applied,
}

/// The delta script's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaReply {
    /// `limit − counter` after it.
    pub remaining: i64,
    /// How the store treated the sequence number.
    pub status: Applied,
}

/// Whether the store applied an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Now.
    Now,
    /// Already, this very sequence number (a retry): its result repeated.
    Replay,
    /// Never: a newer sequence number was applied first (the operation
    /// was overtaken; a holder following the protocol never sees this).
    Stale,
}

fn status(n: i64) -> Result<Applied, StoreError> {
    match n {
        0 => Ok(Applied::Now),
        1 => Ok(Applied::Replay),
        2 => Ok(Applied::Stale),
        _ => Err(malformed(format!("unknown status {n}"))),
    }
}

fn error_of(reply: &Reply) -> Option<StoreError> {
    match reply {
        Reply::Error(m) if m.starts_with("NOSCRIPT") => Some(StoreError::NoScript),
        Reply::Error(m) => Some(StoreError::Redis(m.clone())),
        _ => None,
    }
}

fn integers(reply: &Reply, n: usize) -> Result<Vec<i64>, StoreError> {
    if let Some(e) = error_of(reply) {
        return Err(e);
    }
    let Reply::Array(Some(items)) = reply else {
        return Err(malformed("expected an array"));
    };
    if items.len() != n {
        return Err(malformed(format!(
            "expected {n} integers, got {}",
            items.len()
        )));
    }
    items
        .iter()
        .map(|i| match i {
            Reply::Integer(v) => Ok(*v),
            _ => Err(malformed("expected an integer")),
        })
        .collect()
}

impl GrantReply {
    /// Reads the grant script's reply.
    pub fn from_reply(reply: &Reply) -> Result<GrantReply, StoreError> {
        let v = integers(reply, 3)?;
        let granted = u64::try_from(v[1]).map_err(|_| malformed("negative grant"))?;
        Ok(GrantReply {
            remaining: v[0],
            granted,
            status: status(v[2])?,
        })
    }
}

impl DeltaReply {
    /// Reads the delta script's reply.
    pub fn from_reply(reply: &Reply) -> Result<DeltaReply, StoreError> {
        let v = integers(reply, 2)?;
        Ok(DeltaReply {
            remaining: v[0],
            status: status(v[1])?,
        })
    }
}

/// `SCRIPT LOAD`'s answer: the script's SHA-1.
pub fn sha_from_reply(reply: &Reply) -> Result<String, StoreError> {
    if let Some(e) = error_of(reply) {
        return Err(e);
    }
    match reply {
        Reply::Bulk(Some(b)) if b.len() == 40 && b.iter().all(u8::is_ascii_hexdigit) => {
            Ok(String::from_utf8_lossy(b).into_owned())
        }
        _ => Err(malformed("expected a 40-digit SHA-1")),
    }
}

/// A delta waiting for the store, with no lease to carry it (its lease's
/// budget window ended, or its table was replaced).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingDelta {
    /// The counter's keys.
    pub keys: CounterKeys,
    /// What the counter is.
    pub kind: CounterKind,
    /// Its sequence number.
    pub seq: u64,
    /// What to add.
    pub delta: i64,
}

/// Deltas waiting for the store, oldest first, at most `capacity`. Past it
/// a return (a negative delta: an amount a lease gives back) goes first:
/// one not sent leaves its counter over, never under. With no return to
/// give up, the oldest delta is dropped and counted (its amount is then
/// missing from the counter until reconciliation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeltaBuffer {
    queue: VecDeque<PendingDelta>,
    capacity: usize,
    dropped: u64,
    dropped_amount: u64,
    returns_not_sent: u64,
}

impl DeltaBuffer {
    /// An empty buffer of `capacity` deltas (at least 1).
    pub fn new(capacity: usize) -> DeltaBuffer {
        DeltaBuffer {
            queue: VecDeque::new(),
            capacity: capacity.max(1),
            dropped: 0,
            dropped_amount: 0,
            returns_not_sent: 0,
        }
    }

    /// Adds a delta; when full, gives up a return (this one, else the
    /// oldest waiting), else drops the oldest delta.
    pub fn push(&mut self, delta: PendingDelta) {
        if self.queue.len() >= self.capacity {
            if delta.delta < 0 {
                self.returns_not_sent += 1;
                return;
            }
            if let Some(i) = self.queue.iter().position(|d| d.delta < 0) {
                self.queue.remove(i);
                self.returns_not_sent += 1;
            } else if let Some(old) = self.queue.pop_front() {
                self.dropped += 1;
                self.dropped_amount = self.dropped_amount.saturating_add(old.delta.unsigned_abs());
            }
        }
        self.queue.push_back(delta);
    }

    /// The deltas to send, oldest first.
    pub fn pending(&self) -> impl Iterator<Item = &PendingDelta> {
        self.queue.iter()
    }

    /// The store answered `seq`: forget it.
    pub fn answered(&mut self, seq: u64) {
        self.queue.retain(|d| d.seq != seq);
    }

    /// Deltas waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether none wait.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Deltas dropped so far, and the sum of their absolute amounts.
    pub fn dropped(&self) -> (u64, u64) {
        (self.dropped, self.dropped_amount)
    }

    /// Returns given up so far for a full buffer (their counters keep
    /// what they would have given back).
    pub fn returns_not_sent(&self) -> u64 {
        self.returns_not_sent
    }
}

impl Default for ModelStore {
    fn default() -> Self {
        ModelStore::new()
    }
}

/// The scripts' semantics in Rust, on an in-memory map: what Redis does
/// with each call (time passed in, since Redis's `TIME` is the model's
/// `now_ms`). Tests replay, duplicate and reorder operations against it;
/// a fake store can answer with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelStore {
    budgets: HashMap<String, i64>,
    rates: HashMap<String, RateBucket>,
    /// Per record key: (last seq, last remaining, last grant).
    records: HashMap<String, (u64, i64, u64)>,
    /// Whether `EVALSHA` finds the scripts.
    loaded: bool,
    /// Hashes written by the hand-off script: key to (field to value).
    hashes: HashMap<String, HashMap<String, String>>,
}

/// The SHA the model answers `SCRIPT LOAD` of the grant script with.
pub const MODEL_GRANT_SHA: &str = "0000000000000000000000000000000000000001";
/// The SHA the model answers `SCRIPT LOAD` of the delta script with.
pub const MODEL_DELTA_SHA: &str = "0000000000000000000000000000000000000002";

impl ModelStore {
    /// An empty store.
    pub fn new() -> ModelStore {
        ModelStore {
            budgets: HashMap::new(),
            rates: HashMap::new(),
            records: HashMap::new(),
            loaded: true,
            hashes: HashMap::new(),
        }
    }

    /// The grant script.
    pub fn grant(
        &mut self,
        keys: &CounterKeys,
        kind: CounterKind,
        seq: u64,
        force: u64,
        asked: u64,
        now_ms: u64,
    ) -> GrantReply {
        let record = self.records.get(&keys.record).copied().unwrap_or((0, 0, 0));
        if seq <= record.0 {
            return if seq == record.0 {
                GrantReply {
                    remaining: record.1,
                    granted: record.2,
                    status: Applied::Replay,
                }
            } else {
                GrantReply {
                    remaining: record.1,
                    granted: 0,
                    status: Applied::Stale,
                }
            };
        }
        let (remaining, granted) = match kind {
            CounterKind::Budget { limit, .. } => {
                let used = self.budgets.entry(keys.counter.clone()).or_insert(0);
                *used = used.saturating_add(force as i64);
                let room = (limit as i64).saturating_sub(*used).max(0) as u64;
                let granted = asked.min(room);
                *used = used.saturating_add(granted as i64);
                ((limit as i64) - *used, granted)
            }
            CounterKind::Rate { limit, period_ms } => {
                let bucket = self
                    .rates
                    .entry(keys.counter.clone())
                    .or_insert(RateBucket {
                        scaled: 0,
                        at_ms: now_ms,
                    });
                bucket.adjust(now_ms, force as i64, limit, period_ms);
                let granted = bucket.take(now_ms, asked, limit, period_ms);
                (rate_remaining(bucket, limit, period_ms), granted)
            }
        };
        self.records
            .insert(keys.record.clone(), (seq, remaining, granted));
        GrantReply {
            remaining,
            granted,
            status: Applied::Now,
        }
    }

    /// The delta script.
    pub fn delta(
        &mut self,
        keys: &CounterKeys,
        kind: CounterKind,
        seq: u64,
        delta: i64,
        now_ms: u64,
    ) -> DeltaReply {
        let record = self.records.get(&keys.record).copied().unwrap_or((0, 0, 0));
        if seq <= record.0 {
            return DeltaReply {
                remaining: record.1,
                status: Applied::Replay,
            };
        }
        let remaining = match kind {
            CounterKind::Budget { limit, .. } => {
                let used = self.budgets.entry(keys.counter.clone()).or_insert(0);
                *used = used.saturating_add(delta).max(0);
                (limit as i64) - *used
            }
            CounterKind::Rate { limit, period_ms } => {
                let bucket = self
                    .rates
                    .entry(keys.counter.clone())
                    .or_insert(RateBucket {
                        scaled: 0,
                        at_ms: now_ms,
                    });
                bucket.adjust(now_ms, delta, limit, period_ms);
                rate_remaining(bucket, limit, period_ms)
            }
        };
        self.records
            .insert(keys.record.clone(), (seq, remaining, 0));
        DeltaReply {
            remaining,
            status: Applied::Now,
        }
    }

    /// Answers a webdis request whose path after the store's prefix is
    /// `path` as webdis in front of this model would: `{"VERB": reply}`
    /// (a fake store for host-sim and the stage's tests).
    pub fn answer_webdis(&mut self, path: &[u8], now_ms: u64) -> Vec<u8> {
        let Some(command) = Command::from_webdis(path) else {
            return serde_json::json!({"ERR": [false, "bad escape"]})
                .to_string()
                .into_bytes();
        };
        let reply = self.execute(&command, now_ms);
        let mut answer = serde_json::Map::new();
        answer.insert(command.verb(), reply.webdis_json());
        serde_json::Value::Object(answer).to_string().into_bytes()
    }

    /// Answers `command` as Redis would with the scripts (time `now_ms`):
    /// `SCRIPT LOAD` (with a SHA of the model's own: it does not hash),
    /// `EVAL` and `EVALSHA` of the two scripts, `EVAL` of the hand-off script; anything else is an error
    /// reply, as are malformed arguments.
    pub fn execute(&mut self, command: &Command, now_ms: u64) -> Reply {
        let text = |i: usize| {
            command
                .args
                .get(i)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .unwrap_or_default()
        };
        let verb = text(0).to_ascii_uppercase();
        if verb == "SCRIPT" && text(1).eq_ignore_ascii_case("LOAD") {
            self.loaded = true;
            return match text(2) {
                s if s == GRANT_SCRIPT => Reply::Bulk(Some(MODEL_GRANT_SHA.as_bytes().to_vec())),
                s if s == DELTA_SCRIPT => Reply::Bulk(Some(MODEL_DELTA_SHA.as_bytes().to_vec())),
                _ => Reply::Error("ERR the model knows only the quota scripts".into()),
            };
        }
        if verb == "EVAL" && text(1) == HAND_OFF_SCRIPT {
            return self.hand_off(&text(3), text(4), text(5), text(6).parse().unwrap_or(0));
        }
        let script = match (verb.as_str(), text(1)) {
            ("EVAL", s) if s == GRANT_SCRIPT => Script::Grant,
            ("EVAL", s) if s == DELTA_SCRIPT => Script::Delta,
            ("EVALSHA", s) if s == MODEL_GRANT_SHA && self.loaded => Script::Grant,
            ("EVALSHA", s) if s == MODEL_DELTA_SHA && self.loaded => Script::Delta,
            ("EVALSHA", _) => {
                return Reply::Error("NOSCRIPT No matching script. Please use EVAL.".into());
            }
            _ => return Reply::Error(format!("ERR unknown command {verb:?}")),
        };
        let num = |i: usize| text(i).parse::<i64>().ok();
        let keys = CounterKeys {
            counter: text(3),
            record: text(4),
        };
        let (Some(limit), Some(third), Some(seq), Some(a)) = (num(6), num(7), num(8), num(9))
        else {
            return Reply::Error("ERR malformed arguments".into());
        };
        let limit = limit.max(0) as u64;
        let kind = if text(5) == "r" {
            CounterKind::Rate {
                limit,
                period_ms: third.max(1) as u64,
            }
        } else {
            CounterKind::Budget {
                limit,
                expire_at: third,
            }
        };
        let seq = seq.max(0) as u64;
        let ints = |v: &[i64]| Reply::Array(Some(v.iter().map(|n| Reply::Integer(*n)).collect()));
        let code = |a: Applied| match a {
            Applied::Now => 0,
            Applied::Replay => 1,
            Applied::Stale => 2,
        };
        match script {
            Script::Grant => {
                let asked = num(10).unwrap_or(0).max(0) as u64;
                let g = self.grant(&keys, kind, seq, a.max(0) as u64, asked, now_ms);
                ints(&[g.remaining, g.granted as i64, code(g.status)])
            }
            Script::Delta => {
                let d = self.delta(&keys, kind, seq, a, now_ms);
                ints(&[d.remaining, code(d.status)])
            }
        }
    }

    /// The hand-off script (the TTL is not modelled).
    fn hand_off(&mut self, key: &str, field: String, value: String, max: u64) -> Reply {
        let hash = self.hashes.entry(key.to_string()).or_default();
        if hash.contains_key(&field) {
            return Reply::Integer(1);
        }
        if hash.len() as u64 >= max {
            return Reply::Integer(0);
        }
        hash.insert(field, value);
        Reply::Integer(1)
    }

    /// The fields and values of hash `key` (empty when absent).
    pub fn hash(&self, key: &str) -> Option<&HashMap<String, String>> {
        self.hashes.get(key)
    }

    /// Forgets the loaded scripts, as a restarted Redis does (`EVALSHA`
    /// then answers `NOSCRIPT`); the model starts with them loaded.
    pub fn flush_scripts(&mut self) {
        self.loaded = false;
    }

    /// A budget counter's value (0 when absent).
    pub fn counter(&self, key: &str) -> i64 {
        self.budgets.get(key).copied().unwrap_or(0)
    }

    /// Every budget counter, by key.
    pub fn counters(&self) -> impl Iterator<Item = (&str, i64)> {
        self.budgets.iter().map(|(k, v)| (k.as_str(), *v))
    }
}

fn rate_remaining(bucket: &RateBucket, limit: u64, period_ms: u64) -> i64 {
    let cap = i128::from(limit) * i128::from(period_ms);
    let room = cap - i128::from(bucket.scaled);
    i64::try_from(room.div_euclid(i128::from(period_ms.max(1)))).unwrap_or(i64::MIN)
}
