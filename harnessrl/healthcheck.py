"""`python -m harnessrl.healthcheck grpc HOST:PORT | http URL | docker SOCKET [--timeout S] ...`

Exits 0 when the target is healthy, 1 otherwise: `grpc` asks the standard `grpc.health.v1`
service every harnessrl service serves (overall status SERVING: ready, i.e. able to do its job
— the store with Redis answering, the gateway with an engine and a store, the controller with a
store), `http` expects a 200 (vLLM's `/health`, the gateway's `/health`), `docker` a 200 from the
Docker API's `/_ping` on a Unix socket (the rollout gate's, which asks the daemon). With `--live`, `grpc`
asks for the `liveness` service instead, SERVING while the process answers at all. Container
healthchecks (docker-compose.yml) use it, so the images need no grpc_health_probe binary or
curl. `--wait S` retries for up to S seconds before giving up (a one-shot "wait until ready"
step). gRPC checks are mTLS like every call (harnessrl/identity.py): in a container the probe
runs with the service's own identity and checks that service (`--peer` names another).
"""

from __future__ import annotations

import argparse
import sys
import time


def healthy(kind: str, target: str, timeout: float, live: bool = False, peer: str = "") -> bool:
    if kind == "grpc":
        from harnessrl.rpc import LIVENESS_SERVICE, health_check

        return health_check(target, service=LIVENESS_SERVICE if live else "", timeout=timeout,
                            peer=peer)
    if kind == "docker":
        import http.client
        import socket

        class _Unix(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.settimeout(timeout)
                self.sock.connect(target)

        try:
            conn = _Unix("docker", timeout=timeout)
            conn.request("GET", "/_ping")
            return conn.getresponse().status == 200
        except OSError:
            return False
    import urllib.request  # (the standard library: every image has it)

    try:
        with urllib.request.urlopen(target, timeout=timeout) as r:
            return r.status == 200  # type: ignore[no-any-return]
    except (OSError, ValueError):  # (HTTPError for other statuses is an OSError)
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harnessrl.healthcheck", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("grpc", "http", "docker"))
    ap.add_argument("target", help="host:port (grpc), URL (http) or socket path (docker)")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds per check")
    ap.add_argument("--wait", type=float, default=0.0, help="retry for this many seconds")
    ap.add_argument("--live", action="store_true",
                    help="grpc: only whether the process answers (liveness), not readiness")
    ap.add_argument("--peer", default="", help="grpc: the service expected at target (store, "
                    "controller, gateway, trainer); default: this process's own identity, "
                    "as a container's probe checks its own service with its own identity "
                    "(harnessrl/identity.py)")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.wait
    while True:
        if healthy(args.kind, args.target, args.timeout, args.live, args.peer):
            return 0
        if time.monotonic() >= deadline:
            print(f"{args.target}: not healthy", file=sys.stderr)
            return 1
        time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main())
