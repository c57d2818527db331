#!/usr/bin/env bash
# The GPU checks of shared/GPU.md that fit short leases: CUDA exactness (step 1), engine speed of the
# full-size architectures against the ordinary pipeline, eager and compiled (step 2), their cost
# profiles (step 3), one worker under load (step 4) and the benches of the adapter and deadline
# targets (step 5). `bash scripts/gpu-checks.sh [CHECK ...]` runs the named checks (see the case
# below), or all of them in order.
# Runs from the repository root on a CUDA machine whose python3 has torch; the project's other
# dependencies come as wheels in .whl/ (docs/bench/gpu-h200.md lists them). Results land in
# $RESULTS (default /tmp/gpu-results) and, packed after every step, in $OUT/results.tgz when OUT
# is set, so a run cut short still returns what it finished.
set -u
RESULTS=${RESULTS:-/tmp/gpu-results}
mkdir -p "$RESULTS/profiles"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:.
else
    export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MASKSERVE_DATA_DIR=${MASKSERVE_DATA_DIR:-/tmp/maskserve}
MS="python3 -m backend.cli"

pack() {
    [ -n "${OUT:-}" ] && tar czf "$OUT/results.tgz" -C "$RESULTS" .
}

step() {  # step NAME SECONDS COMMAND...: one check, its log kept, results packed after it
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date -u +%T))"
    local started=$SECONDS
    timeout "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - started)) s"
    grep -vE "it/s\]|s/it\]|Warning|warn\(|^ *$" "$RESULTS/$name.log" | tail -n 40
    pack
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    nproc
    free -g | head -2
    df -h /tmp | tail -1
} >"$RESULTS/device.txt" 2>&1
cat "$RESULTS/device.txt"

