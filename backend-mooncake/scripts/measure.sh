#!/usr/bin/env bash
# Throughput on loopback, same session: real->real, ours->real, real->ours,
# ours->ours. 1 MiB blocks, batch 32, 4 threads, DUR seconds each.
# Run from the workspace root (where .engines lives). Needs the mc_bench
# example built in release: CARGO_TARGET_DIR=tgt/mooncake cargo build --release
# -p backend-mooncake --example mc_bench
set -u
DUR=${DUR:-5}
SP=${ENGINES:-.engines}/lib/python3.11/site-packages
export LD_LIBRARY_PATH=$SP/mooncake_transfer_engine_non_cuda.libs:$SP/mooncake
BENCH=$SP/mooncake/transfer_engine_bench
OURS=${OURS:-${CARGO_TARGET_DIR:-tgt/mooncake}/release/examples/mc_bench}
COMMON="--protocol=tcp --metadata_server=P2PHANDSHAKE --local_server_name=127.0.0.1"
LOAD="--operation=write --duration=$DUR --threads=4 --batch_size=32 --block_size=1048576 --buffer_size=1073741824"
LOG=$(mktemp -d)

timeout $((DUR * 3 + 20)) "$BENCH" --mode=target $COMMON --buffer_size=1073741824 >"$LOG/t.log" 2>&1 &
TP=$!
for _ in $(seq 50); do grep -q "listening on" "$LOG/t.log" && break; sleep 0.2; done
SEG=$(grep -o "listening on 127.0.0.1:[0-9]*" "$LOG/t.log" | head -1 | cut -d' ' -f3)
echo "real target: $SEG"
echo -n "real -> real:  "; timeout $((DUR + 20)) "$BENCH" --mode=initiator $COMMON --segment_id="$SEG" $LOAD 2>&1 | grep -o "throughput.*"
echo -n "ours -> real:  "; timeout $((DUR + 20)) "$OURS" --segment "$SEG" --duration "$DUR"
kill "$TP" 2>/dev/null; wait "$TP" 2>/dev/null

timeout $((DUR + 30)) "$OURS" --serve $((DUR + 15)) >"$LOG/o.log" 2>&1 &
OP=$!
for _ in $(seq 50); do grep -q "listening on" "$LOG/o.log" && break; sleep 0.2; done
OSEG=$(grep -o "listening on [0-9.:]*" "$LOG/o.log" | cut -d' ' -f3)
echo -n "real -> ours:  "; timeout $((DUR + 20)) "$BENCH" --mode=initiator $COMMON --segment_id="$OSEG" $LOAD 2>&1 | grep -o "throughput.*"
kill "$OP" 2>/dev/null; wait "$OP" 2>/dev/null

echo -n "ours -> ours:  "; timeout $((DUR + 20)) "$OURS" --duration "$DUR"
rm -rf "$LOG"
