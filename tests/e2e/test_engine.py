"""Engine behaviour on a tiny random Llama: batching, preemption, n > 1, stop conditions, validation."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import hf_float32, hf_greedy, random_prompts
from internals import core_of, worker_of

from ember import LLM, ConfigError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batch_invariance_greedy(tiny_llm):
    prompts = random_prompts(32, 2, 120, tiny_llm.model_info.vocab_size, seed=11)
    batched = _tokens(tiny_llm.generate(prompts, GREEDY, use_tqdm=False))
    for i in (0, 7, 31):
        alone = _tokens(tiny_llm.generate([prompts[i]], GREEDY, use_tqdm=False))[0]
        assert alone == batched[i]


def test_seeded_sampling_independent_of_batch(tiny_llm):
    prompts = random_prompts(12, 5, 60, tiny_llm.model_info.vocab_size, seed=12)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=0.7, max_tokens=30, ignore_eos=True)
    alone = _tokens(tiny_llm.generate([prompts[0]], seeded, use_tqdm=False))[0]
    mixed = tiny_llm.generate(prompts, [seeded] + [other] * 11, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    again = tiny_llm.generate(prompts[5:] + prompts[:1], [other] * 7 + [seeded], use_tqdm=False)
    assert again[-1].outputs[0].token_ids == alone


def test_preemption_keeps_greedy_output(llama_dir, tiny_llm):
    prompts = random_prompts(16, 20, 60, tiny_llm.model_info.vocab_size, seed=13)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _tokens(tiny_llm.generate(prompts, params, use_tqdm=False))
    # 64 blocks of 16 tokens hold only ~1,000 tokens; the batch needs ~1,400
    per_block = tiny_llm.model_info.kv_block_bytes
    small = LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=64 * per_block)
    try:
        assert core_of(small).block_manager.num_blocks == 64
        outs = small.generate(prompts, params, use_tqdm=False)
        assert small.stats()["preemptions"] > 0
        assert _tokens(outs) == expected
        assert small.stats()["kv_blocks_free"] == 64
    finally:
        small.shutdown()


def test_n_samples_share_prompt_blocks(tiny_llm):
    prompt = random_prompts(1, 40, 40, tiny_llm.model_info.vocab_size, seed=14)[0]
    one = tiny_llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    out = tiny_llm.generate([prompt], GREEDY.clone(n=3), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == one for o in out.outputs)
    sampled = tiny_llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=5,
                                                         ignore_eos=True), use_tqdm=False)[0]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    assert tiny_llm.stats()["kv_blocks_free"] == tiny_llm.stats()["kv_blocks_total"]


def test_stop_conditions(tiny_llm):
    prompt = random_prompts(1, 10, 10, tiny_llm.model_info.vocab_size, seed=15)[0]
    free = tiny_llm.generate([prompt], GREEDY.clone(max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    # stop_token_ids: stop at the 5th generated token
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = tiny_llm.generate([prompt], GREEDY.clone(max_tokens=30, stop_token_ids=[stop_tok]),
                            use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok and len(out.token_ids) == first + 1
    # min_tokens holds the stop token back
    out = tiny_llm.generate([prompt], GREEDY.clone(max_tokens=30, stop_token_ids=[stop_tok], min_tokens=first + 2),
                            use_tqdm=False)[0].outputs[0]
    assert stop_tok not in out.token_ids[:first + 2]
    # stop string: cut from the text, not included
    text = free.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        out = tiny_llm.generate([prompt], GREEDY.clone(max_tokens=30, stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert stop not in out.text and text.startswith(out.text)


def test_generation_config_eos_and_defaults(tiny_llm, llama_dir, tmp_path):
    """generation_config.json's EOS ids end generation and its values become the default sampling params."""
    prompt = random_prompts(1, 8, 8, tiny_llm.model_info.vocab_size, seed=16)[0]
    free = tiny_llm.generate([prompt], GREEDY.clone(max_tokens=10), use_tqdm=False)[0].outputs[0].token_ids
    eos = free[3]
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos], "temperature": 0.0, "top_k": 7, "max_new_tokens": 9}))
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB")
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 7, 9)
        out = llm.generate([prompt], use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free[:free.index(eos) + 1]
        assert out.finish_reason == "stop" and out.stop_reason is None
        out = llm.generate([prompt], defaults.clone(ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 9
    finally:
        llm.shutdown()


@pytest.mark.parametrize("prompt,match", [("", "prompt"), ([], "prompt"), ([10**7], "token id"),
                                          ([5] * 600, "max_model_len")])
def test_bad_request_rejected_while_others_run(tiny_llm, prompt, match):
    good = random_prompts(1, 10, 10, tiny_llm.model_info.vocab_size, seed=17)[0]
    stream = tiny_llm.stream(good, GREEDY.clone(max_tokens=30))
    first = next(stream)
    with pytest.raises(ValueError, match=match):
        tiny_llm.generate([prompt], GREEDY, use_tqdm=False)
    rest = list(stream)
    assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "length"
    assert sum(len(o.outputs[0].token_ids) for o in [first, *rest]) == 30


def test_config_validation(llama_dir):
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(llama_dir, max_num_seqs=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(llama_dir, dtype="int3")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir, max_model_len=10**6)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(llama_dir, kv_cache_memory=1024)
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/no/such/model")


def test_token_prompts_and_text_prompts_agree(tiny_llm):
    text = "The quick brown fox"
    ids = tiny_llm.tokenizer.encode(text)
    a = tiny_llm.generate(text, GREEDY, use_tqdm=False)[0]
    b = tiny_llm.generate([ids], GREEDY, use_tqdm=False)[0]
    assert a.prompt == text and b.prompt is None
    assert a.prompt_token_ids == ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.metrics.num_prompt_tokens == len(ids) and a.metrics.num_generated_tokens == 24
    assert a.metrics.first_token_time >= a.metrics.arrival_time


def test_vllm_prompt_dicts(tiny_llm):
    """vLLM's TextPrompt / TokensPrompt dicts, alone or in a list, run as the string or ids they hold; a dict with
    another key (multi_modal_data) or no prompt is refused before anything runs."""
    text = "The quick brown fox"
    ids = tiny_llm.tokenizer.encode(text)
    want = tiny_llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    outs = tiny_llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert outs[0].prompt == text and outs[1].prompt is None and outs[1].prompt_token_ids == ids
    assert [o.outputs[0].token_ids for o in outs] == [want, want]
    assert tiny_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    for bad, match in [({"prompt": text, "multi_modal_data": {}}, "multi_modal_data"), ({}, "exactly one"),
                       ({"prompt": None}, r"prompt\['prompt'\]"), ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
                       ({"prompt": text, "prompt_token_ids": ids}, "exactly one")]:
        with pytest.raises(ValueError, match=match):
            tiny_llm.generate([bad], GREEDY, use_tqdm=False)


def test_engine_failure_reaches_every_consumer(llama_dir):
    """A crash in the model ends every request with an error instead of a hang; later calls fail fast."""
    from ember.errors import EngineDeadError

    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    try:
        def boom(batch):
            raise RuntimeError("simulated kernel failure")

        worker_of(llm).execute_model = boom
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            llm.generate(["hello", "world"], GREEDY, use_tqdm=False)
        with pytest.raises(EngineDeadError):
            llm.generate(["again"], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_chunked_prefill_same_outputs_and_prompt_logprobs(llama_dir, tiny_llm):
    prompts = random_prompts(6, 30, 200, tiny_llm.model_info.vocab_size, seed=18)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=2)
    whole = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", enable_chunked_prefill=False)
    chunked = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=40)
    try:
        a = whole.generate(prompts, params, use_tqdm=False)
        b = chunked.generate(prompts, params, use_tqdm=False)
    finally:
        whole.shutdown()
        chunked.shutdown()
    for x, y, prompt in zip(a, b, prompts):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert len(y.prompt_logprobs) == len(prompt) and y.prompt_logprobs[0] is None
        for px, py, tok in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], prompt[1:]):
            assert px[tok].logprob == pytest.approx(py[tok].logprob, abs=1e-4)


