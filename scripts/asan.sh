#!/usr/bin/env bash
# The hostile-peer tests of the simulator and MORI (lifetime, panics, early
# completions) under AddressSanitizer: a write into freed or unowned memory
# fails the run. Needs a nightly toolchain (std itself is not instrumented:
# rust-src is not required). Usage: scripts/asan.sh [extra test filter]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    echo "asan: no nightly toolchain (rustup toolchain install nightly); not run" >&2
    exit 2
fi
target="$(rustc -vV | sed -n 's/^host: //p')"
RUSTFLAGS="-Zsanitizer=address" ASAN_OPTIONS="detect_leaks=0" \
    cargo +nightly test --target "$target" --target-dir target/asan \
    -p backend-mori -p backend-tcp-sim --features backend-mori/sim \
    --test adapter_sim --test loopback_engine --test sim "${1:-hostile}"
