#!/usr/bin/env bash
# Several device steps in one call, each under its own time limit with its own log, inside one overall budget.
#   bash bench/device_suite.sh BUDGET_S STEP[:SECONDS[:ARGS]] ...   e.g. 560 tests:200 kda mla:60 layer:200:--profile
# STEP: tests (pytest -m gpu; ARGS: paths), diag (tools/diagnose_fast_paths.py), or NAME for bench/bench_NAME.py; ARGS are
# passed on, split at commas (so an argument cannot hold one): layer:200:--profile, train:400:--precision=bf16.
# Logs (and the benches' JSON) go to $OUT (default ./out/device). A step is stopped with SIGINT, so pytest and
# the benches print what they have. Triton's autotuning results (*.autotune.json, a few KB) are restored from
# .whl/tune.tgz when present and saved to $OUT/tune.tgz: copy that to .whl/ to spare the next machine the
# minutes fla's kernels spend tuning. The fla wheel is installed from .whl/ when torch has no fla. The steps' logs
# and JSON come back packed in $OUT/results.tgz (the device returns at most 8 files), beside suite.log.
set -uo pipefail
budget=${1:?usage: device_suite.sh BUDGET_S STEP[:SECONDS] ...}
shift
out=${OUT:-out/device}
mkdir -p "$out" && out=$(cd "$out" && pwd)
start=$(date +%s)
export PYTHONPATH="/tmp/site:$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! python3 -c "import fla" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
fi
# the serve stack and the load generator (bench_serve), from .whl/serve/ when the image lacks them
if ! python3 -c "import fastapi, aiohttp" 2>/dev/null && ls .whl/serve/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/serve/*.whl
fi
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
# FRESH=1: a new machine as a user meets it (only the package's own autotuning choices, kimik3.ops.tuned)
[ -z "${FRESH:-}" ] && [ -f .whl/tune.tgz ] && mkdir -p "$cache" && tar xzf .whl/tune.tgz -C "$cache"
for spec in "$@"; do
    IFS=: read -r name secs args <<<"$spec"
    IFS=, read -r -a extra <<<"$args"
    left=$(( budget - ($(date +%s) - start) - 10 ))
    limit=$left
    [ -n "$secs" ] && limit=$(( secs < left ? secs : left ))
    if [ "$limit" -lt 5 ]; then echo "== $name: skipped, no time left" | tee -a "$out/suite.log"; continue; fi
    case $name in
        # correctness steps take each Triton autotuner's first config (tests/conftest.py): no tuning minutes
        tests) [ ${#extra[@]} -eq 0 ] && extra=(tests)  # ARGS: the test paths (default: all)
               # tests/serve holds no GPU test, and its modules import the CPU suite's test extras (openai,
               # jsonschema), which the device image lacks: skip collecting it there rather than log errors
               python3 -c "import openai, jsonschema" 2>/dev/null || extra+=(--ignore=tests/serve)
               # likewise the GGUF modules (CPU tests of the gguf and llama.cpp extras, imported at the top)
               python3 -c "import gguf" 2>/dev/null || extra+=(--ignore=tests/checkpoint/test_gguf.py
                   --ignore=tests/checkpoint/test_gguf_llama_cpp.py --ignore=tests/lora/test_gguf_export.py)
               cmd=(env KIMIK3_TEST_TRITON_FIRST_CONFIG=1 python3 -m pytest -m gpu -rfs --durations=10
                    --continue-on-collection-errors
                    -p no:cacheprovider "${extra[@]}") ;;
        diag) cmd=(env KIMIK3_TEST_TRITON_FIRST_CONFIG=1 python3 -m tools.diagnose_fast_paths "${extra[@]}") ;;
        *) cmd=(python3 "bench/bench_$name.py" "${extra[@]}") ;;
    esac
    t0=$(date +%s)
    timeout -s INT -k 10 "$limit" "${cmd[@]}" 2>&1 | tee "$out/$name.log"
    echo "== $name: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$out/suite.log"
done
(cd "$cache" 2>/dev/null && find . -name '*.autotune.json' | tar czf "$out/tune.tgz" -T -) || true
# the device returns at most 8 files: everything but the suite log and the tuning archive travels as one archive
(cd "$out" && find . -maxdepth 1 -type f ! -name suite.log ! -name tune.tgz ! -name results.tgz -printf '%P\n' \
    | tar czf results.tgz -T - --remove-files) || true
