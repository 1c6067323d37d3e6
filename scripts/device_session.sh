#!/usr/bin/env bash
# One lent GPU machine (one GPU, 16 cores), one call, two lanes at once, everything stopped
# by a deadline and its results packed under $OUT -- what fits the 15 minutes a session:
#
#   bash scripts/device_session.sh            # in the repo root, on the GPU machine
#
# 1. Horovod 0.28.1 (Gloo + CUDA, no NCCL) on all cores, through scripts/gpu_check.sh
#    (about 165 s on 16 cores); every step below needs it (hvd_compress.torch imports it).
# 2. Lane A, the GPU, on cores 0-3: the Triton kernels' CUDA tests (HVD_COMPRESS_TRITON=all:
#    also the kernels that stay off by default), bench_kernels.py --device cuda twice,
#    hvd-compress-compare --device cuda --np 1 2, then the other CUDA tests until the end.
# 3. Lane B, the CPU, on cores 4-15 (B_CORES): hvd-compress-compare --np $NODES_NP
#    --nodes $NODES_N over $NODES_BANDWIDTHS (capped links need `ip` and `tc`: carry them with
#    ../shared/tools/carry-iproute2.sh .devcarry/ipr), then --predict; or several matrices
#    one after the other ($NODES_MATRICES).
#
# Settings (environment): LIMIT seconds from the start after which everything is stopped
# (default 540; leave the machine's start and the transfers room in the call's limit),
# SDIST (default .devcarry/horovod-0.28.1.tar.gz), IPR (default .devcarry/ipr), NODES_NP
# (4), NODES_N (2), NODES_BANDWIDTHS ("200mbit 1gbit uncapped"), NODES_COMPRESSION
# ("topk:ratio=0.01 onebit dgc:ratio=0.001"), NODES_EXCHANGE ("two-phase auto"),
# NODES_MATRICES (lane B's matrices in turn, a line each: "np|nodes|bandwidths|specs|
# exchanges", then optionally "|more compare arguments|the example's arguments", e.g.
# "4|2|200mbit|none|auto|--example lm --optimizer adamw onebit-adam --diloco 50 --modes-for
# none --target-loss 2.5|--steps 300 --freeze-step 40 --d-model 64 --layers 2 --batch-size
# 8"; default the one of the five settings before), NODES_PREDICT (1: --predict
# after each matrix that finished; 0: none, fit the rows later where you are),
# NODES_EXAMPLE_ARGS (the synthetic model of docs/results/two-phase.md, 4 steps), LANES
# ("a b"; "b" alone: lane B on every core, B_CORES), OUT (default ./device-out), DRY_RUN=1
# (print the commands, run nothing).
# A second call on the warm machine (within its 30 s) finds the first call's Horovod in
# /tmp and skips the build: LANES=b there gives lane B the whole call.
# Results: $OUT/session.log (the timeline), triton-cuda.log, bench-cuda-1.txt and -2,
# cuda-tests.log, compare-gpu.md, compare-nodes.md and results.tgz (every folder and log,
# the cost model's prediction.md): 8 files, what a device call brings back at most.
set -u

case "${1:-}" in
    -h|--help) sed -n '2,/^set -u/{/^set -u/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    "") ;;
    *) echo "device_session.sh: no arguments (settings are environment variables; --help)" >&2; exit 2 ;;
esac
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/device-out}
LIMIT=${LIMIT:-540}
SDIST=${SDIST:-.devcarry/horovod-0.28.1.tar.gz}
IPR=${IPR:-.devcarry/ipr}
NODES_NP=${NODES_NP:-4}
NODES_N=${NODES_N:-2}
NODES_BANDWIDTHS=${NODES_BANDWIDTHS:-200mbit 1gbit uncapped}
NODES_COMPRESSION=${NODES_COMPRESSION:-topk:ratio=0.01 onebit dgc:ratio=0.001}
NODES_EXCHANGE=${NODES_EXCHANGE:-two-phase auto}
NODES_MATRICES=${NODES_MATRICES:-"$NODES_NP|$NODES_N|$NODES_BANDWIDTHS|$NODES_COMPRESSION|$NODES_EXCHANGE"}
NODES_PREDICT=${NODES_PREDICT:-1}
NODES_EXAMPLE_ARGS=${NODES_EXAMPLE_ARGS:---width 64 --blocks 1 1 1 --num-classes 80000 --image-size 8 --batch-size 8 --num-warmup-batches 1 --num-iters 1 --num-batches-per-iter 3}
LANES=${LANES:-a b}
case " $LANES " in *" a "*) B_CORES=${B_CORES:-4-15} ;; *) B_CORES=${B_CORES:-0-15} ;; esac
PY=${PYTHON:-python3}
SITE=/tmp/hvd-gpu-site
WORK=$(mktemp -d)
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( LIMIT - $(date +%s) + T0 )); }
say() { echo "[$(el)s] $*" | tee -a "$OUT/session.log"; }
run() {  # a step's command line, or only its printout with DRY_RUN=1
    if [ -n "${DRY_RUN:-}" ]; then echo "would run: $*"; return 0; fi
    "$@"
}
export PATH=$ROOT/$IPR/bin:$PATH PYTHONUNBUFFERED=1

if [ -z "${DRY_RUN:-}" ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/session.log" 2>&1
    "$PY" -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)" >>"$OUT/session.log" 2>&1
fi
if [ -z "${DRY_RUN:-}" ] && PYTHONPATH=$SITE "$PY" -c "import horovod.torch" 2>/dev/null; then
    # a second call on the warm machine: /tmp kept the last call's Horovod
    say "Horovod already in $SITE (a warm machine): no build"
    echo "build rc=0 (kept)" >"$WORK/build.log"; touch "$WORK/build.done"
