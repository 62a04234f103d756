#!/usr/bin/env bash
# The README's test command: set up .venv if needed, then run the whole test suite.
. "$(dirname "$0")/env.sh"
python -m pytest tests "$@"
