"""Speculative decoding with a draft model (docs/speculative.md): a second model drafts inside the step, into its
own KV pool over the target's blocks. Output equals transformers' greedy tokens and the engine's own without
speculation whatever the draft; a draft that is the target itself is kept whole, which shows its KV cache follows
every sequence exactly (catch-up, rollback of rejected tokens, preemption, chunked prefill, parallel samples)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_float32, hf_greedy, make_tiny_model, random_prompts, save_random_model

import ember.core.speculator as speculator
from ember.core.ngram import NgramIndex, RecentOutputs
from ember import LLM, SamplingParams
from ember.errors import ConfigError
from ember.worker import worker as worker_module
from ember.worker.drafter import DraftCosts, Drafter


def _always_draft(monkeypatch, lookup: bool = False) -> None:
    """Every decoding row drafts all it may: the cost model would rightly refuse a draft model as big as the
    target. lookup=False: only the draft model drafts (prompt lookup, which goes first, finds nothing)."""
    monkeypatch.setattr(speculator, "best_k", lambda acceptance, weight, most, draft_cost=0.0, costs=None: most)
    if not lookup:
        monkeypatch.setattr(NgramIndex, "propose", lambda self, context, k: [])
        monkeypatch.setattr(RecentOutputs, "propose", lambda self, context, k: [])


def _draft(path: str, k: int = 4) -> dict:
    return {"model": path, "num_speculative_tokens": k}


def _run(model: str, prompts, sp, **kw):
    with LLM(model, dtype="float32", **{"kv_cache_memory": "64MiB", **kw}) as llm:
        outs = llm.generate([p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts], sp,
                            use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs], [o.outputs[0].logprobs for o in outs], llm.stats()


@pytest.fixture(scope="module")
def other_drafts(tmp_path_factory, tokenizer_dir) -> list[str]:
    """Drafts that mostly disagree with the target: another random llama, and a qwen2 (same tokenizer)."""
    return [make_tiny_model("llama", str(tmp_path_factory.mktemp("draft-llama")), tokenizer_dir, seed=1),
            make_tiny_model("qwen2", str(tmp_path_factory.mktemp("draft-qwen2")), tokenizer_dir, seed=2)]


def test_greedy_tokens_and_logprobs_whatever_the_draft(llama_dir, other_drafts, monkeypatch):
    _always_draft(monkeypatch)
    prompts = random_prompts(6, 5, 40, 49152, 2)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    want, want_lps, _ = _run(llama_dir, prompts, sp)
    hf = hf_float32(llama_dir)
    assert [w[0] for w in want] == [hf_greedy(hf, p, 24) for p in prompts]
    quantized = {**_draft(llama_dir), "quantization": "int4"}  # the target's weights in int4 drafting for it
    for config in (_draft(llama_dir), *map(_draft, other_drafts), quantized):
        draft = config["model"]
        got, lps, stats = _run(llama_dir, prompts, sp, speculative_config=config)
        assert got == want, config
        for a_seq, b_seq in zip(lps, want_lps):
            for a, b in zip(a_seq, b_seq):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
        drafted, kept = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
        assert drafted > 60, stats
        if config is quantized:  # int4 rounding flips the near-uniform argmaxes of a random model: some kept
            assert 0 < kept < drafted, stats
        elif draft == llama_dir:  # the target drafting for itself: every drafted token is its own next token
            assert kept == drafted, stats
        else:
            assert kept < drafted / 2, stats


def test_prediction_drafts_and_model_drafts_in_one_engine_keep_the_tokens(llama_dir, other_drafts, monkeypatch):
    """Free drafts (here a prediction: right for 16 tokens, then wrong) go first, the draft model's where they
    find nothing or stop paying: the same tokens as without speculation, and both kinds of draft verified."""
    _always_draft(monkeypatch, lookup=True)
    prompts = random_prompts(4, 5, 30, 49152, 12)
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want, _, _ = _run(llama_dir, prompts, sp)
    junk = random_prompts(1, 16, 16, 49152, 13)[0]
    predicted = [{"prompt_token_ids": p, "prediction_token_ids": w[0][:16] + junk} for p, w in zip(prompts, want)]
    for draft in (llama_dir, other_drafts[0]):
        got, _, stats = _run(llama_dir, predicted, sp, speculative_config=_draft(draft))
        drafted, kept = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
        assert got == want, draft
        assert 4 * 10 <= kept < drafted, (draft, stats)  # most of the predictions' right tokens kept, no junk


def test_preemption_chunked_prefill_prefix_caching_and_parallel_samples(llama_dir, monkeypatch):
    """Twelve requests of two greedy samples each (sharing blocks until they write) over a pool of a few sequences
    (preemptions: the draft's KV caught up again on return), 48-token steps (chunked prompts), a shared prompt
    prefix (prefix caching): the same tokens as without speculation, and the target drafting for itself still keeps
    every draft."""
    _always_draft(monkeypatch)
    prefix = random_prompts(1, 20, 20, 49152, 8)[0]
    prompts = [prefix + p for p in random_prompts(12, 5, 30, 49152, 9)]
    sp = SamplingParams(max_tokens=20, temperature=0, n=2, ignore_eos=True)
    kw = dict(kv_cache_memory=16 * 16 * 512 * 2, max_model_len=128, max_num_batched_tokens=48)  # both pools
    want, _, _ = _run(llama_dir, prompts, sp, **kw)
    got, _, stats = _run(llama_dir, prompts, sp, speculative_config=_draft(llama_dir, 3), **kw)
    assert got == want
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0, stats
    assert 0 < stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"], stats


def test_a_draft_model_beside_a_model_split_over_two_ranks(llama_dir, monkeypatch):
    """Each tensor-parallel rank holds the whole draft model and its KV pool and drafts the same tokens; the target
    drafting for itself under T=2 keeps every draft and gives the tokens of one rank."""
    _always_draft(monkeypatch)
    prompts = random_prompts(4, 5, 30, 49152, 14)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want, _, _ = _run(llama_dir, prompts, sp)
    got, _, stats = _run(llama_dir, prompts, sp, speculative_config=_draft(llama_dir), tensor_parallel_size=2)
    assert got == want
    assert 0 < stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"], stats


def test_seeded_sampling_draws_the_same_tokens(llama_dir, other_drafts, monkeypatch):
    """A draft's tokens are greedy: a sampling row keeps one where its own draw (seeded by seed and position) is
    that token, so seeded samples are those of one-token steps."""
    _always_draft(monkeypatch)
    prompts = random_prompts(4, 5, 30, 49152, 6)
    sp = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=5, n=2, ignore_eos=True)
    want, _, _ = _run(llama_dir, prompts, sp)
    for draft in (llama_dir, other_drafts[0]):
        got, _, stats = _run(llama_dir, prompts, sp, speculative_config=_draft(draft))
        assert got == want and stats["spec_decode_num_draft_tokens"] > 50, draft


def test_the_cost_model_keeps_a_draft_as_big_as_the_target_off(llama_dir):
    """Unpatched, the engine measures a draft step against a target step at start-up; a draft as costly as the
    target never pays (1 + a + ... gains less than the draft's steps cost), so nothing is drafted."""
    prompts = random_prompts(2, 5, 10, 49152, 4)
    _, _, stats = _run(llama_dir, prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                       speculative_config=_draft(llama_dir))
    assert stats["spec_decode_num_drafts"] == 0, stats


def test_draft_model_config_errors(llama_dir, tmp_path, tokenizer_dir):
    with pytest.raises(ConfigError, match=r"speculative_config.model is required by method='draft_model'"):
        LLM(llama_dir, speculative_config={"method": "draft_model"})
    with pytest.raises(ConfigError, match=r"speculative_config.model=.* is only read by method='draft_model'"):
        LLM(llama_dir, speculative_config={"method": "ngram", "model": llama_dir})
    with pytest.raises(ConfigError, match=r"speculative_config.quantization='int3' is not supported: use one of "
                                          r"'none', 'int8', 'int4', 'w8a8' or None"):
        LLM(llama_dir, speculative_config={"model": llama_dir, "quantization": "int3"})
    with pytest.raises(ConfigError, match=r"speculative_config.quantization='int4' is only read with a draft model"):
        LLM(llama_dir, speculative_config={"quantization": "int4"})
    with pytest.raises(ConfigError, match=r"speculative_config.model=3 is not a path"):
        LLM(llama_dir, speculative_config={"model": 3})
    with pytest.raises(ConfigError, match=r"not split in stages: pipeline_parallel_size must be 1"):
        LLM(llama_dir, speculative_config={"model": llama_dir}, pipeline_parallel_size=2)
    short = make_tiny_model("llama", str(tmp_path / "short"), tokenizer_dir, max_position=64)
    with pytest.raises(ConfigError, match=r"speculative_config.model supports 64 positions, fewer than max_model_len"):
        LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB", speculative_config={"model": short})
    other = _with_tokens_swapped(llama_dir, str(tmp_path / "swapped"), 1000, 1001)
    with pytest.raises(ConfigError, match=r"speculative_config.model=.*: its tokenizer has .* at id 1000 where the "
                                          r"model's has .*: a draft model must share the model's tokenizer"):
        LLM(llama_dir, dtype="float32", kv_cache_memory="64MiB", speculative_config={"model": other})


def _with_tokens_swapped(src: str, dst: str, a: int, b: int) -> str:
    """A copy of the model folder src whose tokenizer gives ids a and b each other's token: another tokenizer."""
    import json
    import shutil

    shutil.copytree(src, dst)
    path = f"{dst}/tokenizer.json"
    with open(path) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    ta, tb = (next(t for t, i in vocab.items() if i == x) for x in (a, b))
    vocab[ta], vocab[tb] = b, a
    with open(path, "w") as f:
        json.dump(spec, f)
    return dst


def _padded(src: str, dst: str, rows: int, extra) -> str:
    """src (untied embeddings) with its vocabulary padded to ``rows`` rows, as Qwen2.5's checkpoints pad their
    151,665 tokens to 151,936 or 152,064 rows: the LM head's new rows are ``extra(head)`` of the old ones."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    n = model.config.vocab_size
    model.resize_token_embeddings(rows, mean_resizing=False)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[n:] = extra(head[:n])[:rows - n]
        model.get_input_embeddings().weight[n:] = 0
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def test_a_draft_with_more_or_fewer_rows_than_the_model(tiny_models, tmp_path, monkeypatch):
    """The same tokenizer over padded vocabularies (Qwen2.5-Coder-0.5B drafting for Qwen2.5-7B): a draft whose
    padding rows would win nearly every argmax (twice the first 848 rows) proposes only ids the model embeds, and a
    model padded with rows that never win takes a draft without them; each draft is the model's own function on
    the shared ids, so every drafted token is kept and the tokens are those of the model alone."""
    _always_draft(monkeypatch)
    base = tiny_models["llama-mha-untied"]
    wide_draft = _padded(base, str(tmp_path / "wide-draft"), 50000, lambda head: 2 * head)
    wide_model = _padded(base, str(tmp_path / "wide-model"), 50000, lambda head: 0 * head)
    prompts = random_prompts(4, 5, 30, 49152, 21)
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for model, draft in ((base, wide_draft), (wide_model, base)):
        want, _, _ = _run(model, prompts, sp)
        got, _, stats = _run(model, prompts, sp, speculative_config=_draft(draft))
        assert got == want, (model, draft)
        assert 0 < stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"], stats
    assert [w[0] for w in want] == [hf_greedy(hf_float32(base), p, 20) for p in prompts]
    # a prompt holding an id the model embeds and the draft does not: the draft is fed another there
    odd = [prompts[0][:3] + [49500] + prompts[0][3:]]
    want, _, _ = _run(wide_model, odd, sp)
    got, _, stats = _run(wide_model, odd, sp, speculative_config=_draft(base))
    assert got == want and stats["spec_decode_num_draft_tokens"] > 0, stats


def test_a_long_prompt_catches_up_a_share_a_step(llama_dir, monkeypatch):
    """A draft model's KV holds nothing of a new sequence: with a catch-up of 16 tokens a step, no pass of the draft
    feeds a sequence more than 16 tokens behind its last (plus that last), the rows decode without drafts until
    caught up, and then draft; the tokens are the model's own, every draft of the target drafting for itself
    kept."""
    _always_draft(monkeypatch)
    monkeypatch.setattr(worker_module, "measure_draft_costs", lambda *a, **k: DraftCosts(0.1, 16))
    fed: list[int] = []
    real = Drafter._pass

    def counting(self, rows, tables):
        fed.extend(len(r.tokens) for r in rows)
        return real(self, rows, tables)

    monkeypatch.setattr(Drafter, "_pass", counting)
    prompts = random_prompts(3, 60, 90, 49152, 22)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want, _, _ = _run(llama_dir, prompts, sp)
    got, _, stats = _run(llama_dir, prompts, sp, speculative_config=_draft(llama_dir))
    assert got == want
    assert 0 < stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"], stats
    assert fed and max(fed) <= 17, fed
