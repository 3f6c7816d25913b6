#!/usr/bin/env bash
# Every Secret k8s/ needs, made once into DIR and printed as YAML for kubectl (without
# cert-manager; with k8s/components/cert-manager making the identities, add --no-tls):
#
#   bash scripts/k8s-secrets.sh DIR [-n NAMESPACE] [--no-tls] | kubectl apply -f -
#
# DIR (0700) keeps what it made; a second run prints the same Secrets (certificates within 30
# days of expiry are renewed: apply again and the pods' mounted files follow). In it:
#   pki/     the CA and an identity each (python -m harnessrl.pki): Secrets
#            harnessrl-tls-<identity> (kubernetes.io/tls: ca.crt, tls.crt, tls.key) for
#            store, controller, gateway, trainer and grader; the operator and reader
#            identities stay here, for your own tools (docs/deploy.md). The CA's key never
#            leaves this folder.
#   redis/   Redis's password (harnessrl-redis-password: the store's) and the ACL file with
#            its SHA-256 (harnessrl-redis-acl: Redis's) (python -m harnessrl.deploy_secrets)
#   engine/  the keys the engine accepts (harnessrl-engine-keys), the one the gateway and the
#            trainer send (harnessrl-engine-api-key), the judge's own
#            (harnessrl-engine-judge-key) (python -m harnessrl.engine_guard keys)
#   secret   the gateway's and the controller's shared secret (harnessrl-secret)
# Needs a Python with harnessrl installed ($PYTHON, default python).
set -euo pipefail

usage() { sed -n '2,4p' "$0" >&2; exit 2; }
[ $# -ge 1 ] || usage
dir=$1; shift
ns=harnessrl
tls=1
while [ $# -gt 0 ]; do
  case $1 in
    -n|--namespace) ns=${2:?}; shift 2 ;;
    --no-tls) tls=0; shift ;;
    *) usage ;;
  esac
done
py=${PYTHON:-python}
# The identities pods mount (k8s/base); operator and reader are made but not printed.
identities=(store controller gateway trainer grader)

umask 077
mkdir -p "$dir"
chmod 700 "$dir"
"$py" -m harnessrl.pki create "$dir/pki" >&2
"$py" -m harnessrl.deploy_secrets redis --password "$dir/redis/password" \
  --acl "$dir/redis/users.acl" >&2
"$py" -m harnessrl.engine_guard keys "$dir/engine" >/dev/null
if [ ! -s "$dir/secret" ]; then
  od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$dir/secret"
fi

secret() {  # NAME KEY=FILE ...: an Opaque Secret holding each FILE under KEY
  local name=$1 kv
  shift
  printf -- '---\napiVersion: v1\nkind: Secret\ntype: Opaque\nmetadata:\n'
  printf '  name: %s\n  namespace: %s\n' "$name" "$ns"
  printf '  labels: {app.kubernetes.io/part-of: harnessrl}\ndata:\n'
  for kv in "$@"; do
    printf '  %s: %s\n' "${kv%%=*}" "$(base64 -w0 <"${kv#*=}")"
  done
}

if [ "$tls" = 1 ]; then
  "$py" -m harnessrl.pki kube-secrets "$dir/pki" --namespace "$ns" \
    "${identities[@]/#/--identity=}"
fi
secret harnessrl-secret secret="$dir/secret"
secret harnessrl-redis-password password="$dir/redis/password"
secret harnessrl-redis-acl users.acl="$dir/redis/users.acl"
secret harnessrl-engine-keys keys="$dir/engine/keys"
secret harnessrl-engine-api-key api.key="$dir/engine/api.key"
secret harnessrl-engine-judge-key judge.key="$dir/engine/judge.key"
