"""Images in a prompt -> the prompt's token ids with each image's placeholder tokens, and one ``MultiModalInput`` an
image (content hash, place, the model's own processor's arrays). Runs in the caller's thread, before anything is
queued, so a bad image is refused with a ``BadRequestError`` naming it.

A prompt marks each image with the model's image token (its chat template writes it; a text or token-id prompt
holds it once an image, or already expanded to the image's length). The model's processor (transformers'
``AutoProcessor`` of the checkpoint folder) preprocesses each image and says how many tokens it takes: it expands
one image token for one image, exactly as it does for transformers' own generate."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from typing import Any

import numpy as np

from ember.errors import BadRequestError, ConfigError
from ember.frontend.hf_processor import load_processor
from ember.frontend.media import MediaPolicy, image_hash, load_image
from ember.protocol import MultiModalInput, Placeholder

_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
_IMAGE_PARTS = ("image_url", "image", "image_pil")  # OpenAI's part, and vLLM's for PIL images in LLM.chat


def image_parts(conversation: list[dict[str, Any]], images: "ImageInputs | None",
                model: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """A conversation's image parts taken out: the messages as chat templates read them (each image part becomes
    ``{"type": "image"}``) and the images, loaded and checked, in order. images: the model's image handling (None:
    a text-only model, which refuses image parts by name)."""
    found: list[Any] = []
    out = []
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in _IMAGE_PARTS
                                                    for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in _IMAGE_PARTS:
                parts.append(part)
                continue
            field = f"messages[{i}].content[{j}]"
            if images is None:
                # the model's file name, not its path: the message may go to an HTTP client
                raise BadRequestError(f"{field} is an image part: model {os.path.basename(model.rstrip(os.sep))} "
                                      "takes text only")
            source = part.get(kind)
            if kind == "image_url" and isinstance(source, dict):
                source = source.get("url")
            if source is None:
                raise BadRequestError(f"{field}.{kind} is missing: an {kind} part holds the image")
            if len(found) == images.limit:
                raise BadRequestError(f"{field}: more than {images.limit} images in one prompt (limit_mm_per_prompt)")
            found.append(load_image(source, field, images.policy))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, found


class ImageInputs:
    """A vision-language model's image handling: load and check each image, preprocess it, place its tokens."""

    def __init__(self, path: str, image_token_id: int, limit: int, policy: MediaPolicy, hidden_size: int,
                 image_tokens: int | None = None, image_pixels: tuple[int, int] | None = None,
                 image_grid: bool = False) -> None:
        """hidden_size: the decoder's width, the width of image embeddings given instead of images;
        image_tokens / image_pixels: what the model's tower takes when that is fixed (ModelInfo), else None;
        image_grid: the model's positions follow each image's token grid (M-RoPE)."""
        self.image_grid = image_grid
        self.path, self.image_token_id, self.limit, self.policy = path, image_token_id, limit, policy
        self.hidden_size, self.image_tokens = hidden_size, image_tokens
        self.image_pixels = tuple(image_pixels) if image_pixels is not None else None
        self._processor: Any = None
        self._lock = threading.Lock()  # the processor is built once, on first use, by whichever thread comes first
        self._cache: dict[str, tuple[int, dict[str, Any]]] = {}  # hash -> (tokens, arrays): the last few images
        self._order: list[str] = []

    @property
    def processor(self) -> Any:
        if not os.path.isdir(self.path):
            raise BadRequestError(f"images: model {self.path} has no processor files (a Hugging Face folder holds "
                                  "them): pass image_embeds, or serve the model's folder")
        with self._lock:
            if self._processor is None:
                from transformers.utils import logging as hf_logging

                verbosity = hf_logging.get_verbosity()
                hf_logging.set_verbosity_error()  # "falling back to the PIL image processor" is expected here
                try:
                    self._processor = load_processor(self.path)
                finally:
                    hf_logging.set_verbosity(verbosity)
            return self._processor

    @property
    def image_token(self) -> str:
        tokenizer = getattr(self.processor, "tokenizer", None)
        if tokenizer is None:
            raise ConfigError(f"model={self.path!r}: its processor has no tokenizer: a vision-language model needs a "
                              "processor with one (processor_config.json)")
        return tokenizer.convert_ids_to_tokens(self.image_token_id)

    def images_of(self, value: Any, field: str) -> list[Any]:
        """The images a prompt's ``multi_modal_data['image']`` gives: one image or a list of them."""
        images = list(value) if isinstance(value, (list, tuple)) else [value]
        if not images:
            raise BadRequestError(f"{field}=[] is empty: pass an image or a list of images")
        if len(images) > self.limit:
            raise BadRequestError(f"{field} holds {len(images)} images: at most {self.limit} a prompt "
                                  "(limit_mm_per_prompt)")
        return [load_image(img, f"{field}[{i}]" if len(images) > 1 else field, self.policy)
                for i, img in enumerate(images)]

    def embeds_of(self, value: Any, field: str) -> list[np.ndarray]:
        """Image embeddings given instead of images (``multi_modal_data['image_embeds']``, DashInfer's mm_info):
        one [tokens, hidden] array an image (a list of them, or one [images, tokens, hidden] array), float, finite,
        of the decoder's width. They take the image's place as they are: the vision encoder does not run."""
        if hasattr(value, "detach"):  # a torch tensor, wherever it lives
            value = value.detach().float().cpu().numpy()
        if isinstance(value, np.ndarray) and value.ndim == 3:
            value = list(value)
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if not items or len(items) > self.limit:
            raise BadRequestError(f"{field} holds {len(items)} images: give 1 to {self.limit} (limit_mm_per_prompt)")
        out = []
        for i, e in enumerate(items):
            name = f"{field}[{i}]"
            if hasattr(e, "detach"):
                e = e.detach().float().cpu().numpy()
            e = np.asarray(e) if isinstance(e, (np.ndarray, list)) else e
            if not isinstance(e, np.ndarray) or e.ndim != 2 or e.shape[1] != self.hidden_size or not e.shape[0] \
                    or e.dtype.kind != "f":
                shape = getattr(e, "shape", type(e).__name__)
                raise BadRequestError(f"{name} of shape {shape} is not supported: pass a float array of shape "
                                      f"[tokens, {self.hidden_size}] (the decoder's width)")
            if not np.isfinite(e).all():
                raise BadRequestError(f"{name} holds NaN or infinite values: embeddings must be finite")
            out.append(np.ascontiguousarray(e, dtype=np.float32))
        return out

    def place_embeds(self, ids: list[int], embeds: list[np.ndarray],
                     field: str) -> tuple[list[int], tuple[MultiModalInput, ...]]:
        """As ``place``, for embeddings: each run of image tokens is 1 or exactly its embedding's rows long."""
        if self.image_grid:
            raise BadRequestError(f"{field}: image embeddings are not supported by this model: its positions follow "
                                  "each image's grid of tokens (M-RoPE), which only the image gives; pass the image")
        items = [(hashlib.blake2b(e.tobytes() + str(e.shape).encode(), digest_size=16).hexdigest(), e.shape[0],
                  {"image_embeds": e}) for e in embeds]
        return self._place(ids, items, field)

    def place(self, ids: list[int], images: list[Any], field: str) -> tuple[list[int], tuple[MultiModalInput, ...]]:
        """The ids with each image's run of image tokens expanded to its length, and the images' inputs."""
        items = []
        for i, image in enumerate(images):
            h = image_hash(image)
            items.append((h, *self._process(h, image, f"{field}[{i}]")))
        return self._place(ids, items, field)

    def _place(self, ids: list[int], items: list[tuple[str, int, dict[str, Any]]],
               field: str) -> tuple[list[int], tuple[MultiModalInput, ...]]:
        """Each run of image tokens holds the next images: one token each (expanded here), or exactly their
        lengths (expanded already); adjacent images make one run."""
        out: list[int] = []
        inputs: list[MultiModalInput] = []
        at, i = 0, 0
        for start, length in _runs(ids, self.image_token_id):
            out.extend(ids[at:start])
            taken = _split(length, [tokens for _, tokens, _ in items[i:]])
            if taken is None:
                left = len(items) - i
                raise BadRequestError(
                    f"{field}: the prompt's image tokens ({self.image_token!r}) do not match the {len(items)} "
                    f"images given: a run of {length} at token {start} holds neither one token an image nor whole "
                    f"images ({left} left, of {[t for _, t, _ in items[i:]]} tokens); put one image token where "
                    "each image goes (the chat template does this for image parts)")
            for h, tokens, data in items[i:i + taken]:
                inputs.append(MultiModalInput(Placeholder(h, len(out), tokens,
                                                          self._grid(data, tokens, f"{field}[{i}]")), data))
                out.extend([self.image_token_id] * tokens)
                i += 1
            at = start + length
        if i != len(items):
            raise BadRequestError(f"{field}: the prompt marks {i} images (image token {self.image_token!r}) and "
                                  f"{len(items)} were given: put one image token where each image goes (the chat "
                                  "template does this for image parts)")
        out.extend(ids[at:])
        return out, tuple(inputs)

    @property
    def merge_size(self) -> int | None:
        """The processor's spatial merge (Qwen2-VL: 2 x 2 patches a token), for models whose token positions
        follow each image's grid; None for the others (and for a checkpoint without processor files)."""
        if not os.path.isdir(self.path):
            return None
        return getattr(self.processor.image_processor, "merge_size", None)

    def _grid(self, data: dict[str, Any], tokens: int, field: str) -> tuple[int, int, int] | None:
        """An image's token grid (temporal, height, width after the merge) from the processor's image_grid_thw
        (Qwen2-VL); None where the processor gives none."""
        thw = data.get("image_grid_thw")
        if thw is None:
            if self.image_grid:
                raise BadRequestError(f"{field}: the model's processor gave no image_grid_thw; this model's positions "
                                      "follow each image's grid (M-RoPE)")
            return None
        t, h, w = (int(v) for v in np.asarray(thw).reshape(3))
        m = self.merge_size or 1
        grid = (t, h // m, w // m)
        if grid[0] * grid[1] * grid[2] != tokens:
            raise BadRequestError(f"{field}: its token grid {grid} does not hold its {tokens} tokens")
        return grid

    def _process(self, h: str, image: Any, field: str) -> tuple[int, dict[str, Any]]:
        """The processor's arrays for one image and how many tokens it takes (kept for the last 32 images), checked
        against what the model's tower takes."""
        hit = self._cache.get(h)
        if hit is not None:
            return hit
        processor, token = self.processor, self.image_token
        try:
            enc = processor(text=token, images=[image], return_tensors="np")
        except Exception as e:  # noqa: BLE001 (a processor's refusal is the request's error)
            raise BadRequestError(f"{field}: the model's processor refused the image: {e}") from e
        tokens = int((enc["input_ids"][0] == self.image_token_id).sum())
        data = {k: v for k, v in enc.items() if k not in _TEXT_KEYS}
        self._check(tokens, data, field)
        with self._lock:
            self._cache[h] = (tokens, data)
            self._order.append(h)
            if len(self._order) > 32:
                self._cache.pop(self._order.pop(0), None)
        return tokens, data

    def _check(self, tokens: int, data: dict[str, Any], field: str) -> None:
        """The processor's output against the tower's fixed input (LLaVA): a checkpoint whose processor config does
        not match its model is refused here, per request, never in the engine (where it would stop every request)."""
        pixels = np.shape(data.get("pixel_values", ()))
        if self.image_pixels is not None and tuple(pixels[-2:]) != self.image_pixels:
            raise BadRequestError(f"{field}: the model's processor made {tuple(pixels[-2:])} pixels; the vision "
                                  f"tower takes {self.image_pixels} (the checkpoint's processor config does not match "
                                  "its model: resize / crop settings)")
        if self.image_tokens is not None and tokens != self.image_tokens:
            raise BadRequestError(f"{field}: the model's processor gives the image {tokens} tokens; the vision tower "
                                  f"makes {self.image_tokens} (the checkpoint's processor config does not match its "
                                  "model: num_additional_image_tokens / vision_feature_select_strategy)")

    def check_model(self) -> None:
        """At start-up: one small picture through the processor, so a checkpoint whose processor does not match its
        model fails to load (ConfigError) instead of refusing every request."""
        from PIL import Image

        if not os.path.isdir(self.path):
            return  # a single-file checkpoint (.asmodel): embeddings only
        if self.image_grid:  # the tower merges config.vision_config.spatial_merge_size^2 patches a token
            with open(os.path.join(self.path, "config.json")) as f:
                merge = json.load(f).get("vision_config", {}).get("spatial_merge_size")
            if merge is not None and self.merge_size != merge:
                raise ConfigError(f"model={self.path!r}: its processor merges {self.merge_size} x {self.merge_size} "
                                  f"patches a token, its vision tower {merge} x {merge}: the checkpoint's "
                                  "preprocessor config does not match its model")
        try:
            self._process("start-up", Image.new("RGB", (64, 48), (127, 127, 127)), "start-up image")
        except BadRequestError as e:
            raise ConfigError(f"model={self.path!r}: {e}") from None
        finally:
            self._cache.pop("start-up", None)


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``token`` in ids."""
    runs: list[tuple[int, int]] = []
    i, n = 0, len(ids)
    while i < n:
        if ids[i] == token:
            j = i
            while j < n and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def _split(length: int, tokens: list[int]) -> int | None:
    """How many of the next images (of these token counts) a run of ``length`` image tokens holds: as many as its
    length, one token each (not expanded yet), or as many as fill it exactly (expanded already); None: neither."""
    total = 0
    for k, t in enumerate(tokens, 1):
        total += t
        if total == length:
            return k
        if total > length:
            break
    return length if length <= len(tokens) else None
