"""The adapters the front end has accepted: each ``LoRARequest`` is checked once, in the caller's thread, against
the model (files, rank, target modules, shapes: the config and the safetensors header, no weights read), so a bad
adapter fails its request before anything is queued and the engine never sees it."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ember.config import ModelShape
from ember.errors import BadRequestError
from ember.lora.adapter import inspect_adapter
from ember.lora.request import LoRARequest
from ember.protocol import ModelInfo


class Adapters:
    def __init__(self, info: ModelInfo, shape: Callable[[], ModelShape]) -> None:
        self.info = info
        self._read_shape = shape  # read from the checkpoint's config when the first adapter is checked
        self._shape: ModelShape | None = None
        self._known: dict[int, LoRARequest] = {}
        # removed ones: an id keeps naming its adapter (it keys the adapter's prefix-cache entries, which outlive it)
        self._retired: dict[int, LoRARequest] = {}
        self._lock = threading.Lock()

    def check(self, lora: object) -> LoRARequest:
        """The request's adapter, accepted; BadRequestError names what is wrong with it."""
        if not isinstance(lora, LoRARequest):
            raise BadRequestError(f"lora_request of type {type(lora).__name__} is not supported: pass a "
                                  "LoRARequest(lora_name, lora_int_id, lora_path) or None")
        if not self.info.max_loras:
            raise BadRequestError(f"lora_request={lora.lora_name!r} needs an engine started with enable_lora=True "
                                  "(and max_loras / max_lora_rank to fit the adapters)")
        with self._lock:
            known = self._known.get(lora.lora_int_id) or self._retired.get(lora.lora_int_id)
            if known is not None and (known.lora_name, known.lora_path) != (lora.lora_name, lora.lora_path):
                was = "was" if lora.lora_int_id in self._retired else "is already"
                raise BadRequestError(f"lora_int_id={lora.lora_int_id} {was} the adapter {known.lora_name!r} at "
                                      f"{known.lora_path}: each adapter needs its own id, for the engine's life")
            if lora.lora_int_id in self._known:
                return known
            if self._shape is None:
                self._shape = self._read_shape()
            inspect_adapter(lora.lora_path, self._shape, self.info.max_lora_rank)
            self._known[lora.lora_int_id] = lora
            self._retired.pop(lora.lora_int_id, None)
            return lora

    def remove(self, lora_id: int) -> bool:
        with self._lock:
            lora = self._known.pop(lora_id, None)
            if lora is not None:
                self._retired[lora_id] = lora
            return lora is not None

    def list(self) -> list[LoRARequest]:
        with self._lock:
            return sorted(self._known.values(), key=lambda r: r.lora_int_id)