else
    say "Horovod (Gloo + CUDA) on all cores"
    ( run env OUT="$WORK/gpu-check" GPU_CHECK_NCCL=0 GPU_CHECK_BUILD_ONLY=1 HVD_GPU_SITE=$SITE \
          bash scripts/gpu_check.sh "$SDIST" >"$WORK/build.log" 2>&1
      echo "build rc=$?" >>"$WORK/build.log"; touch "$WORK/build.done" ) &
fi
built() {  # waits for the build (or the deadline); whether Horovod is there
    while [ ! -f "$WORK/build.done" ] && [ "$(left)" -gt 20 ]; do sleep 2; done
    grep -q "build rc=0" "$WORK/build.log"
}
within() { echo $(( $(left) - $1 > 5 ? $(left) - $1 : 5 )); }  # seconds a step may take

lane_a() {
    built || { say "A: no Horovod: $(tail -3 "$WORK/build.log")"; return; }
    export PYTHONPATH=$SITE:$ROOT
    say "A: the Triton kernels' CUDA tests (every kernel)"
    HVD_COMPRESS_TRITON=all run taskset -c 0-3 timeout "$(within 200)" "$PY" -m pytest -p no:cacheprovider \
        -q -rf --tb=short -k cuda tests/test_triton_kernels.py tests/test_triton_powersgd.py \
        tests/test_triton_defaults.py >"$OUT/triton-cuda.log" 2>&1
    say "A: rc=$? $(tail -1 "$OUT/triton-cuda.log" 2>/dev/null)"
    for i in 1 2; do
        say "A: bench_kernels --framework torch --device cuda, run $i"
        run taskset -c 0-3 timeout "$(within 150)" "$PY" scripts/bench_kernels.py --framework torch \
            --device cuda >"$OUT/bench-cuda-$i.txt" 2>&1
    done
    say "A: hvd-compress-compare --device cuda --np 1 2"
    run taskset -c 0-3 timeout -s INT "$(within 120)" "$PY" -m hvd_compress.tools.compare --device cuda \
        --np 1 2 --bandwidth uncapped --compression none topk:ratio=0.01 onebit --out "$WORK/compare-gpu" \
        --timeout 90 --quiet >"$WORK/compare-gpu.log" 2>&1
    say "A: rc=$?; the other CUDA tests until the end"
    run taskset -c 0-3 timeout "$(within 15)" "$PY" -m pytest -p no:cacheprovider -q -rf --tb=line \
        -k "cuda or gpu" tests/test_torch_same_bits.py tests/test_torch_multiprocess.py \
        tests/test_ddp_hook.py tests/test_device_option.py tests/test_torch_examples.py \
        tests/test_bench_kernels.py >"$OUT/cuda-tests.log" 2>&1
    say "A: rc=$? $(tail -1 "$OUT/cuda-tests.log" 2>/dev/null)"
}

lane_b() {
    built || { say "B: no Horovod: $(tail -3 "$WORK/build.log")"; return; }
    export PYTHONPATH=$SITE:$ROOT
    local i=0 np n bands specs exch extra eargs rc
    while IFS='|' read -r np n bands specs exch extra eargs; do
        [ -n "${np// /}" ] || continue
        i=$((i + 1))
        # shellcheck disable=SC2206  # the lists split into words
        local matrix=(--device cpu --np $np --nodes $n --bandwidth $bands --compression $specs)
        # shellcheck disable=SC2206
        [ -n "${exch// /}" ] && matrix+=(--exchange $exch)
        # shellcheck disable=SC2206
        [ -n "${extra// /}" ] && matrix+=($extra)
        [ -n "${eargs// /}" ] || eargs=$NODES_EXAMPLE_ARGS
        matrix+=(--example-args "$eargs" --out "$WORK/compare-nodes-$i" --quiet)
        say "B$i: hvd-compress-compare ${matrix[*]:0:$((${#matrix[@]} - 5))}"
        # stdin from /dev/null: the runs must not read the rest of the matrices' lines
        run taskset -c "$B_CORES" timeout -s INT "$(within 25)" "$PY" -m hvd_compress.tools.compare \
            "${matrix[@]}" --timeout 100 </dev/null >>"$WORK/compare-nodes.log" 2>&1
        rc=$?
        say "B$i: rc=$rc"
        [ "$rc" = 0 ] && [ "$NODES_PREDICT" = 1 ] && \
            run timeout "$(within 5)" "$PY" -m hvd_compress.tools.compare "${matrix[@]}" \
                --resume --predict </dev/null >>"$WORK/compare-nodes.log" 2>&1
    done <<<"$NODES_MATRICES"
}

pids=()
for lane in $LANES; do
    case $lane in a) lane_a & pids+=($!) ;; b) lane_b & pids+=($!) ;;
                  *) echo "device_session.sh: no lane '$lane' (a, b)" >&2; exit 2 ;; esac
done
wait "${pids[@]}"
say "packing"
[ -f "$WORK/compare-gpu/results.md" ] && cp "$WORK/compare-gpu/results.md" "$OUT/compare-gpu.md"
rm -f "$OUT/compare-nodes.md"  # (an OUT kept from a call before: its tables go)
for d in "$WORK"/compare-nodes-*; do  # every matrix's table in one file
    [ -f "$d/results.md" ] && { echo "# ${d##*/}"; cat "$d/results.md"; echo; } >>"$OUT/compare-nodes.md"
done
tar czf "$OUT/results.tgz" -C "$WORK" --exclude='*.png' . 2>>"$OUT/session.log"
say "done"
