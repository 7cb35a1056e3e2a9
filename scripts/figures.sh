#!/usr/bin/env bash
# One quiet session: every figure the closing note reports.
set -u
cd "$(dirname "$0")/.."
echo "== date $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
echo "== core: lease cycle (criterion)"
cargo bench -q -p kv-transfer-core --bench lease_cycle -- --warm-up-time 2 --measurement-time 5 2>&1 | grep -E "time:|metadata|lease_cycle/"
echo "== kvt bench: tcp-sim, mori, mooncake, nixl (WRITE, batch 32, 4 threads, 3 s), 64KiB and 1MiB, twice"
for round in 1 2; do
  ./target/release/kvt bench --backend tcp-sim,mori,mooncake,nixl --sweep 64KiB,1MiB --duration 3s --json > ${TMPDIR:-/tmp}/kvt-$round.json 2>${TMPDIR:-/tmp}/kvt-$round.err || cat ${TMPDIR:-/tmp}/kvt-$round.err
  python3 -c "
import json;r=json.load(open('${TMPDIR:-/tmp}/kvt-$round.json'))
for x in r: print('round $round', x['backend'].ljust(9), str(x['block_size']).rjust(8), '%.3f GB/s'%x['gb_per_s'], 'p50 %d p99 %d us/batch'%(x['p50_us'],x['p99_us']))
"
done
echo "== kvt bench: MORI against the bare simulator, 12 alternating rounds (median of per-round ratios)"
./target/release/kvt bench --backend tcp-sim,mori --sweep 64KiB,1MiB --rounds 12 --duration 1500ms 2>&1 | tail -n 8
./target/release/kvt bench --backend tcp-sim,mori,mooncake,nixl --sweep 64KiB,256KiB,1MiB,4MiB --duration 2s --plot ${TMPDIR:-/tmp}/sweep.svg --json > ${TMPDIR:-/tmp}/kvt-sweep.json 2>&1 && echo "sweep plot: /tmp/sweep.svg"
echo "== Mooncake: real vs ours, 1 MiB and 64 KiB (measure.sh, 4 s each)"
DUR=4 CARGO_TARGET_DIR=target bash backend-mooncake/scripts/measure.sh 2>&1
DUR=4 BLOCK=65536 CARGO_TARGET_DIR=target bash backend-mooncake/scripts/measure.sh 2>&1
echo "== MORI at 64 KiB with other thread x batch shapes against the bare simulator (the gap depends on them)"
for shape in "2 32" "4 16" "2 64" "8 32"; do
  set -- $shape
  echo "threads $1 batch $2:"
  ./target/release/kvt bench --backend tcp-sim,mori --sweep 64KiB --threads $1 --batch $2 --rounds 12 --duration 1500ms 2>&1 | tail -n 3
done
echo "== NIXL: adapter vs raw C API (default UCX, 31 rounds twice: the 64 KiB figure is near its goal; then TCP)"
for run in 1 2; do
  KVT_BENCH_ROUNDS=31 KVT_BENCH_SECS=0.3 timeout 600 ./target/release/examples/adapter_bench 2>&1 | tail -5
done
# NIXL refuses UCX_TLS=tcp alone on a machine with an NVIDIA GPU: add cuda_copy there.
tls=tcp; command -v nvidia-smi >/dev/null && tls=tcp,cuda_copy
UCX_TLS=$tls KVT_BENCH_ROUNDS=9 KVT_BENCH_SECS=0.3 timeout 300 ./target/release/examples/adapter_bench 2>&1 | tail -5
echo "== done $(date -u +%T)"
