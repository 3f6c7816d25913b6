"""What the gateway costs: latency and throughput through it (recording on) vs direct.

Side by side in one run, with wrk (Debian's `wrk`, C, one thread) as the load generator:

1. against a stub OpenAI-compatible upstream in its own process (fixed chat completion with
   vLLM's `prompt_token_ids`, `token_ids` and logprobs fields), at 32 connections and at 1;
2. against the real vLLM serving the project's tiny model (16-token completions), at 32
   connections (skip with --no-vllm), twice: with every process sharing the machine's CPUs
   (`*_shared`; on a small machine the gateway, store and Redis then take CPU from the engine),
   and with vLLM alone on `--engine-cpus` and everything else on the other CPUs, which is what
   the gateway adds when it does not compete with the engine for CPU, as with a GPU engine.

Every call through the gateway is authenticated with a rollout credential, forwarded, and
recorded in the store (Redis) before the response returns. "Direct" sends the engine the very
request the gateway forwards (`logprobs` and `return_token_ids` on, so the response carries the
token ids and logprobs), so the difference is what the gateway adds; `*_direct_plain` also
shows a direct request without those fields (what asking for them costs the engine itself).
Ends with one JSON line: `added_p50_ms` (gateway p50 - direct p50, real vLLM, 32 connections,
engine isolated; `added_p50_ms_shared_cpus` without isolation; with --no-vllm the stub's), `throughput_ratio` (gateway calls/s / direct calls/s, stub
upstream, 32 connections), and the raw figures.

3. streaming (`bench/_stream_client.py`, asyncio, the same client direct and through the
   gateway): the stub streams 64 events, each with token ids and logprobs; TTFT is the time to
   the first event that carries generated text (not the role-only first chunk).
   `stream_added_ttft_p50_ms` (stub, 1 connection) and `stream_throughput_ratio` (gateway
   streams/s / direct streams/s, stub, 32 connections) join the JSON line.

4. the HTTP layer's arms (`--arms`, `bench/_gateway_variants.py`): the same gateway served by
   uvicorn or granian (raw ASGI, no framework), or calling the stub with httpx or aiohttp
   instead of its own pool; each measured like the gateway (32 connections, 1, streaming).
   The JSON line's `arms` holds, per arm, the four figures above and the gateway's CPU per
   call (docs/http.md: the decision they informed).

5. the baseline (`--baseline REF`, default e4c7192, the code before the gateway kept its
   per-rollout state in the store; `bench/_baseline.py`): REF's store and gateway, from a
   temporary git worktree, on a Redis of their own, measured with the same stub loads as
   today's in alternating rounds (`--rounds`, medians). `baseline` holds its
   `added_p50_ms_stub_c1` and `throughput_ratio`, `vs_baseline` today's / the baseline's
   (above 1 is worse for the first, below 1 for the second).
6. two replicas on the one store (docs/gateway-replicas.md), each rollout owned by one: two
   wrk processes of 16 connections, each request with the next of 64 rollouts' keys, both
   against the gateway alone (`replicas1_throughput`, calls/s summed) and one against each of
   two replicas (`replicas2_throughput`: random arrival, about half of the calls forwarded to
   their owner, `forwarded_share`; `replicas_ratio` = replicas2 / replicas1), and each wrk
   sending only the rollouts of the replica it calls (`replicas_ratio_owner`), alternating;
   `replicas_cpu_us_per_call` gives the gateways', store's and Redis's CPU per call of each.

7. what authentication costs (`bench/_auth_overhead.py`; `--auth-only` measures just this): the
   store's RecordCalls stream as the gateway records through it, and one unary RPC
   (GetRollout), mTLS with the calling service's identity against a plaintext store on the
   same Redis, in `--auth-rounds` alternating draws of `--auth-seconds`. The JSON line's
   `auth` holds, per measurement, mTLS / plaintext of calls/s (`ratio`) and of the
   throughput the CPU per call gives (`cpu_ratio`), each the median, min and max over rounds
   (target >= 0.95), and each arm's medians; besides, the handshake's cost and `parts`:
   harnessrl's own per-call pieces and gRPC's TLS with no harnessrl code
   (`bench/_auth_parts.py`).

Every service runs authenticated as in a deployment (mTLS, harnessrl/pki.py identities from
$HARNESSRL_TLS_ROOT, else a PKI the bench makes in its work folder; the bench calls as admin).

    python bench/gateway_overhead.py [--duration 10] [--no-vllm] [--engine-cpus 0|''] [--arms ...]
        [--baseline e4c7192|''] [--rounds 3] [--auth-rounds 8] [--auth-seconds 2]
    python bench/gateway_overhead.py --auth-only  # about 2 minutes
    python bench/gateway_overhead.py --no-vllm --quick --arms uvicorn+builtin --baseline ''  # runs?
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import _auth_overhead, _baseline  # noqa: E402
from bench._procstat import children, proc_table  # noqa: E402
from bench._services import (bench_pki, running_attempt, start_gateway,  # noqa: E402
                             start_store, start_stub_engine)
import httpx  # noqa: E402

from harnessrl import procs  # noqa: E402
from harnessrl.clients import StoreClient  # noqa: E402
from services.gateway import rendezvous  # noqa: E402

SECRET = "bench-secret-0123456789abcdef0123"
# HTTP-layer arms (server+engine client) measured beside the gateway's own httptools server and
# pooled client (builtin+builtin): a general server or client in place of each.
ARMS = ("uvicorn+builtin", "granian+builtin", "builtin+httpx", "builtin+aiohttp")

WRK_LUA = """
wrk.method = "POST"
wrk.body = %(body)s
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = %(auth)s
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK {"p50_us": %%d, "p99_us": %%d, "requests": %%d, "duration_us": %%d, "errors": %%d, "non2xx": %%d}\\n',
    latency:percentile(50), latency:percentile(99), summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def lua_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def wrk(url: str, body: dict, key: str, connections: int, duration: int, workdir: Path  # type: ignore[type-arg]
        ) -> dict[str, float]:
    script = workdir / f"wrk-{time.monotonic_ns()}.lua"
    script.write_text(WRK_LUA % {"body": lua_str(json.dumps(body)),
                                 "auth": lua_str(f"Bearer {key}")})
    return _run_wrk(url, script, connections, duration)


