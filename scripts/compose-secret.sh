#!/usr/bin/env bash
# Creates the credential secret docker-compose.yml hands to the gateway and the controller as
# the compose secret `harnessrl_secret` (at /run/secrets/harnessrl_secret in their containers).
# Compose bind-mounts the file as it is, with its owner and mode, and the services run as uid
# 10001: so the file is world-readable (0644) inside a folder only you can enter (0700).
# Keeps an existing secret. Path: $HARNESSRL_SECRET_FILE or .harnessrl/compose/secret.
set -euo pipefail
cd "$(dirname "$0")/.."
file=${HARNESSRL_SECRET_FILE:-.harnessrl/compose/secret}
if [ -s "$file" ]; then
  echo "compose secret: $file (kept)"
  exit 0
fi
mkdir -p "$(dirname "$file")"
chmod 0700 "$(dirname "$file")"
(umask 022 && od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$file")
chmod 0644 "$file"
echo "compose secret: $file (new)"
