#!/usr/bin/env bash
# The stories260K golden check on ARM64, under qemu-aarch64 (user mode) on an x86-64 Debian 12 host.
# qemu emulates IEEE arithmetic exactly, so this checks ARM64's code path (NEON code generation, no FMA
# contraction, tinydet's own math), not its speed. Not for CI: a cold numba cache compiles every kernel
# under emulation (tens of minutes).
#
#   tools/arm64_golden.sh [MODEL [GOLDEN]]     # default stories260K.gguf as the tests find it, tests/golden/stories260k.json
#
# Setup, idempotent, needs root, apt (Debian's arm64 packages) and PyPI:
#   - qemu-user-static from apt;
#   - Debian's arm64 python3.11 and the libraries it and the wheels need, unpacked (dpkg -x) into a
#     sysroot $ARM64/root (installing python3:arm64 itself would conflict with the host's python3);
#   - the aarch64 manylinux wheels of tinydet's dependencies, at the versions the host's .venv has,
#     unzipped into $ARM64/site (PYTHONPATH; tinydet itself runs from this checkout).
# Then tools/arm64_golden.py runs the cases, the fp32 + native ones and the fp16 ones in two processes
# when there are two CPUs (each compiles its kernels; compilation dominates), one thread each.
# numba's arm64 cache goes to $ARM64_CACHE, bytecode to a prefix there: nothing is written into the
# checkout. Environment: TINYDET_SHARED_MODELS (the tests' folder of stories260K.gguf, default
# ../shared/models beside the checkout), ARM64 (${XDG_CACHE_HOME:-~/.cache}/tinydet/arm64),
# ARM64_CACHE (${TMPDIR:-/tmp}/arm64-golden), JOBS (1 or 2),
# SETUP_ONLY=1 (stop after the setup).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
MODEL=${1:-${TINYDET_SHARED_MODELS:-$REPO/../shared/models}/stories260K.gguf}
GOLDEN=${2:-$REPO/tests/golden/stories260k.json}
ARM64=${ARM64:-${XDG_CACHE_HOME:-$HOME/.cache}/tinydet/arm64}
ARM64_CACHE=${ARM64_CACHE:-${TMPDIR:-/tmp}/arm64-golden}
JOBS=${JOBS:-$(( $(nproc) >= 2 ? 2 : 1 ))}
HOST_PY=${HOST_PY:-$REPO/.venv/bin/python}
[ -x "$HOST_PY" ] || HOST_PY=python3

# Debian arm64 packages: python3.11 and the shared libraries it, numpy, llvmlite and tokenizers load.
DEBS="python3.11 python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libc6 libgcc-s1 libstdc++6
gcc-12-base libgomp1 zlib1g libexpat1 libffi8 libbz2-1.0 liblzma5 libzstd1 libssl3 libcrypt1 libdb5.3
libncursesw6 libtinfo6 libreadline8 libsqlite3-0 libuuid1 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3
libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libselinux1 libpcre2-8-0 libacl1 libmd0"
PKGS="numpy numba llvmlite tokenizers safetensors click jinja2 markupsafe"

if ! command -v qemu-aarch64-static >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static
fi
if [ ! -x "$ARM64/root/usr/bin/python3.11" ]; then
    dpkg --print-foreign-architectures | grep -qx arm64 || { dpkg --add-architecture arm64; apt-get update -q; }
    mkdir -p "$ARM64/debs" "$ARM64/root"
    (cd "$ARM64/debs" && apt-get download $(for p in $DEBS; do echo "$p:arm64"; done))
    for d in "$ARM64"/debs/*.deb; do dpkg -x "$d" "$ARM64/root"; done
fi
if [ ! -f "$ARM64/site/.complete" ]; then
    # The host venv's versions, so that both sides run the same numpy/numba/llvmlite.
    pins=$("$HOST_PY" -c 'import importlib.metadata as m, sys
for p in sys.argv[1:]:
    try: print(f"{p}=={m.version(p)}")
    except m.PackageNotFoundError: print(p)' $PKGS)
    mkdir -p "$ARM64/wheels" "$ARM64/site"
    "$HOST_PY" -m pip download -q --dest "$ARM64/wheels" --only-binary :all: --python-version 3.11 \
        --implementation cp --abi cp311 --abi abi3 --abi none --platform manylinux2014_aarch64 \
        --platform manylinux_2_17_aarch64 --platform manylinux_2_27_aarch64 --platform manylinux_2_28_aarch64 $pins
    for w in "$ARM64"/wheels/*.whl; do "$HOST_PY" -m zipfile -e "$w" "$ARM64/site"; done
    touch "$ARM64/site/.complete"
fi

[ "${SETUP_ONLY:-0}" = 1 ] && { echo "setup done in $ARM64"; exit 0; }
mkdir -p "$ARM64_CACHE/numba" "$ARM64_CACHE/pycache" "$ARM64_CACHE/home"
arm64_python() {
    env -i PATH=/usr/bin:/bin HOME="$ARM64_CACHE/home" LANG=C.UTF-8 PYTHONPATH="$ARM64/site:$REPO" \
        PYTHONPYCACHEPREFIX="$ARM64_CACHE/pycache" NUMBA_CACHE_DIR="$ARM64_CACHE/numba" NUMBA_NUM_THREADS=1 \
        qemu-aarch64-static -L "$ARM64/root" "$ARM64/root/usr/bin/python3.11" "$@"
}
echo "$(qemu-aarch64-static --version | head -1); model $MODEL; golden $GOLDEN; $JOBS process(es)"
start=$(date +%s)
if [ "$JOBS" -ge 2 ]; then
    groups=("fp32,native" "fp16")
else
    groups=("fp32,fp16,native")
fi
pids=()
for g in "${groups[@]}"; do
    # Each line tagged with its group, as it comes (a run cut short still shows how far it got).
    (arm64_python "$REPO/tools/arm64_golden.py" "$MODEL" "$GOLDEN" --dtype "$g" --threads 1 2>&1 \
        | sed -u "s/^/[$g] /"; exit "${PIPESTATUS[0]}") &
    pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo "$([ $rc = 0 ] && echo PASSED || echo FAILED) on ARM64 (qemu) in $(( $(date +%s) - start )) s"
exit $rc