def _run_wrk(url: str, script: Path, connections: int, duration: int) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--timeout", "30s", "-s",
         str(script), url], capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("WRK "))
    r = json.loads(line[4:])
    if r["errors"] or r["non2xx"]:
        raise RuntimeError(f"wrk saw errors against {url}: {r}\n{out}")
    return {"p50_ms": r["p50_us"] / 1000, "p99_ms": r["p99_us"] / 1000,
            "calls_per_s": r["requests"] / (r["duration_us"] / 1e6), "calls": r["requests"]}


WRK_KEYS_LUA = """
wrk.method = "POST"
wrk.body = %(body)s
wrk.headers["Content-Type"] = "application/json"
keys = {%(keys)s}
i = 0
request = function()
  i = i %% #keys + 1
  wrk.headers["Authorization"] = keys[i]
  return wrk.format()
end
""" + WRK_LUA[WRK_LUA.index("done = function"):]


def wrk_keys(url: str, body: dict, keys: list[str], connections: int,  # type: ignore[type-arg]
             duration: int, workdir: Path) -> dict[str, float]:
    """`wrk`, each request with the next of `keys` (the rollouts of many harnesses)."""
    script = workdir / f"wrk-{time.monotonic_ns()}.lua"
    script.write_text(WRK_KEYS_LUA % {"body": lua_str(json.dumps(body)), "keys": ", ".join(
        lua_str(f"Bearer {k}") for k in keys)})
    return _run_wrk(url, script, connections, duration)


