"""Build a model from a Hugging Face folder, a GGUF file or an ember .asmodel pair (``load_model``, for workers), and
its tokenizer and generation defaults (``load_tokenizer``, for the front end). The three checkpoint kinds share one
small interface: hf_config(), generation_config(), tensors(config, keep_quantized) (Hugging Face names),
native_quantization() (the quantized layout it stores, if any), tokenizer()."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from ember.config import ModelConfig, ModelShape
from ember.dtypes import resolve_dtype
from ember.distributed import ParallelContext
from ember.errors import ConfigError
from ember.layers.linear import mkldnn_prepack_available
from ember.model_loader import prepared
from ember.model_loader.asmodel import AsModelCheckpoint
from ember.model_loader.checkpoint import Checkpoint, file_errors, model_config, needs_calibration, open_checkpoint
from ember.model_loader.finalize import finalize
from ember.model_loader.gguf import GGUFCheckpoint
from ember.model_loader.hf import HFCheckpoint, read_all
from ember.model_loader.pooler import max_seq_length
from ember.model_loader.trtllm import TRTLLMCheckpoint
from ember.model_loader.weight_checks import checked_weights
from ember.models import resolve_architecture
from ember.quantization import QUANT_ALGORITHMS, QuantConfig
from ember.quantization.held import held_kinds, takes_int8_activations
from ember.tokenizer import Tokenizer

logger = logging.getLogger("ember")


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    shape: ModelShape
    quant: QuantConfig | None
    prepared_key: str | None = None  # its entry in the prepared-model cache (``prepared``), None: not cached

    @property
    def max_position(self) -> int:
        return self.shape.max_position

    @property
    def local_layers(self) -> int:
        """Decoder layers this rank holds (its pipeline stage's)."""
        return len(self.model.attention_layers())

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank holds (its tensor-parallel share, at least one)."""
        return self.model.heads.num_kv_heads


@dataclass(frozen=True, slots=True)
class TokenizerInfo:
    """What the front end needs of a checkpoint: its tokenizer, generation defaults and every EOS id."""

    tokenizer: Tokenizer
    generation_config: dict[str, Any]
    eos_token_ids: tuple[int, ...]


def load_model(config: ModelConfig, parallel: ParallelContext = ParallelContext()) -> LoadedModel:
    """Build this rank's part of the model and read only its part of each weight; on CPU, map it from the prepared
    cache when an earlier load saved it there (``prepared``)."""
    key = prepared.entry_key(config, parallel)
    if key is not None:
        cached = prepared.load(key)
        if isinstance(cached, LoadedModel):
            cached.prepared_key = key
            return cached
    loaded = _build_model(config, parallel)
    if key is not None:
        prepared.save(key, loaded)
        loaded.prepared_key = key
    return loaded


def _build_model(config: ModelConfig, parallel: ParallelContext) -> LoadedModel:
    ckpt = open_checkpoint(config.path)
    hf_config = model_config(ckpt)
    with file_errors(config.path):  # a config value the checks let through that the model cannot be built from
        architecture, cls = resolve_architecture(getattr(hf_config, "architectures", None))
        dtype, quant = weight_layout(config, ckpt, hf_config)
        shape = ModelShape.of(hf_config)
        if quant is not None:
            logger.info("weights quantized: %s%s", quant.describe(), ", embeddings int8" if quant.embeddings else "")
        with torch.device("cpu"):
            model = cls(architecture, hf_config, shape.max_position, dtype, quant, parallel)
    select = model.weight_slice if parallel.world_size > 1 else read_all
    if needs_calibration(ckpt, quant):  # awq / smoothquant: the transformed float weights, computed once and cached
        from ember.model_loader.calibrated import calibrated_tensors

        tensors = calibrated_tensors(ckpt, hf_config, quant, config.calibration_data, config.tokenizer, select,
                                     config.device)
    else:
        tensors = ckpt.tensors(hf_config, keep_quantized=quant is not None, select=select)
    with file_errors(config.path):  # a tensor the header promised but the data cannot give: named, not a traceback
        model.load_weights(checked_weights(config.path, tensors))
    model.to(config.device).eval()
    device = torch.device(config.device)
    prepack = device.type == "cpu" and mkldnn_prepack_available(dtype)
    finalize(model, device, prepack, config.batch_invariant, config.int8_activations)
    if config.int8_activations and not takes_int8_activations(held_kinds(model)):
        logger.warning("int8_activations=True is taken by no weight of this model here: it needs int4 / int8 "
                       "weights and the CPU kernels for them (AVX512-BF16 with VNNI and VBMI, AMX not running the "
                       "weights); bf16 activations run (docs/int8_activations.md)")
    return LoadedModel(model, hf_config, architecture, dtype, shape, quant)


def weight_layout(config: ModelConfig, ckpt: Checkpoint, hf_config: Any) -> tuple[torch.dtype, QuantConfig | None]:
    """The dtype the model runs in and the quantized layout its weights take (see resolve_quantization)."""
    config_dtype = getattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", None)
    requested = config.dtype
    if requested == "auto" and isinstance(ckpt, AsModelCheckpoint):
        requested = ckpt.meta["dtype"]  # chosen when it was serialized: run it as stored
    dtype = resolve_dtype(requested, config_dtype, config.device)
    return dtype, resolve_quantization(config, ckpt, dtype)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_parallel(config: ModelConfig, tp: int, pp: int, ranks_here: int | None = None) -> None:
    """Refuse a split that cannot work, before any process starts: from the checkpoint's config and the weight
    layout alone (no weight is read). ConfigError names the sizes that would work. ranks_here: the ranks this
    machine runs (all of them for spawned ranks; a launcher's local count; None: unknown, as on a Ray cluster)."""
    if tp * pp == 1:
        return
    ckpt = open_checkpoint(config.path)
    hf_config = model_config(ckpt)
    if getattr(hf_config, "vision_config", None) is not None:
        raise ConfigError(f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} is not supported for a "
                          "vision-language model: it runs on one rank (both 1)")
    s = ModelShape.of(hf_config)
    inter = s.intermediate_size or hf_config.intermediate_size
    ok_tp = [t for t in _divisors(s.num_heads) if (s.num_kv_heads % t == 0 or t % s.num_kv_heads == 0)
             and inter % t == 0]
    if tp not in ok_tp:
        raise ConfigError(f"tensor_parallel_size={tp} is out of range for this model ({s.num_heads} attention heads, "
                          f"{s.num_kv_heads} KV heads, MLP size {inter}): it must divide the "
                          f"attention heads and the MLP size, and divide or be a multiple of the KV heads; allowed: "
                          f"{ok_tp}")
    if pp > s.num_layers:
        raise ConfigError(f"pipeline_parallel_size={pp} is out of range: this model has {s.num_layers} layers; "
                          f"allowed: 1..{s.num_layers}")
    if config.device.startswith("cuda") and ranks_here is not None:
        count = torch.cuda.device_count()
        if ranks_here > count:
            raise ConfigError(f"{ranks_here} ranks on this machine (tensor_parallel_size x pipeline_parallel_size = "
                              f"{tp * pp}) is out of range: it has {count} CUDA devices, one a rank; across machines, "
                              "start the ranks with a launcher or on a Ray cluster (docs/parallel.md)")
    if tp == 1:
        return
    quant = weight_layout(config, ckpt, hf_config)[1]
    # row-parallel layers: each rank's input slice must hold whole int4 groups (and whole GGUF blocks)
    for name, k in (("o_proj", s.num_heads * s.head_dim), ("down_proj", inter)):
        if quant is not None and quant.method == "int4":
            group = quant.linear_layout(k)[1]
            if (k // tp) % group:
                ok = [t for t in ok_tp if (k // t) % group == 0]
                raise ConfigError(f"tensor_parallel_size={tp} is out of range for int4 groups of {group}: each rank's "
                                  f"{k // tp} inputs of {name} must hold whole groups; allowed: {ok}, or a smaller "
                                  "quant_group_size")
        if quant is not None and isinstance(ckpt, GGUFCheckpoint):  # blocks kept as they are stored
            block = ckpt.kept_block_size(f"{name}.weight")
            if (k // tp) % block:
                raise ConfigError(f"tensor_parallel_size={tp} is out of range: {name} stays in GGUF blocks of "
                                  f"{block} values and each rank's {k // tp} inputs must hold whole blocks")


def read_shape(path: str) -> ModelShape:
    """The model's shape from its checkpoint's config alone, without reading any weight. A sentence-transformers
    folder's max_seq_length caps its positions (the inputs it was trained for), as vLLM caps max_model_len."""
    shape = ModelShape.of(model_config(open_checkpoint(path)))
    limit = max_seq_length(path)
    return replace(shape, max_position=min(shape.max_position, limit)) if limit else shape


def is_encoder(path: str) -> bool:
    """The checkpoint is an encoder (embeddings only, each prompt in one step), from its config alone; an unknown
    architecture is not (loading it names the supported ones)."""
    try:
        _, cls = resolve_architecture(getattr(model_config(open_checkpoint(path)), "architectures", None))
    except ValueError:
        return False
    return bool(getattr(cls, "encoder_only", False))


def load_tokenizer(config: ModelConfig) -> TokenizerInfo:
    """The tokenizer (from a tokenizer given apart: a folder, a .gguf or an .asmodel), the generation defaults and
    the EOS ids of the tokenizer, the generation config and the model config together."""
    ckpt = open_checkpoint(config.path)
    tokenizer = (open_checkpoint(config.tokenizer) if config.tokenizer else ckpt).tokenizer()
    generation_config = ckpt.generation_config()
    hf_config = model_config(ckpt)
    check_tokenizer(config.tokenizer or config.path, tokenizer, ModelShape.of(hf_config).vocab_size)
    eos = _eos_ids(tokenizer, hf_config, generation_config)
    return TokenizerInfo(tokenizer, generation_config, eos)


def shared_vocabulary(draft: ModelConfig, target: ModelConfig, draft_rows: int, target_rows: int) -> int:
    """The ids a draft model may propose for a target: those both embed (their rows may differ where the tokenizer
    is one: Qwen2.5's 0.5B pads its 151,665 tokens to 151,936 rows, its 7B to 152,064). The two tokenizers must
    spell every id the smaller holds alike (one may add tokens after the other's), else the draft's ids would mean
    other text: ConfigError naming the first that differs. A draft without a tokenizer of its own is taken for the
    model's where the rows agree."""
    def source(config: ModelConfig) -> str:
        return config.tokenizer or config.path

    limit = min(draft_rows, target_rows)
    if os.path.realpath(source(draft)) == os.path.realpath(source(target)):
        return limit
    ours = open_checkpoint(source(target)).tokenizer()
    try:
        theirs = open_checkpoint(source(draft)).tokenizer()
    except ConfigError as e:
        if draft_rows == target_rows:
            logger.info("speculative_config.model=%r: no tokenizer read (%s); its rows are the model's, taken as "
                        "the same tokenizer", draft.path, e)
            return limit
        raise ConfigError(f"speculative_config.model={draft.path!r}: its tokenizer cannot be read and its "
                          f"{draft_rows} vocabulary rows differ from the model's {target_rows}: a draft model must "
                          f"share the model's tokenizer ({e})") from None
    n = min(ours.vocab_size, theirs.vocab_size)
    for i in range(n):
        a, b = ours.convert_id(i), theirs.convert_id(i)
        if a != b:
            raise ConfigError(f"speculative_config.model={draft.path!r}: its tokenizer has {b!r} at id {i} where "
                              f"the model's has {a!r}: a draft model must share the model's tokenizer")
    return min(limit, n)


def check_tokenizer(path: str, tokenizer: Tokenizer, vocab_size: int) -> None:
    """A tokenizer whose BOS / EOS ids lie past the model's embedding rows is another model's: every prompt would
    be refused, no output would end. A larger vocabulary alone is allowed (test models use the first ids of a real
    tokenizer); a prompt holding an id past the rows is refused by the request checks."""
    for name in ("bos_token_id", "eos_token_id"):
        token = getattr(tokenizer, name)
        if isinstance(token, int) and not 0 <= token < vocab_size:
            raise ConfigError(f"tokenizer of {path!r}: {name}={token} is out of range for the model's vocab_size="
                              f"{vocab_size} embedding rows: the tokenizer does not belong to this model")
    if tokenizer.vocab_size > vocab_size:
        logger.warning("tokenizer of %r has %d tokens, more than the model's %d embedding rows: prompts holding "
                       "the others are refused", path, tokenizer.vocab_size, vocab_size)


def resolve_quantization(config: ModelConfig, ckpt: Checkpoint, dtype: torch.dtype) -> QuantConfig | None:
    """The weight layout to build: the engine config's choice, else what the checkpoint stores (see EngineConfig)."""
    native = ckpt.native_quantization()
    stored = isinstance(ckpt, AsModelCheckpoint) and native is not None
    mode = config.quantization  # a method, or a calibrated algorithm (QuantConfig.of)
    if mode == "none":
        return None
    if mode is None:
        if native is None or (not stored and dtype == torch.float32):  # float32 asks for the reference precision
            return None
        mode = default_mode(config, ckpt, native, stored)
    elif stored and mode != native.mode:
        raise ValueError(f"quantization={mode!r}: {config.path} is stored quantized as {native.describe()}; "
                         "convert the original checkpoint to change it, or use quantization=None or 'none'")
    elif mode in QUANT_ALGORITHMS and not _calibratable(ckpt):
        raise ValueError(f"quantization={mode!r} is not supported for {model_config(ckpt).architectures}: its "
                         "scales fold into Llama-style norms; use 'int8', 'int4', 'w8a8' or None")
    # int4 keeps the groups it is stored in (GGUF Q4 blocks load exactly); AWQ changes the weights: its own default
    keeps_blocks = native is not None and native.method == "int4" and (stored or mode not in QUANT_ALGORITHMS)
    group = config.quant_group_size or (native.group_size if keeps_blocks else 128)
    embeddings = config.quantize_embeddings
    if embeddings is None:
        embeddings = native.embeddings if native is not None else False
    quant = QuantConfig.of(mode, group, embeddings)
    if config.quantization is None and native is not None and native.mixed and keeps_blocks and \
            group == native.group_size:  # another quant_group_size asks for int4 of that group throughout
        return replace(quant, mixed=True)  # as stored; quantization="int4" asks for int4 throughout
    return quant


def default_mode(config: ModelConfig, ckpt: Checkpoint, native: QuantConfig, stored: bool) -> str:
    """The quantization a checkpoint runs with when none is asked for: as stored, except that a GGUF's int8 (blocks
    other than 4-, 5- and 6-bit ones, requantized per row; a file with those is int4 or mixed, and a file with any
    K-quant block that is int8 stays int8 with bf16 activations: neither calibrates unless asked, since
    a K-quant user expects the file to open at once) runs as SmoothQuant w8a8 where that costs the model at most
    ``calibrated.NLL_BUDGET`` (measured on first load, with the smoothing scales; both cached): the same int8
    weights, smoothed, with activations rounded to int8 per token (llama.cpp rounds them to 8 bits per block of
    32 for these types), so that prefill runs the VNNI int8 GEMM, twice bf16's products a cycle on CPU.
    Qwen2.5-Coder-0.5B's blocks as int8 pass (perplexity within 0.1% of bf16 activations'; its file, with Q4_K
    weights, now loads mixed); SmolLM2-135M as Q8_0 does not (+1.2%) and keeps bf16 activations."""
    if stored or native.method != "int8" or native.algorithm is not None or not _calibratable(ckpt) or \
            (isinstance(ckpt, GGUFCheckpoint) and ckpt.has_k_quants()):
        return native.mode
    from ember.model_loader.calibrated import smoothquant_holds

    holds = smoothquant_holds(ckpt, model_config(ckpt), config.tokenizer, config.device)
    return "smoothquant" if holds else native.mode


def _calibratable(ckpt: Checkpoint) -> bool:
    """Whether AWQ / SmoothQuant scales can fold into the model's norms (the Llama family's layout)."""
    return resolve_architecture(getattr(model_config(ckpt), "architectures", None))[1].calibrated


def _eos_ids(tokenizer: Tokenizer, hf_config: Any, gen: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (tokenizer.eos_token_id, gen.get("eos_token_id"), getattr(hf_config, "eos_token_id", None)):
        for i in source if isinstance(source, list) else [source]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


__all__ = ["Checkpoint", "HFCheckpoint", "LoadedModel", "TRTLLMCheckpoint", "TokenizerInfo", "check_parallel",
           "finalize", "load_model", "load_tokenizer", "model_config", "needs_calibration", "open_checkpoint",
           "read_shape", "resolve_quantization", "shared_vocabulary"]
