"""Images on CPU: the vision tower's throughput against transformers running the same tower, and the time to first
token of a prompt whose image was seen before against a text-only prompt of the same length.

    python benchmarks/vision.py [--repeats 5] [--out FILE]

No vision-language model small enough ships on the package registry, so the models are random-initialised at real
sizes: a CLIP ViT-B/16 tower (768 wide, 12 layers; at 224 px 196 patches, at 448 px 784) with LLaVA's projector,
before a Qwen2.5-0.5B-sized Llama decoder (896 wide, 24 layers), float32. Random weights take the same time as
trained ones. Every figure is the median of interleaved repeats in this one process.

- encoder: images/s of ``encode_images`` (tower + projector, batch 8) against transformers'
  ``get_image_features`` on the same checkpoint, at 224 and 448 px.
- TTFT: prefix caching off, so every prompt is computed; the image's encoding is in the encoder cache (seen
  before); the text-only prompt has as many tokens as the image prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def build(out: str, image_size: int) -> str:
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from ember.config import default_model_path
    from ember.tokenizer import Tokenizer
    from vision_models import LLAVA_TEMPLATE

    path = default_model_path()
    tok_dir = os.path.join(out, "tok")
    Tokenizer.load(path, gguf_file=path).hf.save_pretrained(tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = LlamaConfig(vocab_size=len(tok), hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True)
    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=image_size, patch_size=16)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<image>"))
    config.architectures = ["LlavaForConditionalGeneration"]
    model_dir = os.path.join(out, f"llava-{image_size}")
    LlavaForConditionalGeneration(config).save_pretrained(model_dir)
    size = {"height": image_size, "width": image_size}
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size=size),
                               tokenizer=tok, patch_size=16, vision_feature_select_strategy="default",
                               chat_template=LLAVA_TEMPLATE, num_additional_image_tokens=1)
    processor.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir


def encoder_throughput(model_dir: str, repeats: int, batch: int = 8) -> dict:
    from transformers import LlavaForConditionalGeneration

    from ember import LLM
    from internals import worker_of
    from vision_models import picture

    llm = LLM(model_dir, dtype="float32", kv_cache_memory="64MiB", max_model_len=2048)
    try:
        images = [picture(i, 256) for i in range(batch)]
        items = [llm.client.images._process(str(i), img)[1] for i, img in enumerate(images)]
        ember_model = worker_of(llm).model
        hf = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        pixels = torch.cat([torch.as_tensor(item["pixel_values"]) for item in items])

        def run_ember() -> None:
            ember_model.encode_images(items, torch.device("cpu"))

        def run_hf() -> None:
            with torch.inference_mode():
                hf.model.get_image_features(pixel_values=pixels)

        times: dict[str, list[float]] = {"ember": [], "transformers": []}
        for fn in (run_ember, run_hf):  # warm-up
            fn()
        for _ in range(repeats):
            for name, fn in (("ember", run_ember), ("transformers", run_hf)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        e, h = statistics.median(times["ember"]), statistics.median(times["transformers"])
        return {"batch": batch, "ember_images_per_s": batch / e, "transformers_images_per_s": batch / h,
                "ratio": h / e}
    finally:
        llm.shutdown()


def ttft(model_dir: str, repeats: int) -> dict:
    from ember import LLM, SamplingParams
    from vision_models import picture

    llm = LLM(model_dir, dtype="float32", kv_cache_memory="256MiB", max_model_len=2048, enable_prefix_caching=False)
    try:
        image = picture(99, 256)
        one = SamplingParams(max_tokens=1, temperature=0)
        words = "the quick brown fox jumps over a lazy dog near the river bank today " * 40
        question = "\nDescribe the picture in detail.<|im_end|>\n<|im_start|>assistant\n"
        with_image = {"prompt": "<|im_start|>user\n<image>" + question, "multi_modal_data": {"image": image}}
        image_len = len(llm.generate([with_image], one, use_tqdm=False)[0].prompt_token_ids)  # encodes it once
        ids = llm.client.tokenizer.encode(words, add_special_tokens=False)
        text_only = ids[:image_len]

        def timed(prompt) -> float:
            t = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            return time.perf_counter() - t

        seen, text = [], []
        for _ in range(repeats):
            seen.append(timed(with_image))
            text.append(timed(text_only))
        s, t = statistics.median(seen), statistics.median(text)
        encoded = llm.stats()["images_encoded"]
        return {"prompt_tokens": image_len, "seen_image_ttft_s": s, "text_only_ttft_s": t, "ratio": s / t,
                "images_encoded": encoded}
    finally:
        llm.shutdown()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    torch.manual_seed(0)
    result: dict = {"cpu": cpu_name(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as out:
        for size in (224, 448):
            model_dir = build(out, size)
            result[f"encoder_{size}px"] = encoder_throughput(model_dir, args.repeats)
            print(f"encoder {size}px:", result[f"encoder_{size}px"], flush=True)
            if size == 224:
                result["ttft_224px"] = ttft(model_dir, args.repeats)
                print("ttft:", result["ttft_224px"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
