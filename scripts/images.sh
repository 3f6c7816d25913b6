#!/usr/bin/env bash
# Builds every image docker-compose.yml uses, reusing those whose inputs are unchanged;
# `--offline` for machines without a registry. See scripts/images.py (--help).
set -euo pipefail
cd "$(dirname "$0")/.."
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
exec "$py" scripts/images.py "$@"
