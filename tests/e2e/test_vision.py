"""Images in prompts, on a random-initialised LLaVA (CLIP tower + Llama decoder) saved with transformers' classes:
greedy tokens equal transformers' with the model's own processor; a repeated image is encoded once and its prompt
hits the prefix cache; the same text with another image never takes the first image's KV; bad images are refused
by name and the engine keeps serving."""

from __future__ import annotations

import io

import pytest
import torch

from ember import LLM, SamplingParams
from ember.errors import BadRequestError, ConfigError
from vision_models import generated_tokens, hf_llava_features, hf_llava_greedy, picture, save_llava

PROMPT = "<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\n<image>\nand\n<image>\nWhich is brighter?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, tokenizer_dir) -> str:
    return save_llava(str(tmp_path_factory.mktemp("llava")), tokenizer_dir)


@pytest.fixture(scope="module")
def llava(llava_dir):
    llm = LLM(llava_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    yield llm
    llm.shutdown()


def _tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return generated_tokens(llm, prompts, params)


def test_greedy_tokens_equal_transformers_with_its_processor(llava, llava_dir):
    cases = [(PROMPT, [picture(1)]), (PROMPT, [picture(2)]), (TWO, [picture(3), picture(4)]),
             ("<|im_start|>user\nNo picture here.<|im_end|>\n<|im_start|>assistant\n", [])]
    want = [hf_llava_greedy(llava_dir, text, images, 10) for text, images in cases]
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in cases]
    outs = llava.generate(prompts, GREEDY, use_tqdm=False)  # one batch: rows with and without images together
    for out, (ids, tokens) in zip(outs, want):
        assert out.prompt_token_ids == ids  # each image token expanded as transformers' processor expands it
        assert out.outputs[0].token_ids == tokens
    assert want[0][1] != want[1][1]  # the image decides the answer: the test would see a wrong image


def test_chat_with_image_parts_gives_the_prompt_tokens_of_its_template(llava, llava_dir):
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture(5)},
                                             {"type": "text", "text": "What is in the picture?"}]}]
    out = llava.chat(messages, GREEDY, use_tqdm=False)[0]
    ids, tokens = hf_llava_greedy(llava_dir, PROMPT, [picture(5)], 10)
    assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, tokens)


def test_same_text_with_another_image_never_takes_the_first_images_kv(llava_dir):
    """The prefix cache keys a block by the images its placeholders hold: with image B after image A, only the
    blocks before the image are hits; image A again hits past it."""
    llm = LLM(llava_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256, block_size=4)
    try:
        a, b = picture(6), picture(7)
        ids, want_b = hf_llava_greedy(llava_dir, PROMPT, [b], 10)
        start = ids.index(llm.client.images.image_token_id)
        first = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": a}}], GREEDY, use_tqdm=False)[0]
        other = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": b}}], GREEDY, use_tqdm=False)[0]
        again = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": a}}], GREEDY, use_tqdm=False)[0]
        assert other.outputs[0].token_ids == want_b
        assert other.num_cached_tokens == start // 4 * 4  # the text blocks before the image only
        assert again.num_cached_tokens > start + 16  # past the image: its KV is the first image's, rightly
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        llm.shutdown()


def test_a_repeated_image_is_encoded_once(llava_dir):
    llm = LLM(llava_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256, enable_prefix_caching=False)
    try:
        img = picture(8)
        prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": img}},
                   {"prompt": "<|im_start|>user\n<image>\nDescribe it.<|im_end|>\n<|im_start|>assistant\n",
                    "multi_modal_data": {"image": img.copy()}}]  # another object, the same pixels
        _tokens(llm, prompts[:1])
        _tokens(llm, prompts[1:])
        assert llm.stats()["images_encoded"] == 1
    finally:
        llm.shutdown()


def test_chunked_prefill_through_images_gives_the_same_tokens(llava_dir):
    """A step budget of 8 tokens: prompts are computed in chunks that start and end inside the images (an image
    is encoded once, whole, and each chunk takes its slice)."""
    want = [hf_llava_greedy(llava_dir, TWO, [picture(9), picture(10)], 10)[1],
            hf_llava_greedy(llava_dir, PROMPT, [picture(11)], 10)[1]]
    llm = LLM(llava_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256, max_num_batched_tokens=8,
              enable_prefix_caching=False)
    try:
        got = _tokens(llm, [{"prompt": TWO, "multi_modal_data": {"image": [picture(9), picture(10)]}},
                            {"prompt": PROMPT, "multi_modal_data": {"image": picture(11)}}])
        assert got == want
        assert llm.stats()["images_encoded"] == 3
    finally:
        llm.shutdown()


