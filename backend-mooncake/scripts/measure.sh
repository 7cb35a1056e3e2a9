#!/usr/bin/env bash
# Throughput on loopback, one session, same shape for every line (WRITE,
# BLOCK-byte blocks, batch BATCH, THREADS threads, DUR seconds each):
#   real -> real            Mooncake transfer_engine_bench initiator -> bench target
#   ours(adapter) -> real   kv-transfer adapter initiator -> bench target
#   ours(engine) -> real    our raw engine initiator -> bench target
#   real -> ours            bench initiator -> our target
#   ours(adapter) -> ours(adapter)  full safe cycle per batch (expose, write, notify, settle)
#   ours(engine) -> ours    raw engine both sides
# Run from the workspace root (where .engines lives). Needs the mc_bench
# example built in release: CARGO_TARGET_DIR=tgt/mooncake cargo build --release
# -p backend-mooncake --features testing --example mc_bench
# PROTOCOL=rdma DEVICE=rxe_lo: over Mooncake's RDMA transport (in the verbs
# guest; mc_bench built with --features testing,rdma-device); the adapter lines are
# TCP-only and skipped, MIN_BUF defaults to 64 MiB there.
set -u
PROTOCOL=${PROTOCOL:-tcp}
DEVICE=${DEVICE:-}
DUR=${DUR:-5}
THREADS=${THREADS:-4}
BATCH=${BATCH:-32}
BLOCK=${BLOCK:-1048576}
SP=${ENGINES:-.engines}/lib/python3.11/site-packages
export LD_LIBRARY_PATH=$SP/mooncake_transfer_engine_non_cuda.libs:$SP/mooncake
BENCH=$SP/mooncake/transfer_engine_bench
OURS=${OURS:-${CARGO_TARGET_DIR:-tgt/mooncake}/release/examples/mc_bench}
SHAPE="--threads $THREADS --batch $BATCH --block $BLOCK --duration $DUR"
if [ "$PROTOCOL" = rdma ]; then MIN_BUF=${MIN_BUF:-67108864}; else MIN_BUF=${MIN_BUF:-1073741824}; fi
BUF=$((THREADS * BATCH * BLOCK))
[ "$BUF" -lt "$MIN_BUF" ] && BUF=$MIN_BUF
COMMON="--protocol=$PROTOCOL --metadata_server=P2PHANDSHAKE --local_server_name=127.0.0.1"
RDMA_OURS=""
if [ "$PROTOCOL" = rdma ]; then
    COMMON="$COMMON --device_name=$DEVICE"
    RDMA_OURS="--rdma $DEVICE"
    SHAPE="$SHAPE $RDMA_OURS"
fi
LOAD="--operation=write --duration=$DUR --threads=$THREADS --batch_size=$BATCH --block_size=$BLOCK --buffer_size=$BUF"
LOG=$(mktemp -d)
echo "shape: WRITE threads=$THREADS batch=$BATCH block=$BLOCK duration=${DUR}s protocol=$PROTOCOL"

timeout $((DUR * 4 + 30)) "$BENCH" --mode=target $COMMON --buffer_size=$BUF >"$LOG/t.log" 2>&1 &
TP=$!
for _ in $(seq 50); do grep -q "listening on" "$LOG/t.log" && break; sleep 0.2; done
SEG=$(grep -o "listening on 127.0.0.1:[0-9]*" "$LOG/t.log" | head -1 | cut -d' ' -f3)
echo "real target: $SEG"
echo -n "real -> real:                    "; timeout $((DUR + 20)) "$BENCH" --mode=initiator $COMMON --segment_id="$SEG" $LOAD 2>&1 | grep -o "throughput.*"
[ "$PROTOCOL" = tcp ] && { echo -n "ours(adapter) -> real:           "; timeout $((DUR + 20)) "$OURS" --adapter --segment "$SEG" $SHAPE; }
echo -n "ours(engine) -> real:            "; timeout $((DUR + 20)) "$OURS" --segment "$SEG" $SHAPE
kill "$TP" 2>/dev/null; wait "$TP" 2>/dev/null

timeout $((DUR + 30)) "$OURS" --serve $((DUR + 15)) --buffer $BUF $RDMA_OURS >"$LOG/o.log" 2>&1 &
OP=$!
for _ in $(seq 50); do grep -q "listening on" "$LOG/o.log" && break; sleep 0.2; done
OSEG=$(grep -o "listening on [0-9.:]*" "$LOG/o.log" | cut -d' ' -f3)
echo -n "real -> ours:                    "; timeout $((DUR + 20)) "$BENCH" --mode=initiator $COMMON --segment_id="$OSEG" $LOAD 2>&1 | grep -o "throughput.*"
kill "$OP" 2>/dev/null; wait "$OP" 2>/dev/null

[ "$PROTOCOL" = tcp ] && { echo -n "ours(adapter) -> ours(adapter):  "; timeout $((DUR + 20)) "$OURS" --adapter $SHAPE; }
echo -n "ours(engine) -> ours:            "; timeout $((DUR + 20)) "$OURS" $SHAPE
rm -rf "$LOG"
