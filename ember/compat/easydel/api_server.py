"""EasyDeL's ``vSurgeApiServer`` on ember: the surges' engines served by ember's OpenAI-compatible server
(ember.server: chat and text completions, streaming, /v1/models, /health, /metrics, the chat page), one engine per
surge, a request's ``model`` naming its surge. Tool calling (EasyDeL's function-calling parsers) is not served:
``tools`` in a request is refused by name, as ``ember serve`` does."""

from __future__ import annotations

from typing import Any

from ember.compat.easydel.surge import vSurge
from ember.server.app import ServedModel, ServerSettings
from ember.server.launch import run_app


class vSurgeApiServer:  # noqa: N801  (EasyDeL's name)
    def __init__(self, vsurge_map: dict[str, vSurge] | vSurge, oai_like_processor: bool = True,
                 enable_function_calling: bool = True, tool_parser_name: str = "hermes", max_workers: int | None = None,
                 enable_cors: bool = True, cors_origins: list[str] | None = None,
                 max_request_size: int = 10 * 1024 * 1024, request_timeout: float = 300.0,
                 default_function_format: Any = None, **kwargs: Any) -> None:
        """vsurge_map: one vSurge (served as its vsurge_name) or {model name: vSurge}. Each surge is started when it
        was not. CORS (on by default, as EasyDeL) allows cors_origins, or every origin when None."""
        if kwargs:
            raise TypeError(f"vSurgeApiServer() got arguments ember does not know: {', '.join(sorted(kwargs))}")
        if isinstance(vsurge_map, vSurge):
            vsurge_map = {vsurge_map.vsurge_name: vsurge_map}
        if not isinstance(vsurge_map, dict) or not vsurge_map:
            raise TypeError("vsurge_map must be a vSurge or a non-empty dict of model name -> vSurge")
        for name, surge in vsurge_map.items():
            if not isinstance(surge, vSurge):
                raise TypeError(f"Value for key '{name}' must be an instance of vSurge")
        if isinstance(max_request_size, bool) or not isinstance(max_request_size, int) or max_request_size < 1:
            raise ValueError(f"max_request_size={max_request_size!r} is out of range: it must be an integer >= 1")
        self.vsurge_map = vsurge_map
        self.oai_like_processor = oai_like_processor  # ember renders chats with each model's own chat template
        self.enable_function_calling = enable_function_calling
        self.tool_parser_name = tool_parser_name
        # accepted: ember's server is one event loop (no worker threads), and a request runs until it ends or its
        # client leaves
        self.max_workers, self.request_timeout = max_workers, request_timeout
        self.default_function_format = default_function_format
        origins = tuple(cors_origins) if cors_origins else ("*",)
        self.settings = ServerSettings(max_request_bytes=max_request_size,
                                       allowed_origins=origins if enable_cors else ())

    def run(self, host: str = "0.0.0.0", port: int = 11556, workers: int = 1, log_level: str = "info",
            ssl_keyfile: str | None = None, ssl_certfile: str | None = None, reload: bool = False) -> None:
        """Serve until SIGINT / SIGTERM (requests in flight end with finish_reason "abort"); the surges stay
        started. One process (workers=1): every engine lives in it."""
        if workers != 1 or reload:
            raise ValueError(f"workers={workers}, reload={reload} is not supported: the engines live in this process; "
                             "use workers=1, reload=False")
        if ssl_keyfile or ssl_certfile:
            raise ValueError("ssl_keyfile / ssl_certfile are not supported: put a TLS proxy in front of the server")
        models = []
        for name, surge in self.vsurge_map.items():
            surge.start()
            models.append(ServedModel((name,), surge.client))
        run_app(models, self.settings, host, port, log_level=log_level)

    fire = run
