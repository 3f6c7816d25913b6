"""Who may call what: the one table of per-RPC authorization, and the interceptor that applies it.

Every harnessrl gRPC server (harnessrl/rpc.py `start_server`) runs `Authorize`. A caller's
identity is the common name of its client certificate (mTLS, harnessrl/identity.py); a call
with no verified certificate is UNAUTHENTICATED, a call its identity may not make is
PERMISSION_DENIED naming the identity and the RPC, and both are counted in
`harnessrl_rpc_refused_total{service, method, identity, code}`.

`RULES` below is the table docs/security.md shows. `grader` is the identity the controller
hands its graders (and the judge): it may call nothing by itself; each call must carry a scope
token (`x-harnessrl-scope` metadata) that the controller signed with its own key, naming the
run, group and rollouts of that grader, and the call must stay inside it (`SCOPED`).
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client import Counter

from harnessrl.identity import SCOPE_METADATA, Identity, common_name

log = logging.getLogger(__name__)

REFUSED = Counter("harnessrl_rpc_refused", "gRPC calls refused by authentication or "
                  "authorization", ["service", "method", "identity", "code"])

CONTROLLER, GATEWAY, TRAINER = "controller", "gateway", "trainer"
OPERATOR, READER, GRADER, ADMIN = "operator", "reader", "grader", "admin"
VIEW = (OPERATOR, READER)  # get, list and watch

# Full method name -> identities allowed (ADMIN is allowed everything, see `allowed`).
RULES: dict[str, tuple[str, ...]] = {
    # Store: rollouts and attempts are the controller's, calls and gateway state the gateway's,
    # completed groups the trainer's. The gateway reads a rollout and its run when it first
    # sees a key (services/gateway/sessions.py: the running attempt, next seq, model, sampling).
    "/harnessrl.v1.Store/PutRun": (CONTROLLER,),
    "/harnessrl.v1.Store/GetRun": (CONTROLLER, GATEWAY, TRAINER, *VIEW),
    "/harnessrl.v1.Store/ListRuns": (CONTROLLER, TRAINER, *VIEW),
    "/harnessrl.v1.Store/CreateRollouts": (CONTROLLER,),
    "/harnessrl.v1.Store/StartAttempt": (CONTROLLER,),
    "/harnessrl.v1.Store/AppendCalls": (GATEWAY,),
    "/harnessrl.v1.Store/RecordCalls": (GATEWAY,),
    "/harnessrl.v1.Store/ReportReward": (GATEWAY,),
    "/harnessrl.v1.Store/GetGatewayState": (GATEWAY,),
    "/harnessrl.v1.Store/FinishAttempt": (CONTROLLER,),
    "/harnessrl.v1.Store/SetGroupRewards": (CONTROLLER,),
    "/harnessrl.v1.Store/GetRollout": (CONTROLLER, GATEWAY, TRAINER, *VIEW, GRADER),
    "/harnessrl.v1.Store/ListRollouts": (CONTROLLER, TRAINER, *VIEW, GRADER),
    "/harnessrl.v1.Store/ReadGroups": (TRAINER,),
    "/harnessrl.v1.Store/AckGroups": (TRAINER,),
    "/harnessrl.v1.Store/NackGroups": (TRAINER,),
    "/harnessrl.v1.Store/ListDeadLetters": (TRAINER, *VIEW),
    "/harnessrl.v1.Store/TrimGroups": (TRAINER, OPERATOR),
    "/harnessrl.v1.Store/PutState": (GATEWAY, GRADER),
    "/harnessrl.v1.Store/DeleteState": (GATEWAY,),
    "/harnessrl.v1.Store/GetState": (GATEWAY, *VIEW, GRADER),
    "/harnessrl.v1.Store/ListState": (GATEWAY, *VIEW),
    # Images of recorded calls (content-addressed): the gateway stores them, the trainer reads
    # them back to rebuild prompts (and may store those it makes itself); a rollout reaches no
    # RPC at all, and graders and the controller have no use for pixels.
    "/harnessrl.v1.Store/PutImages": (GATEWAY, TRAINER),
    "/harnessrl.v1.Store/GetImages": (GATEWAY, TRAINER, *VIEW),
    # Controller: runs are started by the trainer (training, eval) or the operator (eval).
    "/harnessrl.v1.Controller/CreateRun": (TRAINER, OPERATOR),
    "/harnessrl.v1.Controller/GetRun": (TRAINER, *VIEW),
    "/harnessrl.v1.Controller/ListRunRollouts": (TRAINER, *VIEW),
    "/harnessrl.v1.Controller/CancelRun": (TRAINER, OPERATOR),
    "/harnessrl.v1.Controller/WatchRun": (TRAINER, *VIEW),
    "/harnessrl.v1.Controller/AdmissionUpdate": (TRAINER,),
    # Gateway admin: engines are the trainer's and the operator's (a stack's supervisor
    # registers the engine it restarts); pauses and adapters the trainer's; Sync is between
    # gateway replicas.
    "/harnessrl.v1.GatewayAdmin/RegisterEngine": (TRAINER, OPERATOR),
    "/harnessrl.v1.GatewayAdmin/RemoveEngine": (TRAINER, OPERATOR),
    "/harnessrl.v1.GatewayAdmin/ListEngines": (GATEWAY, TRAINER, *VIEW),
    "/harnessrl.v1.GatewayAdmin/UpdateEngine": (TRAINER, OPERATOR),
    "/harnessrl.v1.GatewayAdmin/Pause": (TRAINER,),
    "/harnessrl.v1.GatewayAdmin/Resume": (TRAINER,),
    "/harnessrl.v1.GatewayAdmin/SetAdapter": (TRAINER,),
    "/harnessrl.v1.GatewayAdmin/RemoveAdapter": (TRAINER,),
    "/harnessrl.v1.GatewayAdmin/Sync": (GATEWAY,),
    # Trainer: the operator's.
    "/harnessrl.v1.Trainer/GetStatus": (OPERATOR, READER),
    "/harnessrl.v1.Trainer/CheckpointNow": (OPERATOR,),
    "/harnessrl.v1.Trainer/Stop": (OPERATOR,),
}
# Health and reflection: any identity the CA issued (probes run with the service's own).
OPEN_TO_ANY = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
               "/grpc.reflection.v1.ServerReflection/")


@dataclass(frozen=True)
class Scope:
    """What one grader may read: its run's judge cache, its group, its rollouts."""

    run_id: str
    group_id: str
    rollout_ids: tuple[str, ...]
    expires_at: float


