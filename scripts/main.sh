#!/usr/bin/env bash
# The README's main job: set up .venv if needed, run the demo, then the quick benchmark.
. "$(dirname "$0")/env.sh"
# torch's OpenMP workers spin ~10 ms after every parallel op and steal a core from the next call on
# small machines (docs/performance.md, "Deployment"): let them sleep unless the caller chose otherwise
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
python -m fia.bench.demo
python -m fia.bench --quick "$@"
