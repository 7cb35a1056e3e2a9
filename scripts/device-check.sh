#!/usr/bin/env bash
# The GPU proof of KV slots in device memory, on one NVIDIA GPU, in one table:
#
#   1. the CUDA region's tests (allocation, copies both ways, borrowed memory,
#      the driver's pointer query);
#   2. the conformance suite with every slot in GPU memory: the `_cuda`
#      columns (tcp-sim and Mooncake over TCP stage through host buffers,
#      NIXL registers VRAM, the verbs software NIC copies through the region),
#      the reassignment race included (`s2_*`, its positive control too);
#   3. NIXL's hazard with device slots between two processes: raw NIXL (a
#      WRITE released while IN_PROG lands in the reassigned slot) against the
#      adapter (nothing lands);
#   4. throughput: `kvt bench --device cuda` device to device and host to
#      device at 64 KiB and 16 MiB, and NIXL's adapter against its raw C API
#      in the same run (goal: at least 95 %).
#
# It builds what it needs (release, the features `cuda`) and needs cargo, the
# NVIDIA driver and, for the NIXL rows, NIXL (the engines venv .engines made
# by scripts/test, KVT_ENGINES_VENV, or NIXL_LIB_DIR). Under 5 minutes on one
# GPU once built. A row that cannot run says why; the exit status is non-zero
# if any row failed.
#
#   scripts/device-check.sh                    build and run here
#   scripts/device-check.sh --build-only DIR   build here, put the binaries in DIR
#   scripts/device-check.sh --prebuilt DIR     run DIR's binaries (a GPU machine
#                                              with no Rust toolchain)
#   KVT_DEVICE=cuda:1 picks the GPU; KVT_HAZARD_MIB the hazard's size (256)
set -uo pipefail
mode=run
bin=
case "${1:-}" in
    --build-only) mode=build; bin=${2:?--build-only needs a folder} ;;
    --prebuilt) mode=prebuilt; bin=${2:?--prebuilt needs a folder} ;;
    "") ;;
    *) echo "usage: scripts/device-check.sh [--build-only DIR | --prebuilt DIR]" >&2; exit 2 ;;
esac
[ -n "$bin" ] && bin=$(realpath -m "$bin")
cd "$(dirname "$0")/.."
t0=$(date +%s)
say() { printf '[device-check %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*" >&2; }
export KVT_DEVICE="${KVT_DEVICE:-cuda:0}"
export UCX_TLS="${UCX_TLS:-tcp,cuda_copy}"
if [ -z "${KVT_ENGINES_VENV:-}" ] && [ -x .engines/bin/python ]; then
    export KVT_ENGINES_VENV="$PWD/.engines"
fi
log=$(mktemp -d /tmp/kvt-device-check.XXXXXX)

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
# Whether the summary counts any test passed (all ignored is not a pass).
some_passed() {
    [ "$(counts "$1" | sed -E 's/^([0-9]+) passed.*/\1/')" -gt 0 ] 2>/dev/null
}

# The binaries each row runs, built once: test binaries by target, and the
# tools. In `--build-only` they are copied (without debug info) into $bin.
build() {
    command -v cargo >/dev/null || { echo "device-check: cargo is not installed (https://rustup.rs)" >&2; exit 2; }
    say "building (release, features cuda)"
    export CARGO_PROFILE_RELEASE_DEBUG=0
    local spec name out
    for spec in "core-lib:-p kv-transfer-core --features cuda,fake-device --lib" \
                "conformance:-p kv-transfer-tests --features mooncake,nixl --test conformance" \
                "adapter_two_process:-p backend-nixl --features cuda --test adapter_two_process"; do
        name=${spec%%:*}
        # shellcheck disable=SC2086
        out=$(cargo test -q --release --no-run --message-format=json ${spec#*:} 2>>"$log/build" |
            python3 -c "
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get('reason') == 'compiler-artifact' and m.get('executable') and m['profile'].get('test'):
        print(m['executable'])" | tail -1)
        [ -n "$out" ] || { tail -20 "$log/build" >&2; echo "device-check: building $name failed" >&2; exit 1; }
        exes[$name]=$out
    done
    for spec in "-p kv-transfer-tests --bins" "-p backend-nixl --features cuda --bins --examples" \
                "-p kvt --features cuda --bins"; do
        # shellcheck disable=SC2086
        cargo build -q --release $spec >>"$log/build" 2>&1 || { tail -20 "$log/build" >&2; exit 1; }
    done
    exes[prefill-worker]=target/release/prefill-worker
    exes[nixl_peer]=target/release/nixl_peer
    exes[kvt]=target/release/kvt
    exes[adapter_bench]=target/release/examples/adapter_bench
}

declare -A exes
case $mode in
    build)
        build
        mkdir -p "$bin"
        for name in "${!exes[@]}"; do
            cp "${exes[$name]}" "$bin/$name" && strip "$bin/$name" 2>/dev/null
        done
        du -sh "$bin" >&2
        say "built into $bin: run scripts/device-check.sh --prebuilt $bin where the GPU is"
        exit 0 ;;
    prebuilt)
        for name in core-lib conformance adapter_two_process prefill-worker nixl_peer kvt adapter_bench; do
            [ -x "$bin/$name" ] || { echo "device-check: $bin/$name is missing (--build-only $bin makes it)" >&2; exit 2; }
            exes[$name]=$bin/$name
        done ;;
    run) build ;;