def forwarded(urls: list[str]) -> float:
    """Calls the gateways at `urls` forwarded to their rollout's owner, so far (each counted
    once)."""
    total = 0.0
    for base in {u.split("/v1/")[0] for u in urls}:
        for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
            if line.startswith("harnessrl_gateway_forwarded_calls_total "):
                total += float(line.split()[1])
    return total


def cpu_ms(processes: dict[str, procs.ServiceProcess]) -> dict[str, float]:
    """CPU time (user + system, ms) each process has used so far, from /proc."""
    table = proc_table()
    out = {}
    for name, p in processes.items():
        assert p.proc is not None
        out[name] = table[p.proc.pid].cpu_s * 1000
    return out


def pin(pids: list[int], cpus: set[int]) -> None:
    """Restricts every thread of these processes to `cpus`."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            os.sched_setaffinity(int(task.name), cpus)


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    kids = children(proc_table())
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += kids.get(p, [])
    return tree


def medians(rs: list[dict[str, float]]) -> dict[str, float]:
    return {m: statistics.median(r[m] for r in rs) for m in rs[0]}


def as_forwarded(body: dict) -> dict:  # type: ignore[type-arg]
    """The request the gateway sends the engine for a chat completion `body`."""
    return {**body, "logprobs": True, "return_token_ids": True}


def print_auth(auth: dict) -> None:  # type: ignore[type-arg]
    """The authentication rows: per measurement, each arm's medians and the ratio."""
    print(f"\n{'authentication':<15}{'arm':>10}{'calls/s':>9}{'p50 ms':>8}"
          f"{'CPU us/call: store / redis / client':>37}{'mTLS/plain':>12}{'min-max':>13}")
    for kind in _auth_overhead.KINDS:
        a = auth[kind]
        for arm in ("mtls", "plaintext"):
            r = a[arm]
            cpu = f"{r['store_cpu_us_per_call']:.0f} / {r['redis_cpu_us_per_call']:.0f} / " \
                  f"{r['client_cpu_us_per_call']:.0f}"
            ratio = [(f"{a['ratio']:.3f}", f"{a['ratio_min']:.2f}-{a['ratio_max']:.2f}"),
                     (f"CPU {a['cpu_ratio']:.3f}",
                      f"{a['cpu_ratio_min']:.2f}-{a['cpu_ratio_max']:.2f}")][arm != "mtls"]
            print(f"{kind:<15}{arm:>10}{r['calls_per_s']:>9.0f}{r['p50_ms']:>8.2f}{cpu:>37}"
                  f"{ratio[0]:>12}{ratio[1]:>13}")
    connect, parts = auth["connect_p50_ms"], auth["parts"]
    alone = parts["grpc_alone"]
    print(f"target: mTLS/plain >= {auth['target']}\n"
          f"handshake: a new channel's first call p50 {connect['mtls']:.2f} ms mTLS, "
          f"{connect['plaintext']:.2f} ms plaintext\n"
          f"harnessrl's own, per call (in-process): Authorize interceptor "
          f"{parts['authorize_interceptor_us']} us (its table check "
          f"{parts['authorize_check_us']} us), reading the peer's identity "
          f"{parts['auth_context_us']} us\n"
          f"gRPC alone (an echo, 32 in flight): mTLS/plain {alone['ratio']:.3f}, CPU "
          f"{alone['cpu_ratio']:.3f} ({alone['mtls_cpu_us_per_call']:.0f} / "
          f"{alone['plaintext_cpu_us_per_call']:.0f} us per call)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=int, default=10, help="seconds per measurement")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--no-vllm", action="store_true", help="skip the real-vLLM comparison")
    ap.add_argument("--engine-cpus", default="0",
                    help="CPU ids for vLLM alone in the isolated vLLM phase (vLLM pinned there, "
                         "wrk, gateway, store and Redis on the other CPUs); '' skips that phase")
    ap.add_argument("--vllm-rounds", type=int, default=5,
                    help="alternating direct/gateway runs against vLLM (medians reported)")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help="HTTP-layer variants server+client to measure beside the gateway "
                         "(servers: builtin, uvicorn, granian; clients: builtin, httpx, "
                         "aiohttp); '' for none")
    ap.add_argument("--baseline", default="e4c7192",
                    help="git ref whose store and gateway are measured beside today's (stub "
                         "loads, from a temporary worktree); '' for none")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating direct/gateway/baseline runs against the stub, and "
                         "1-replica/2-replica runs (medians reported)")
    ap.add_argument("--auth-rounds", type=int, default=8,
                    help="alternating mTLS/plaintext draws of the store's RecordCalls stream "
                         "and a unary RPC (bench/_auth_overhead.py); 0 skips them")
    ap.add_argument("--auth-seconds", type=float, default=2.0, help="seconds per such draw")
    ap.add_argument("--auth-only", action="store_true",
                    help="measure only what authentication costs (no wrk needed)")
    ap.add_argument("--quick", action="store_true",
                    help="1 s per measurement and per warm-up, 1 connection included, one round "
                         "against vLLM: checks that every part runs (tests/test_bench_cli.py); "
                         "the figures mean nothing")
    args = ap.parse_args()
    if shutil.which("wrk") is None and not args.auth_only:
        sys.exit("wrk not found: apt-get install wrk (scripts/setup.sh does)")

    all_cpus = os.sched_getaffinity(0)
    engine_cpus = {int(x) for x in args.engine_cpus.split(",") if x.strip()}
    if engine_cpus and not engine_cpus < all_cpus:
        print(f"--engine-cpus {sorted(engine_cpus)} leaves no CPU for the rest of "
              f"{sorted(all_cpus)}: no isolated phase", flush=True)
        engine_cpus = set()
    work = Path(tempfile.mkdtemp(prefix="hrl-bench-gw-"))
    started: list[procs.ServiceProcess] = []
    cleanup = contextlib.ExitStack()
    try:
        pki_root = bench_pki(work)
        redis_url, redis_proc = procs.start_redis(work / "redis")
        started.append(redis_proc)
        auth = None
        if args.auth_rounds > 0 or args.auth_only:
            assert redis_proc.proc is not None
            auth = _auth_overhead.run(work, redis_url, redis_proc.proc.pid, pki_root,
                                      0.3 if args.quick else args.auth_seconds,
                                      1 if args.quick else max(1, args.auth_rounds),
                                      args.connections, args.quick)
            print_auth(auth)
        if args.auth_only:
            print(json.dumps({"auth": auth, "quick": args.quick}))
            return
        store_proc, store_addr = start_store(work, redis_url)
        started.append(store_proc)
        stub_proc, stub_url = start_stub_engine(work, "stub-model")
        started.append(stub_proc)
        engines: list[dict[str, object]] = [{"name": "stub", "base_url": stub_url,
                                             "model": "stub-model"}]
        vllm = None
        if not args.no_vllm:
            from harnessrl.local.engine import start_engine
            from harnessrl.model.build import build_tiny_model, default_model_dir
            model_dir = build_tiny_model(default_model_dir())
            print("starting vLLM on", model_dir, flush=True)
            vllm = start_engine(model_dir, workdir=work / "engine", served_model_name="tiny")
            started.append(vllm)
            assert vllm.keys is not None  # its key check on, as `harnessrl up` runs it: the
            # gateways started below send its key (harnessrl/engine_guard.py)
            os.environ["HARNESSRL_ENGINE_API_KEY_FILE"] = str(vllm.keys.api_key_file)
            vllm.wait_healthy(300)
            engines.append({"name": "vllm", "base_url": vllm.base_url, "model": "tiny"})
        gw_proc, gw = start_gateway(work, store_addr, SECRET, engines,
                                    extra=("--replica-name", "bench-a"))
        started.append(gw_proc)
        gw_url = f"http://127.0.0.1:{gw['http_port']}/v1/chat/completions"
        key = running_attempt(store_addr, "bench/0", SECRET)
        store = StoreClient.connect(store_addr)
        base_ours: dict[str, procs.ServiceProcess] = {}
        if args.baseline:
            src = cleanup.enter_context(_baseline.worktree(args.baseline))
            base_ours, base_url, base_key = _baseline.start(src, work / "baseline", SECRET,
                                                            engines, "bench/0", started)

        stub_body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
        results: dict[str, dict[str, float]] = {}
        d, n = args.duration, args.connections
        # seconds of each 1-connection measurement (enough calls for a p50) and of a warm-up
        # (vLLM's longer), and runs against vLLM
        d_c1, warm, warm_vllm, vllm_rounds_n = max(3, d // 2), 2, 3, args.vllm_rounds
        rounds = max(1, args.rounds)
        if args.quick:
            d = d_c1 = warm = warm_vllm = vllm_rounds_n = rounds = 1
        ours = {"gateway": gw_proc, "store": store_proc, "redis": redis_proc}

        def through_gateway(name: str, body: dict, conns: int, secs: int,  # type: ignore[type-arg]
                            url: str = gw_url, key: str = key,
                            ours: dict[str, procs.ServiceProcess] = ours) -> dict[str, float]:
            before = cpu_ms(ours)
            r = results[name] = wrk(url, body, key, conns, secs, work)
            after = cpu_ms(ours)
            for proc_name in ours:  # CPU the harnessrl side spent per call, in microseconds
                r[f"{proc_name}_cpu_us_per_call"] = \
                    (after[proc_name] - before[proc_name]) * 1000 / max(1, r["calls"])
            return r

        stub_direct = f"{stub_url}/v1/chat/completions"
        gateways = [("stub_gateway", gw_url, key, ours)]
        if base_ours:
            gateways.append(("baseline_stub_gateway", base_url, base_key, base_ours))
        for _, url, k, _ in gateways:
            wrk(url, stub_body, k, n, warm, work)  # warm-up
        # direct, today's gateway and the baseline's in turn (the two gateways in alternating
        # order), `rounds` times at 32 connections and at 1: medians
        runs: dict[str, list[dict[str, float]]] = {}
        for i in range(rounds):
            for conns, secs, sfx in ((n, d, ""), (1, d_c1, "_c1")):
                runs.setdefault(f"stub_direct{sfx}", []).append(
                    wrk(stub_direct, as_forwarded(stub_body), key, conns, secs, work))
                for name, url, k, ps in gateways[::-1 if i % 2 else 1]:
                    runs.setdefault(name + sfx, []).append(
                        through_gateway(name + sfx, stub_body, conns, secs, url, k, ps))
        results.update({name: medians(rs) for name, rs in runs.items()})
        results["stub_direct_plain"] = wrk(stub_direct, stub_body, key, n, d, work)
        from bench import _stream_client
        stream_body = {**stub_body, "stream": True, "stub_tokens": 64}
        forwarded_stream = {**as_forwarded(stream_body)}
        _stream_client.run(gw_url, stream_body, key, n, warm)  # warm-up
        for conns, suffix in ((n, ""), (1, "_c1")):
            secs = d if conns > 1 else d_c1
            results[f"stream_direct{suffix}"] = _stream_client.run(
                stub_direct, forwarded_stream, key, conns, secs)
            results[f"stream_gateway{suffix}"] = _stream_client.run(
                gw_url, stream_body, key, conns, secs)
        # The HTTP layer's arms: the same gateway with another server or engine client
        # (bench/_gateway_variants.py), each against the stub, as the default gateway above.
        for arm in [a for a in args.arms.split(",") if a.strip()]:
            server, client = arm.split("+")
            arm_proc, arm_info = start_gateway(work, store_addr, SECRET, engines, server,
                                               client)
            arm_url = f"http://127.0.0.1:{arm_info['http_port']}/v1/chat/completions"
            try:
                wrk(arm_url, stub_body, key, n, warm, work)  # warm-up
                before = cpu_ms({"gateway": arm_proc})
                r = results[f"arm_{arm}"] = wrk(arm_url, stub_body, key, n, d, work)
                r["gateway_cpu_us_per_call"] = (cpu_ms({"gateway": arm_proc})["gateway"]
                                                - before["gateway"]) * 1000 / max(1, r["calls"])
                results[f"arm_{arm}_c1"] = wrk(arm_url, stub_body, key, 1, d_c1, work)
                _stream_client.run(arm_url, stream_body, key, n, warm)  # warm-up
                results[f"arm_{arm}_stream"] = _stream_client.run(arm_url, stream_body, key, n, d)
                results[f"arm_{arm}_stream_c1"] = _stream_client.run(
                    arm_url, stream_body, key, 1, d_c1)
            finally:
                arm_proc.stop()
        # Two replicas on the one store, each rollout owned by one (services/gateway/
        # ownership.py): two wrks of n/2 connections, each rotating the keys of many rollouts.
        # `replicas1`: both against the gateway alone; `replicas2`: one against each replica
        # (random arrival: about half of the calls reach the replica that does not own their
        # rollout and are forwarded); `replicas2_owner`: each wrk sends only the rollouts of
        # the replica it calls. The second replica starts and stops every round (it leaves,
        # announcing it), so the first is alone again in between.
        names = ["bench-a", "bench-b"]
        keyed = [(f"bench/r{i}", running_attempt(store_addr, f"bench/r{i}", SECRET))
                 for i in range(64)]
        owned = {nm: [k for rid, k in keyed if rendezvous.choose(rid, names) == nm]
                 for nm in names}
        every = [k for _, k in keyed]

        def two_wrks(urls: list[str], keys: list[list[str]], secs: int,
                     gateways: dict[str, procs.ServiceProcess]) -> dict[str, float]:
            watched = {"store": store_proc, "redis": redis_proc, **gateways}
            before, fwd = cpu_ms(watched), forwarded(urls)
            with ThreadPoolExecutor(2) as ex:
                rs = list(ex.map(lambda u, ks: wrk_keys(u, stub_body, ks, n // 2, secs, work),
                                 urls, keys))
            after, calls = cpu_ms(watched), sum(r["calls"] for r in rs)
            per_call = {f"{who}_cpu_us_per_call": sum(after[g] - before[g] for g in watched
                                                      if g == who or g.startswith(who))
                        * 1000 / max(1, calls) for who in ("gateway", "store", "redis")}
            return {"p50_ms": max(r["p50_ms"] for r in rs), "p99_ms": max(r["p99_ms"] for r in rs),
                    "calls_per_s": sum(r["calls_per_s"] for r in rs), "calls": calls,
                    "forwarded_share": (forwarded(urls) - fwd) / max(1, calls), **per_call}

        runs: dict[str, list[dict[str, float]]] = {
            "replicas1": [], "replicas2": [], "replicas2_owner": []}
        for _ in range(rounds):
            runs["replicas1"].append(two_wrks([gw_url, gw_url], [every, every], d,
                                              {"gateway": gw_proc}))
            b_proc, b = start_gateway(work / "replica-b", store_addr, SECRET, engines,
                                      extra=("--replica-name", "bench-b"))
            try:
                b_url = f"http://127.0.0.1:{b['http_port']}/v1/chat/completions"
                both = {"gateway": gw_proc, "gateway_b": b_proc}
                two_wrks([gw_url, b_url], [every, every], warm, both)  # warm-up (b joins)
                runs["replicas2"].append(two_wrks([gw_url, b_url], [every, every], d, both))
                runs["replicas2_owner"].append(two_wrks(
                    [gw_url, b_url], [owned["bench-a"], owned["bench-b"]], d, both))
            finally:
                b_proc.stop()
            time.sleep(2.5)  # the first replica's next heartbeat finds it alone
        results.update({name: medians(rs) for name, rs in runs.items()})
        if vllm is not None:
            # Every completion exactly 16 tokens (ignore_eos), so each request is the same work.
            body = {"model": "tiny", "max_tokens": 16, "temperature": 1.0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "What is 12 + 30?"}]}
            vllm_direct = f"{vllm.base_url}/v1/chat/completions"
            wrk(vllm_direct, body, vllm.api_key, n, warm_vllm, work)  # warm-up

            def vllm_rounds(suffix: str) -> None:
                # vLLM on CPU varies from one run to the next: alternate direct and gateway
                # runs and keep the median of each.
                runs: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": []}
                for _ in range(vllm_rounds_n):
                    runs["direct"].append(wrk(vllm_direct, as_forwarded(body), vllm.api_key, n,
                                              d, work))
                    through_gateway("vllm_gateway" + suffix, body, n, d)
                    runs["gateway"].append(results["vllm_gateway" + suffix])
                for how, rs in runs.items():
                    results[f"vllm_{how}{suffix}"] = medians(rs)

            # 1. everything shares the machine's CPUs, as `harnessrl up` runs here.
            vllm_rounds("_shared")
            # 2. the engine alone on `engine_cpus`, everything else on the other CPUs: what the
            #    gateway adds when it does not compete with the engine for CPU (as on a GPU box).
            if engine_cpus:
                assert vllm.proc is not None
                pin(process_tree(vllm.proc.pid), engine_cpus)
                others = all_cpus - engine_cpus
                pin([p.proc.pid for p in ours.values() if p.proc], others)
                os.sched_setaffinity(0, others)  # wrk inherits it
                wrk(vllm_direct, body, vllm.api_key, n, warm_vllm, work)  # settle
                vllm_rounds("")
            else:
                for how in ("direct", "gateway"):
                    results[f"vllm_{how}"] = results[f"vllm_{how}_shared"]
            results["vllm_direct_plain"] = wrk(vllm_direct, body, vllm.api_key, n, d, work)
        recorded = len(store.get_rollout("bench/0").attempts) and \
            store.get_rollout("bench/0").attempts[0].num_calls
        store.close()

        print(f"\n{'measurement':<26}{'p50 ms':>10}{'p99 ms':>10}{'calls/s':>11}"
              f"{'gateway / store / redis CPU us per call':>42}")
        for name, r in results.items():
            if name.startswith("stream_") or name.endswith("_stream") or \
                    name.endswith("_stream_c1"):
                print(f"{name:<26}{r['stream_p50_ms']:>10.2f}{'':>10}{r['streams_per_s']:>11.0f}"
                      f"   TTFT p50 {r['ttft_p50_ms']:.2f} ms, p99 {r['ttft_p99_ms']:.2f} ms")
                continue
            cpu = "" if "gateway_cpu_us_per_call" not in r else (
                f"{r['gateway_cpu_us_per_call']:>24.0f}" if "store_cpu_us_per_call" not in r
                else f"{r['gateway_cpu_us_per_call']:>24.0f} / {r['store_cpu_us_per_call']:.0f}"
                     f" / {r['redis_cpu_us_per_call']:.0f}")
            print(f"{name:<26}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['calls_per_s']:>11.0f}"
                  f"{cpu}")
        ref = "vllm" if vllm is not None else "stub"
        summary = {
            "added_p50_ms": round(results[f"{ref}_gateway"]["p50_ms"]
                                  - results[f"{ref}_direct"]["p50_ms"], 3),
            "added_p50_ms_basis": f"{ref} upstream, {n} connections"
                                  + (f", vLLM alone on CPUs {sorted(engine_cpus)}, the rest on "
                                     f"{sorted(all_cpus - engine_cpus)}"
                                     if engine_cpus and vllm is not None else ", shared CPUs"),
            "added_p99_ms": round(results[f"{ref}_gateway"]["p99_ms"]
                                  - results[f"{ref}_direct"]["p99_ms"], 3),
            "throughput_ratio": round(results["stub_gateway"]["calls_per_s"]
                                      / results["stub_direct"]["calls_per_s"], 3),
            "throughput_ratio_vs_plain_direct": round(
                results["stub_gateway"]["calls_per_s"]
                / results["stub_direct_plain"]["calls_per_s"], 3),
            "added_p50_ms_stub_c1": round(results["stub_gateway_c1"]["p50_ms"]
                                          - results["stub_direct_c1"]["p50_ms"], 3),
            "stream_added_ttft_p50_ms": round(results["stream_gateway_c1"]["ttft_p50_ms"]
                                              - results["stream_direct_c1"]["ttft_p50_ms"], 3),
            "stream_throughput_ratio": round(results["stream_gateway"]["streams_per_s"]
                                             / results["stream_direct"]["streams_per_s"], 3),
            "arms": {arm[4:]: {
                "added_p50_ms_stub_c1": round(results[f"{arm}_c1"]["p50_ms"]
                                              - results["stub_direct_c1"]["p50_ms"], 3),
                "throughput_ratio": round(results[arm]["calls_per_s"]
                                          / results["stub_direct"]["calls_per_s"], 3),
                "gateway_cpu_us_per_call": round(results[arm]["gateway_cpu_us_per_call"]),
                "stream_added_ttft_p50_ms": round(results[f"{arm}_stream_c1"]["ttft_p50_ms"]
                                                  - results["stream_direct_c1"]["ttft_p50_ms"], 3),
                "stream_throughput_ratio": round(results[f"{arm}_stream"]["streams_per_s"]
                                                 / results["stream_direct"]["streams_per_s"], 3),
            } for arm in results if arm.startswith("arm_") and arm.count("_") == 1},
            "replicas1_throughput": round(results["replicas1"]["calls_per_s"]),
            "replicas2_throughput": round(results["replicas2"]["calls_per_s"]),
            "replicas_ratio": round(results["replicas2"]["calls_per_s"]
                                    / results["replicas1"]["calls_per_s"], 3),
            "replicas_ratio_owner": round(results["replicas2_owner"]["calls_per_s"]
                                          / results["replicas1"]["calls_per_s"], 3),
            "forwarded_share": round(results["replicas2"]["forwarded_share"], 3),
            "replicas_cpu_us_per_call": {
                arm: {who: round(results[arm][f"{who}_cpu_us_per_call"], 1)
                      for who in ("gateway", "store", "redis")}
                for arm in ("replicas1", "replicas2", "replicas2_owner")},
            "recorded_calls": recorded,
            "connections": n, "duration_s": d, "rounds": rounds, "quick": args.quick,
            "results": {k: {m: round(v, 3) for m, v in r.items()} for k, r in results.items()},
        }
        if base_ours:
            base = summary["baseline"] = {
                "ref": args.baseline,
                "added_p50_ms_stub_c1": round(results["baseline_stub_gateway_c1"]["p50_ms"]
                                              - results["stub_direct_c1"]["p50_ms"], 3),
                "throughput_ratio": round(results["baseline_stub_gateway"]["calls_per_s"]
                                          / results["stub_direct"]["calls_per_s"], 3)}
            summary["vs_baseline"] = {m: round(summary[m] / base[m], 3)  # type: ignore[operator]
                                      for m in ("added_p50_ms_stub_c1", "throughput_ratio")}
        if auth is not None:
            summary["auth"] = auth
        if vllm is not None:
            summary["vllm_throughput_ratio"] = round(
                results["vllm_gateway"]["calls_per_s"] / results["vllm_direct"]["calls_per_s"], 3)
            summary["added_p50_ms_shared_cpus"] = round(
                results["vllm_gateway_shared"]["p50_ms"] - results["vllm_direct_shared"]["p50_ms"],
                3)
            summary["vllm_throughput_ratio_shared_cpus"] = round(
                results["vllm_gateway_shared"]["calls_per_s"]
                / results["vllm_direct_shared"]["calls_per_s"], 3)
            summary["added_p50_ms_vs_plain_direct"] = round(
                results["vllm_gateway"]["p50_ms"] - results["vllm_direct_plain"]["p50_ms"], 3)
        print(json.dumps(summary))
    finally:
        for p in reversed(started):
            p.stop()
        cleanup.close()  # the baseline's worktree
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
