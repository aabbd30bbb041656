//! The request path allocates nothing once a scope's lease exists:
//! reserve, draw and settle against 8 policies, counted by an allocator
//! that counts only this thread's allocations (other test threads cannot
//! disturb it; the activation test's global counter can be, when the
//! harness's threads allocate meanwhile). A `GlobalAlloc` impl is the one
//! place tests need `unsafe`.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use serde_json::json;
use zerolayer_core::quota::config::QuotaConfig;
use zerolayer_core::quota::gateway::{GatewayQuota, Identity, Settlement};
use zerolayer_core::quota::reserve::{RequestBound, TokenCounts};
use zerolayer_core::quota::store::ModelStore;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

struct Counting;

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|a| a.set(a.get() + 1));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

#[test]
fn reserve_draw_and_settle_do_not_allocate() {
    let policies: Vec<_> = (0..8)
        .map(|i| {
            let limit = if i % 2 == 0 {
                json!({"budget": {"amount": 1_000_000_000u64, "window": "day"}})
            } else {
                json!({"rate": {"amount": 1_000_000_000u64, "per": "second"}})
            };
            let unit = match i % 4 {
                0 => json!("tokens"),
                1 => json!("requests"),
                2 => json!({"weighted_tokens": {"models": {"m": {"input": 1000, "output": 3000, "cache_read": 100}}}}),
                _ => json!({"currency": {"default": {"input": 2_500_000, "output": 10_000_000, "cache_read": 1_000_000}}}),
            };
            json!({"name": format!("p{i}"), "scope": ["tenant", "model"], "models": ["m"], "unit": unit, "limit": limit, "stream": "hard"})
        })
        .collect();
    let config = json!({"store": {"cluster": "webdis", "path": "/"}, "policies": policies});
    let config = QuotaConfig::from_json(config.to_string().as_bytes()).unwrap();
    let mut q = GatewayQuota::new(&config, 1, 2).unwrap();
    let mut store = ModelStore::new();
    let who = Identity {
        verified: true,
        tenant: Some("acme"),
        model: Some("m"),
        ..Identity::default()
    };
    let bound = RequestBound::new(2_000, Some(256));
    let t0 = 1_796_256_000_000u64;
    // Warm up: the first request is refused (no lease has a grant yet) and
    // makes all 8 leases; one sync refills them all.
    assert!(q.reserve(&who, &bound, true, t0).is_err());
    for _ in 0..2 {
        let mut calls = Vec::new();
        q.sync(t0, &mut calls);
        for c in &calls {
            let reply = store.execute(&c.command, t0);
            q.on_reply(&c.target, Ok(reply), t0);
        }
    }
    let before = allocations();
    for i in 0..1000u64 {
        let now = t0 + 1 + i / 100;
        let mut ticket = q.reserve(&who, &bound, true, now).unwrap();
        assert_eq!(ticket.policies().count(), 8);
        for out in [16, 32, 48] {
            q.draw(&mut ticket, Some("m"), out, now);
        }
        let usage = TokenCounts {
            input: 500,
            output: 48,
            cache_read: 100,
            cache_write: 0,
        };
        q.settle(ticket, Some("m"), Settlement::Usage(usage), now);
    }
    assert_eq!(allocations() - before, 0, "the request path allocated");
}
