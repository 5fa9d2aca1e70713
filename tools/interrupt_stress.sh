#!/usr/bin/env bash
# The interrupt tests, round after round, with the CPUs kept busy beside them and the test run itself
# started the way that once broke them (in the background of a script, where SIGINT is ignored):
#   tools/interrupt_stress.sh ROUNDS BUSY [PYTEST-ARGS...]
# ROUNDS runs of `pytest -n 0 tests/test_interrupt.py PYTEST-ARGS` (e.g. -k "importing or compil"),
# with BUSY Python processes spinning on the cores throughout. Prints one line per round and a
# closing count; exits non-zero if any round failed (its output is kept in $OUT, default /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:?ROUNDS}; busy=${2:?BUSY}; shift 2
out=${OUT:-/tmp}
pids=()
for _ in $(seq "$busy"); do python -c "while True: pass" & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
passed=0 failed=0 tests=0
for r in $(seq "$rounds"); do
    log="$out/interrupt_stress.$r.log"
    python -m pytest -q -n 0 -p no:cacheprovider tests/test_interrupt.py "$@" >"$log" 2>&1 &
    wait $!  # a background job: SIGINT ignored, as `pytest &` in a script has it
    line=$(tail -n 1 "$log")
    n=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+' || echo 0)
    tests=$((tests + n))
    if grep -qE 'failed|error' <<<"$line" || [ "$n" = 0 ]; then failed=$((failed + 1)); else passed=$((passed + 1)); rm -f "$log"; fi
    echo "round $r: $line"
done
echo "$rounds rounds with $busy busy processes: $passed passed, $failed failed ($tests tests passed in all)"
[ "$failed" = 0 ]
