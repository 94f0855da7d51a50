"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the matching status, for
every failure the server answers (bad bodies, ember's own ``BadRequestError``, unknown routes, overload)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ember.errors import BadRequestError, DoesNotFitError, EngineDeadError, RequestFailedError
from ember.server.protocol import UNSUPPORTED

# the OpenAI error type of each status
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error", 500: "server_error"}


class APIError(Exception):
    """An answer other than 200; ``headers`` carries e.g. Retry-After."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)")


def from_engine(e: Exception, prompt_field: str) -> APIError:
    """ember's errors as answers: its messages start with the field they are about (``temperature=nan is ...``,
    ``prompt has 9000 tokens ...``); the prompt is called ``prompt_field`` in this API (messages or prompt)."""
    if isinstance(e, EngineDeadError):
        return APIError(503, f"the engine has stopped: {e}", code="engine_dead")
    if isinstance(e, RequestFailedError):  # the server's files, not the request, were at fault; a retry may work
        return APIError(503, "the request could not be run: its LoRA adapter's files could not be read (the "
                        "server's log says why)", code="request_failed")
    m = _FIELD.match(str(e))
    param = m.group(1) if m else None
    if param in ("prompt", "prompts"):
        param = prompt_field
    code = "context_length_exceeded" if isinstance(e, DoesNotFitError) or "tokens: prompt length" in str(e) else None
    return APIError(400, str(e), param=param, code=code)


def is_engine_error(e: BaseException) -> bool:
    return isinstance(e, (BadRequestError, DoesNotFitError, EngineDeadError, RequestFailedError))


@contextmanager
def engine_errors(prompt_field: str) -> Iterator[None]:
    """ember's own errors raised inside become answers (400, or 503 for a stopped engine)."""
    try:
        yield
    except (BadRequestError, DoesNotFitError, EngineDeadError, RequestFailedError) as e:
        raise from_engine(e, prompt_field) from None


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def from_validation(errors: list[dict[str, Any]]) -> APIError:
    """pydantic's complaint about a body as a 400 that names the field (dotted path): the deepest one, since a
    value that fits no member of a union gets one complaint per member and the deepest says what is wrong with the
    one it nearly was; the members' type names are left out of the path."""
    if not errors:
        return APIError(400, "the request body is not valid")
    err = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and str(p) not in _TYPE_NAMES and "[" not in str(p)]
    field = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}",
                        code="invalid_json")
    if kind == "missing":
        return APIError(400, f"{field or 'a JSON body'} is required", param=field, code="missing_field")
    if kind == "extra_forbidden" or (loc and loc[-1] in UNSUPPORTED and kind == "none_required"):
        name = loc[-1] if loc else field
        why = "not supported by ember's server" if name in UNSUPPORTED else "not a known field"
        return APIError(400, f"{field} is {why}", param=field, code="unsupported_field")
    value = err.get("input")
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    where = f"{field}={shown}" if field else f"the body {shown}"
    return APIError(400, f"{where}: {err.get('msg', 'invalid value')}", param=field, code="invalid_value")
