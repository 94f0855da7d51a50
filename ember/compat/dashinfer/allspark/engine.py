"""DashInfer's Engine on ember: each installed model is one native ember engine (its own loop thread, KV pool and
scheduler) under a unique name, with DashInfer's life cycle Initial -> Running -> Stopped -> Released. Requests
are native requests whose output sink is a ResultQueue; nothing here schedules or runs a model."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ember import envs
from ember.compat.dashinfer.allspark.generation_config import (ASGenerationConfigBuilder, PromptLengthError,
                                                               to_sampling_params)
from ember.compat.dashinfer.allspark.lora import SUFFIX, adapter_path
from ember.compat.dashinfer.allspark.model_loader import (DashInferModel, HuggingFaceModel, LLM, pin_model_files,
                                                          unpin_model_files)
from ember.compat.dashinfer.allspark.result_queue import GeneratedElements, RequestHandle, ResultQueue
from ember.compat.dashinfer.allspark.runtime_config import AsModelConfig, AsModelRuntimeConfigBuilder
from ember.compat.dashinfer.allspark.status import (AsCacheMode, AsException, AsStatus, GenerateRequestStatus,
                                                    ModelState, RoPEScaleMethod, TargetDevice)
from ember.lora.request import LoRARequest
from ember.model_loader import asmodel
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember")
_OK = AsStatus.ALLSPARK_SUCCESS
# What CPU_NUMA does here, said when its node ids would suggest more. DashInfer's own CPU engine ignores the ids as
# well (one engine; its multi-NUMA client starts one process per node under numactl instead).
NUMA_NOTE = ("model %s: TargetDevice.CPU_NUMA with NUMA nodes %s runs as one CPU engine of %s threads, not bound to "
             "any node: ember pins no threads and binds no memory. To keep it on one node, start the process under "
             "`numactl --cpunodebind=N --membind=N`")
BFC_MEM_RATIO_DEFAULT = 0.975  # "The default value is 0.975 in this release" (the offline inference guide)


@dataclass(slots=True)
class _Model:
    config: AsModelConfig
    state: ModelState = ModelState.Initial
    engine: Any = None  # an ember EngineClient while Running
    queues: dict[str, ResultQueue] = field(default_factory=dict)  # request id -> queue, until release_request
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # adapters loaded by load_lora, by name
    lora_of: dict[str, str] = field(default_factory=dict)  # request id -> the adapter it runs with


def engine_config(cfg: AsModelConfig, warn: bool = True):
    """The native EngineConfig of a DashInfer runtime config (CUDA asked for on a machine without it runs on CPU,
    with a warning, so that CUDA scripts still run)."""
    from ember.config import EngineConfig

    kind, ids = cfg.device_type, cfg.device_ids
    tp = 1
    if kind == "CUDA":
        if torch.cuda.is_available() and len(ids) > 1:  # DashInfer splits the model over the listed GPUs
            if ids != list(range(len(ids))):
                raise ValueError(f"compute_unit={cfg.compute_unit!r}: ember places its {len(ids)} ranks on "
                                 f"cuda:0..{len(ids) - 1}; to use GPUs {ids}, set CUDA_VISIBLE_DEVICES="
                                 f"{','.join(map(str, ids))} and pass device ids {list(range(len(ids)))}")
            device, tp = "cuda", len(ids)
        elif torch.cuda.is_available():
            device = f"cuda:{ids[0] if ids else 0}"
        else:
            if warn:
                logger.warning("model %s: TargetDevice.CUDA asked for but no CUDA device is available; running on "
                               "CPU", cfg.model_name)
            device = "cpu"
    else:
        if warn and cfg.extra.get("numa") and list(ids) != [0]:
            logger.warning(NUMA_NOTE, cfg.model_name, ids, cfg.num_threads or "torch's default number of")
        device = "cpu"
    meta = asmodel.read_meta(cfg.model_path)
    # DashInfer's memory knob: the runtime config's cuda_mem.memory_ratio, else its BFC_MEM_RATIO variable, else
    # on CUDA the guide's default (BFC_MEM_RATIO, the share of the device's total memory; its allocator is for
    # NVIDIA GPUs only, so on CPU ember's own default holds); ember's EMBER_MEM_RATIO, when set, wins as it does
    # for every engine
    fraction = None
    if os.environ.get(envs.MEM_RATIO) is None:
        fraction = cfg.memory_ratio
        if fraction is None:
            fraction = envs.ratio_from("BFC_MEM_RATIO", os.environ.get("BFC_MEM_RATIO"))
        if fraction is None and device.startswith("cuda"):
            fraction = BFC_MEM_RATIO_DEFAULT
    # a model serialized with lora_cfg gets lora_max_num adapter slots of lora_max_rank (DashInfer builds its LoRA
    # ops only into such a model)
    lora = dict(enable_lora=True, max_loras=cfg.lora_max_num, max_lora_rank=cfg.lora_max_rank) \
        if (meta.get("extra") or {}).get("dashinfer", {}).get("lora") and cfg.lora_max_num > 0 else {}
    return EngineConfig(model=cfg.model_path, dtype=meta["dtype"], device=device, max_num_seqs=cfg.engine_max_batch,
                        max_model_len=cfg.engine_max_length,
                        max_num_batched_tokens=cfg.engine_max_prefill_length or None,
                        enable_prefix_caching=cfg.enable_prefix_cache, block_size=cfg.cache_span_size,
                        prefix_cache_ttl=cfg.prefix_cache_ttl or None,
                        num_threads=cfg.num_threads if device == "cpu" and cfg.num_threads else None,
                        kv_cache_dtype=_KV_CACHE_DTYPES[cfg.cache_mode], kv_cache_memory_fraction=fraction,
                        tensor_parallel_size=tp, **lora)


def _reporting(as_request: bool):
    """A call that reports its failures as DashInfer's engine calls do, its reason logged, instead of raising: a wrong
    model state, an unknown model or an unknown request as AsException's status; a request start also a prompt
    that is empty or leaves no room under max_length (ALLSPARK_EXCEED_LIMIT_ERROR) and a bad generation field
    (ALLSPARK_PARAM_ERROR), returned as (status, None, None). Inputs of the wrong type still raise ValueError, as
    DashInfer's do."""

    def wrap(call):
        @functools.wraps(call)
        def reporting(self, *args, **kwargs):
            try:
                return call(self, *args, **kwargs)
            except (AsException, PromptLengthError, _BadGeneration) as e:
                logger.error("%s: %s", call.__name__, e)
                status = e.status if isinstance(e, AsException) else _STATUS_OF[type(e)]
                return (status, None, None) if as_request else status

        return reporting

    return wrap


