"""Beam search in the engine core against transformers' ``generate(num_beams=W, num_return_sequences=W,
do_sample=False)`` in float32: the returned beams, tokens and order, for W = 1, 2, 4 and the three early-stopping
modes; beams sharing and copying KV blocks (block_size 4, so most forks copy a partial block); preemption; mixed
batches; the KV budget."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import default_gguf, hf_float32, random_prompts

from ember import LLM, SamplingParams
from ember.errors import BadRequestError, DoesNotFitError

NEW = 12


def hf_beams(model, prompt: list[int], width: int, eos: int, max_new: int = NEW, **kw) -> list[list[int]]:
    """transformers' returned beams, each cut after its EOS (the padding is EOS too)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, num_beams=width,
                             num_return_sequences=width, eos_token_id=eos, pad_token_id=eos, **kw)
    beams = []
    for row in out:
        t = row[len(prompt):].tolist()
        beams.append(t[:t.index(eos) + 1] if eos in t else t)
    return beams


def ember_beams(llm: LLM, prompts: list[list[int]], width: int, eos: int, max_new: int = NEW,
                **kw) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_new, beam_width=width, n=width, eos_token_ids=(eos,), **kw)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def setup(llama_dir):
    """The tiny Llama in both engines, prompts, and per prompt an EOS id its greedy path reaches at step 5 (so
    beams end at different lengths)."""
    hf = hf_float32(llama_dir)
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB", block_size=4, max_num_seqs=16)
    prompts = random_prompts(3, 5, 11, hf.config.vocab_size, seed=1)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    eos = [o.outputs[0].token_ids[4] for o in greedy]
    yield hf, llm, prompts, eos
    llm.shutdown()


@pytest.mark.parametrize("width", [1, 2, 4])
@pytest.mark.parametrize("early_stopping,length_penalty", [(False, 1.0), (True, 0.5), ("never", -1.0),
                                                           ("never", 2.0)])
def test_beams_match_transformers(setup, width, early_stopping, length_penalty):
    hf, llm, prompts, eos = setup
    kw = dict(early_stopping=early_stopping, length_penalty=length_penalty)
    for prompt, e in zip(prompts, eos):
        want = hf_beams(hf, prompt, width, e, **kw)
        got = ember_beams(llm, [prompt], width, e, **kw)[0] if width > 1 else [
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, eos_token_ids=(e,)),
                         use_tqdm=False)[0].outputs[0].token_ids]
        assert got == want


def test_beams_end_at_eos_and_report_scores(setup):
    """The case above is not vacuous: some returned beams end with EOS before the limit, and every beam's
    cumulative logprob is that of its tokens under the model."""
    hf, llm, prompts, eos = setup
    params = SamplingParams(temperature=0, max_tokens=NEW, beam_width=4, n=4, eos_token_ids=(eos[0],))
    out = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    assert any(c.finish_reason == "stop" and c.token_ids[-1] == eos[0] for c in out.outputs)
    assert any(c.finish_reason == "length" and len(c.token_ids) == NEW for c in out.outputs)
    for c in out.outputs:
        ids = torch.tensor([prompts[0] + c.token_ids])
        with torch.no_grad():
            lps = hf(ids).logits[0, len(prompts[0]) - 1:-1].log_softmax(-1)
        assert c.cumulative_logprob == pytest.approx(float(lps.gather(1, ids[0, len(prompts[0]):, None]).sum()),
                                                     abs=1e-3)


def test_mixed_batch_and_pool_returns_to_full(setup):
    """Beam and sampled requests in one batch give what each gives alone; every block is free afterwards (the
    copy-on-write copies included)."""
    hf, llm, prompts, eos = setup
    alone_beams = ember_beams(llm, prompts, 4, eos[0])
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    alone_greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    beam = SamplingParams(temperature=0, max_tokens=NEW, beam_width=4, n=4, eos_token_ids=(eos[0],))
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW, seed=3)
    mixed = llm.generate(prompts * 3, [beam] * 3 + [greedy] * 3 + [sampled] * 3, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in mixed[:3]] == alone_beams
    assert [o.outputs[0].token_ids for o in mixed[3:6]] == alone_greedy
    assert all(len(o.outputs[0].token_ids) == NEW for o in mixed[6:])
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_beams_survive_preemption(llama_dir, setup):
    """A pool too small for every beam of three requests at once: beams are preempted and recomputed, and the
    result is still transformers'."""
    hf, _, prompts, eos = setup
    per_block = 2 * 2 * 2 * 16 * 4 * 4  # layers x (K, V) x KV heads x head_dim x float32 bytes x block_size
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory=24 * per_block, block_size=4, enable_prefix_caching=False,
              max_model_len=64)
    try:
        assert llm.model_info.num_kv_blocks == 24
        got = ember_beams(llm, prompts, 4, eos[0])
        assert llm.stats()["preemptions"] > 0
        with pytest.raises(DoesNotFitError, match="beam_width=8 .*KV blocks"):
            llm.generate([prompts[0]], SamplingParams(beam_width=8, max_tokens=100), use_tqdm=False)
    finally:
        llm.shutdown()
    assert got == [hf_beams(hf, p, 4, eos[0]) for p in prompts]


