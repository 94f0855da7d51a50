"""DashInfer's enums and its exception, with DashInfer's names and values."""

from __future__ import annotations

from enum import Enum, IntEnum


class AsStatus(IntEnum):
    """Return code of the engine calls (values as in DashInfer's as_status.h)."""

    ALLSPARK_SUCCESS = 0
    ALLSPARK_UNKNOWN_ERROR = 1
    ALLSPARK_PARAM_ERROR = 2
    ALLSPARK_IO_ERROR = 3
    ALLSPARK_MEMORY_ERROR = 4
    ALLSPARK_RUNTIME_ERROR = 5
    ALLSPARK_EXCEED_LIMIT_ERROR = 7
    ALLSPARK_INVALID_CALL_ERROR = 8
    ALLSPARK_EMPTY_REQUEST = 9
    ALLSPARK_ILLEGAL_REQUEST_ID = 10
    ALLSPARK_CACHE_MEMORY_OUT = 11
    ALLSPARK_REQUEST_DENIED = 12
    ALLSPARK_LORA_NOT_LOADED = 13
    ALLSPARK_CHUNK_PREFILL = 14
    ALLSPARK_DEPRECATED = 20
    ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR = 21
    ALLSPARK_LORA_RANK_EXCEED_LIMIT_ERROR = 22
    ALLSPARK_LORA_NOT_FOUND = 23
    ALLSPARK_LORA_ALREADY_LOADED = 24
    ALLSPARK_LORA_IN_USE = 25
    ALLSPARK_STREAMING = 200
    # the name DashInfer's Python binding gives code 8 (a typo there): scripts written against it compare with it
    ALLSPARK_ALLSPARK_INVALID_CALL_ERROR = 8


class GenerateRequestStatus(IntEnum):
    """Where a request is: Init -> ContextFinished (prefill done, first token out) -> Generating ->
    GenerateFinished; or GenerateInterrupted (the engine gave it up: no KV memory, or its model was stopped) or
    InternalError (the engine failed)."""

    Init = 0
    ContextFinished = 1
    Generating = 2
    GenerateFinished = 3
    GenerateInterrupted = 4
    InternalError = 5

    @property
    def is_terminal(self) -> bool:
        return self >= GenerateRequestStatus.GenerateFinished


class AsCacheMode(IntEnum):
    """KV cache element type: the model's float, int8, or uint4 (ember's kv_cache_dtype 'auto' | 'int8' | 'uint4')."""

    AsCacheDefault = 0
    AsCacheQuantI8 = 1
    AsCacheQuantU4 = 2


class TargetDevice(Enum):
    """Where a model runs: CUDA, CPU, or CPU with NUMA awareness."""

    CUDA = "CUDA"
    CPU = "CPU"
    CPU_NUMA = "CPU_NUMA"


class RoPEScaleMethod(Enum):
    NO_SCALE = 0
    YaRN = 3
    NTK = 4


class ModelState(Enum):
    """A model's life in an Engine: install -> Initial, start -> Running, stop -> Stopped, release -> Released."""

    Initial = "Initial"
    Running = "Running"
    Stopped = "Stopped"
    Released = "Released"


class AsException(RuntimeError):
    """An engine call that cannot be honoured (wrong model state, unknown model or request); carries its AsStatus."""

    def __init__(self, message: str, status: AsStatus = AsStatus.ALLSPARK_INVALID_CALL_ERROR) -> None:
        super().__init__(f"[{status.name}] {message}")
        self.status = status


class ModelSerializerException(Exception):
    """The model could not be read or serialized."""

    def __init__(self, message: str, code: int = 1, model_name: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.model_name = model_name
