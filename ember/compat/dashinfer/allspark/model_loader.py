"""DashInfer's model loaders: HuggingFaceModel reads a checkpoint and serializes it into ember's .asmodel/.asparam
pair (on disk, or into temporary files for the in-memory mode); DashInferModel opens a pair serialized before.
Both hand out the tokenizer and reference runtime / generation configs for the model."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ember.compat.dashinfer.allspark.generation_config import ASGenerationConfigBuilder
from ember.compat.dashinfer.allspark.lora import LoraRecipe
from ember.compat.dashinfer.allspark.runtime_config import AsModelConfig, AsModelRuntimeConfigBuilder
from ember.compat.dashinfer.allspark.status import ModelSerializerException, TargetDevice
from ember.config import ModelShape, hub
from ember.model_loader import asmodel, open_checkpoint
from ember.quantization.config import QuantConfig

logger = logging.getLogger("ember")


_QUANT_KEYS = ("quant_method", "weight_format", "group_size", "compute_method")


@dataclass(slots=True)
class QuantRecipe:
    """What DashInfer's serialize(enable_quant=..., weight_only_quant=..., customized_quant_config=...) asked for,
    recorded as given in the pair's ``extra["dashinfer"]["serialize"]``; the QuantConfig it translates to
    (``quant_config_from_recipe``) is what the weights were quantized with."""

    enable_quant: bool = False
    weight_only_quant: bool = False
    customized_quant_config: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"enable_quant": self.enable_quant, "weight_only_quant": self.weight_only_quant,
                "customized_quant_config": self.customized_quant_config}


def quant_config_from_recipe(enable_quant: bool, weight_only_quant: bool,
                             custom: dict[str, Any] | None) -> QuantConfig | None:
    """DashInfer's quantization switches as ember's QuantConfig. weight_only_quant: A16W8 (weight_format 'int8',
    per channel) or A16W4 ('uint4', group_size 32/64/128, default 128); otherwise A8W8 (int8 weights and
    activations: ember's 'w8a8'). customized_quant_config keys: quant_method ('instant_quant'), weight_format,
    group_size (-1: per channel), compute_method ('weight_only' | 'activate_quant', overrides weight_only_quant)."""
    if not enable_quant:
        return None
    custom = dict(custom or {})
    unknown = sorted(set(custom) - set(_QUANT_KEYS))
    if unknown:
        raise ValueError(f"customized_quant_config has unknown key {unknown[0]!r}: supported keys are {_QUANT_KEYS}")
    if custom.get("quant_method", "instant_quant") != "instant_quant":
        raise ValueError(f"customized_quant_config quant_method={custom['quant_method']!r} is not supported: ember "
                         "quantizes at serialization ('instant_quant')")
    fmt = custom.get("weight_format", "int8")
    if fmt not in ("int8", "uint4"):
        raise ValueError(f"customized_quant_config weight_format={fmt!r} is not supported: use 'int8' or 'uint4'")
    compute = custom.get("compute_method", "weight_only" if weight_only_quant else "activate_quant")
    if compute not in ("weight_only", "activate_quant"):
        raise ValueError(f"customized_quant_config compute_method={compute!r} is not supported: use 'weight_only' "
                         "or 'activate_quant'")
    group = custom.get("group_size", 128 if fmt == "uint4" else -1)
    if fmt == "int8":
        if group not in (-1, None):
            raise ValueError(f"customized_quant_config group_size={group!r} is out of range for weight_format "
                             "'int8': ember's int8 weights have one scale per output channel (-1)")
        return QuantConfig("int8" if compute == "weight_only" else "w8a8")
    if compute == "activate_quant":
        raise ValueError("customized_quant_config weight_format='uint4' needs weight_only_quant=True (or "
                         "compute_method='weight_only'): int4 weights with int8 activations are not supported")
    return QuantConfig("int4", group)


class _TempPair:
    """The temporary folder of an in-memory serialization. Freed by free_model() / free_memory_serialize_file() or
    at exit; while an engine holds it (given to serialize_to_memory, or the model installed but not yet loaded) the
    removal waits for it."""

    _by_model_path: dict[str, "_TempPair"] = {}
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="ember-asmodel-")
        self.pins = 0
        self.freed = False
        # tied to the class, not the loader: a loader dropped after install_model must not take the files along;
        # runs at exit or when free() calls it
        self._finalizer = weakref.finalize(_TempPair, shutil.rmtree, self.folder, True)

    def register(self, model_path: str) -> None:
        with self._lock:
            self._by_model_path[os.path.abspath(model_path)] = self

    def free(self) -> None:
        with self._lock:
            self.freed = True
            if self.pins == 0:
                self._remove()

    def _remove(self) -> None:
        self._finalizer()
        for k in [k for k, v in self._by_model_path.items() if v is self]:
            del self._by_model_path[k]

    @classmethod
    def pin(cls, model_path: str) -> None:
        with cls._lock:
            pair = cls._by_model_path.get(os.path.abspath(model_path))
            if pair is not None:
                pair.pins += 1

    @classmethod
    def unpin(cls, model_path: str) -> None:
        with cls._lock:
            pair = cls._by_model_path.get(os.path.abspath(model_path))
            if pair is not None:
                pair.pins -= 1
                if pair.freed and pair.pins == 0:
                    pair._remove()


pin_model_files, unpin_model_files = _TempPair.pin, _TempPair.unpin


def _default_device() -> TargetDevice:
    return TargetDevice.CUDA if torch.cuda.is_available() else TargetDevice.CPU


class LLM:
    """What every loader offers: the model's config, tokenizer, context length and reference configs."""

    def __init__(self) -> None:
        self.hf_model_config: Any = None
        self.generation_config_dict: dict[str, Any] = {}
        self.tokenizer: Any = None  # ember.tokenizer.Tokenizer; get_tokenizer() hands out the transformers one
        self.serialize_model_name = ""
        self.model_output_dir = ""
        self.model_path = ""  # the .asmodel this loader's model runs from, once known

    def _checkpoint(self):
        raise NotImplementedError

    def read_model_config(self) -> "LLM":
        """Read the model's config and generation defaults (load_model does it too)."""
        if self.hf_model_config is None:
            ckpt = self._checkpoint()
            self.hf_model_config = ckpt.hf_config()
            self.generation_config_dict = ckpt.generation_config()
        return self

    def get_model_config(self) -> dict[str, Any]:
        return self.read_model_config().hf_model_config.to_dict()

    def init_tokenizer(self, padding_side: str = "left") -> "LLM":
        if self.tokenizer is None:
            self.tokenizer = self._checkpoint().tokenizer()
            self.tokenizer.hf.padding_side = padding_side
        return self

    def get_tokenizer(self) -> Any:
        """The transformers tokenizer (encode, decode, apply_chat_template); call init_tokenizer() first."""
        if self.tokenizer is None:
            raise ModelSerializerException("the tokenizer is not loaded: call init_tokenizer() first", 1,
                                           self.serialize_model_name)
        return self.tokenizer.hf

    def get_model_context_length(self) -> int:
        return int(getattr(self.read_model_config().hf_model_config, "max_position_embeddings", 0) or 8192)

    def _eos_token_id(self) -> int | list[int] | None:
        for source in (self.generation_config_dict.get("eos_token_id"),
                       getattr(self.read_model_config().hf_model_config, "eos_token_id", None)):
            if source is not None:
                return source
        return self.init_tokenizer().tokenizer.eos_token_id

    def create_reference_generation_config_builder(self, runtime_cfg: AsModelConfig | None = None
                                                   ) -> ASGenerationConfigBuilder:
        """The model's generation defaults (transformers' defaults where its generation_config is silent), with
        max_length capped by the runtime config's."""
        from transformers import GenerationConfig

        self.read_model_config()
        gen = dict(self.generation_config_dict)
        gen.setdefault("eos_token_id", self._eos_token_id())
        known = {k: v for k, v in gen.items() if not k.startswith("_") and k != "transformers_version"}
        builder = ASGenerationConfigBuilder(GenerationConfig(**known).to_dict() | {"eos_token_id": gen["eos_token_id"]})
        max_length = self.get_model_context_length()
        if runtime_cfg is not None:
            max_length = min(max_length, runtime_cfg.engine_max_length)
        builder.update({"max_length": max_length})
        return builder

    def create_reference_runtime_config_builder(self, engine_model_name: str | None = None,
                                                device_type: TargetDevice | str | None = None,
                                                device_ids: list[int] | None = None, max_batch: int = 32,
                                                max_context_length: int = -1) -> AsModelRuntimeConfigBuilder:
        """A runtime config for this model: its serialized files, the device, max_batch, and the model's context
        length (or max_context_length)."""
        if max_context_length == -1:
            max_context_length = self.get_model_context_length()
        builder = (AsModelRuntimeConfigBuilder()
                   .model_name(engine_model_name or self.serialize_model_name)
                   .compute_unit(device_type or _default_device(), device_ids)
                   .max_length(max_context_length)
                   .max_batch(max_batch))
        if self.model_path:
            builder.model_file_path(self.model_path, self.model_path[:-len(asmodel.MODEL_SUFFIX)]
                                    + asmodel.PARAM_SUFFIX)
        return builder


class HuggingFaceModel(LLM):
    """A Hugging Face checkpoint folder (or a GGUF file) to serialize for the engine. A hub id that is not a local
    path is resolved by ``ember.config.hub``: the Hugging Face cache, then ModelScope's (when the modelscope package
    is installed), then a download unless HF_HUB_OFFLINE is set."""

    def __init__(self, pretrain_model_name_or_path: str, pretrain_model_name: str, in_memory_serialize: bool = False,
                 user_set_data_type: str | None = None, trust_remote_code: bool = False) -> None:
        super().__init__()
        if not pretrain_model_name_or_path:
            raise ValueError(f"pretrain_model_name_or_path={pretrain_model_name_or_path!r} is empty: pass a local "
                             "Hugging Face folder, a .gguf file or a hub id")
        path = hub.resolve(str(pretrain_model_name_or_path), arg="pretrain_model_name_or_path", modelscope=True,
                           accepted="a local Hugging Face folder or .gguf file")
        if os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "config.json")):
                ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
                if len(ggufs) != 1:
                    raise ValueError(f"pretrain_model_name_or_path={path!r} has no config.json and {len(ggufs)} .gguf "
                                     "files: it is not a model (an empty folder?)")
                path = os.path.join(path, ggufs[0])
        elif not path.endswith((".gguf", asmodel.MODEL_SUFFIX)):
            raise ValueError(f"pretrain_model_name_or_path={path!r} is a file but not .gguf: pass a Hugging Face "
                             "folder or a .gguf file")
        if trust_remote_code:
            logger.warning("trust_remote_code=True has no effect: ember runs its own implementation of each "
                           "architecture and never executes code from a checkpoint")
        self.hf_model_path = path
        self.pretrain_model_name = pretrain_model_name
        self.serialize_model_name = pretrain_model_name.replace("/", "_")
        self.in_memory_serialize = in_memory_serialize
        self.user_set_data_type = user_set_data_type
        self.data_type: str | None = user_set_data_type
        self.contents: asmodel.ModelContents | None = None
        self.quant = QuantRecipe()
        self._temp: _TempPair | None = None
        self._ckpt = None
        if user_set_data_type is not None:
            asmodel.parse_dtype(user_set_data_type, None, "user_set_data_type")

    def _checkpoint(self):
        if self._ckpt is None:
            try:
                self._ckpt = open_checkpoint(self.hf_model_path)
            except ValueError as e:
                raise ModelSerializerException(f"cannot read {self.hf_model_path!r}: {e}", 1,
                                               self.serialize_model_name) from e
        return self._ckpt

    def _dtype(self) -> torch.dtype:
        return asmodel.parse_dtype(self.data_type, self.read_model_config().hf_model_config, "user_set_data_type")

    def load_model(self, override_data_type: str | None = None, **kwargs: Any) -> "HuggingFaceModel":
        """Read the weights into memory in the chosen data type (user_set_data_type, else the checkpoint's)."""
        if override_data_type is not None:
            asmodel.parse_dtype(override_data_type, None, "override_data_type")
            self.data_type = override_data_type
        self.read_model_config()
        self.contents = asmodel.read_contents(self._checkpoint(), self._dtype(), os.path.abspath(self.hf_model_path))
        self.tokenizer = self.tokenizer or self.contents.tokenizer
        return self

    def init_quantization(self, enable: bool = True, customized_quant_config: dict | None = None
                          ) -> "HuggingFaceModel":
        """Record a quantization recipe (written into the serialized model)."""
        self.quant = QuantRecipe(enable, self.quant.weight_only_quant, customized_quant_config)
        return self

    def _shape(self) -> ModelShape:
        """The model's shape, which lora_cfg's adapters are checked against."""
        return ModelShape.of(self.read_model_config().hf_model_config)

    def _write(self, out_dir: str, enable_quant: bool, weight_only_quant: bool,
               customized_quant_config: dict | None, lora: LoraRecipe | None = None) -> str:
        """Write the pair (unless lora_only) and the adapters of lora_cfg beside it; the model's path."""
        if lora is not None:  # adapters first: one that does not fit the model fails before the model is written
            lora.write(out_dir, self._shape())
            if lora.lora_only:
                return asmodel.pair_paths(out_dir, self.serialize_model_name)[0]
        if self.contents is None:
            self.load_model()
        self.contents.extra["dashinfer"] = {
            "serialize": QuantRecipe(enable_quant, weight_only_quant, customized_quant_config).to_dict(),
            "lora": lora is not None}  # serialized for LoRA: the engine gets adapter slots (lora_max_num)
        self.contents.quant_config = quant_config_from_recipe(enable_quant, weight_only_quant, customized_quant_config)
        return asmodel.write(self.contents, out_dir, self.serialize_model_name)[0]

    def serialize(self, engine: Any = None, model_output_dir: str = "", enable_quant: bool = False,
                  weight_only_quant: bool = False, customized_quant_config: dict | None = None,
                  skip_if_exists: bool = False, lora_cfg: dict | None = None, **kwargs: Any) -> "HuggingFaceModel":
        """serialize_to_memory when the loader was made with in_memory_serialize=True, else serialize_to_path."""
        if self.in_memory_serialize:
            return self.serialize_to_memory(engine, enable_quant, weight_only_quant,
                                            customized_quant_config=customized_quant_config, lora_cfg=lora_cfg)
        if not model_output_dir:
            raise ValueError("model_output_dir='' is empty: serializing to files needs an output folder")
        return self.serialize_to_path(engine, model_output_dir, enable_quant, weight_only_quant,
                                      customized_quant_config=customized_quant_config, skip_if_exists=skip_if_exists,
                                      lora_cfg=lora_cfg)

    def serialize_to_path(self, engine: Any = None, model_output_dir: str = "", enable_quant: bool = False,
                          weight_only_quant: bool = False, skip_if_exists: bool = False,
                          customized_quant_config: dict | None = None, lora_cfg: dict | None = None,
                          **kwargs: Any) -> "HuggingFaceModel":
        """Write model_output_dir/NAME.asmodel + NAME.asparam (and NAME.aslora for each adapter of lora_cfg);
        skip_if_exists keeps a pair that validates."""
        if not model_output_dir:
            raise ValueError("model_output_dir='' is empty: serialize_to_path needs an output folder")
        lora = LoraRecipe.of(lora_cfg)
        model_path, _ = asmodel.pair_paths(model_output_dir, self.serialize_model_name)
        if skip_if_exists and asmodel.validate(model_path) is None:
            logger.info("%s exists and validates: serialization skipped", model_path)
            if lora is not None:
                lora.write(model_output_dir, self._shape())
        else:
            self._write(model_output_dir, enable_quant, weight_only_quant, customized_quant_config, lora)
        self.model_output_dir, self.model_path = model_output_dir, model_path
        return self

    def serialize_to_memory(self, engine: Any = None, enable_quant: bool = False, weight_only_quant: bool = False,
                            customized_quant_config: dict | None = None, lora_cfg: dict | None = None,
                            **kwargs: Any) -> "HuggingFaceModel":
        """Serialize into temporary files, removed by free_model(), free_memory_serialize_file() or at process exit;
        the engine given here keeps them until its start_model has loaded them (the guide's snippet frees the model
        before it installs it)."""
        lora = LoraRecipe.of(lora_cfg)
        self.free_memory_serialize_file()
        self.in_memory_serialize = True
        self._temp = _TempPair()
        self.model_path = self._write(self._temp.folder, enable_quant, weight_only_quant, customized_quant_config,
                                      lora)
        self.model_output_dir = self._temp.folder
        self._temp.register(self.model_path)
        if engine is not None and hasattr(engine, "_hold_until_loaded"):
            engine._hold_until_loaded(self.model_path)  # the engine keeps the files until it has loaded them
        return self

    def free_memory_serialize_file(self) -> "HuggingFaceModel":
        """Remove the in-memory serialization's files (once no engine still needs to load them)."""
        if self._temp is not None:
            self._temp.free()
            self._temp = None
        return self

    def free_model(self) -> "HuggingFaceModel":
        """Drop the weights read by load_model and, as the guide says, an in-memory serialization's temporary files
        (they wait until the engine given to serialize_to_memory, or one that installed the model, has loaded
        them). Files serialized to a path stay."""
        self.contents = None
        return self.free_memory_serialize_file()

    @property
    def temp_folder(self) -> str | None:
        return self._temp.folder if self._temp is not None else None