# Each check by name; no names: all, in this order (shared/GPU.md's).
CHECKS=("$@")
[ ${#CHECKS[@]} -eq 0 ] && CHECKS=(engine-graphs exactness engine-sd2 step-trace-sd2 graphs-sd2 \
    batch-ops-sd2 batch-ops-lora-sd2 profile-sd2 engine-sdxl step-trace-sdxl profile-sdxl \
    engine-flux profile-flux worker-sd2 adapters-sd2 deadlines-sd2 pytest-gpu)
export MASKSERVE_DTYPE=bfloat16  # the engine runs; exactness and pytest choose their own dtypes
for check in "${CHECKS[@]}"; do
    case $check in
    engine-graphs)  # 2. the arms side by side: ordinary eager and compiled (CUDA graphs), the
        # mask-aware edit eager (cache in host RAM, then on the device tier) and with compiled
        # units (bucketed, cache on the device tier); 8 minutes in all, each model cut off on its
        # own and keeping the cells it finished in its .partial.json; mask ratios 0.2 (the
        # targets') then 0.05 only, to leave the compiled units their compiles; reduce-overhead
        # (CUDA graphs without max-autotune's kernel tuning) to fit the lease
        step engine-graphs-arch-sd2-inpaint 120 $MS bench engine --device cuda \
            --model arch-sd2-inpaint --steps 20 --mask-ratios 0.2,0.05 --batch 1,8 \
            --arms ordinary,ordinary-compiled,maskaware,maskaware-device,maskaware-compiled \
            --modes kv --repeats 1 --compile-mode reduce-overhead --fresh-process-baseline \
            --json "$RESULTS/engine-graphs-arch-sd2-inpaint-cuda.json"
        step engine-graphs-arch-sdxl-inpaint 180 $MS bench engine --device cuda \
            --model arch-sdxl-inpaint --steps 10 --mask-ratios 0.2,0.05 --batch 1,8 \
            --arms ordinary,ordinary-compiled,maskaware,maskaware-device,maskaware-compiled \
            --modes kv --repeats 1 --compile-mode reduce-overhead \
            --json "$RESULTS/engine-graphs-arch-sdxl-inpaint-cuda.json"
        rm -rf "$MASKSERVE_DATA_DIR/template_cache"  # flux's caches need the disk
        step engine-graphs-arch-flux-fill 150 $MS bench engine --device cuda \
            --model arch-flux-fill --in-memory --steps 8 --mask-ratios 0.2,0.05 --batch 1,8 \
            --arms ordinary,ordinary-compiled,maskaware,maskaware-device,maskaware-compiled \
            --modes kv --repeats 1 --compile-mode reduce-overhead \
            --json "$RESULTS/engine-graphs-arch-flux-fill-cuda.json" ;;
    exactness)  # 1. the engine's exactness checks on cuda (float32 without TF32, bfloat16)
        step exactness 180 $MS bench exactness --device cuda --json "$RESULTS/exactness-cuda.json" ;;
    engine-sd2)  # 2. engine speed: arch-sd2-inpaint at 512 px
        step engine-arch-sd2-inpaint 200 $MS bench engine --device cuda --model arch-sd2-inpaint \
            --steps 20 --repeats 3 --json "$RESULTS/engine-arch-sd2-inpaint-cuda.json" ;;
    step-trace-sd2)  # 2. where a step's time goes: the dense step against the cached one
        (
            export MASKSERVE_DEVICE=cuda  # the step-trace bench has no --device
            step step-trace-arch-sd2-inpaint 150 $MS bench step-trace --model arch-sd2-inpaint \
                --size 512 --steps 10 --requests 1,8 --trace "$RESULTS/traces" \
                --json "$RESULTS/step-trace-arch-sd2-inpaint-cuda.json"
        ) ;;
    step-trace-sdxl)  # 2. the same on arch-sdxl-inpaint at 1024 px (0.86 GiB of cache a step)
        (
            export MASKSERVE_DEVICE=cuda  # 2 templates x 6 steps: 10 GB of caches, disk and RAM
            step step-trace-arch-sdxl-inpaint 240 $MS bench step-trace \
                --model arch-sdxl-inpaint --size 1024 --steps 6 --repeats 3 --requests 1,2 \
                --json "$RESULTS/step-trace-arch-sdxl-inpaint-cuda.json"
        ) ;;
    graphs-sd2)  # 2. how much of a UNet step is launching: eager against a CUDA graph's replay
        step cuda-graphs-arch-sd2-inpaint 150 python3 scripts/cuda_graphs.py \
            --model arch-sd2-inpaint --size 512 --rows 2,4,8,16 --dtype bfloat16 \
            --models-dir "$MASKSERVE_DATA_DIR/models" \
            --json "$RESULTS/cuda-graphs-arch-sd2-inpaint.json" ;;
    batch-ops-sd2)  # 2. a step of 1-8 requests, attention grouped per request or padded
        (
            export MASKSERVE_DEVICE=cuda  # the batch-ops bench has no --device
            step batch-ops-arch-sd2-inpaint 150 $MS bench batch-ops --model arch-sd2-inpaint \
                --size 512 --steps 10 --requests 1,2,4,8 \
                --json "$RESULTS/batch-ops-arch-sd2-inpaint-cuda.json"
        ) ;;
    batch-ops-lora-sd2)  # 2. a step of 1-8 requests with 2 adapters each, deltas grouped or stacked
        (
            export MASKSERVE_DEVICE=cuda
            step batch-ops-lora-arch-sd2-inpaint 150 $MS bench batch-ops --compare lora \
                --model arch-sd2-inpaint --size 512 --steps 10 --requests 1,2,4,8 \
                --json "$RESULTS/batch-ops-lora-arch-sd2-inpaint-cuda.json"
        ) ;;
    profile-sd2)  # 3. its cost profiles (both modes)
        step profile-arch-sd2-inpaint 120 $MS profile --device cuda --model arch-sd2-inpaint \
            --out-dir "$RESULTS/profiles" ;;
    engine-sdxl)  # 2. arch-sdxl-inpaint at 1024 px; 10 steps: its two caches are 13 GB
        step engine-arch-sdxl-inpaint 300 $MS bench engine --device cuda \
            --model arch-sdxl-inpaint --steps 10 --repeats 2 \
            --json "$RESULTS/engine-arch-sdxl-inpaint-cuda.json" ;;
    profile-sdxl)
        step profile-arch-sdxl-inpaint 150 $MS profile --device cuda \
            --model arch-sdxl-inpaint --out-dir "$RESULTS/profiles" ;;
    engine-flux)  # 2. arch-flux-fill at 1024 px, built in memory (68 GB as float32 files)
        rm -rf "$MASKSERVE_DATA_DIR"/models/arch-*  # its caches need the disk
        step engine-arch-flux-fill 540 $MS bench engine --device cuda --model arch-flux-fill \
            --in-memory --steps 8 --repeats 2 --json "$RESULTS/engine-arch-flux-fill-cuda.json" ;;
    worker-sd2)  # 4. one worker under a Poisson trace: continuous, static and inline batching
        (
            export MASKSERVE_DEVICE=cuda  # the worker bench has no --device
            step worker-arch-sd2-inpaint 420 $MS bench worker --model arch-sd2-inpaint --size 512 \
                --steps 20 --templates 6 --ram-templates 6 --max-batch 8 --rps 4 --duration 30 \
                --json "$RESULTS/worker-arch-sd2-inpaint-cuda.json"
        ) ;;
    profile-flux)  # 3. arch-flux-fill's cost profiles, built in memory again
        rm -rf "$MASKSERVE_DATA_DIR"/models/arch-*
        step profile-arch-flux-fill 420 $MS profile --device cuda --model arch-flux-fill \
            --in-memory --out-dir "$RESULTS/profiles" ;;
    adapters-sd2)  # 5. issue 19's bench: 200 adapters at the baseline's measured capacity
        (   # with deadlines-sd2, 9 minutes at most (a 15-minute lease); a run cut short keeps
            # what it finished in adapters-small-sd2-inpaint-cuda.partial.json
            export MASKSERVE_DEVICE=cuda  # the adapters bench has no --device
            step adapters-small-sd2-inpaint 270 $MS bench adapters --model small-sd2-inpaint \
                --size 512 --steps 20 --adapters 200 --arms baseline,maskserve,base-model \
                --loads 1.0 --burst-rps 0 --max-requests 32 --duration-s 120 \
                --calibration-requests 8 --json "$RESULTS/adapters-small-sd2-inpaint-cuda.json"
        ) ;;
    deadlines-sd2)  # 5. issue 20's worker bench: FIFO and the slack scheduler on a real-size UNet
        (
            export MASKSERVE_DEVICE=cuda  # the worker bench has no --device
            step worker-deadlines-arch-sd2-inpaint 270 $MS bench worker-deadlines \
                --model arch-sd2-inpaint --size 512 --steps 20 --templates 4 --ram-templates 4 \
                --duration 15 --schedulers fifo,slack --repeats 1 \
                --json "$RESULTS/worker-deadlines-arch-sd2-inpaint-cuda.json"
        ) ;;
    pytest-gpu)  # 1. the gpu-marked tests: pinned tiers, side-stream feeder, adapters, exactness
        step pytest-gpu 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
            tests/test_engine_cuda.py tests/test_host_copies.py tests/test_cache_store.py \
            tests/test_profile_planner.py tests/test_worker_adapters.py ;;
    *)
        echo "unknown check $check" >&2
        exit 2 ;;
    esac
    rm -rf "$MASKSERVE_DATA_DIR/template_cache"  # the next check's caches need the disk
done
echo "=== done ($(date -u +%T))"
