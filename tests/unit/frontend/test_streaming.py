"""Streaming: deltas add up to the final text, and no delta ever holds half a character."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from ember import SamplingParams
from ember.frontend.detokenizer import IncrementalDetokenizer
from ember.tokenizer import Tokenizer

TEXTS = ["Hello 😀 world 🎉🎉 done", "東京は日本の首都です。北京和上海", "mixed: café ñ 한국어 👩‍👩‍👧 ok", "🤖"]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer.load(tokenizer_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_never_splits_characters(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # byte-level pieces: some characters span several tokens
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=[])
    deltas = []
    for t in ids:
        detok.add(t)
        deltas.append(detok.delta(finished=False))
    deltas.append(detok.delta(finished=True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_never_streamed(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["three f"])
    streamed, hit = "", None
    for t in ids:
        hit = detok.add(t)
        streamed += detok.delta(finished=hit is not None)
        if hit:
            break
    assert hit == "three f" and streamed == "one two "


def test_stream_deltas_equal_final_text(tiny_llm):
    prompts = random_prompts(3, 5, 30, tiny_llm.model_info.vocab_size, seed=21)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    finals = tiny_llm.generate(prompts, params, use_tqdm=False)
    for prompt, final in zip(prompts, finals):
        deltas = list(tiny_llm.stream(prompt, params))
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        text = "".join(o.text for d in deltas for o in d.outputs)
        ids = [t for d in deltas for o in d.outputs for t in o.token_ids]
        assert text == final.outputs[0].text
        assert ids == final.outputs[0].token_ids
        assert final.outputs[0].text == tiny_llm.tokenizer.decode(final.outputs[0].token_ids)
