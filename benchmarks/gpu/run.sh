#!/usr/bin/env bash
# The GPU run (benchmarks/gpu/README.md): installs the wheels carried in .whl/ (if any) into
# /tmp/site, then runs benchmarks/gpu/run.py with gigatron from this checkout's src/.
set -euo pipefail
cd "$(dirname "$0")/../.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec python3 benchmarks/gpu/run.py "$@"
