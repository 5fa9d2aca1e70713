#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, CuPy and NVRTC, does `--device cuda` give the CPU's
# bits, and how fast is it? One run of a few minutes:
#   tools/gpu_check.sh MODEL.gguf [MODEL.gguf ...]
# with stories260K.gguf and, where it can be brought, SmolLM2-135M-Instruct.Q4_1.gguf (each model's
# golden file, tests/golden/*.json, is found by its SHA-256). In six phases ($PHASES, default all):
#   gpu:   per model, the golden hashes with --device cuda (every case, the fp32 ones again with native
#          storage), with CUDA graphs (the default) and without (TINYDET_CUDA_GRAPHS=0); then
#          tinydet bench --device cuda for each dtype (prefill of 512 tokens and decode, tok/s);
#   profile: with gpu, per model, tools/gpu_profile.py: the GPU time of 16 native tokens per kernel
#          (needs torch, whose profiler sees CuPy's kernels);
#   size:  a random-weight Llama-3.2-1B-shaped Q4_0 file made here by bench/make_random_gguf.py (needs
#          the gguf package, and SmolLM2's GGUF among the models for its tokenizer): tinydet bench
#          --device cuda native (512-token prefill, decode), tools/gpu_bench.py (generate_batch of 32,
#          aggregate tok/s, each request's bits those of the request alone) and, with profile, its
#          per-kernel table; then the issue's targets, met or missed, from the bench lines;
#   cpu:   per model, the golden hashes on this machine's CPU (started in the background at once: they
#          compile numba's kernels, minutes on a cold cache, while the GPU phase runs), tinydet verify
#          --device cuda (threads, chunked prefill, recompute, batches, and the CPU backend's run as one
#          more cell, for fp32, fp16 and native) and the CPU's fp32 bench beside the GPU's;
#   tests: tests/test_cuda.py with TINYDET_TEST_DEVICE=cuda: the kernels of every storage type, every
#          architecture's tiny checkpoint, traces and verify, each against the CPU backend's bits, on
#          the GPU instead of the emulator (in parallel where pytest-xdist is installed); needs pytest
#          and the gguf package;
#   serve: tinydet serve on stories260K on the GPU and on the CPU, one /v1/completions request with
#          logprobs to each: the same text and logprobs (needs the serve extra and curl).
# Writes everything to $OUT (or /tmp/gpu-check) as it goes, and ends with PASSED or FAILED (exit 1).
# DEVICE=cuda-host runs the same steps on the kernels' emulator, to check this script on a machine
# without a GPU (slowly).
#
# Runs from the repository with PYTHONPATH, no install: python3 needs numpy, numba, safetensors,
# tokenizers, click, jinja2 and CuPy (cupy-cuda12x or cupy-cuda13x, matching the driver) with
# cuda-bindings and NVRTC. A model file larger than what can be copied to the machine in one go can be
# given as its pieces (split -b 50M), in order: they are joined into /tmp first (MODEL.gguf.part-aa
# MODEL.gguf.part-ab ... -> MODEL.gguf). Where a machine takes at most 64 MiB a call (SmolLM2's Q4_1
# file is 98 MB): split it (split -b 48M), carry the first piece in one call and copy it to a folder
# there (cp to /tmp/models), then, while that machine is still held, carry the second in the next call,
# copy it beside the first and run this script on /tmp/models/...part-aa. The gguf package (the size
# and tests phases) and the serve extra travel as wheels if the machine lacks them.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
log=$out/gpu_check.log  # everything goes here (the only file written to $out)
work=$(mktemp -d)  # traces, background logs, answers: read into the log, then removed
trap 'rm -rf "$work"' EXIT
failed=0
device=${DEVICE:-cuda}

run() {
    echo "+ $*" | tee -a "$log"
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "FAIL (exit $rc): $*" | tee -a "$log"
        failed=1
    fi
    return "$rc"
}

phases=${PHASES:-gpu profile size cpu tests serve}
has() { [[ " $phases " == *" $1 "* ]]; }

if [ "$device" != cuda-host ]; then
    run python3 -c "import cupy, numba, numpy; from cuda.bindings import nvrtc; \
from tinydet.backends.cupy.device import CudaDevice; p = cupy.cuda.runtime.getDeviceProperties(0); \
d = CudaDevice(0); print('GPU', p['name'].decode(), 'driver', cupy.cuda.runtime.driverGetVersion(), \
'runtime', cupy.cuda.runtime.runtimeGetVersion(), 'NVRTC', nvrtc.nvrtcVersion()[1:], 'arch', d.arch, \
'cupy', cupy.__version__, 'numba', numba.__version__, 'numpy', numpy.__version__)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$log"
fi
lscpu 2>/dev/null | grep -E "^Model name|^CPU\(s\)" | tee -a "$log"

