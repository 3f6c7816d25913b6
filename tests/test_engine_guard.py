"""The engine's key check (harnessrl/engine_guard.py) and the clients that send the key.

- In front of the real vLLM (the session's `vllm_engine`, started with the guard by
  harnessrl.local.engine): without a key, or with a wrong one, every route answers 401 (chat,
  the weight-update routes, sleep, wake, pause, tokenize, collective_rpc, LoRA loading, metrics,
  unknown paths); with the key they reach vLLM; GET /health and /ping stay open; a keys file
  rewritten while it runs is obeyed at the next request (rotation without a restart).
- The middleware alone (plain ASGI): it refuses to be built without keys, insecure mode only on
  a loopback --host, the 401 body in OpenAI's error shape, websockets closed.
- The clients: the gateway's upstream pool and httpx's auth hook send the key; a client key file
  rotates; `EngineKeys` keeps its files private.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl import engine_guard
from harnessrl.engine_guard import ClientKey, EngineKeys, GuardError, RequireKey

KEY = "k" * 20 + "-first"
OTHER = "o" * 20 + "-second"


# -- the middleware alone ---------------------------------------------------------------------

async def _inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.accept"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"inner"})


def call(guard: RequireKey, path: str, method: str = "POST", auth: bytes | None = None,
         kind: str = "http") -> tuple[int, bytes]:
    """One request through the guard: (status, body); a websocket: (close code or 101, b"")."""
    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    headers = [(b"host", b"x")] + ([(b"authorization", auth)] if auth is not None else [])
    scope = {"type": kind, "method": method, "path": path, "headers": headers}
    asyncio.run(guard(scope, receive, send))
    if kind == "websocket":
        return (sent[0].get("code", 0) if sent[0]["type"] == "websocket.close" else 101), b""
    return sent[0]["status"], sent[1]["body"]


def keys_file(tmp_path: Path, *keys: str) -> Path:
    path = tmp_path / "keys"
    path.write_text("# engine keys\n\n" + "".join(k + "\n" for k in keys))
    return path


def lifespan_startup(guard: RequireKey) -> dict[str, Any]:
    """What the guard answers a server's lifespan startup."""
    sent: list[dict[str, Any]] = []
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    asyncio.run(guard({"type": "lifespan"}, receive, send))
    return sent[0]


def test_guard_refuses_the_server_its_start_without_keys(tmp_path: Path) -> None:
    local = ["serve", "--host", "127.0.0.1"]
    insecure = {"HARNESSRL_INSECURE": "1"}
    cases = [({}, local, "HARNESSRL_ENGINE_KEYS_FILE"),
             ({"HARNESSRL_ENGINE_KEYS_FILE": str(tmp_path / "none")}, local, "does not exist"),
             ({"HARNESSRL_ENGINE_KEYS_FILE": str(keys_file(tmp_path, "short"))}, local,
              "holds no key")]
    for argv in (["serve"], ["serve", "--host", "0.0.0.0"], ["serve", "--host=10.1.2.3"],
                 ["serve", "--host", "::"]):
        cases.append((insecure, argv, "loopback"))
    for env, argv, why in cases:
        with pytest.raises(GuardError, match=why):
            engine_guard.guard_keys(environ=env, argv=argv)
        guard = RequireKey(_inner, environ=env, argv=argv)
        answer = lifespan_startup(guard)
        assert answer["type"] == "lifespan.startup.failed" and why in answer["message"], answer
        status, body = call(guard, "/health", "GET")  # served without a lifespan: nothing
        assert status == 503 and b"no keys" in body
        assert call(guard, "/v1/models", "GET", auth=b"Bearer " + KEY.encode())[0] == 503
    open_guard = RequireKey(_inner, environ=insecure, argv=local)
    assert open_guard.insecure and call(open_guard, "/update_weights") == (200, b"inner")
    # a keys file wins over insecure mode
    guard = RequireKey(_inner, environ={**insecure, "HARNESSRL_ENGINE_KEYS_FILE": str(
        keys_file(tmp_path, KEY))}, argv=["serve", "--host", "127.0.0.1"])
    assert call(guard, "/update_weights")[0] == 401


