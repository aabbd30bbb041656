# Thin recipes over `cargo xtask` (which needs nothing but cargo and python3).

# Run the demo: the filters inside real Envoy, per-request decisions printed.
demo *args:
    cargo xtask demo {{args}}

# Run every test, as CI does.
test:
    cargo xtask test

# Install the wasm target and the pinned Envoy into .venv.
setup:
    cargo xtask setup

# Build every filter as .wasm.
build-wasm:
    cargo xtask build-wasm

# Build the rule playground page into target/playground/ (serve: cargo run -p host-sim-tools -- playground).
playground:
    cargo xtask build-playground

# Criterion benchmarks.
bench:
    cargo xtask bench

# The whole chain in real Envoy under steady load (default 10 minutes).
soak *args:
    cargo xtask soak {{args}}