# A scoped call's request -> whether it stays inside the scope.
SCOPED: dict[str, Callable[[Any, Scope], bool]] = {
    "/harnessrl.v1.Store/GetRollout": lambda r, s: r.rollout_id in s.rollout_ids,
    "/harnessrl.v1.Store/ListRollouts": lambda r, s: bool(s.group_id) and (
        r.group_id == s.group_id and r.run_id in ("", s.run_id)),
    "/harnessrl.v1.Store/GetState": lambda r, s: r.namespace == judge_namespace(s.run_id),
    "/harnessrl.v1.Store/PutState": lambda r, s: r.namespace == judge_namespace(s.run_id),
}


def judge_namespace(run_id: str) -> str:
    """The store state namespace of a run's judge cache (harnessrl/graders/judge.py)."""
    return f"judge:{run_id or 'default'}"[:256]


def allowed(identity: str, method: str) -> bool:
    """Whether `identity` may call `method` (a full method name) by the table."""
    if identity == ADMIN or method.startswith(OPEN_TO_ANY):
        return bool(identity)
    return identity in RULES.get(method, ())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def mint_scope(controller: Identity, run_id: str, group_id: str, rollout_ids: list[str],
               ttl_s: float) -> str:
    """A scope token signed with the controller's key: `<payload>.<signature>.<certificate>`,
    each base64url; the certificate lets any service check it against the CA."""
    key = serialization.load_pem_private_key(controller.key, None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("scope tokens are signed with an EC key (harnessrl.pki issues them)")
    payload = json.dumps({"run": run_id, "group": group_id, "rollouts": rollout_ids,
                          "exp": round(time.time() + ttl_s, 3)}, separators=(",", ":")).encode()
    cert = x509.load_pem_x509_certificate(controller.cert).public_bytes(
        serialization.Encoding.DER)
    sig = key.sign(payload, ec.ECDSA(hashes.SHA256()))
    return ".".join((_b64(payload), _b64(sig), _b64(cert)))


class ScopeError(ValueError):
    pass


def _issued_by_any(cert: x509.Certificate, ca_pem: bytes) -> bool:
    """Whether one of the CA certificates in `ca_pem` (a bundle while a CA is rolled over)
    signed `cert`."""
    for ca in x509.load_pem_x509_certificates(ca_pem):
        try:
            cert.verify_directly_issued_by(ca)
            return True
        except (ValueError, TypeError, InvalidSignature):
            continue
    return False


def verify_scope(token: str, ca_pem: bytes, now: float | None = None) -> Scope:
    """The scope a token grants; ScopeError says why it grants none."""
    try:
        payload_b, sig, cert_der = (_unb64(p) for p in token.split("."))
        cert = x509.load_der_x509_certificate(cert_der)
    except (ValueError, TypeError) as exc:
        raise ScopeError(f"scope token does not parse: {type(exc).__name__}") from exc
    if not _issued_by_any(cert, ca_pem):
        raise ScopeError("scope token's certificate is not from this deployment's CA")
    cn = common_name(cert.public_bytes(serialization.Encoding.PEM))
    if cn != CONTROLLER:
        raise ScopeError(f"scope token signed by {cn!r}, not the controller")
    t = time.time() if now is None else now
    if not cert.not_valid_before_utc.timestamp() <= t <= cert.not_valid_after_utc.timestamp():
        raise ScopeError("scope token's signing certificate is not valid now")
    pub = cert.public_key()
    try:
        assert isinstance(pub, ec.EllipticCurvePublicKey)
        pub.verify(sig, payload_b, ec.ECDSA(hashes.SHA256()))
        p = json.loads(payload_b)
        scope = Scope(str(p["run"]), str(p["group"]), tuple(map(str, p["rollouts"])),
                      float(p["exp"]))
    except (AssertionError, InvalidSignature, ValueError, KeyError, TypeError) as exc:
        raise ScopeError(f"scope token does not verify: {type(exc).__name__}") from exc
    if scope.expires_at < t:
        raise ScopeError("scope token expired")
    return scope


class _Refusal(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class Authorize(grpc.aio.ServerInterceptor):
    """Applies `RULES` (and `SCOPED` for graders) to every call of a server whose peers are
    authenticated by mTLS with the CA in `ca_pem`. `ca_file`: where that CA is kept (an
    identity folder's ca.crt): a scope token from a CA the server does not know yet is checked
    again against the file, so a CA rolled over (a bundle of old and new) counts for tokens as
    it does for TLS, without a restart."""

    def __init__(self, ca_pem: bytes, ca_file: Path | None = None) -> None:
        self.ca_pem = ca_pem
        self.ca_file = ca_file
        self._scopes: dict[str, Scope] = {}
        # method -> (the handler it wrapped, the wrapper): built once per method, not per call
        # (the wrapper checks every call itself; bench/gateway_overhead.py --auth-only)
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def _identity(self, context: Any) -> str:
        names = context.auth_context().get("x509_common_name") or []
        return names[0].decode() if names else ""

    def _scope(self, metadata: Any) -> Scope:
        token = dict(metadata or ()).get(SCOPE_METADATA, "")
        if not token:
            raise ScopeError("no scope token")
        scope = self._scopes.get(token)
        if scope is None or scope.expires_at < time.time():
            try:
                scope = verify_scope(token, self.ca_pem)
            except ScopeError:
                if not self._reload_ca():
                    raise
                scope = verify_scope(token, self.ca_pem)
            if len(self._scopes) > 4096:
                self._scopes.clear()
            self._scopes[token] = scope
        return scope

    def _reload_ca(self) -> bool:
        """Reads the CA file again; whether it changed (a file that does not load, such as
        one half-written, is skipped: the CA in use stays)."""
        try:
            ca = self.ca_file.read_bytes() if self.ca_file is not None else self.ca_pem
            x509.load_pem_x509_certificates(ca)
        except (OSError, ValueError):
            return False
        changed, self.ca_pem = ca != self.ca_pem, ca
        return changed

    def check(self, method: str, context: Any, request: Any) -> None:
        identity = self._identity(context)
        if not identity:
            raise _Refusal(grpc.StatusCode.UNAUTHENTICATED,
                           f"{method}: no client certificate from this deployment's CA")
        if not allowed(identity, method):
            raise _Refusal(grpc.StatusCode.PERMISSION_DENIED,
                           f"identity {identity!r} may not call {method}")
        if identity == GRADER and method in SCOPED:
            try:
                scope = self._scope(context.invocation_metadata())
            except ScopeError as exc:
                raise _Refusal(grpc.StatusCode.PERMISSION_DENIED,
                               f"identity {identity!r} may not call {method}: {exc}") from exc
            try:
                inside = SCOPED[method](request, scope)
            except AttributeError:  # a request that did not parse
                inside = False
            if not inside:
                raise _Refusal(grpc.StatusCode.PERMISSION_DENIED,
                               f"identity {identity!r} may not call {method} outside its "
                               f"scope (run {scope.run_id}, group {scope.group_id})")

    async def _refuse(self, method: str, context: Any, r: _Refusal) -> None:
        service, _, name = method.strip("/").rpartition("/")
        REFUSED.labels(service, name, self._identity(context) or "-", r.code.name).inc()
        log.warning("refused: %s", r.message)
        await context.abort(r.code, r.message)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(method, handler)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    async def _admit(self, method: str, context: Any, request: Any) -> None:
        """Returns when the call may go on; otherwise aborts it with its refusal."""
        try:
            self.check(method, context, request)
        except _Refusal as r:
            await self._refuse(method, context, r)

    def _wrap(self, method: str, handler: Any) -> Any:
        """`handler` with `check` before every call of `method`."""
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def uu(request: Any, context: Any) -> Any:
                await self._admit(method, context, request)
                return await inner_uu(request, context)
            return grpc.unary_unary_rpc_method_handler(uu, **kw)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def us(request: Any, context: Any) -> Any:
                await self._admit(method, context, request)
                async for item in inner_us(request, context):
                    yield item
            return grpc.unary_stream_rpc_method_handler(us, **kw)
        if method in SCOPED:
            raise RuntimeError(f"{method}: scoped RPCs must be unary requests")
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def su(requests: Any, context: Any) -> Any:
                await self._admit(method, context, None)
                return await inner_su(requests, context)
            return grpc.stream_unary_rpc_method_handler(su, **kw)
        inner_ss = handler.stream_stream

        async def ss(requests: Any, context: Any) -> Any:
            await self._admit(method, context, None)
            async for item in inner_ss(requests, context):
                yield item
        return grpc.stream_stream_rpc_method_handler(ss, **kw)
