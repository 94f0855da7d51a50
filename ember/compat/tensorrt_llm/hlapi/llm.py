"""TensorRT-LLM's HLAPI ``LLM`` on ember: one native engine (an ``EngineClient``) built from the HLAPI's configs;
generate / generate_async / save / get_default_sampling_config translated onto it. There is no engine build:
``LLM(config)`` loads (and quantizes) the weights as ember does; ``save`` writes them as ember's .asmodel pair."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from ember.compat.tensorrt_llm.hlapi.config import (
    CapacitySchedulerPolicy,
    KvCacheConfig,
    ModelConfig,
    StreamingLLMParam,
)
from ember.compat.tensorrt_llm.hlapi.result import GenerationResult
from ember.compat.tensorrt_llm.hlapi.sampling import DEFAULT_MAX_NEW_TOKENS, SamplingConfig, to_sampling_params
from ember.config import EngineConfig
from ember.errors import ConfigError
from ember.frontend.client import start_client
from ember.frontend.processor import prompt_list

logger = logging.getLogger("ember")

# the LLM's "_additional_options" (TensorRT-LLM tunes its TensorRT build with them): accepted, nothing to tune here
_BUILD_OPTIONS = ("normalize_log_probs", "enable_trt_overlap", "multi_block_mode", "use_custom_all_reduce")


def auto_parallel_plan(model_path: str, world_size: int) -> tuple[int, int]:
    """(tp, pp) for world_size ranks: the widest tensor split the model's heads, KV heads and MLP allow (it cuts
    every rank's weights and KV), the rest as pipeline stages over its layers."""
    from ember.model_loader import check_parallel

    model = EngineConfig(model=model_path).resolve().model
    for tp in sorted((t for t in range(1, world_size + 1) if world_size % t == 0), reverse=True):
        try:
            check_parallel(model, tp, world_size // tp, None)
        except ConfigError:
            continue
        return tp, world_size // tp
    raise ValueError(f"world_size={world_size} is out of range for {model_path}: no tp x pp split of it fits the "
                     "model's heads and layers")


class LLM:
    def __init__(self, config: ModelConfig, *, tokenizer: Any = None, dtype: str = "auto",
                 kv_cache_config: KvCacheConfig | None = None, streaming_llm: bool | StreamingLLMParam = False,
                 async_mode: bool = False, async_engine_tmp_dir: str | None = None,
                 capacity_scheduling_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
                 **_additional_options: Any) -> None:
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config of type {type(config).__name__} is not supported: pass a ModelConfig")
        self.config = config
        self.kv_cache_config = kv_cache_config or KvCacheConfig()
        self.async_mode = async_mode  # ember's engine always runs on its own thread: both modes are asynchronous
        self.async_engine_tmp_dir = async_engine_tmp_dir
        chunked = _additional_options.pop("enable_chunked_context", True)
        policy = _additional_options.pop("scheduling_policy", capacity_scheduling_policy)
        for name in _BUILD_OPTIONS:
            _additional_options.pop(name, None)
        if _additional_options:
            raise ValueError(f"Unknown options {_additional_options}")
        try:
            policy = CapacitySchedulerPolicy(policy.value if hasattr(policy, "value") else policy)
        except ValueError:
            raise ValueError(f"capacity_scheduling_policy={policy!r} is not supported: use "
                             "CapacitySchedulerPolicy.GUARANTEED_NO_EVICT or MAX_UTILIZATION") from None
        if streaming_llm is True:
            streaming_llm = StreamingLLMParam()
        self.streaming_llm = streaming_llm

        self._tokenizer_obj = None if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)) else tokenizer
        tokenizer_path = str(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else None
        self.parallel_plan = self._parallel()
        self.engine_config = EngineConfig(
            model=config.model_path, tokenizer=tokenizer_path, dtype=dtype, scheduling_policy=policy.value,
            enable_chunked_prefill=bool(chunked), tensor_parallel_size=self.parallel_plan[0],
            pipeline_parallel_size=self.parallel_plan[1], **self._limits(),
            **self._kv_kwargs(), **self._quant_kwargs())
        self.client = start_client(self.engine_config)

    # ----- translation of the configs -----

    def _parallel(self) -> tuple[int, int]:
        c = self.config
        if c.parallel_config.auto_parallel:
            world = c.world_size
            tp, pp = auto_parallel_plan(c.model_path, world) if world > 1 else (1, 1)
            logger.warning("auto_parallel: world_size=%d runs as tp_size=%d x pp_size=%d (the widest tensor split "
                           "the model's heads allow)", world, tp, pp)
            return tp, pp
        _ = c.world_size  # raises for world_size > 1 without auto_parallel, as TensorRT-LLM does
        return c.parallel_config.tp_size, c.parallel_config.pp_size

    def _limits(self) -> dict[str, Any]:
        """The engine's limits from TensorRT-LLM's build options: max_batch_size sequences (at least max_beam_width),
        max_input_len + max_output_len tokens each (capped by the model's positions), max_num_tokens a step."""
        from ember.model_loader import read_shape

        c = self.config
        length = min(c.max_input_len + c.max_output_len, read_shape(c.model_path).max_position)
        return dict(max_num_seqs=max(c.max_batch_size, c.max_beam_width), max_model_len=length,
                    max_num_batched_tokens=c.max_num_tokens)

    def _kv_kwargs(self) -> dict[str, Any]:
        kv, out = self.kv_cache_config, {}
        if kv.free_gpu_memory_fraction is not None:
            out["kv_cache_memory_fraction"] = kv.free_gpu_memory_fraction
        if kv.max_tokens is not None:
            out["max_kv_cache_tokens"] = kv.max_tokens
        window, sink = kv.max_attention_window, kv.sink_token_length
        if self.streaming_llm:
            window, sink = self.streaming_llm.max_attention_window_size, self.streaming_llm.sink_token_length
        if window is not None:
            out["attention_window"] = window
            out["sink_tokens"] = sink or 0
        out["enable_prefix_caching"] = bool(kv.enable_block_reuse)
        return out

    def _quant_kwargs(self) -> dict[str, Any]:
        """The QuantConfig's settings; a saved folder keeps the KV mode it was saved with unless one is set."""
        out = self.config.quant_config.ember_kwargs()
        saved_kv = self.config.saved.get("kv_cache_dtype")
        if saved_kv and "kv_cache_dtype" not in out:
            out["kv_cache_dtype"] = saved_kv
        return out

    # ----- generation -----

    @property
    def tokenizer(self) -> Any:
        """The tokenizer given, else the model's (an ember Tokenizer: encode / decode / eos_token_id)."""
        return self._tokenizer_obj if self._tokenizer_obj is not None else self.client.tokenizer

    def get_default_sampling_config(self) -> SamplingConfig:
        """The model's end / pad ids and default length; greedy decoding, beam_width 1 (TensorRT-LLM's defaults)."""
        tok = self.tokenizer
        end = getattr(tok, "eos_token_id", None)
        if end is None and self.client.eos_token_ids:
            end = self.client.eos_token_ids[0]
        pad = getattr(tok, "pad_token_id", None)
        return SamplingConfig(end_id=end, pad_id=pad if pad is not None else end,
                              max_new_tokens=self._default_max_new_tokens())

    def _default_max_new_tokens(self) -> int:
        return self.kv_cache_config.max_new_tokens or DEFAULT_MAX_NEW_TOKENS

    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 sampling_config: SamplingConfig | Sequence[SamplingConfig] | None = None) -> list[GenerationResult]:
        """Run every prompt to completion (a string, token ids, or a list of either); results in input order."""
        prompts = prompt_list(prompts)
        configs = sampling_config if isinstance(sampling_config, (list, tuple)) else [sampling_config] * len(prompts)
        if len(configs) != len(prompts):
            raise ValueError(f"sampling_config has {len(configs)} entries for {len(prompts)} prompts: pass one, or "
                             "one per prompt")
        results: list[GenerationResult] = []
        try:  # a bad prompt or config later in the list aborts the ones already submitted
            for p, sc in zip(prompts, configs):
                results.append(self._submit(p, sc, streaming=False))
            return [r.result() for r in results]
        except BaseException:
            for r in results:
                r.cancel()
            raise

    def generate_async(self, prompt: str | Sequence[int], streaming: bool = False,
                       sampling_config: SamplingConfig | None = None) -> GenerationResult:
        """Submit one prompt and return at once: a future, and an iterator of its progress (see GenerationResult)."""
        return self._submit(prompt, sampling_config, streaming)

    def _submit(self, prompt: Any, sampling_config: SamplingConfig | None, streaming: bool) -> GenerationResult:
        sc = sampling_config if sampling_config is not None else self.get_default_sampling_config()
        params = to_sampling_params(sc, self.config.max_beam_width, self._default_max_new_tokens())
        if sc.end_id is None and self._tokenizer_obj is not None and getattr(self._tokenizer_obj, "eos_token_id",
                                                                             None) is not None:
            params.eos_token_ids = (self._tokenizer_obj.eos_token_id,)
        text_wanted = isinstance(prompt, str)  # token-id prompts get ids only: the tokenizer is not used
        if text_wanted and self._tokenizer_obj is not None:
            prompt = list(self._tokenizer_obj.encode(prompt))
        decode = self._tokenizer_obj.decode if self._tokenizer_obj is not None else None
        result = GenerationResult(lambda: self.client.abort(result.request_id), params.beam_width, streaming, decode)
        result.request_id = self.client.submit([prompt], [params], lambda item: result._add(item, text_wanted))[0]
        return result

    # ----- life cycle -----

    def save(self, engine_dir: str) -> None:
        """Write the loaded model as a folder ``ModelConfig(model_dir=engine_dir)`` loads without the source: the
        weights as this LLM holds them (quantized ones stay quantized, calibrated ones transformed), the tokenizer,
        and the settings that shape the engine (max_beam_width, the KV cache mode, the tp x pp split)."""
        from ember.model_loader import open_checkpoint, weight_layout
        from ember.model_loader.convert import convert

        model = self.engine_config.resolve().model
        ckpt = open_checkpoint(model.path)
        dtype, quant = weight_layout(model, ckpt, ckpt.hf_config())
        os.makedirs(engine_dir, exist_ok=True)
        extra = {"tensorrt_llm": {"max_beam_width": self.config.max_beam_width,
                                  # an engine built for tp x pp ranks runs on them again, as TensorRT-LLM's does
                                  "tp_size": self.parallel_plan[0], "pp_size": self.parallel_plan[1],
                                  "kv_cache_dtype": self.engine_config.kv_cache_dtype
                                  if self.engine_config.kv_cache_dtype != "auto" else None}}
        convert(model.path, engine_dir, "model", dtype=dtype, quant_config=quant, extra=extra,
                calibration_data=self.engine_config.calibration_data if quant and quant.algorithm else None,
                tokenizer=model.tokenizer)
        logger.info("saved the model to %s", engine_dir)

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> bool:
        self.shutdown()
        return False

    def __getstate__(self):
        raise RuntimeError("LLM object can not be pickled.")