def test_beam_input_errors(setup):
    _, llm, prompts, _ = setup
    with pytest.raises(BadRequestError, match="n=.*<= beam_width"):
        SamplingParams(beam_width=2, n=3)
    with pytest.raises(BadRequestError, match="beam_width"):
        SamplingParams(beam_width=0)
    with pytest.raises(BadRequestError, match="beam_width"):
        SamplingParams(beam_width=float("nan"))
    with pytest.raises(BadRequestError, match="early_stopping"):
        SamplingParams(beam_width=2, early_stopping="sometimes")
    with pytest.raises(BadRequestError, match="length_penalty"):
        SamplingParams(beam_width=2, length_penalty=float("inf"))
    with pytest.raises(BadRequestError, match="top_p"):
        SamplingParams(beam_width=2, top_p=0.5)
    with pytest.raises(BadRequestError, match="stop"):
        SamplingParams(beam_width=2, stop=["x"])
    with pytest.raises(BadRequestError, match="beam_width=.*max_num_seqs"):
        llm.generate([prompts[0]], SamplingParams(beam_width=32, max_tokens=4), use_tqdm=False)
    assert llm.generate([prompts[0]], SamplingParams(beam_width=2, max_tokens=2), use_tqdm=False)[0].finished


def test_beams_match_transformers_default_model():
    """The real default model (GGUF dequantized by both engines), float32, its own EOS."""
    path = default_gguf()
    hf = hf_float32(os.path.dirname(path), gguf_file=os.path.basename(path))
    llm = LLM(path, dtype="float32", kv_cache_memory="256MiB", max_model_len=512)
    try:
        tok = llm.tokenizer
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name a color."}]),
                            add_special_tokens=False)
        eos = tok.eos_token_id
        for width in (2, 4):
            assert ember_beams(llm, [prompt], width, eos, max_new=10)[0] == hf_beams(hf, prompt, width, eos, 10)
    finally:
        llm.shutdown()


def test_beams_with_tensor_parallel_ranks(llama_dir, setup):
    """Two spawned ranks: every rank runs the copy-on-write block copies; the beams are transformers' still."""
    hf, _, prompts, eos = setup
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", block_size=4, tensor_parallel_size=2,
              distributed_executor_backend="mp", device="cpu")
    try:
        got = ember_beams(llm, prompts[:2], 4, eos[0])
    finally:
        llm.shutdown()
    assert got == [hf_beams(hf, p, 4, eos[0]) for p in prompts[:2]]


def test_beams_over_http_match_transformers(setup, llama_dir):
    """`ember serve`: vLLM's use_beam_search with n beams answers transformers' n beams, best first, streamed or
    not; draws a beam has no meaning for are refused by name."""
    import asyncio
    import json

    from server_utils import post, running_server
    from transformers import AutoTokenizer

    hf, _, prompts, _ = setup
    tok = AutoTokenizer.from_pretrained(llama_dir)
    eos = hf.config.eos_token_id
    with running_server(llama_dir, "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "256") as srv:
        for prompt in prompts:
            want = [tok.decode(b, skip_special_tokens=True) for b in hf_beams(hf, prompt, 3, eos, length_penalty=0.5)]
            body = {"prompt": prompt, "max_tokens": NEW, "n": 3, "use_beam_search": True, "length_penalty": 0.5}
            r = asyncio.run(post(srv.url, "/v1/completions", body))
            assert r.status == 200, r.body
            assert [c["text"] for c in json.loads(r.body)["choices"]] == want
            streamed = asyncio.run(post(srv.url, "/v1/completions", {**body, "stream": True}))
            texts = [""] * 3
            for event in streamed.events[:-1]:
                for c in json.loads(event)["choices"]:
                    texts[c["index"]] += c["text"]
            assert streamed.events[-1] == "[DONE]" and texts == want
        refused = asyncio.run(post(srv.url, "/v1/completions", {**body, "top_p": 0.5}))
        assert refused.status == 400 and b"top_p" in refused.body
