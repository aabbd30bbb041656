//! The quota stage's Lua scripts on a real Redis 7 (RESP over a plain
//! socket) and through webdis, against the Rust model they follow
//! (`zerolayer_core::quota::store::ModelStore`). Each test starts its own
//! Redis and webdis on free ports (`RedisFleet`; installed by `cargo xtask
//! setup`) and fails, never skips, when they cannot start.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use zerolayer_core::quota::store::{
    Command, CounterKeys, CounterKind, DeltaReply, GrantReply, ModelStore, Reply, Script,
    ScriptShas, StoreError, delta_command, grant_command, parse_resp, sha_from_reply,
};

use zerolayer_e2e::fleet::RedisFleet;

struct Redis(TcpStream);

impl Redis {
    fn call(&mut self, command: &Command) -> Reply {
        self.0.write_all(&command.resp()).unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let n = self.0.read(&mut chunk).unwrap();
            assert!(n > 0, "redis closed the connection");
            buf.extend_from_slice(&chunk[..n]);
            match parse_resp(&buf) {
                Ok(reply) => return reply,
                Err(StoreError::Malformed(_)) => continue, // incomplete: read more
                Err(e) => panic!("{e}"),
            }
        }
    }

    fn int(&mut self, args: &[&str]) -> i64 {
        match self.call(&Command::new(args.iter().copied())) {
            Reply::Integer(n) => n,
            other => panic!("{args:?}: {other:?}"),
        }
    }
}