def test_guard_lets_only_keys_through_but_health(tmp_path: Path) -> None:
    guard = RequireKey(_inner, keys_file=keys_file(tmp_path, KEY, OTHER), recheck_s=0.0)
    for path in ("/v1/chat/completions", "/update_weights", "/sleep", "/health/", "//health",
                 "/metrics", "/nowhere"):
        status, body = call(guard, path)
        assert status == 401, path
        err = json.loads(body)["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in err["message"]
    assert call(guard, "/health", "GET") == (200, b"inner")
    assert call(guard, "/ping", "GET") == (200, b"inner")
    assert call(guard, "/health", "POST")[0] == 401  # probes GET; nothing else is open
    assert call(guard, "/health", "OPTIONS")[0] == 401
    for good in (KEY, OTHER):
        assert call(guard, "/update_weights", auth=b"Bearer " + good.encode()) == (200, b"inner")
        assert call(guard, "/x", auth=b"bearer " + good.encode()) == (200, b"inner")
    for bad in (b"Bearer " + KEY.encode()[:-1], b"Bearer " + KEY.encode() + b"x", b"Bearer ",
                b"Basic " + KEY.encode(), KEY.encode(), b"Bearer short"):
        status, body = call(guard, "/update_weights", auth=bad)
        assert status == 401 and b"not accepted" in body, bad
    assert call(guard, "/v1/realtime", "GET", kind="websocket") == (1008, b"")
    assert call(guard, "/v1/realtime", "GET", auth=b"Bearer " + KEY.encode(),
                kind="websocket") == (101, b"")


def test_guard_follows_the_keys_file(tmp_path: Path) -> None:
    path = keys_file(tmp_path, KEY)
    guard = RequireKey(_inner, keys_file=path, recheck_s=0.0)
    auth_old, auth_new = b"Bearer " + KEY.encode(), b"Bearer " + OTHER.encode()
    assert call(guard, "/pause", auth=auth_old)[0] == 200
    assert call(guard, "/pause", auth=auth_new)[0] == 401
    tmp = tmp_path / "keys.new"
    tmp.write_text(f"{KEY}\n{OTHER}\n")
    tmp.replace(path)  # as a Secret volume or an editor's save does
    assert call(guard, "/pause", auth=auth_new)[0] == 200
    path.write_text(OTHER + "\n")  # rewritten in place: the old key revoked
    assert call(guard, "/pause", auth=auth_old)[0] == 401
    assert call(guard, "/pause", auth=auth_new)[0] == 200
    path.unlink()  # no file: nobody
    assert call(guard, "/pause", auth=auth_new)[0] == 401
    assert call(guard, "/health", "GET")[0] == 200


# -- the keys and the clients -----------------------------------------------------------------

def test_engine_keys_are_private_and_kept(tmp_path: Path) -> None:
    keys = EngineKeys.ensure(tmp_path / "engine")
    mode = stat.S_IMODE
    assert mode(os.stat(keys.folder).st_mode) == 0o700
    for f in (keys.keys_file, keys.api_key_file, keys.judge_key_file):
        assert mode(os.stat(f).st_mode) == 0o600, f
    accepted = engine_guard.read_keys(keys.keys_file)
    judge = engine_guard.read_keys(keys.judge_key_file)[0]
    assert accepted == [keys.api_key, judge] and keys.api_key != judge
    assert len(keys.api_key) >= 32
    again = EngineKeys.ensure(tmp_path / "engine")
    assert again.api_key == keys.api_key and engine_guard.read_keys(again.keys_file) == accepted
    adopted = EngineKeys.ensure(tmp_path / "engine", api_key=KEY)  # an external engine's key
    assert adopted.api_key == KEY
    assert engine_guard.read_keys(adopted.keys_file) == [KEY, judge]
    with pytest.raises(GuardError):
        EngineKeys.ensure(tmp_path / "engine", api_key="short")


def test_client_key_from_env_and_rotation(tmp_path: Path) -> None:
    assert not ClientKey.from_env({})
    assert ClientKey.from_env({"HARNESSRL_ENGINE_API_KEY": KEY}).headers() == {
        "Authorization": f"Bearer {KEY}"}
    with pytest.raises(GuardError):
        ClientKey.from_env({"HARNESSRL_ENGINE_API_KEY_FILE": str(tmp_path / "missing")})
    for bad in ("short", KEY + "\r\nX-Injected: 1"):  # it goes into a header line
        with pytest.raises(GuardError):
            ClientKey.from_env({"HARNESSRL_ENGINE_API_KEY": bad})
    path = tmp_path / "api.key"
    path.write_text(KEY + "\n")
    key = ClientKey.from_env({"HARNESSRL_ENGINE_API_KEY_FILE": str(path),
                              "HARNESSRL_ENGINE_API_KEY": OTHER})  # the file wins
    assert key.file is not None
    key.file.recheck_s = 0.0
    assert key.value() == KEY
    path.write_text(OTHER + "\n")
    assert key.value() == OTHER
    path.unlink()  # mid-rotation: the last key is still sent
    assert key.value() == OTHER
    judge = ClientKey.from_env({"HARNESSRL_JUDGE_API_KEY": KEY}, name="HARNESSRL_JUDGE_API_KEY")
    req = judge(httpx.Request("POST", "http://x/v1/chat/completions"))
    assert req.headers["Authorization"] == f"Bearer {KEY}"


def test_gateway_upstream_pool_sends_the_key(tmp_path: Path) -> None:
    """The gateway's own HTTP client (services/gateway/upstream.py) puts the key in each request;
    a rotated client key file is sent from the next request on."""
    from services.gateway.upstream import UpstreamPool

    path = tmp_path / "api.key"
    path.write_text(KEY + "\n")
    seen: list[bytes] = []

    async def main() -> list[int]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                seen.append(head)
                ok = b"Authorization: Bearer " + KEY.encode() + b"\r\n" in head
                body = b"{}"
                writer.write(b"HTTP/1.1 %d X\r\nContent-Length: 2\r\n\r\n" % (200 if ok else 401)
                             + body)
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        key = ClientKey(path=path, recheck_s=0.0)
        pool = UpstreamPool(f"http://127.0.0.1:{port}", key=key)
        statuses = [(await pool.post("/v1/completions", b"{}", 5))[0]]
        path.write_text(OTHER + "\n")
        statuses.append((await pool.post("/v1/completions", b"{}", 5))[0])
        pool.close()
        server.close()
        return statuses

    assert asyncio.run(main()) == [200, 401]
    assert b"Authorization: Bearer " + OTHER.encode() in seen[1]


def test_gateway_sends_its_key_to_a_guarded_engine(tmp_path: Path, store_service: Any) -> None:
    """The gateway process with its key file ($HARNESSRL_ENGINE_API_KEY_FILE): its harnesses'
    calls are served by an engine behind the guard (the stub, wrapped as vLLM wraps itself);
    a gateway with a key the engine does not hold answers 502 (not the engine's 401: the
    harness's own key is fine) and logs why. Each gateway is its own replica set: in one set
    the wrong-keyed one would forward its rollout's call to the right-keyed owner."""
    from conftest import TEST_SECRET, running_rollout
    from harnessrl import procs
    from harnessrl.clients import StoreClient

    keys = EngineKeys.ensure(tmp_path / "keys")
    stub, info = procs.start_service(
        "stub", "harnessrl.testing.stub_engine",
        ["--model", "tiny", "--middleware", engine_guard.MIDDLEWARE], tmp_path / "stub",
        env={"HARNESSRL_ENGINE_KEYS_FILE": str(keys.keys_file)}, timeout=30)
    engine = f"http://127.0.0.1:{info['http_port']}"
    wrong = tmp_path / "wrong.key"
    wrong.write_text(OTHER + "\n")
    store = StoreClient.connect(store_service.address)
    gateways = []
    try:
        assert httpx.post(engine + "/v1/completions", json={}).status_code == 401
        for name, key_file in (("right", keys.api_key_file), ("wrong", wrong)):
            gw, ginfo = procs.start_service(
                "gateway", "services.gateway",
                ["--http-port", "0", "--grpc-bind", "127.0.0.1:0", "--store-address",
                 store_service.address, "--replica-namespace", f"guard-{name}",
                 "--engines", json.dumps([{"name": "e0", "base_url": engine, "model": "tiny"}])],
                tmp_path / name, env={"HARNESSRL_GATEWAY_SECRET": TEST_SECRET,
                                      "HARNESSRL_ENGINE_API_KEY_FILE": str(key_file)},
                timeout=30)
            gateways.append(gw)
            _, token = running_rollout(store)
            r = httpx.post(f"http://127.0.0.1:{ginfo['http_port']}/v1/chat/completions",
                           headers={"Authorization": f"Bearer {token}"}, timeout=30, json={
                               "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
            if name == "right":
                assert r.status_code == 200, r.text
            else:
                assert r.status_code == 502 and "refused the gateway" in r.text, r.text
                assert "refuses the gateway's engine key" in gw.log_path.read_text()
    finally:
        for gw in gateways:
            gw.stop()
        stub.stop()
        store.close()


# -- in front of the real vLLM ---------------------------------------------------------------

GUARDED: list[tuple[str, str, Any]] = [  # (method, path, body): what a rollout must not reach
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "hi"}),
    ("POST", "/pause", None), ("POST", "/resume", None), ("GET", "/is_paused", None),
    ("POST", "/sleep", None), ("POST", "/wake_up", None), ("GET", "/is_sleeping", None),
    ("POST", "/init_weight_transfer_engine", {"init_info": {}}),
    ("POST", "/start_weight_update", {}), ("POST", "/update_weights", {"update_info": {}}),
    ("POST", "/finish_weight_update", {}),
    ("POST", "/update_weight_version", {"new_version": "planted"}),
    ("GET", "/weight_info", None),
    ("POST", "/collective_rpc", {"method": "reload_weights"}),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
    ("GET", "/metrics", None), ("GET", "/openapi.json", None), ("GET", "/docs", None),
    ("POST", "/health", None), ("GET", "/health/", None), ("GET", "/server_info", None),
]


def _req(engine: Any, method: str, path: str, body: Any = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.request(method, engine.base_url + path, json=body, headers=headers,
                         timeout=60)


@pytest.mark.vllm
def test_vllm_answers_only_with_the_key(vllm_engine: Any, tmp_path: Path) -> None:
    assert vllm_engine.keys is not None
    assert "--middleware" in vllm_engine.argv
    for name, headers in (("no key", None), ("wrong key", {"Authorization": f"Bearer {OTHER}"}),
                          ("key as x-api-key", {"x-api-key": vllm_engine.api_key}),
                          ("a prefix of the key", {"Authorization": "Bearer " +
                                                vllm_engine.api_key[:-1]})):
        for method, path, body in GUARDED:
            r = _req(vllm_engine, method, path, body, headers)
            assert r.status_code == 401, f"{name}: {method} {path} -> {r.status_code} {r.text}"
        ws = httpx.get(vllm_engine.base_url + "/v1/realtime", headers={
            **(headers or {}), "Connection": "Upgrade", "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
        assert ws.status_code in (401, 403, 404), ws.status_code  # never 101
    for path in ("/health", "/ping"):
        assert _req(vllm_engine, "GET", path).status_code == 200, path

    key = vllm_engine.headers
    chat = _req(vllm_engine, "POST", "/v1/chat/completions", {
        "model": vllm_engine.model_name, "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3}, key)
    assert chat.status_code == 200 and chat.json()["choices"], chat.text
    tok = _req(vllm_engine, "POST", "/tokenize", {"model": vllm_engine.model_name,
                                                 "prompt": "hi"}, key)
    assert tok.status_code == 200 and tok.json()["tokens"], tok.text
    for path in ("/pause", "/resume", "/sleep", "/wake_up"):
        r = _req(vllm_engine, "POST", path, None, key)
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text}"
    assert _req(vllm_engine, "GET", "/is_paused", None, key).json() == {"is_paused": False}
    assert _req(vllm_engine, "GET", "/is_sleeping", None, key).json() == {"is_sleeping": False}
    # routes this engine has no backend or LoRA for: vLLM itself answers, not the guard
    for method, path, body in GUARDED:
        if path in ("/pause", "/sleep", "/update_weight_version"):
            continue  # done above; not left paused / asleep / relabelled
        r = _req(vllm_engine, method, path, body, key)
        assert r.status_code != 401, f"with the key: {method} {path} -> 401 {r.text}"


@pytest.mark.vllm
def test_vllm_obeys_a_rotated_keys_file_without_a_restart(vllm_engine: Any) -> None:
    keys = vllm_engine.keys
    before = keys.keys_file.read_text()
    pid = vllm_engine.proc.pid
    new = {"Authorization": "Bearer rotated-" + "n" * 30}
    old = {"Authorization": f"Bearer {keys.api_key}"}

    def status(headers: dict[str, str]) -> int:
        return _req(vllm_engine, "GET", "/weight_info", None, headers).status_code

    try:
        assert status(new) == 401
        # step 1: the new key beside the old (the guard looks at the file once a second)
        keys.keys_file.write_text(before + new["Authorization"][7:] + "\n")
        time.sleep(engine_guard.RECHECK_S + 0.2)
        assert (status(old), status(new)) == (200, 200)
        keys.keys_file.write_text(new["Authorization"][7:] + "\n")  # step 3: the old removed
        time.sleep(engine_guard.RECHECK_S + 0.2)
        assert (status(old), status(new)) == (401, 200)
    finally:
        keys.keys_file.write_text(before)
    time.sleep(engine_guard.RECHECK_S + 0.2)
    assert (status(old), status(new)) == (200, 401)
    assert vllm_engine.proc.pid == pid and vllm_engine.alive


@pytest.mark.vllm
def test_the_judge_reaches_the_engine_with_its_own_key(vllm_engine: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The judge calls the engine directly (never through the gateway): refused without a key,
    served with the judge's own (the keys file's second line, HARNESSRL_JUDGE_API_KEY_FILE)."""
    from harnessrl.graders.judge import Judge, JudgeConfig, JudgeError

    cfg = JudgeConfig(base_url=vllm_engine.openai_base_url, model=vllm_engine.model_name,
                      max_tokens=16, retries=0, timeout_s=120)
    messages = [{"role": "user", "content": "Score the attempt."}]
    for var in ("HARNESSRL_JUDGE_API_KEY", "HARNESSRL_JUDGE_API_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(JudgeError, match="HTTP 401"):
        Judge(cfg)._ask(messages, 1)
    judge_key = vllm_engine.keys.judge_key_file
    assert engine_guard.read_keys(judge_key)[0] != vllm_engine.api_key
    monkeypatch.setenv("HARNESSRL_JUDGE_API_KEY_FILE", str(judge_key))
    _, usage = Judge(cfg)._ask(messages, 1)  # the model answered (its text may be anything)
    assert usage["prompt_tokens"] > 0


@pytest.mark.vllm
def test_a_local_stack_gives_the_key_to_the_gateway_and_the_judge_only(
        tmp_path: Path, redis_url: str, tiny_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`harnessrl up`'s wiring, with no engine key in this process's environment: the stack
    makes its own keys (private files), its engine refuses callers without them, the gateway
    sends its key (its weight check reads /weight_info; a harness's call through it is served),
    and the controller holds the judge's key, not the engine's."""
    import uuid

    from harnessrl.clients import GatewayAdminClient, StoreClient
    from conftest import running_rollout
    from harnessrl.credentials import load_secret
    from harnessrl.identity import Identity
    from harnessrl.local.stack import Stack, StackConfig

    session_key = ClientKey.from_env().value()  # conftest's, which the stack would adopt
    monkeypatch.delenv("HARNESSRL_ENGINE_API_KEY_FILE", raising=False)
    cfg = StackConfig(state_dir=tmp_path / "state", redis_url=redis_url,
                      key_prefix=f"eg{uuid.uuid4().hex[:6]}:", model_dir=tiny_model_dir,
                      served_model_name="tiny", weight_transfer_backend=None,
                      max_model_len=1024)
    with Stack(cfg) as stack:
        keys = EngineKeys(stack.engine_keys)
        assert stat.S_IMODE(os.stat(keys.keys_file).st_mode) == 0o600
        assert keys.api_key != session_key
        (engine,) = stack.engines
        assert engine.keys.keys_file == keys.keys_file
        for method, path, body in GUARDED:
            assert _req(engine, method, path, body).status_code == 401, path

        def environ(name: str) -> dict[str, str]:
            proc = stack.procs[name].proc
            assert proc is not None
            raw = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            return dict(x.decode().split("=", 1) for x in raw if b"=" in x)

        assert environ("gateway")["HARNESSRL_ENGINE_API_KEY_FILE"] == str(keys.api_key_file)
        ctl = environ("controller")
        assert ctl["HARNESSRL_JUDGE_API_KEY_FILE"] == str(keys.judge_key_file)
        assert not any(k.startswith("HARNESSRL_ENGINE_") for k in ctl)
        assert stack.engine_env("trainer") == {
            "HARNESSRL_ENGINE_API_KEY_FILE": str(keys.api_key_file)}

        admin = GatewayAdminClient.connect(stack.gateway_admin_address,
                                           ident=Identity.from_folder(stack.tls / "operator"))
        deadline = time.monotonic() + 60
        while not admin.list_engines().engines[0].weight_version:  # read with the key
            assert time.monotonic() < deadline, "the gateway never read /weight_info"
            time.sleep(0.5)

        store = StoreClient.connect(stack.store_address,
                                    ident=Identity.from_folder(stack.tls / "controller"))
        rid, token = running_rollout(store, load_secret(None, stack.secret_file))
        r = httpx.post(stack.gateway_url + "/chat/completions", timeout=120, headers={
            "Authorization": f"Bearer {token}"}, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert "refuses the gateway" not in stack.procs["gateway"].log_path.read_text()
