#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the main job: `harnessrl up` (arguments are
# passed on; `bash scripts/up.sh --help` lists them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec harnessrl up "$@"