#[test]
fn the_scripts_do_on_redis_what_the_model_does() {
    let fleet = RedisFleet::start_for_quota().expect("Redis and webdis");
    let stream = TcpStream::connect(fleet.redis()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut redis = Redis(stream);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let prefix = format!("zl:test:{}:", now.as_nanos());

    // EVAL first, then EVALSHA once the SHA is known.
    let mut shas = ScriptShas::default();
    let keys = CounterKeys::new(&prefix, "daily", &[7; 16], Some(20_261_203), 1);
    let expire_at = now.as_secs() as i64 + 7200;
    let budget = CounterKind::Budget {
        limit: 1000,
        expire_at,
    };
    let mut model = ModelStore::new();
    let grant = |redis: &mut Redis, shas: &ScriptShas, seq, force, asked| {
        GrantReply::from_reply(&redis.call(&grant_command(shas, &keys, budget, seq, force, asked)))
            .unwrap()
    };
    assert_eq!(
        grant(&mut redis, &shas, 1, 0, 400),
        model.grant(&keys, budget, 1, 0, 400, 0)
    );
    for script in [Script::Grant, Script::Delta] {
        let sha = sha_from_reply(&redis.call(&Command::script_load(script))).unwrap();
        shas.learn(script, &sha);
    }
    // (seq, force, asked, what the case is)
    for (seq, force, asked, case) in [
        (1, 0, 400, "replay"),
        (2, 0, 700, "capped"),
        (3, 30, 5, "debt"),
        (2, 0, 5, "stale"),
    ] {
        assert_eq!(
            grant(&mut redis, &shas, seq, force, asked),
            model.grant(&keys, budget, seq, force, asked, 0),
            "{case}"
        );
    }
    let delta = |redis: &mut Redis, seq, d| {
        DeltaReply::from_reply(&redis.call(&delta_command(&shas, &keys, budget, seq, d))).unwrap()
    };
    assert_eq!(
        delta(&mut redis, 4, -130),
        model.delta(&keys, budget, 4, -130, 0)
    );
    assert_eq!(
        delta(&mut redis, 4, -130),
        model.delta(&keys, budget, 4, -130, 0),
        "replay"
    );
    assert_eq!(
        delta(&mut redis, 5, -5000),
        model.delta(&keys, budget, 5, -5000, 0),
        "floor 0"
    );
    let counter =
        |redis: &mut Redis| match redis.call(&Command::new(["GET", keys.counter.as_str()])) {
            Reply::Bulk(Some(b)) => String::from_utf8(b).unwrap().parse::<i64>().unwrap(),
            other => panic!("{other:?}"),
        };
    assert_eq!(counter(&mut redis), model.counter(&keys.counter));
    // The expiry is the window's, set once, never pushed back.
    assert_eq!(redis.int(&["EXPIRETIME", &keys.counter]), expire_at);
    assert_eq!(redis.int(&["EXPIRETIME", &keys.record]), expire_at);
    let later = CounterKind::Budget {
        limit: 1000,
        expire_at: expire_at + 999,
    };
    redis.call(&delta_command(&shas, &keys, later, 6, 1));
    assert_eq!(redis.int(&["EXPIRETIME", &keys.counter]), expire_at);

    // Large amounts stay exact (formatted with %.0f, never 1e+15).
    let big = CounterKind::Budget {
        limit: 1 << 53,
        expire_at,
    };
    let bk = CounterKeys::new(&prefix, "big", &[8; 16], Some(1), 1);
    let g =
        GrantReply::from_reply(&redis.call(&grant_command(&shas, &bk, big, 1, 0, (1 << 53) - 3)))
            .unwrap();
    assert_eq!((g.granted, g.remaining), ((1 << 53) - 3, 3));

    // A rate: Redis's clock, so only what does not depend on it exactly.
    let rk = CounterKeys::new(&prefix, "rps", &[9; 16], None, 1);
    let rate = CounterKind::Rate {
        limit: 1_000_000,
        period_ms: 3_600_000,
    };
    let g = GrantReply::from_reply(&redis.call(&grant_command(&shas, &rk, rate, 1, 0, 2_000_000)))
        .unwrap();
    assert_eq!(g.granted, 1_000_000, "one period's amount at most");
    let g = GrantReply::from_reply(&redis.call(&grant_command(&shas, &rk, rate, 2, 0, 5))).unwrap();
    assert!(g.granted <= 5 && g.remaining >= 0);
    let d =
        DeltaReply::from_reply(&redis.call(&delta_command(&shas, &rk, rate, 3, -500_000))).unwrap();
    assert!(d.remaining >= 500_000, "{d:?}");
    assert!(redis.int(&["PTTL", &rk.counter]) > 3_600_000);

    // NOSCRIPT after a flush of the script cache.
    redis.call(&Command::new(["SCRIPT", "FLUSH"]));
    let reply = redis.call(&grant_command(&shas, &keys, budget, 9, 0, 1));
    assert_eq!(GrantReply::from_reply(&reply), Err(StoreError::NoScript));
}

/// The same calls through webdis: the percent-encoded body and the JSON
/// answer.
#[test]
fn the_scripts_work_through_webdis() {
    let fleet = RedisFleet::start_for_quota().expect("Redis and webdis");
    let address = fleet.webdis();
    let post = |command: &Command| -> Reply {
        let body = command.webdis_body();
        let mut s = TcpStream::connect(address).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let head = format!(
            "POST / HTTP/1.1\r\nHost: webdis\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        // Head and body in one write: webdis 0.1.9 now and then never
        // answers a POST whose body arrives in a later segment than its head
        // (9 of 40 fresh servers here).
        let mut request = head.into_bytes();
        request.extend_from_slice(&body);
        s.write_all(&request).unwrap();
        // Read the head, then `content-length` bytes (not until close).
        let mut response = Vec::new();
        let mut chunk = [0u8; 4096];
        let at = loop {
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0, "webdis closed the connection");
            response.extend_from_slice(&chunk[..n]);
            if let Some(i) = response.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
        };
        let head = String::from_utf8_lossy(&response[..at]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap();
        while response.len() < at + length {
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0, "webdis closed the connection early");
            response.extend_from_slice(&chunk[..n]);
        }
        assert!(
            response.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&response)
        );
        zerolayer_core::quota::store::parse_webdis(&response[at..], &command.verb()).unwrap()
    };
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let keys = CounterKeys::new(
        &format!("zl:test:{}:", now.as_nanos()),
        "daily",
        &[7; 16],
        Some(1),
        1,
    );
    let budget = CounterKind::Budget {
        limit: 1000,
        expire_at: now.as_secs() as i64 + 60,
    };
    let mut shas = ScriptShas::default();
    let g = GrantReply::from_reply(&post(&grant_command(&shas, &keys, budget, 1, 0, 400))).unwrap();
    assert_eq!((g.granted, g.remaining), (400, 600));
    shas.learn(
        Script::Grant,
        &sha_from_reply(&post(&Command::script_load(Script::Grant))).unwrap(),
    );
    let g = GrantReply::from_reply(&post(&grant_command(&shas, &keys, budget, 1, 0, 400))).unwrap();
    assert_eq!(
        (g.granted, g.remaining, g.status),
        (400, 600, zerolayer_core::quota::store::Applied::Replay)
    );
    let d = DeltaReply::from_reply(&post(&delta_command(&shas, &keys, budget, 2, -100))).unwrap();
    assert_eq!(d.remaining, 700);
}
