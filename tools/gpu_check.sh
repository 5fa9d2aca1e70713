#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU, CuPy and NVRTC, does `--device cuda` give the CPU's
# bits, and how fast is it? One run of a few minutes:
#   tools/gpu_check.sh MODEL.gguf [MODEL.gguf ...]
# with stories260K.gguf and, where it can be brought, SmolLM2-135M-Instruct.Q4_1.gguf (each model's
# golden file, tests/golden/*.json, is found by its SHA-256). Per model:
#   1. the golden hashes with --device cuda (every case, the fp32 ones again with native storage), with
#      CUDA graphs (the default) and without (TINYDET_CUDA_GRAPHS=0);
#   2. tinydet bench --device cuda for each dtype (prefill and decode tok/s);
#   3. tinydet verify --device cuda: threads, chunked prefill, recompute, batches, and the CPU backend's
#      run as one more cell, for fp32, fp16 and native; and the CPU's fp32 bench beside the GPU's;
# then tests/test_cuda.py's GPU tests where pytest and the test extra are installed. Writes everything
# to $OUT (or /tmp/gpu-check) and ends with PASSED or FAILED (exit 1). DEVICE=cuda-host runs the same
# steps on the kernels' emulator, to check this script on a machine without a GPU (slowly).
#
# Runs from the repository with PYTHONPATH, no install: python3 needs numpy, numba, safetensors,
# tokenizers, click, jinja2 and CuPy (cupy-cuda12x or cupy-cuda13x, matching the driver). A model file
# larger than what can be copied to the machine in one go can be given as its pieces (split -b 60M),
# in order: they are joined into /tmp first (MODEL.gguf.part-aa MODEL.gguf.part-ab ... -> MODEL.gguf).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
log=$out/gpu_check.log
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
}

if [ "$device" != cuda-host ]; then
    run python3 -c "import cupy, numba, numpy; p = cupy.cuda.runtime.getDeviceProperties(0); \
print('GPU', p['name'].decode(), 'driver', cupy.cuda.runtime.driverGetVersion(), 'cupy', cupy.__version__, \
'numba', numba.__version__, 'numpy', numpy.__version__)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$log"
fi

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

# The GPU's own results first (they compile little on the CPU), then verify and the CPU's bench, which
# compile the CPU kernels (minutes on a cold numba cache): a run cut short still has the first part.
for m in "${models[@]}"; do
    sha=$(sha256sum "$m" | cut -d' ' -f1)
    golden=$(grep -l "\"$sha\"" tests/golden/*.json | head -n 1)
    if [ -z "$golden" ]; then
        echo "FAIL: no golden file for $m (SHA-256 $sha)" | tee -a "$log"
        failed=1
        continue
    fi
    run python3 -m tinydet golden "$m" --check "$golden" --device "$device"
    run env TINYDET_CUDA_GRAPHS=0 python3 -m tinydet golden "$m" --check "$golden" --device "$device"
    name=$(basename "$m" .gguf)
    for dtype in fp32 fp16 native; do
        run python3 -m tinydet bench "$m" --device "$device" --dtype "$dtype" --prompt-tokens 128 --new-tokens 64 \
            --repeats 3 --json
        tail -n 1 "$log" > "$out/bench-$name-$device-$dtype.json"
    done
done
for m in "${models[@]}"; do
    run python3 -m tinydet verify --model "$m" --device "$device" --new-tokens 16
    name=$(basename "$m" .gguf)
    run python3 -m tinydet bench "$m" --dtype fp32 --prompt-tokens 128 --new-tokens 64 --repeats 3 --json
    tail -n 1 "$log" > "$out/bench-$name-cpu-fp32.json"
done

if python3 -c "import pytest, gguf" 2>/dev/null; then
    run python3 -m pytest -q -rs tests/test_cuda.py -k "real_gpu or ptx"
else
    echo "(pytest or gguf missing: tests/test_cuda.py not run)" | tee -a "$log"
fi

if [ "$failed" -eq 0 ]; then echo "PASSED" | tee -a "$log"; else echo "FAILED" | tee -a "$log"; exit 1; fi
