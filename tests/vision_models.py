"""Random-initialised vision-language checkpoints saved with transformers' own classes (no small real one ships on
the package registry): the test tokenizer plus an image token, the model, and its processor (image processor,
chat template), so that `transformers` with the same processor is the reference."""

from __future__ import annotations

import json

import numpy as np
import torch

LLAVA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_llava(out_dir: str, tokenizer_dir: str, seed: int = 0, image_size: int = 56) -> str:
    """A LLaVA model (CLIP tower of 3 layers, patch 14: (image_size / 14)^2 image tokens a picture; a Llama
    decoder of 2 layers) with a LlavaProcessor whose image processor resizes to image_size."""
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, initializer_range=0.3,
                       tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=image_size, patch_size=14, projection_dim=32)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # larger projector weights: the image changes the greedy answer
        model.model.multi_modal_projector.linear_2.weight.mul_(8)
    model.save_pretrained(out_dir)
    images = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size,
                                                                               "width": image_size})
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                               vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
                               num_additional_image_tokens=1)
    processor.save_pretrained(out_dir)
    tok.chat_template = LLAVA_TEMPLATE
    tok.save_pretrained(out_dir)
    return out_dir


def picture(seed: int, size: int = 64, width: int | None = None):
    """A random RGB PIL image, size x size, or size high and width wide."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, width or size, 3), dtype=np.uint8))


def generated_tokens(llm, prompts: list, params) -> list[list[int]]:
    """Each prompt's first sample's token ids."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def hf_llava_greedy(path: str, text: str, images: list, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' prompt ids (its processor's expansion) and greedy new tokens for text with images, float32."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


def hf_llava_features(path: str, images: list):
    """transformers' projected image features of each image ([tokens, hidden] float32 tensors)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        feats = model.get_image_features(pixel_values=pixels).pooler_output
    return [f.reshape(-1, f.shape[-1]) for f in feats]


QWEN2_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_qwen2_vl(out_dir: str, tokenizer_dir: str, seed: int = 0, v25: bool = False) -> str:
    """A Qwen2-VL model (vision tower of 2 blocks, width 32, patch 14, merge 2, temporal patch 2; a Qwen2 decoder
    of 2 layers, hidden 64, M-RoPE) with a Qwen2VLProcessor whose image processor keeps images between 4 and 64
    merged tokens (min_pixels / max_pixels), so that an image is a few dozen tokens. v25: Qwen2.5-VL (4 blocks,
    blocks 1 and 3 full attention, the others in windows of 2 x 2 merged tokens)."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, initializer_range=0.3,
                tie_word_embeddings=False,
                rope_parameters={"rope_type": "mrope", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    name = "Qwen2_5_VL" if v25 else "Qwen2VL"
    if v25:
        vision = dict(depth=4, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56,
                      fullatt_block_indexes=[1, 3])
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    config.architectures = [f"{name}ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).to(torch.float32).eval()
    with torch.no_grad():  # larger merger weights: the image changes the greedy answer
        model.model.visual.merger.mlp[2].weight.mul_(8)
    model.save_pretrained(out_dir)
    # the tokenizer and image processor only: Qwen2VLProcessor's video processor needs torchvision to load; the
    # processor is built from these two (ember.frontend.hf_processor), as AutoProcessor would with torchvision
    Qwen2VLImageProcessor(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28).save_pretrained(out_dir)
    tok.chat_template = QWEN2_VL_TEMPLATE
    tok.save_pretrained(out_dir)
    return out_dir


def hf_qwen2_vl_greedy(path: str, text: str, images: list, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' prompt ids (its processor's expansion) and greedy new tokens for text with images, float32."""
    import transformers

    from ember.frontend.hf_processor import load_processor

    processor = load_processor(path)
    with open(f"{path}/config.json") as f:
        architecture = json.load(f)["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32).eval()
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()