class _BadGeneration(ValueError):
    """A generation config field out of range (the message names it)."""


_STATUS_OF = {PromptLengthError: AsStatus.ALLSPARK_EXCEED_LIMIT_ERROR, _BadGeneration: AsStatus.ALLSPARK_PARAM_ERROR}
_reports_status, _starts_request = _reporting(as_request=False), _reporting(as_request=True)


_KV_CACHE_DTYPES = {AsCacheMode.AsCacheDefault: "auto", AsCacheMode.AsCacheQuantI8: "int8",
                    AsCacheMode.AsCacheQuantU4: "uint4"}


class Engine:
    """Models installed under unique names, and the requests sent to them."""

    def __init__(self) -> None:
        # DashInfer logs its version when an engine is made ("AllSpark Init with Version: ..."); so does this one
        logger.info("AllSpark Init with Version: %s", self.get_version_full())
        self._models: dict[str, _Model] = {}
        self._lock = threading.RLock()
        # request ids unique over the engine's life: a handle from before a restart never names a newer request
        self._ids = itertools.count()
        self._held: set[str] = set()  # in-memory serializations made for this engine, not installed yet

    def _hold_until_loaded(self, model_path: str) -> None:
        """serialize_to_memory(engine): its files stay until this engine has installed and loaded the model."""
        with self._lock:
            path = os.path.abspath(model_path)
            if path not in self._held:
                self._held.add(path)
                pin_model_files(path)

    def get_version_full(self) -> str:
        from ember.version import __version__

        return f"ember {__version__} (DashInfer allspark API)"

    def __repr__(self) -> str:
        return f"AsEngine: version={self.get_version_full()}"

    # ----- models -----

    def _model(self, name: str, *allowed: ModelState,
               wrong_state: AsStatus = AsStatus.ALLSPARK_INVALID_CALL_ERROR) -> _Model:
        """The model, else AsException (with DashInfer's status: PARAM_ERROR for a name not installed, wrong_state
        for a state the call cannot run in) naming what is wrong; the calls turn it into the status they return,
        as DashInfer's do (get_model_state raises it)."""
        m = self._models.get(name)
        if m is None:
            raise AsException(f"model {name!r} is not installed: installed models are {sorted(self._models)}",
                              AsStatus.ALLSPARK_PARAM_ERROR)
        if allowed and m.state not in allowed:
            raise AsException(f"model {name!r} is {m.state.name}: this call needs it "
                              f"{' or '.join(s.name for s in allowed)}", wrong_state)
        return m

    def install_model(self, as_model_config_struct: AsModelConfig) -> AsStatus:
        """Register a model under its runtime config's model_name (state Initial); the files must validate. Unlike
        the other calls it raises (AsException, a RuntimeError, for a name in use), as DashInfer's does."""
        cfg = as_model_config_struct
        if not isinstance(cfg, AsModelConfig):
            raise ValueError(f"install_model takes an AsModelConfig (AsModelRuntimeConfigBuilder().build()), not "
                             f"{type(cfg).__name__}")
        if not cfg.model_name:
            raise ValueError("model_name='' is empty: set it with AsModelRuntimeConfigBuilder.model_name()")
        if not cfg.model_path:
            raise ValueError(f"model {cfg.model_name!r} has no model files: serialize the model before building its "
                             "runtime config, or set them with model_dir() / model_file_path()")
        problem = asmodel.validate(cfg.model_path)
        if problem is not None:
            raise ValueError(f"model {cfg.model_name!r}: {cfg.model_path!r} cannot be used: {problem}")
        engine_config(cfg, warn=False)  # refuse a config that cannot run before anything is loaded
        with self._lock:
            old = self._models.get(cfg.model_name)
            if old is not None and old.state is not ModelState.Released:
                raise AsException(f"model name {cfg.model_name!r} is already installed ({old.state.name}): model "
                                  "names must be unique in an engine", AsStatus.ALLSPARK_PARAM_ERROR)
            self._models[cfg.model_name] = _Model(cfg)
            held = os.path.abspath(cfg.model_path)
            if held in self._held:
                self._held.discard(held)  # the hold taken at serialize_to_memory becomes this model's
            else:
                pin_model_files(cfg.model_path)  # in-memory serializations stay until the model has loaded them
        return _OK

    build_model_from_config_struct = install_model  # DashInfer's deprecated name

    @_reports_status
    def start_model(self, model_name: str) -> AsStatus:
        """Load the model and warm it up at max_batch x max_length; a configuration that cannot fit fails with
        what would fit."""
        from ember.frontend.client import start_client

        with self._lock:
            m = self._model(model_name, ModelState.Initial, ModelState.Stopped)
            try:
                m.engine = start_client(engine_config(m.config))
            except ValueError as e:
                raise ValueError(f"start_model({model_name!r}) failed: {e}") from e
            if m.state is ModelState.Initial:  # loaded: in-memory files may go (a failed start keeps them)
                unpin_model_files(m.config.model_path)
            m.state = ModelState.Running
        return _OK

    @_reports_status
    def stop_model(self, model_name: str) -> AsStatus:
        """Stop serving: unfinished requests end GenerateInterrupted (their queues stay readable), the model's
        loop thread stops and its memory is freed. start_model runs it again."""
        with self._lock:
            stopped = getattr(self._models.get(model_name), "state", None) is ModelState.Stopped
            m = self._model(model_name, ModelState.Running, wrong_state=AsStatus.ALLSPARK_REQUEST_DENIED if stopped
                            else AsStatus.ALLSPARK_INVALID_CALL_ERROR)  # DashInfer denies stopping twice
            self._interrupt_all(m)
            m.engine.shutdown()
            m.engine = None
            m.loras.clear()  # adapters lived in the stopped engine: load_lora again after start_model
            m.state = ModelState.Stopped
        return _OK

    @_reports_status
    def release_model(self, model_name: str) -> AsStatus:
        """Forget a model that is not running; its name may be installed again."""
        with self._lock:
            m = self._model(model_name, ModelState.Initial, ModelState.Stopped)
            if m.state is ModelState.Initial:
                unpin_model_files(m.config.model_path)
            for q in m.queues.values():
                q._release()
            m.queues.clear()
            m.state = ModelState.Released
        return _OK

    def _interrupt_all(self, m: _Model) -> None:
        live = [(rid, q) for rid, q in m.queues.items() if not q._status.is_terminal]
        for rid, q in live:
            q._mark_abort_as(GenerateRequestStatus.GenerateInterrupted)
            m.engine.abort(rid)
        for _, q in live:
            q._wait_finished()

    def get_model_state(self, model_name: str) -> ModelState:
        return self._model(model_name).state

    # ----- LoRA adapters -----

    @_reports_status
    def load_lora(self, model_name: str, lora_name: str) -> AsStatus:
        """Load NAME.aslora (written beside the model by serialize's lora_cfg), or an absolute path to one (named
        after its file), so that requests may name it in lora_name. The status says why not: not found, too many or
        too big, loaded."""
        with self._lock:
            m = self._model(model_name, ModelState.Running)
            if not isinstance(lora_name, str) or not lora_name:
                return AsStatus.ALLSPARK_PARAM_ERROR
            name = os.path.basename(lora_name).removesuffix(SUFFIX) if os.path.isabs(lora_name) else lora_name
            if name in m.loras:
                return AsStatus.ALLSPARK_LORA_ALREADY_LOADED
            info = m.engine.model_info
            if len(m.loras) >= info.max_loras:  # 0: the model was not serialized with lora_cfg
                logger.warning("model %s: load_lora(%r) refused: %s", model_name, lora_name,
                               f"{len(m.loras)} adapters are loaded, lora_max_num is {info.max_loras}"
                               if info.max_loras else "the model was not serialized with lora_cfg")
                return AsStatus.ALLSPARK_LORA_NUM_EXCEED_LIMIT_ERROR
            path = adapter_path(m.config.model_path, lora_name)
            if not os.path.isfile(path):
                logger.warning("model %s: load_lora(%r): %s does not exist", model_name, lora_name, path)
                return AsStatus.ALLSPARK_LORA_NOT_FOUND
            request = LoRARequest(name, next(self._ids) + 1, path)
            try:
                m.engine.add_lora(request)
            except ValueError as e:  # the adapter does not fit the model or the rank limit: the reader says which
                logger.warning("model %s: load_lora(%r) refused: %s", model_name, lora_name, e)
                return (AsStatus.ALLSPARK_LORA_RANK_EXCEED_LIMIT_ERROR if "max_lora_rank" in str(e)
                        else AsStatus.ALLSPARK_PARAM_ERROR)
            m.loras[name] = request
        return _OK

    @_reports_status
    def unload_lora(self, model_name: str, lora_name: str) -> AsStatus:
        """Forget a loaded adapter; refused (LORA_IN_USE) while a request that names it is unfinished."""
        with self._lock:
            m = self._model(model_name, ModelState.Running)
            request = m.loras.get(lora_name)
            if request is None:
                return AsStatus.ALLSPARK_LORA_NOT_FOUND
            if any(m.lora_of.get(rid) == lora_name and not q._status.is_terminal for rid, q in m.queues.items()):
                return AsStatus.ALLSPARK_LORA_IN_USE
            m.engine.remove_lora(request.lora_int_id)
            del m.loras[lora_name]
        return _OK

    def get_as_engine_stat(self, model_name: str) -> dict[str, Any]:
        """The native engine's counters (KV blocks, queues, prefix-cache hits, memory) of a running model."""
        return self._model(model_name, ModelState.Running).engine.stats()

    # ----- requests -----

    @_starts_request
    def start_request(self, model_name: str, inputs: dict[str, Any],
                      generate_config: dict[str, Any] | ASGenerationConfigBuilder | None = None
                      ) -> tuple[AsStatus, RequestHandle, ResultQueue]:
        """Start one request from {"input_ids": ids} and a generation config dict."""
        if not isinstance(inputs, dict) or "input_ids" not in inputs:
            raise ValueError("inputs must be a dict with 'input_ids'")
        return self._start(model_name, _as_id_list(inputs["input_ids"]), generate_config or {})

    @_starts_request
    def start_request_ids(self, model_name: str, model: LLM | None, input_ids: Any,
                          generate_config_builder: ASGenerationConfigBuilder | dict[str, Any]
                          ) -> tuple[AsStatus, RequestHandle, ResultQueue]:
        """Start one request from token ids (a list, or a 1-D tensor or a [1, n] one)."""
        return self._start(model_name, _as_id_list(input_ids), generate_config_builder)

    @_starts_request
    def start_request_text(self, model_name: str, model: LLM, input_str_or_array: str | Sequence[str],
                           generate_config_builder: ASGenerationConfigBuilder | dict[str, Any]):
        """Start a request from text, tokenized by the model loader's tokenizer. A list of texts starts one request
        per text and returns (status, [handles], [queues]) in the same order."""
        tokenizer = model.init_tokenizer().get_tokenizer()
        if isinstance(input_str_or_array, str):
            return self._start(model_name, _encode(tokenizer, input_str_or_array), generate_config_builder)
        texts = list(input_str_or_array)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("input_str_or_array must be a string or a non-empty list of strings")
        prompts = [_encode(tokenizer, t) for t in texts]
        with self._lock:  # every request is checked before any starts: all start, or none
            prepared = [self._prepare(model_name, ids, generate_config_builder) for ids in prompts]
            if len({p[1] for p in prepared}) < len(prepared):
                raise _BadGeneration(f"uuid={prepared[0][1]!r} names every request of the list: leave uuid unset")
            started: list[tuple[RequestHandle, ResultQueue]] = []
            try:
                for ids, p in zip(prompts, prepared):
                    started.append(self._submit(model_name, ids, *p))
            except _BadGeneration:
                for handle, _ in started:  # all or none
                    self._drop(handle)
                raise
        return _OK, [h for h, _ in started], [q for _, q in started]

    def _start(self, model_name: str, ids: list[int], gen: ASGenerationConfigBuilder | dict[str, Any]
               ) -> tuple[AsStatus, RequestHandle, ResultQueue]:
        with self._lock:
            handle, queue = self._submit(model_name, ids, *self._prepare(model_name, ids, gen))
        return _OK, handle, queue

    def _prepare(self, model_name: str, ids: list[int], gen: ASGenerationConfigBuilder | dict[str, Any]
                 ) -> tuple[SamplingParams, str, str | None, dict[str, Any] | None]:
        """The request's native params, id and adapter, checked; raises what _starts_request reports."""
        m = self._model(model_name, ModelState.Running, wrong_state=AsStatus.ALLSPARK_REQUEST_DENIED)
        if not ids:
            raise PromptLengthError("input_ids is empty: a request needs at least one token")
        cfg = gen.build() if isinstance(gen, ASGenerationConfigBuilder) else dict(gen)
        try:
            params = to_sampling_params(cfg, len(ids), m.engine.model_info.max_model_len)
        except PromptLengthError:
            raise
        except ValueError as e:
            raise _BadGeneration(str(e)) from e
        rid = str(cfg.get("uuid") or f"{model_name}-{next(self._ids)}")
        if rid in m.queues:
            raise _BadGeneration(f"uuid={rid!r} is already in use by a request of model {model_name!r}")
        lora_name = cfg.get("lora_name") or None
        if lora_name is not None and lora_name not in m.loras:
            raise AsException(f"model {model_name}: lora_name={lora_name!r} is not loaded (load_lora first); loaded: "
                              f"{sorted(m.loras)}", AsStatus.ALLSPARK_LORA_NOT_FOUND)
        mm = cfg.get("mm_info")
        try:
            prompt = mm.prompt(ids, m.engine.model_info.image_token_id) if mm is not None else None
        except ValueError as e:
            raise _BadGeneration(str(e)) from e
        return params, rid, lora_name, prompt

    def _submit(self, model_name: str, ids: list[int], params: SamplingParams, rid: str, lora_name: str | None,
                prompt: dict[str, Any] | None = None) -> tuple[RequestHandle, ResultQueue]:
        """prompt: the native prompt when mm_info gives image embeddings (else the ids)."""
        m = self._models[model_name]
        queue = ResultQueue(rid, len(ids), params.logprobs or 0)
        try:  # what only the engine checks (a constraint's grammar) is a bad field too
            m.engine.submit([prompt or ids], [params], queue._put, [rid],
                            [m.loras[lora_name] if lora_name else None])
        except ValueError as e:
            raise _BadGeneration(str(e)) from e
        m.queues[rid] = queue
        if lora_name is not None:
            m.lora_of[rid] = lora_name
        return RequestHandle(model_name, rid), queue

    def _drop(self, handle: RequestHandle) -> None:
        """Abort and forget a request that was just started (a list whose later request failed)."""
        m = self._models[handle.model_name]
        queue = m.queues.pop(handle.request_id)
        m.lora_of.pop(handle.request_id, None)
        m.engine.abort(handle.request_id)
        queue._release()

    def _queue(self, model_name: str, handle: RequestHandle, *allowed: ModelState) -> tuple[_Model, ResultQueue]:
        m = self._model(model_name, *allowed)
        if handle is None:  # DashInfer: a None handle is an empty request
            raise AsException("request_handle is None: pass the handle start_request returned",
                              AsStatus.ALLSPARK_EMPTY_REQUEST)
        rid = handle.request_id if isinstance(handle, RequestHandle) else str(handle)
        q = m.queues.get(rid)
        if q is None:
            raise AsException(f"request {rid!r} is not a live request of model {model_name!r} (released, or never "
                              "started there)", AsStatus.ALLSPARK_ILLEGAL_REQUEST_ID)
        return m, q

    @_reports_status
    def stop_request(self, model_name: str, request_handle: RequestHandle) -> AsStatus:
        """End a request now; it keeps what it generated and ends GenerateFinished."""
        with self._lock:
            m, q = self._queue(model_name, request_handle, ModelState.Running)
            if not q._status.is_terminal:
                m.engine.abort(q.request_id)
        q._wait_finished()
        return _OK

    @_reports_status
    def release_request(self, model_name: str, request_handle: RequestHandle) -> AsStatus:
        """Free everything the request holds (stopping it first if it runs); its queue then returns None."""
        with self._lock:
            m, q = self._queue(model_name, request_handle, ModelState.Running, ModelState.Stopped)
            if m.state is ModelState.Running and not q._status.is_terminal:
                m.engine.abort(q.request_id)
        q._wait_finished()
        with self._lock:
            m.queues.pop(q.request_id, None)
            m.lora_of.pop(q.request_id, None)
        q._release()
        return _OK

    @_reports_status
    def sync_request(self, model_name: str, request_handle: RequestHandle | None = None) -> AsStatus:
        """Block until the request (or, with no handle, every request of the model) has finished."""
        with self._lock:
            m = self._model(model_name, ModelState.Running, ModelState.Stopped)
            queues = list(m.queues.values()) if request_handle is None else \
                [self._queue(model_name, request_handle)[1]]
        for q in queues:
            q._wait_finished()
        return _OK

    # DashInfer's deprecated per-queue calls
    def get_no_wait(self, model_name: str, result_queue: ResultQueue) -> GeneratedElements | None:
        return result_queue.GetNoWait()

    def get_wait(self, model_name: str, result_queue: ResultQueue) -> GeneratedElements | None:
        return result_queue.Get()

    def get_request_status(self, model_name: str, result_queue: ResultQueue) -> GenerateRequestStatus:
        return result_queue.GenerateStatus()


