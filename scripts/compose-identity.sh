#!/usr/bin/env bash
# Copies an identity that docker-compose.yml's one-shot `pki` made (default: operator; or
# reader) out of its volume into .harnessrl/compose/tls/<identity> on this host (the folder
# 0700, tls.key 0600, owned by you), for the CLI and the Python clients:
#
#   bash scripts/compose-identity.sh [operator|reader] [compose options: -f FILE, -p NAME]
#   export HARNESSRL_TLS_DIR=$PWD/.harnessrl/compose/tls/operator
#   harnessrl status --controller 127.0.0.1:50053
#
# It runs the one-shot's image once more with `tar` as its command (no network; it prints
# that one folder, never the CA's key) and unpacks the stream here: compose 1.29 has no
# `compose cp` from a volume, and a host folder the one-shot wrote into would have to be
# writable by its uid (10001). Run it after `docker compose up` has made the identities.
# Output folder: $HARNESSRL_COMPOSE_TLS (default .harnessrl/compose/tls)/<identity>.
set -euo pipefail
cd "$(dirname "$0")/.."
identity=operator
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then identity=$1; shift; fi
case $identity in
  operator|reader) ;;
  *) echo "compose-identity: $identity: only operator or reader (the services' identities stay in their volumes)" >&2; exit 2 ;;
esac
if docker compose version >/dev/null 2>&1; then compose=(docker compose)
elif command -v docker-compose >/dev/null; then compose=(docker-compose)
else echo "compose-identity: neither 'docker compose' nor docker-compose found" >&2; exit 1
fi
out=${HARNESSRL_COMPOSE_TLS:-.harnessrl/compose/tls}/$identity
tmp=$(mktemp -d "${TMPDIR:-/tmp}/hrl-identity-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
chmod 0700 "$tmp"
"${compose[@]}" "$@" run --rm --no-deps -T pki \
  tar -C "/var/lib/harnessrl/tls/$identity" -c ca.crt tls.crt tls.key > "$tmp/identity.tar"
(umask 077 && tar -x --no-same-owner --no-same-permissions -C "$tmp" -f "$tmp/identity.tar")
rm "$tmp/identity.tar"
mkdir -p "$(dirname "$out")"
chmod 0700 "$(dirname "$out")"
rm -rf "$out"
mv "$tmp" "$out"
trap - EXIT
chmod 0700 "$out"
chmod 0600 "$out/tls.key"
chmod 0644 "$out/ca.crt" "$out/tls.crt"
out=$(cd "$out" && pwd)
echo "compose identity: $out ($identity)"
echo "export HARNESSRL_TLS_DIR=$out"