def test_one_prefill_a_step_same_outputs(llama_dir, tiny_llm):
    """max_num_prefill_seqs=1: prompts are prefilled one per step, and every greedy output is unchanged."""
    prompts = random_prompts(5, 20, 60, tiny_llm.model_info.vocab_size, seed=19)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", max_num_prefill_seqs=1)
    try:
        core = core_of(one)
        steps = []
        step = core.scheduler.schedule

        def counted():
            batch = step()
            steps.append(sum(1 for s in batch.seqs if s.num_tokens - s.num_computed_tokens > 1))
            return batch

        core.scheduler.schedule = counted
        got = _tokens(one.generate(prompts, params, use_tqdm=False))
    finally:
        one.shutdown()
    assert max(steps) == 1 and sum(steps) == len(prompts)
    assert got == _tokens(tiny_llm.generate(prompts, params, use_tqdm=False))
    with pytest.raises(ConfigError, match="max_num_prefill_seqs"):
        LLM(llama_dir, max_num_prefill_seqs=0)


def test_prefix_caching_hits_and_same_outputs(llama_dir, tiny_llm):
    vocab = tiny_llm.model_info.vocab_size
    system = random_prompts(1, 384, 384, vocab, seed=22)[0]
    prompts = [system + suffix for suffix in random_prompts(6, 16, 64, vocab, seed=23)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    off = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", enable_prefix_caching=False)
    on = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB")
    try:
        expected = _tokens(off.generate(prompts, params, use_tqdm=False))
        first = on.generate(prompts[:1], params, use_tqdm=False)[0]
        rest = on.generate(prompts[1:], params, use_tqdm=False)
        assert first.num_cached_tokens == 0
        assert all(r.num_cached_tokens >= 384 - 16 for r in rest)
        assert _tokens([first] + rest) == expected
        assert on.stats()["prefix_cache_hit_rate"] > 0.5
        with_lp = on.generate(prompts[:1], params.clone(prompt_logprobs=1), use_tqdm=False)[0]
        assert len(with_lp.prompt_logprobs) == len(prompts[0])  # prompt logprobs bypass the cache
        assert with_lp.num_cached_tokens == 0 and with_lp.outputs[0].token_ids == expected[0]
        again = on.generate(prompts, params, use_tqdm=False)  # fully cached prompts still compute >= 1 token
        assert _tokens(again) == expected
        assert all(r.num_cached_tokens < len(p) for r, p in zip(again, prompts))
    finally:
        off.shutdown()
        on.shutdown()


def test_requests_arriving_together_share_a_prefix_computed_in_the_same_step(llama_dir):
    """Six requests with one 96-token system prompt in one call, all admitted to the first step: the first computes
    the prefix and the others take its blocks in that same step (without that, all six compute it); every output
    is transformers' greedy output."""
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=2048)
    vocab = llm.model_info.vocab_size
    system = random_prompts(1, 96, 96, vocab, seed=26)[0]
    prompts = [system + suffix for suffix in random_prompts(6, 5, 30, vocab, seed=27)]
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 96 for o in outs[1:])  # six whole blocks of 16
    hf = hf_float32(llama_dir)
    assert _tokens(outs) == [hf_greedy(hf, p, 8) for p in prompts]


def test_prefix_caching_with_preemption_in_a_tiny_pool(llama_dir, tiny_llm):
    vocab = tiny_llm.model_info.vocab_size
    system = random_prompts(1, 100, 100, vocab, seed=24)[0]
    prompts = [system + suffix for suffix in random_prompts(12, 5, 40, vocab, seed=25)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    expected = _tokens(tiny_llm.generate(prompts, params, use_tqdm=False))
    per_block = tiny_llm.model_info.kv_block_bytes
    small = LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=40 * per_block,
                max_num_batched_tokens=64)
    try:
        assert _tokens(small.generate(prompts, params, use_tqdm=False)) == expected
        stats = small.stats()
        assert stats["preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        small.shutdown()
