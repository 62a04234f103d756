# Sourced by the other scripts: create .venv (once) with the pinned requirements and FIA installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
if [ ! -f .venv/.fia-installed ] || [ requirements-ci.txt -nt .venv/.fia-installed ] || [ pyproject.toml -nt .venv/.fia-installed ]; then
    python -m pip install -q -r requirements-ci.txt
    python -m pip install -q --no-deps -e .
    touch .venv/.fia-installed
fi
