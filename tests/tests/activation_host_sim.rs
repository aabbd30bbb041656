//! The activation filter in host-sim: the same `.wasm` Envoy loads.

use anyhow::Result;
use host_sim::{Host, PluginSpec};
use zerolayer_e2e::paths;

const RULES: &str = include_str!("../fixtures/activation-rules.json");

fn host_with(rules: &str) -> Result<(Host, host_sim::ChainId)> {
    let mut host = Host::new()?;
    let chain = host.add_chain(vec![
        PluginSpec::new("zerolayer.activation", paths::wasm("activation")?).configuration(rules),
    ])?;
    Ok((host, chain))
}

#[test]
fn decision_is_published_as_filter_state() -> Result<()> {
    let (mut host, chain) = match host_with(RULES) {
        Ok(x) => x,
        Err(e) => panic!("{e:#}"),
    };
    let started = std::time::Instant::now();
    let mut s = host.stream(chain)?;
    s.request_headers(
        &[
            (":method", "POST"),
            (":path", "/v1/messages"),
            (":authority", "gw"),
            ("x-tenant-id", "acme"),
            ("x-request-id", "r-1"),
        ],
        true,
    );
    eprintln!("first stream took {:?}", started.elapsed());
    assert!(s.upstream().complete);
    let state = s
        .filter_state("wasm.wasmx.zerolayer_observers")
        .unwrap_or_default();
    eprintln!("{}", String::from_utf8_lossy(&state));
    assert!(String::from_utf8_lossy(&state).contains("metering"));
    Ok(())
}
