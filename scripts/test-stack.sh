#!/usr/bin/env bash
# `make test-stack`: the whole-stack runs and the heavy tests, in three parts.
#   1. The crash-loop tests, two at a time (pytest-xdist): each restarts a real role until a
#      poison reaches the crash limit, mostly waiting on redeliveries and start-ups.
#   2. The tests marked `beside` (the pretraining-and-learning test, minutes of rendering and
#      training) in a pytest process of their own, at the same time as
#   3. every other whole-stack run, one at a time, as their timings were measured.
# TEST_WORKERS=0 runs everything one at a time. Exits non-zero if any part fails or selects
# no test (pytest's exit 5; under pytest-xdist, pytest 9.2 ends in an INTERNALERROR, exit 3).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
py=${PYTHON:-.venv/bin/python}
workers=${TEST_WORKERS:-2}
crash_loop=(tests/test_trainer_crash.py tests/test_inferencer_crash.py)
ignore=()
for f in "${crash_loop[@]}"; do ignore+=("--ignore=$f"); done
others=(-m "(stack or heavy) and not slow and not compose and not beside" -q --durations=15
    "${ignore[@]}")
beside=(-m "beside and not slow" -q --durations=5)

"$py" -m pytest -m "heavy and not slow" -q --durations=5 -n "$workers" "${crash_loop[@]}"
crash_rc=$?

if [ "$workers" = 0 ]; then
    "$py" -m pytest "${others[@]}"
    others_rc=$?
    "$py" -m pytest "${beside[@]}"
    beside_rc=$?
else
    beside_log=$(mktemp /tmp/joynexus-beside.XXXXXX)
    "$py" -m pytest "${beside[@]}" >"$beside_log" 2>&1 &
    beside_pid=$!
    # An interrupted run leaves no pytest behind.
    trap 'kill "$beside_pid" 2>/dev/null' EXIT
    "$py" -m pytest "${others[@]}"
    others_rc=$?
    wait "$beside_pid"
    beside_rc=$?
    trap - EXIT
    echo "--- the tests marked beside (run at the same time as the ones above):"
    cat "$beside_log"
    rm -f "$beside_log"
fi
echo "test-stack: crash-loop tests exit $crash_rc, whole-stack runs $others_rc, beside $beside_rc"
[ "$crash_rc" = 0 ] && [ "$others_rc" = 0 ] && [ "$beside_rc" = 0 ]