class DashInferModel(LLM):
    """A model serialized before: MODEL_DIR/NAME.asmodel + NAME.asparam (or the path of the .asmodel itself)."""

    def __init__(self, pretrain_model_name_or_path: str, pretrain_model_name: str = "model",
                 config_file_path: str | None = None, config_content: str | None = None) -> None:
        super().__init__()
        path = os.path.expanduser(str(pretrain_model_name_or_path or ""))
        if path.endswith(asmodel.MODEL_SUFFIX):
            model_path = path
            pretrain_model_name = os.path.basename(path)[:-len(asmodel.MODEL_SUFFIX)]
        else:
            model_path = asmodel.pair_paths(path, pretrain_model_name.replace("/", "_"))[0]
        problem = asmodel.validate(model_path)
        if problem is not None:
            raise ValueError(f"DashInferModel({pretrain_model_name_or_path!r}, {pretrain_model_name!r}): "
                             f"{model_path!r} cannot be used: {problem}")
        if config_file_path is not None or config_content is not None:
            logger.warning("config_file_path/config_content are not used: an .asmodel file carries its own config")
        self.serialize_model_name = pretrain_model_name.replace("/", "_")
        self.model_path = model_path
        self.model_output_dir = os.path.dirname(model_path)
        self._ckpt = None

    def _checkpoint(self):
        if self._ckpt is None:
            self._ckpt = open_checkpoint(self.model_path)
        return self._ckpt

    def load_model(self, **kwargs: Any) -> "DashInferModel":
        return self.read_model_config()

    def init_quantization(self, enable: bool = True, customized_quant_config: dict | None = None
                          ) -> "DashInferModel":
        return self

    def serialize(self, *args: Any, **kwargs: Any) -> "DashInferModel":
        return self  # already serialized

    serialize_to_path = serialize_to_memory = serialize

    def free_model(self) -> "DashInferModel":
        return self

    def free_memory_serialize_file(self) -> "DashInferModel":
        return self
