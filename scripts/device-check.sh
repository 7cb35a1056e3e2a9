#!/usr/bin/env bash
# The GPU proof of KV slots in device memory, on one NVIDIA GPU, in one table:
#
#   1. the CUDA region's tests (allocation, copies both ways, borrowed memory,
#      the driver's pointer query);
#   2. the conformance suite with every slot in GPU memory: the `_cuda`
#      columns (tcp-sim and Mooncake over TCP stage through host buffers,
#      NIXL registers VRAM, the verbs software NIC copies through the region);
#   3. the reassignment race on GPU memory, its positive control included;
#   4. NIXL's hazard with device slots between two processes: raw NIXL (a
#      WRITE released while IN_PROG lands in the reassigned slot) against the
#      adapter (nothing lands);
#   5. throughput: `kvt bench --device cuda` device to device and host to
#      device at 64 KiB and 16 MiB, and NIXL's adapter against its raw C API
#      in the same run (goal: at least 95 %).
#
# It builds what it needs (release, the features `cuda`), needs cargo, the
# NVIDIA driver and, for the NIXL rows, the engines venv (.engines, made by
# scripts/test; KVT_ENGINES_VENV elsewhere). Under 5 minutes on one GPU
# once built. A row that cannot run says why; the exit status is non-zero if
# any row failed.
#
#   scripts/device-check.sh            KVT_DEVICE=cuda:1 picks the GPU
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
say() { printf '[device-check %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*" >&2; }
export KVT_DEVICE="${KVT_DEVICE:-cuda:0}"
export UCX_TLS="${UCX_TLS:-tcp,cuda_copy}"
if [ -z "${KVT_ENGINES_VENV:-}" ] && [ -x .engines/bin/python ]; then
    export KVT_ENGINES_VENV="$PWD/.engines"
fi
log=$(mktemp -d /tmp/kvt-device-check.XXXXXX)

command -v cargo >/dev/null || { echo "device-check: cargo is not installed (https://rustup.rs)" >&2; exit 2; }
if ! command -v nvidia-smi >/dev/null; then
    echo "device-check: no NVIDIA driver here (nvidia-smi not found); run this on a machine with a GPU" >&2
    exit 2
elif ! nvidia-smi -L >"$log/gpus" 2>&1; then
    echo "device-check: no usable NVIDIA GPU here (nvidia-smi -L: $(head -1 "$log/gpus"))" >&2
    exit 2
fi
say "GPUs: $(tr '\n' ';' <"$log/gpus")"

rows=()
failed=0
# row NAME RESULT DETAIL
row() {
    rows+=("$(printf '| %-52s | %-6s | %s |' "$1" "$2" "$3")")
    [ "$2" = "FAIL" ] && failed=1
    say "$1: $2 $3"
}
# run NAME LOGFILE TIMEOUT CMD...: runs CMD (stdout to LOGFILE, stderr to
# LOGFILE.err), returns its status.
run() {
    local name=$1 out=$2 limit=$3
    shift 3
    say "$name: $*"
    timeout "$limit" "$@" >"$out" 2>"$out.err"
}
# The libtest summary line's counts, e.g. "4 passed, 0 failed, 0 ignored".
counts() {
    grep -E '^test result' "$1" | tail -1 | sed -E 's/.*ok\. |.*FAILED\. //; s/; [0-9]+ measured.*//'
}

say "building (release, features cuda)"
for b in "-p kv-transfer-core --features cuda,fake-device --lib --tests" \
         "-p kv-transfer-tests --features mooncake,nixl --tests" \
         "-p backend-nixl --features cuda --tests --examples --bins" \
         "-p kvt --features cuda --bins"; do
    # shellcheck disable=SC2086
    if ! cargo build -q --release $b >>"$log/build" 2>&1; then
        tail -20 "$log/build" >&2
        echo "device-check: cargo build --release $b failed (log: $log/build)" >&2
        exit 1
    fi
done

# 1. The CUDA region.
if run "cuda region" "$log/region" 120 cargo test -q --release -p kv-transfer-core --features cuda,fake-device \
        --lib region::cuda -- --include-ignored; then
    row "CUDA region: allocation, copies, borrowed memory" PASS "$(counts "$log/region")"
else
    row "CUDA region: allocation, copies, borrowed memory" FAIL "$(counts "$log/region") ($log/region)"
fi

# 2. The conformance suite with slots in GPU memory.
if run "conformance _cuda" "$log/conformance" 300 cargo test -q --release -p kv-transfer-tests \
        --features mooncake,nixl --test conformance -- _cuda; then
    row "conformance, slots in $KVT_DEVICE (tcp-sim, mooncake, nixl, verbs-fake)" PASS "$(counts "$log/conformance")"
else
    row "conformance, slots in $KVT_DEVICE (tcp-sim, mooncake, nixl, verbs-fake)" FAIL \
        "$(counts "$log/conformance"); $(grep -E '^    [a-z0-9_]+::' "$log/conformance" | head -3 | tr -d ' ' | tr '\n' ' ')"
fi

# 3. The race on GPU memory.
if run "race on cuda" "$log/race" 300 cargo test -q --release -p kv-transfer-tests --test race -- \
        --ignored on_cuda_memory; then
    row "race on $KVT_DEVICE (naive corrupts, safe: 0 foreign bytes)" PASS "$(counts "$log/race")"
else
    row "race on $KVT_DEVICE (naive corrupts, safe: 0 foreign bytes)" FAIL "$(counts "$log/race") ($log/race)"
fi

# 4. NIXL's hazard, device slots, two processes.
if [ -z "${KVT_ENGINES_VENV:-}" ]; then
    row "NIXL hazard, device slots, two processes" SKIP "no engines venv with NIXL (run scripts/test once)"
elif run "nixl hazard" "$log/hazard" 300 env KVT_HAZARD_MIB="${KVT_HAZARD_MIB:-256}" cargo test -q --release \
        -p backend-nixl --features cuda --test adapter_two_process -- --ignored --nocapture on_device_memory; then
    row "NIXL hazard, device slots, two processes" PASS "$(grep -o 'raw release-while-IN_PROG.*' "$log/hazard" | head -1)"
else
    row "NIXL hazard, device slots, two processes" FAIL "$(grep -hE 'panicked|HAZARD|error' "$log/hazard" "$log/hazard.err" | head -2 | tr '\n' ' ')"
fi

# 5. Throughput.
kvt=target/release/kvt
for placement in "device to device:--device $KVT_DEVICE" "host to device:--source-device host --device $KVT_DEVICE"; do
    what=${placement%%:*}
    # shellcheck disable=SC2086
    if run "kvt bench $what" "$log/bench" 300 "$kvt" bench --backend tcp-sim,mooncake,nixl ${placement#*:} \
            --sweep 64KiB,16MiB --duration 1s --rounds 3 --json; then
        detail=$(python3 -c "
import json, sys
doc = json.load(open('$log/bench'))
print('; '.join(f\"{r['backend']} {r['block_size'] >> 10} KiB {r['gb_per_s']:.2f} GB/s\" for r in doc['summary']))
" 2>/dev/null || echo "see $log/bench")
        row "kvt bench, $what ($KVT_DEVICE)" PASS "$detail"
    else
        row "kvt bench, $what ($KVT_DEVICE)" FAIL "$(tail -2 "$log/bench.err" | tr '\n' ' ')"
    fi
done
if [ -z "${KVT_ENGINES_VENV:-}" ]; then
    row "NIXL adapter / raw C API, device to device" SKIP "no engines venv with NIXL (run scripts/test once)"
elif run "nixl adapter_bench" "$log/adapter_bench" 300 env KVT_BENCH_DEVICE="$KVT_DEVICE" \
        target/release/examples/adapter_bench; then
    row "NIXL adapter / raw C API, device to device" INFO \
        "$(grep -o 'block *[0-9]* B: adapter qd1 / best raw = [0-9.]*%' "$log/adapter_bench" | tr '\n' ' ') (goal >= 95%)"
else
    row "NIXL adapter / raw C API, device to device" FAIL "$(tail -2 "$log/adapter_bench" "$log/adapter_bench.err" | tr '\n' ' ')"
fi

echo
echo "kv-transfer device check, $(date -u +%F), $(head -1 "$log/gpus"), $KVT_DEVICE, UCX_TLS=$UCX_TLS"
echo
printf '| %-52s | %-6s | %s |\n' "check" "result" "figures"
printf '| %-52s | %-6s | %s |\n' "---" "---" "---"
printf '%s\n' "${rows[@]}"
echo
echo "logs: $log ($(( $(date +%s) - t0 )) s)"
exit "$failed"
