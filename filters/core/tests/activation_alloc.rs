//! Evaluating rules allocates nothing: checked with a counting allocator
//! (the one place this project needs `unsafe`: a `GlobalAlloc` impl).
#![allow(unsafe_code)]

mod support;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use support::{Facts, Request};
use zerolayer_core::activation::RuleSet;

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn evaluation_does_not_allocate() {
    let rules = RuleSet::from_json(include_str!("../benches/ten_rules.json").as_bytes()).unwrap();
    let requests = [
        Request::get("/v1/messages?beta=1")
            .method("POST")
            .header("x-tier", "silver")
            .header("user-agent", "AsyncAnthropic/Python 2.16.0")
            .header("x-tenant-id", "globex")
            .id("0d9d1e52")
            .at(1_795_953_600),
        Request::get("/internal/x").header("x-debug", "1").at(0),
        Request::get("/v1/chat/completions").id("other"),
    ];
    // Warm up: the regex engine creates its per-thread scratch space once.
    for request in &requests {
        rules.evaluate(&Facts {
            rules: &rules,
            request,
        });
    }
    let before = ALLOCATIONS.load(Ordering::SeqCst);
    let mut any = 0u64;
    for _ in 0..1000 {
        for request in &requests {
            any ^= rules
                .evaluate(&Facts {
                    rules: &rules,
                    request,
                })
                .observers
                .bits();
        }
    }
    let after = ALLOCATIONS.load(Ordering::SeqCst);
    assert_eq!(after - before, 0, "evaluation allocated (result {any})");
}
