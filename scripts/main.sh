#!/usr/bin/env bash
# The README's main job: set up .venv if needed, run the demo, then the quick benchmark.
. "$(dirname "$0")/env.sh"
python -m fia.bench.demo
python -m fia.bench --quick "$@"