esac
export KVT_PREFILL_WORKER="${exes[prefill-worker]}" KVT_NIXL_PEER="${exes[nixl_peer]}"
nixl_here() { [ -n "${KVT_ENGINES_VENV:-}${NIXL_LIB_DIR:-}" ]; }

if ! command -v nvidia-smi >/dev/null; then
    echo "device-check: no NVIDIA driver here (nvidia-smi not found); run this on a machine with a GPU" >&2
    exit 2
elif ! nvidia-smi -L >"$log/gpus" 2>&1; then
    echo "device-check: no usable NVIDIA GPU here (nvidia-smi -L: $(head -1 "$log/gpus"))" >&2
    exit 2
fi
say "GPUs: $(tr '\n' ';' <"$log/gpus")"

# 1. The CUDA region.
if run "cuda region" "$log/region" 120 "${exes[core-lib]}" region::cuda --include-ignored; then
    row "CUDA region: allocation, copies, borrowed memory" PASS "$(counts "$log/region")"
else
    row "CUDA region: allocation, copies, borrowed memory" FAIL "$(counts "$log/region") ($log/region)"
fi

# 2. The conformance suite with slots in GPU memory.
if run "conformance _cuda" "$log/conformance" 300 "${exes[conformance]}" _cuda && some_passed "$log/conformance"; then
    row "conformance and the race, slots in $KVT_DEVICE (tcp-sim, mooncake, nixl, verbs-fake)" PASS "$(counts "$log/conformance")"
else
    row "conformance and the race, slots in $KVT_DEVICE (tcp-sim, mooncake, nixl, verbs-fake)" FAIL \
        "$(counts "$log/conformance"); $(grep -E '^    [a-z0-9_]+::' "$log/conformance" | head -3 | tr -d ' ' | tr '\n' ' ')"
fi

# 3. NIXL's hazard, device slots, two processes.
if ! nixl_here; then
    row "NIXL hazard, device slots, two processes" SKIP "no NIXL (KVT_ENGINES_VENV or NIXL_LIB_DIR)"
elif run "nixl hazard" "$log/hazard" 300 env KVT_HAZARD_MIB="${KVT_HAZARD_MIB:-256}" \
        "${exes[adapter_two_process]}" --ignored --nocapture on_device_memory; then
    row "NIXL hazard, device slots, two processes" PASS "$(grep -o 'raw release-while-IN_PROG.*' "$log/hazard" | head -1)"
else
    row "NIXL hazard, device slots, two processes" FAIL "$(grep -hE 'panicked|HAZARD|error' "$log/hazard" "$log/hazard.err" | head -2 | tr '\n' ' ')"
fi

# 4. Throughput.
kvt=${exes[kvt]}
backends=tcp-sim,mooncake
nixl_here && backends=$backends,nixl
for placement in "device to device:--device $KVT_DEVICE" "host to device:--source-device host --device $KVT_DEVICE"; do
    what=${placement%%:*}
    # shellcheck disable=SC2086
    if run "kvt bench $what" "$log/bench" 300 "$kvt" bench --backend $backends ${placement#*:} \
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
if ! nixl_here; then
    row "NIXL adapter / raw C API, device to device" SKIP "no NIXL (KVT_ENGINES_VENV or NIXL_LIB_DIR)"
elif run "nixl adapter_bench" "$log/adapter_bench" 300 env KVT_BENCH_DEVICE="$KVT_DEVICE" "${exes[adapter_bench]}"; then
    row "NIXL adapter / raw C API, device to device" INFO \
        "$(grep -o 'block *[0-9]* B: adapter qd1 / best raw = [0-9.]*%' "$log/adapter_bench" | tr '\n' ' ') (goal >= 95%)"
else
    row "NIXL adapter / raw C API, device to device" FAIL "$(cat "$log/adapter_bench" "$log/adapter_bench.err" | tail -2 | tr '\n' ' ')"
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
