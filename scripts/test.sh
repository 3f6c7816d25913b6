#!/usr/bin/env bash
# Runs ruff and mypy, then the whole test suite (sets up first when needed). Extra arguments go
# to pytest, e.g. `bash scripts/test.sh -m "not slow"` or `bash scripts/test.sh tests/test_store.py`.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# Lint and types first (pyproject.toml: [tool.ruff], [tool.mypy]); either failing fails the run.
ruff check . || { echo "test: ruff found problems (see above)" >&2; exit 1; }
mypy || { echo "test: mypy found problems (see above)" >&2; exit 1; }
python -m pytest -ra --durations=15 "$@"
rc=$?
if [ $rc -eq 5 ]; then
  echo "test: pytest collected no tests; that is a failure of the suite, not a pass" >&2
  exit 1
fi
exit $rc
