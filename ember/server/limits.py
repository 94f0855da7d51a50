"""ASGI middlewares that guard the server before a route runs: the API key and the body size.

Both answer with OpenAI error objects. The key is compared in constant time (``hmac.compare_digest``), so its
bytes cannot be guessed from response times. The body is read (up to the limit) before the app sees it, so an
oversized or endless body costs at most the limit in memory and is answered 413.
"""

from __future__ import annotations

import hmac

from ember.server.errors import APIError

# routes anyone may reach: the chat page asks for the key itself; health and metrics are for the operator's probes
OPEN_PATHS = ("/", "/health", "/metrics", "/favicon.ico")
OPEN_PREFIXES = ("/static/",)


async def _send_error(send, e: APIError) -> None:
    body = e.json_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or _open(scope["path"]):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            return await _send_error(send, APIError(
                401, "Incorrect or missing API key: send it as `Authorization: Bearer KEY`", code="invalid_api_key"))
        await self.app(scope, receive, send)


def _open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = APIError(413, f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)",
                             code="request_too_large")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, too_large)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await _send_error(send, too_large)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():  # the whole body once, then the connection's own messages (disconnect)
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