def test_n_samples_share_the_image_and_the_prompt(llava, llava_dir):
    want = hf_llava_greedy(llava_dir, PROMPT, [picture(12)], 10)[1]
    out = llava.generate([{"prompt": PROMPT, "multi_modal_data": {"image": picture(12)}}],
                         SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert [s.token_ids for s in out.outputs] == [want] * 3


@pytest.mark.parametrize("prompt, match", [
    ({"prompt": PROMPT, "multi_modal_data": {"image": b"\x89PNG\r\n\x1a\n broken"}},
     r"multi_modal_data'\]\['image'\]"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": [picture(1), picture(2)]}}, "marks 1 images"),
    ({"prompt": PROMPT}, "do not match the 0 images given"),
    ({"prompt": PROMPT, "multi_modal_data": {"video": picture(1)}}, r"\['video'\] is not supported"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": [picture(1)] * 9}}, "at most 8"),
    ({"prompt": PROMPT, "multi_modal_data": {"image": 3}}, "int"),
])
def test_bad_images_are_refused_by_name_and_the_engine_keeps_serving(llava, llava_dir, prompt, match):
    with pytest.raises(BadRequestError, match=match):
        llava.generate([prompt], GREEDY, use_tqdm=False)
    assert _tokens(llava, [{"prompt": PROMPT, "multi_modal_data": {"image": picture(1)}}]) == \
        [hf_llava_greedy(llava_dir, PROMPT, [picture(1)], 10)[1]]


def test_png_bytes_and_pil_give_the_same_answer(llava):
    buf = io.BytesIO()
    picture(13).save(buf, format="PNG")
    a, b = _tokens(llava, [{"prompt": PROMPT, "multi_modal_data": {"image": picture(13)}},
                           {"prompt": PROMPT, "multi_modal_data": {"image": buf.getvalue()}}])
    assert a == b


def test_a_text_only_model_refuses_images_by_name(tiny_llm):
    with pytest.raises(BadRequestError, match="takes text only"):
        tiny_llm.generate([{"prompt": "hi", "multi_modal_data": {"image": picture(1)}}], GREEDY, use_tqdm=False)
    with pytest.raises(BadRequestError, match=r"messages\[0\].content\[1\] is an image part"):
        tiny_llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                    {"type": "image_pil", "image_pil": picture(1)}]}], GREEDY)


def test_image_embeds_take_the_images_place(llava, llava_dir):
    """Embeddings given instead of the image (vLLM's image_embeds; DashInfer's mm_info) skip the encoder and give
    the answer the image gives."""
    feats = hf_llava_features(llava_dir, [picture(14)])
    want = hf_llava_greedy(llava_dir, PROMPT, [picture(14)], 10)[1]
    assert _tokens(llava, [{"prompt": PROMPT, "multi_modal_data": {"image_embeds": feats}}]) == [want]
    with pytest.raises(BadRequestError, match=r"image_embeds'\]\[0\] of shape \(16, 3\) is not supported"):
        llava.generate([{"prompt": PROMPT, "multi_modal_data": {"image_embeds": [feats[0][:, :3]]}}], GREEDY)
    with pytest.raises(BadRequestError, match="NaN"):
        llava.generate([{"prompt": PROMPT, "multi_modal_data": {"image_embeds": [feats[0] * float("nan")]}}],
                       GREEDY)


def test_the_core_in_its_own_process_takes_images_too(llava_dir, monkeypatch):
    """CUDA's default: the requests (with the processor's arrays) cross a socket to the core's process."""
    monkeypatch.setenv("EMBER_ENGINE_CORE_PROCESS", "1")
    llm = LLM(llava_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    try:
        got = _tokens(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": picture(15)}}])
        assert got == [hf_llava_greedy(llava_dir, PROMPT, [picture(15)], 10)[1]]
        assert llm.stats()["images_encoded"] == 1
    finally:
        llm.shutdown()


def test_ember_generate_takes_image_files(llava_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    from ember.entrypoints import cli

    path = tmp_path / "cat.png"
    picture(16).save(path)
    want = AutoTokenizer.from_pretrained(llava_dir).decode(hf_llava_greedy(llava_dir, PROMPT, [picture(16)], 6)[1])
    assert cli.main(["generate", "What is in the picture?", "--image", str(path), "--model", llava_dir,
                     "--dtype", "float32", "--temperature", "0", "--max-tokens", "6", "--kv-cache-memory", "16MiB",
                     "--max-model-len", "256"]) == 0
    assert capsys.readouterr().out.strip() == want.strip()
    assert cli.main(["generate", "Hi", "--image", str(tmp_path / "missing.png"), "--model", llava_dir]) == 2
    assert "--image" in capsys.readouterr().err


def test_adjacent_images_split_their_run_as_transformers_does(llava, llava_dir):
    text = "<|im_start|>user\n<image><image>\nCompare them.<|im_end|>\n<|im_start|>assistant\n"
    ids, want = hf_llava_greedy(llava_dir, text, [picture(17), picture(18)], 10)
    out = llava.generate([{"prompt": text, "multi_modal_data": {"image": [picture(17), picture(18)]}},
                          {"prompt_token_ids": ids, "multi_modal_data": {"image": [picture(17), picture(18)]}}],
                         GREEDY, use_tqdm=False)  # one image token each, and expanded already
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in out] == [(ids, want)] * 2


def test_a_processor_that_does_not_match_its_model_fails_the_load(llava_dir, tmp_path):
    """A processor config giving 15 tokens an image to a tower that makes 16 (older llava-hf files lack
    num_additional_image_tokens): refused at load by name, never inside the engine."""
    from conftest import edited_copy

    bad = edited_copy(llava_dir, tmp_path / "llava-bad", "processor_config.json", num_additional_image_tokens=0)
    with pytest.raises(ConfigError, match="15 tokens; the vision tower makes 16"):
        LLM(str(bad), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)


def test_a_split_or_a_siglip_tower_is_refused_by_name(llava_dir):
    from transformers import AutoConfig, SiglipVisionConfig

    from ember.models.llava import LlavaForConditionalGeneration

    with pytest.raises(ConfigError, match="vision-language model: it runs on one rank"):
        LLM(llava_dir, dtype="float32", kv_cache_memory="16MiB", max_model_len=256, tensor_parallel_size=2)
    config = AutoConfig.from_pretrained(llava_dir)
    config.vision_config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=56, patch_size=14)
    with pytest.raises(ValueError, match="vision_config.model_type='siglip_vision_model' is not supported"):
        LlavaForConditionalGeneration("LlavaForConditionalGeneration", config, 256, torch.float32)