models=()
for m in "$@"; do
    case "$m" in
        *.part-aa)
            whole=/tmp/$(basename "${m%.part-aa}")
            cat "${m%-aa}"-* > "$whole"
            models+=("$whole") ;;
        *.part-*) ;;
        *) models+=("$m") ;;
    esac
done
if [ "${#models[@]}" -eq 0 ]; then
    echo "usage: tools/gpu_check.sh MODEL.gguf [MODEL.gguf ...]" | tee -a "$log"
    exit 2
fi
for m in "${models[@]}"; do
    if [ ! -s "$m" ]; then
        echo "FAILED: no model file $m" | tee -a "$log"
        exit 1
    fi
done

declare -A golden  # each model's golden file, found by the model's SHA-256 (empty: none)
stories=""  # stories260K, for the tests and serve phases
for m in "${models[@]}"; do
    sha=$(sha256sum "$m" | cut -d' ' -f1)
    golden[$m]=$(grep -l "\"$sha\"" tests/golden/*.json | head -n 1)
    [ "$(basename "$m")" = stories260K.gguf ] && stories=$m
done

# The CPU's golden checks compile numba's kernels (minutes on a cold cache): started first, in the
# background, so that the GPU's own results, which compile little on the CPU, run meanwhile.
cpu_jobs=()
if has cpu; then
    for m in "${models[@]}"; do
        [ -n "${golden[$m]}" ] || continue
        name=$(basename "$m" .gguf)
        # four threads each: the GPU phase's host side keeps cores of its own
        python3 -m tinydet golden --model "$m" --check "${golden[$m]}" --threads 4 > "$work/cpu-golden-$name.log" 2>&1 &
        cpu_jobs+=("$!:$name")
    done
fi

for m in "${models[@]}"; do
    if [ -z "${golden[$m]}" ]; then
        echo "FAIL: no golden file for $m" | tee -a "$log"
        failed=1
        continue
    fi
    has gpu || continue
    name=$(basename "$m" .gguf)
    if ! run python3 -m tinydet golden --model "$m" --check "${golden[$m]}" --device "$device"; then
        # where the GPU parts from the CPU: the first op, layer and position, per dtype
        for dtype in fp32 fp16 native int8; do
            for d in cpu "$device"; do
                python3 -m tinydet trace --model "$m" --prompt "Once upon a time" --dtype "$dtype" --no-values \
                    --device "$d" --out "$work/trace-$name-$dtype-$d.jsonl" >> "$log" 2>&1
            done
            run python3 -m tinydet diff "$work/trace-$name-$dtype-cpu.jsonl" "$work/trace-$name-$dtype-$device.jsonl"
        done
    fi
    run env TINYDET_CUDA_GRAPHS=0 python3 -m tinydet golden --model "$m" --check "${golden[$m]}" --device "$device"
    for dtype in fp32 fp16 native int8; do  # one JSON line each in the log (int8: native's on a float file)
        run python3 -m tinydet bench --model "$m" --device "$device" --dtype "$dtype" --prompt-tokens 512 --max-tokens 64 \
            --repeats 3 --json
    done
    if has profile && [ "$device" != cuda-host ]; then  # the GPU time per kernel (needs torch)
        run python3 tools/gpu_profile.py "$m" --dtype native --device "$device"
    fi
done

# The sizes people run: a 1B-shaped Q4_0 file, made here (it is 0.6 GiB: too large to carry)
smollm2=""
for m in "${models[@]}"; do case "$(basename "$m")" in SmolLM2*.gguf) smollm2=$m ;; esac; done
# ($SIZE_SHAPE another of make_random_gguf's shapes: `tiny` checks this phase on the emulator)
shape=${SIZE_SHAPE:-llama-1b}
if has size && { [ "$device" != cuda-host ] || [ -n "${SIZE_SHAPE:-}" ]; }; then
    if [ -z "$smollm2" ] || ! python3 -c "import gguf" 2>/dev/null; then
        echo "(SmolLM2's GGUF or the gguf package missing: size not checked)" | tee -a "$log"
    elif run python3 bench/make_random_gguf.py --shape "$shape" --type Q4_0 --out-dir "$work" --tokenizer "$smollm2"; then
        big=$work/$shape-random.Q4_0.gguf
        for dtype in native int8; do
            run python3 -m tinydet bench --model "$big" --device "$device" --dtype "$dtype" --prompt-tokens 512 \
                --max-tokens 64 --repeats 3 --json
            run python3 tools/gpu_bench.py "$big" --device "$device" --dtype "$dtype" --requests 32 --new-tokens 64
            if has profile; then run python3 tools/gpu_profile.py "$big" --dtype "$dtype" --device "$device"; fi
        done
    fi
fi
if has gpu || has size; then  # the issue's targets, from the JSON lines above
    python3 - "$log" <<'PY' 2>&1 | tee -a "$log"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"model"')]
def show(what, got, want):
    print(f"target {what}: {'n/a' if got is None else round(got, 1)} (>= {want}): "
          f"{'not run' if got is None else 'met' if got >= want else 'MISSED'}")
def pick(name, key, dtype="native", gpu=True):
    vals = [l[key] for l in lines if name in l["model"] and l.get("dtype") == dtype and key in l
            and l.get("backend", l.get("device", "")).startswith("cuda:")]
    return max(vals) if vals else None
for dtype in ("native", "int8"):
    show(f"SmolLM2-135M {dtype} decode tok/s", pick("SmolLM2", "decode_tok_s", dtype), 1000)
    show(f"SmolLM2-135M {dtype} prefill (512) tok/s", pick("SmolLM2", "prefill_tok_s", dtype), 20000)
    show(f"1B Q4_0 {dtype} decode tok/s", pick("llama-1b", "decode_tok_s", dtype), 400)
    show(f"1B Q4_0 {dtype} generate_batch of 32, aggregate tok/s", pick("llama-1b", "aggregate_tok_s", dtype), 3000)
PY
fi

if has cpu; then
    for job in "${cpu_jobs[@]}"; do
        wait "${job%%:*}"
        rc=$?
        echo "+ (background) tinydet golden ${job#*:} --check on this machine's CPU: exit $rc" | tee -a "$log"
        tee -a "$log" < "$work/cpu-golden-${job#*:}.log"
        [ "$rc" -eq 0 ] || failed=1
    done
    for m in "${models[@]}"; do
        run python3 -m tinydet verify --model "$m" --device "$device" --max-tokens 16
        run python3 -m tinydet bench --model "$m" --dtype fp32 --prompt-tokens 128 --max-tokens 64 --repeats 3 --json
    done
fi

if has tests; then
    if python3 -c "import pytest, gguf" 2>/dev/null; then
        workers=()
        # pyproject's addopts give a file's tests to one worker (--dist loadfile), at most 4 of them:
        # here the tests of the one file are spread over as many workers as asked
        n=${TEST_WORKERS:-8}
        python3 -c "import xdist" 2>/dev/null && workers=(-n "$n" --maxprocesses "$n" --dist load)
        # the tests only a GPU runs first (a lease can end before the rest), then the rest; the
        # slowest of each named, for the next run's planning
        for select in real_gpu "not real_gpu"; do
            run env TINYDET_TEST_DEVICE="$device" ${stories:+TINYDET_SHARED_MODELS=$(dirname "$stories")} \
                python3 -m pytest -q -rs -p no:cacheprovider "${workers[@]}" --durations=15 -k "$select" \
                tests/test_cuda.py
        done
    else
        echo "(pytest or gguf missing: tests/test_cuda.py not run)" | tee -a "$log"
    fi
fi

# tinydet serve on the GPU and on the CPU, the same request to each: the same text and logprobs
if has serve; then
    if [ -z "$stories" ] || ! python3 -c "import starlette, uvicorn, pydantic" 2>/dev/null; then
        echo "(stories260K or the serve extra missing: serve not checked)" | tee -a "$log"
    else
        pids=()
        for port_device in 8101:cpu "8102:$device"; do
            port=${port_device%%:*} d=${port_device#*:}
            python3 -m tinydet serve --model "$stories" --device "$d" --port "$port" --threads 4 \
                --served-model-name stories > "$work/serve-$port.log" 2>&1 &
            pids+=("$!")
        done
        body='{"model": "stories", "prompt": "Once upon a time", "max_tokens": 24, "logprobs": 3, "temperature": 0}'
        for port in 8101 8102; do
            for _ in $(seq 240); do
                curl -sf "localhost:$port/health" > /dev/null && break
                sleep 0.5
            done
            curl -s "localhost:$port/health" | tee -a "$log"
            echo | tee -a "$log"
            curl -s "localhost:$port/v1/completions" -H "Content-Type: application/json" -d "$body" \
                > "$work/answer-$port.json"
        done
        run python3 -c "import json, sys; a, b = (json.load(open(f))['choices'] for f in sys.argv[1:]); \
print('serve, CPU and GPU:', json.dumps(a[0]['text']), 'same text and logprobs:', a == b); sys.exit(a != b)" \
            "$work/answer-8101.json" "$work/answer-8102.json"
        kill "${pids[@]}" 2>/dev/null
        wait "${pids[@]}" 2>/dev/null
    fi
fi

if [ "$failed" -eq 0 ]; then echo "PASSED" | tee -a "$log"; else echo "FAILED" | tee -a "$log"; exit 1; fi
