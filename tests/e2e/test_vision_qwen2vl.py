"""Qwen2-VL and Qwen2.5-VL on random-initialised checkpoints saved with transformers' classes: greedy tokens equal
transformers' with the model's own processor, for images of different sizes and shapes (their token grids decide
the M-RoPE positions of the image and of all text after it), text only, a prefix-cache hit past an image, and
prompts computed in chunks that cut through the images."""

from __future__ import annotations

import numpy as np
import pytest

from ember import LLM, SamplingParams
from ember.errors import BadRequestError, ConfigError
from vision_models import generated_tokens, hf_qwen2_vl_greedy, picture, save_qwen2_vl

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{IMAGE}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{IMAGE}and\n{IMAGE}Which is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nNo picture here.<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def wide(seed: int):
    """A random RGB PIL image wider than high: a token grid of 2 x 4."""
    return picture(seed, 60, 120)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen_dir(request, tmp_path_factory, tokenizer_dir) -> str:
    return save_qwen2_vl(str(tmp_path_factory.mktemp(request.param)), tokenizer_dir, v25=request.param == "qwen2_5_vl")


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    llm = LLM(qwen_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    yield llm
    llm.shutdown()


def _tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return generated_tokens(llm, prompts, params)


def test_greedy_tokens_equal_transformers_with_its_processor(qwen, qwen_dir):
    cases = [(PROMPT, [picture(1)]), (PROMPT, [picture(2)]), (TWO, [picture(3, 100), wide(4)]),
             (PROMPT, [wide(5)]), (TEXT, [])]
    want = [hf_qwen2_vl_greedy(qwen_dir, text, images, 10) for text, images in cases]
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in cases]
    outs = qwen.generate(prompts, GREEDY, use_tqdm=False)  # one batch: rows with and without images together
    for out, (ids, tokens) in zip(outs, want):
        assert out.prompt_token_ids == ids  # each image token expanded as transformers' processor expands it
        assert out.outputs[0].token_ids == tokens
    assert want[0][1] != want[1][1]  # the image decides the answer: the test would see a wrong image
    image = qwen.client.images.image_token_id
    assert [want[i][0].count(image) for i in (0, 2, 3)] == [4, 16 + 8, 8]  # 2 x 2, 4 x 4 and 2 x 4 token grids


def test_chat_with_image_parts_gives_the_prompt_tokens_of_its_template(qwen, qwen_dir):
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture(6)},
                                             {"type": "text", "text": "What is in the picture?"}]}]
    out = qwen.chat(messages, GREEDY, use_tqdm=False)[0]
    ids, tokens = hf_qwen2_vl_greedy(qwen_dir, PROMPT, [picture(6)], 10)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)


def test_the_same_prompt_again_hits_the_prefix_cache_past_its_image(qwen_dir):
    """The second run's KV past the image comes from the cache; its decode positions (text index + rope delta)
    must still be right."""
    llm = LLM(qwen_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256, block_size=4)
    try:
        img = wide(7)
        ids, want = hf_qwen2_vl_greedy(qwen_dir, TWO, [img, picture(8, 100)], 10)
        prompt = {"prompt": TWO, "multi_modal_data": {"image": [img, picture(8, 100)]}}
        first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert first.outputs[0].token_ids == want and again.outputs[0].token_ids == want
        last_image = max(i for i, t in enumerate(ids) if t == llm.client.images.image_token_id)
        assert again.num_cached_tokens > last_image
    finally:
        llm.shutdown()


def test_chunked_prefill_through_images_gives_the_same_tokens(qwen_dir):
    """A step budget of 8 tokens: chunks start and end inside the images; each chunk's positions are its slice of
    the prompt's."""
    want = [hf_qwen2_vl_greedy(qwen_dir, TWO, [picture(9, 100), wide(10)], 10)[1],
            hf_qwen2_vl_greedy(qwen_dir, PROMPT, [wide(11)], 10)[1]]
    llm = LLM(qwen_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256, max_num_batched_tokens=8,
              enable_prefix_caching=False)
    try:
        got = _tokens(llm, [{"prompt": TWO, "multi_modal_data": {"image": [picture(9, 100), wide(10)]}},
                            {"prompt": PROMPT, "multi_modal_data": {"image": wide(11)}}])
        assert got == want
    finally:
        llm.shutdown()


def test_image_embeds_are_refused_by_name(qwen):
    """Embeddings carry no token grid, and M-RoPE positions need one."""
    with pytest.raises(BadRequestError, match="M-RoPE"):
        qwen.generate([{"prompt": PROMPT, "multi_modal_data": {"image_embeds": [np.zeros((4, 64), np.float32)]}}],
                      GREEDY, use_tqdm=False)


def test_both_tensor_layouts_load_alike(qwen_dir, tmp_path):
    """save_pretrained writes the hub's layout (the tower ``visual.``, the decoder ``model.``); transformers 5.x's
    module names (``model.visual.``, ``model.language_model.``) load to the same model too."""
    import shutil

    from safetensors.torch import load_file, save_file

    new = tmp_path / "new"
    shutil.copytree(qwen_dir, new)
    tensors = load_file(str(new / "model.safetensors"))
    assert any(k.startswith("visual.") for k in tensors) and any(k.startswith("model.layers.") for k in tensors)
    renamed = {("model." + k if k.startswith("visual.") else
                "model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in tensors.items()}
    save_file(renamed, str(new / "model.safetensors"), metadata={"format": "pt"})
    want = hf_qwen2_vl_greedy(qwen_dir, PROMPT, [wide(12)], 10)[1]
    llm = LLM(str(new), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    try:
        assert _tokens(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": wide(12)}}]) == [want]
    finally:
        llm.shutdown()


def test_speculative_drafts_are_verified_at_their_m_rope_positions(qwen_dir, monkeypatch):
    """A verify row (the last token, then the draft) continues from the sequence's rope delta as a decode row does:
    with drafts from the known answer (kept whole, in part, not at all), the tokens stay transformers'."""
    from internals import oracle_drafts

    images = [picture(13, 100), wide(14)]
    ids, want = hf_qwen2_vl_greedy(qwen_dir, TWO, images, 10)
    oracle_drafts(monkeypatch, [ids], [want])
    llm = LLM(qwen_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    try:
        assert _tokens(llm, [{"prompt": TWO, "multi_modal_data": {"image": images}}]) == [want]
        stats = llm.stats()
        assert stats["spec_decode_num_draft_tokens"] > 4 and stats["spec_decode_num_accepted_tokens"] > 0
    finally:
        llm.shutdown()


def test_a_processor_merging_otherwise_than_the_tower_fails_the_load(qwen_dir, tmp_path):
    from conftest import edited_copy

    bad = edited_copy(qwen_dir, tmp_path / "bad", "preprocessor_config.json", merge_size=1)
    with pytest.raises(ConfigError, match="merges 1 x 1 patches a token, its vision tower 2 x 2"):
        LLM(str(bad), dtype="float32", kv_cache_memory="16MiB", max_model_len=512)