def _encode(tokenizer: Any, text: str) -> list[int]:
    if not isinstance(text, str):
        raise ValueError(f"input text of type {type(text).__name__} is not supported: pass a string")
    if not text:
        raise PromptLengthError("input text '' is empty: a request needs at least one character")
    return list(tokenizer.encode(text))


def _as_id_list(input_ids: Any) -> list[int]:
    """A flat list of token ids from a list, a 1-D tensor or a [1, n] tensor / nested list."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1 or input_ids.is_floating_point():
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)} and dtype {input_ids.dtype}: it must be "
                             "one integer sequence ([n] or [1, n])")
        return input_ids.tolist()
    if isinstance(input_ids, (list, tuple)):
        if len(input_ids) == 1 and isinstance(input_ids[0], (list, tuple)):
            input_ids = input_ids[0]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise ValueError("input_ids must be one sequence of integer token ids (a list, or a [n] / [1, n] tensor)")
        return list(input_ids)
    raise ValueError(f"input_ids of type {type(input_ids).__name__} is not supported: pass a list or a torch tensor")


__all__ = ["Engine", "TargetDevice", "RoPEScaleMethod", "AsStatus", "AsCacheMode", "GenerateRequestStatus",
           "ModelState", "AsException", "AsModelConfig", "AsModelRuntimeConfigBuilder", "ASGenerationConfigBuilder",
           "ResultQueue", "GeneratedElements", "RequestHandle", "HuggingFaceModel", "DashInferModel"]
