"""One harness request on its way to being a recorded call (`Exchange`), and the errors the
data plane answers with, in each API's shape (`HTTPError`: OpenAI's; `anthropic_error`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from harnessrl.errors import HarnessRLError, Unauthenticated, Unavailable
from services.gateway import responses, sampling
from services.gateway.sessions import Session
from services.gateway.streaming import Generated
from services.gateway.tokens import Plan

if TYPE_CHECKING:
    from services.gateway.images import RequestImages

log = logging.getLogger("harnessrl.gateway")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None,
                 raw: bytes | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.raw, self.param = raw, param  # raw: the engine's own error body, passed on as it is

    def body(self, style: str = "openai") -> bytes:
        if style == "anthropic":
            return anthropic_error(self.status, self.message)
        if self.raw is not None:
            return self.raw
        return orjson.dumps({"error": {"message": self.message, "type": self.type,
                                       "param": self.param, "code": self.code}})


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> bytes:
    """Anthropic's error shape."""
    kind = _ANTHROPIC_TYPES.get(status) or ("invalid_request_error" if status < 500
                                            else "api_error")
    return orjson.dumps({"type": "error", "error": {"type": kind, "message": message}})


def engine_refused(engine: str, status: int, raw: bytes) -> HTTPError:
    if status in (401, 403):  # the gateway's engine key, not the harness's: no 401 to it
        log.error("engine %s refuses the gateway's engine key (HARNESSRL_ENGINE_API_KEY_FILE)",
                  engine, extra={"engine": engine})
        return HTTPError(502, f"engine {engine} refused the gateway", "server_error",
                         "engine_error")
    try:
        message = str(orjson.loads(raw)["error"]["message"])
    except Exception:  # noqa: BLE001 - any body: reported as text
        message = raw[:500].decode("utf-8", "replace")
    return HTTPError(status, f"engine {engine}: {message}", "invalid_request_error"
                     if status < 500 else "server_error", "engine_error", raw=raw)


def bad_request(message: str, code: str = "invalid_request") -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", code)


def from_domain(exc: HarnessRLError) -> HTTPError:
    if isinstance(exc, Unauthenticated):
        return HTTPError(401, str(exc), "authentication_error", "invalid_api_key")
    if isinstance(exc, Unavailable):
        return HTTPError(503, str(exc), "service_unavailable", "unavailable")
    return HTTPError(500, str(exc), "server_error", "internal")


@dataclass(slots=True)
class Exchange:
    """One harness request on its way to being a recorded call."""

    session: Session
    api: str  # recorded as Call.api
    asked: str  # the model name the harness asked for (recorded as Call.model)
    model: str  # the served model it maps to (engines are chosen by it)
    request_json: bytes  # the harness's request body
    chat: bool  # engine route: chat completions (True) or completions
    forward: dict[str, Any]  # the engine request
    started: float = field(default_factory=time.time)
    override: bytes = b""  # the run's sampling policy as applied (Call.sampling_override_json)
    plan: Plan | None = None  # how a chat prompt's tokens were made (token in, token out)
    generated: Generated | None = None  # what the engine generated (set with `plan`)
    synced: bool = False  # its session's caches were read from the store for it already
    chain: responses.Chain | None = None  # Responses: what its response adds to the chain
    images: RequestImages | None = None  # its images, checked (None: it has none)

    def __post_init__(self) -> None:
        """Asks the engine for what the gateway records (the token ids; the sampled tokens'
        logprobs), then imposes the run's sampling policy on the engine request."""
        self.forward["return_token_ids"] = True
        if self.chat:
            self.forward["logprobs"] = True
        elif not isinstance(self.forward.get("logprobs"), int) or \
                isinstance(self.forward.get("logprobs"), bool):
            self.forward["logprobs"] = 0  # the sampled token's logprob only
        if self.session.sampling_problem:
            raise bad_request(self.session.sampling_problem, "unmatched_sampling")
        applied = sampling.impose(self.forward, self.session.sampling)
        if applied is not None:
            self.override = orjson.dumps(applied)


# Exchange.api -> the route it came in on
API_ROUTES = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions",
              "messages": "/v1/messages", "responses": "/v1/responses"}
