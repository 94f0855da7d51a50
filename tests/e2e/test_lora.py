"""LoRA adapters as PEFT writes them: the reader gives back PEFT's own A / B and scaling and refuses by name what
ember cannot apply; the engine's greedy tokens with adapters mixed in one batch equal transformers + peft."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import default_gguf, hf_float32, hf_greedy, peft_adapter, peft_greedy, random_prompts
from ember import LLM, SamplingParams
from ember.config import ModelShape
from ember.errors import BadRequestError
from ember.lora import LoRARequest
from ember.lora.adapter import read_adapter, read_adapter_config


def _shape(model_dir: str) -> ModelShape:
    from transformers import AutoConfig

    return ModelShape.of(AutoConfig.from_pretrained(model_dir))


def test_reads_peft_weights_and_scaling(llama_dir, tmp_path):
    state = peft_adapter(llama_dir, str(tmp_path / "a"), rank_pattern={"down_proj": 4},
                          alpha_pattern={"layers.1.self_attn.q_proj": 4})
    shape = _shape(llama_dir)
    adapter = read_adapter(str(tmp_path / "a"), "a", shape, max_lora_rank=8)
    assert len(adapter.weights) == 7 * shape.num_layers and adapter.rank == 8
    for (layer, proj), w in adapter.weights.items():
        part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{part}.{proj}"
        assert torch.equal(w.a, state[f"{prefix}.lora_A.default.weight"])
        assert torch.equal(w.b, state[f"{prefix}.lora_B.default.weight"])
    assert adapter.weights[(0, "q_proj")].scaling == 16 / 8
    assert adapter.weights[(0, "down_proj")].a.shape[0] == 4 and adapter.weights[(0, "down_proj")].scaling == 16 / 4
    assert adapter.weights[(1, "q_proj")].scaling == 4 / 8 and adapter.weights[(0, "q_proj")].scaling == 2


def test_reading_an_adapter_again_and_again_keeps_no_memory(llama_dir, tmp_path):
    """A server swapping adapters reads one at every swap: 3,000 reads must not grow the process (safetensors 0.8's
    load_file kept ~1.8 KiB a read, +5 MiB here; the 30-minute soak's RSS rose with the swaps, docs/reliability.md)."""
    import gc

    import psutil

    peft_adapter(llama_dir, str(tmp_path / "a"))
    shape, proc = _shape(llama_dir), psutil.Process()
    for _ in range(200):  # the allocator's pools settle first
        read_adapter(str(tmp_path / "a"), "a", shape, max_lora_rank=8)
    gc.collect()
    before = proc.memory_info().rss
    for _ in range(3000):
        read_adapter(str(tmp_path / "a"), "a", shape, max_lora_rank=8)
    gc.collect()
    assert proc.memory_info().rss - before < 1 << 20


def test_bad_adapters_fail_by_name(llama_dir, tiny_models, tmp_path):
    shape = _shape(llama_dir)
    good = str(tmp_path / "good")
    peft_adapter(llama_dir, good, target_modules=["q_proj", "v_proj"])

    def read(path, max_rank=8):
        return read_adapter(path, "x", shape, max_rank)

    with pytest.raises(BadRequestError, match="no such folder"):
        read(str(tmp_path / "missing"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(BadRequestError, match="adapter_config.json is missing"):
        read(str(tmp_path / "empty"))
    with pytest.raises(BadRequestError, match="rank 8 is above max_lora_rank=4"):
        read(good, max_rank=4)
    for key, value, message in (("use_dora", True, "use_dora=True is not supported"),
                                ("bias", "all", "bias='all' is not supported"),
                                ("modules_to_save", ["lm_head"], "modules_to_save=.* is not supported"),
                                ("target_modules", ["q_proj", "embed_tokens"], r"\['embed_tokens'\] are not supported"),
                                ("peft_type", "IA3", "peft_type='IA3' is not supported")):
        with open(os.path.join(good, "adapter_config.json")) as f:
            cfg = json.load(f)
        cfg[key] = value
        bad = tmp_path / f"bad-{key}"
        os.makedirs(bad)
        os.link(os.path.join(good, "adapter_model.safetensors"), bad / "adapter_model.safetensors")
        (bad / "adapter_config.json").write_text(json.dumps(cfg))
        with pytest.raises(BadRequestError, match=message):
            read_adapter_config(str(bad), 8)
    other = str(tmp_path / "other")  # an adapter of another base model: its q_proj has 128 outputs, not 64
    peft_adapter(tiny_models["qwen3"], other, target_modules=["q_proj"])
    with pytest.raises(BadRequestError, match=r"q_proj: A .* do not fit this model's 64 -> \d+ projection"):
        read(other)


def test_lora_request_fields():
    assert LoRARequest("a", 1, "/x").lora_int_id == 1
    for args, field in ((("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "lora_int_id"),
                        (("a", True, "/x"), "lora_int_id"), (("a", 1, None), "lora_path")):
        with pytest.raises(BadRequestError, match=f"{field}=.* is out of range"):
            LoRARequest(*args)


# ----- the engine with adapters: greedy tokens against transformers + peft, float32 -----

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def three_adapters(llama_dir, tmp_path_factory) -> list[str]:
    """Three adapters of the tiny Llama: different ranks, targets and scalings."""
    out = tmp_path_factory.mktemp("adapters")
    shapes = [dict(r=8, lora_alpha=16), dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
              dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])]
    paths = []
    for i, kw in enumerate(shapes):
        paths.append(str(out / f"a{i}"))
        peft_adapter(llama_dir, paths[-1], seed=10 + i, **kw)
    return paths


def test_a_batch_mixing_three_adapters_and_the_base_matches_peft_and_survives_swaps(llama_dir, three_adapters):
    """Two slots for three adapters: requests wait for a slot, adapters are swapped out and back in, and each
    request's tokens equal transformers + peft with its adapter. The same prompt under the base model and an
    adapter runs twice: the prefix cache, keyed by adapter, never hands one the other's KV."""
    prompts = random_prompts(6, 20, 40, 49152, seed=61)
    prompts[4] = prompts[0]  # the base model's prompt again, under adapter 1
    which = [None, 0, 1, 2, 0, None]
    want = [None] * len(prompts)
    for a in (None, 0, 1, 2):
        idx = [i for i, w in enumerate(which) if w == a]
        for i, tokens in zip(idx, peft_greedy(llama_dir, None if a is None else three_adapters[a],
                                               [prompts[i] for i in idx], GREEDY.max_tokens)):
            want[i] = tokens
    assert want[4] != want[0]  # the adapter changes the answer
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(three_adapters)]
    loras = [None if w is None else requests[w] for w in which]
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        for _ in range(2):  # the second round finds some adapters resident and swaps the others back in
            out = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in out] == want
        stats = llm.stats()
        assert stats["lora_swaps"] >= 2 and stats["prefix_cache_hit_tokens"] > 0
        assert llm.list_loras() == {1, 2, 3}
    finally:
        llm.shutdown()


def test_adapters_on_a_split_model_and_on_int8_weights(llama_dir, three_adapters):
    """Tensor parallelism (A / B sliced as their layers) and pipeline stages give one rank's tokens; on int8 base
    weights the adapters apply to the quantized projections, matching peft over the same rounded weights."""
    from ember.quantization import quantize_int8

    prompts = random_prompts(4, 10, 30, 49152, seed=62)
    requests = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(three_adapters)]
    loras = [requests[0], None, requests[1], requests[2]]
    # CPU: the split runs gloo ranks on this machine, which may have fewer GPUs than ranks
    settings = dict(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=3, max_lora_rank=16,
                    device="cpu")
    one = LLM(llama_dir, **settings)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)]
    finally:
        one.shutdown()
    split = LLM(llama_dir, tensor_parallel_size=2, pipeline_parallel_size=2, distributed_executor_backend="mp",
                **settings)
    try:
        assert [o.outputs[0].token_ids for o in split.generate(prompts, GREEDY, lora_request=loras,
                                                               use_tqdm=False)] == want
    finally:
        split.shutdown()

    # int8 weights: the packed op runs bf16 activations, so the check is on the prompt's logprobs (0.3 nats, a
    # few % of their size) against peft over the same rounded weights, where the adapter moves them by several nats
    from peft import PeftModel

    int8 = LLM(llama_dir, quantization="int8", **settings)
    try:
        scored = int8.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), lora_request=requests[0],
                               use_tqdm=False)
    finally:
        int8.shutdown()
    model = hf_float32(llama_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):  # the int8 weights ember computes with, as float32
                p.copy_(quantize_int8(p.data).dequantize(torch.float32))
    model = PeftModel.from_pretrained(model, three_adapters[0]).eval()
    for out, prompt in zip(scored, prompts):
        targets = torch.tensor(prompt[1:])[:, None]
        got = torch.tensor([pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], prompt[1:])])
        with torch.no_grad():
            want = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1).gather(1, targets)[:, 0]
            with model.disable_adapter():
                base = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1).gather(1, targets)[:, 0]
        assert (got - want).abs().max() < 0.3 and (base - want).abs().max() > 2


def test_default_model_adapter_matches_peft(tmp_path):
    """An adapter made with peft on the default model (the GGUF in float32): ember's tokens equal transformers +
    peft, with and without the adapter in one batch."""
    from transformers import AutoModelForCausalLM
    from peft import LoraConfig, get_peft_model

    path = default_gguf()
    folder, name = os.path.split(path)
    torch.manual_seed(5)
    base = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                      init_lora_weights=False)
    adapter = str(tmp_path / "smol-adapter")
    reference = get_peft_model(base, lora).eval()  # the GGUF is dequantized once (slow in transformers), for both
    reference.save_pretrained(adapter)
    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory="64MiB", enable_lora=True)
    try:
        prompts = [llm.tokenizer.encode(t) for t in ("The capital of France is", "def fibonacci(n):")]
        out = llm.generate(prompts * 2, GREEDY, lora_request=[LoRARequest("smol", 1, adapter)] * 2 + [None] * 2,
                           use_tqdm=False)
    finally:
        llm.shutdown()
    want = [hf_greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    with reference.disable_adapter():
        want += [hf_greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    assert [o.outputs[0].token_ids for o in out] == want
    assert want[0] != want[2]


def test_bad_adapters_are_refused_before_any_work_and_the_engine_keeps_serving(llama_dir, three_adapters, tmp_path):
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        prompt = random_prompts(1, 5, 10, 49152, seed=63)
        for lora, message in ((LoRARequest("gone", 1, str(tmp_path / "gone")), "no such folder"),
                              (LoRARequest("big", 2, three_adapters[2]), "rank 16 is above max_lora_rank=8"),
                              ("a0", "lora_request of type str is not supported")):
            with pytest.raises(BadRequestError, match=message):
                llm.generate(prompt, GREEDY, lora_request=lora, use_tqdm=False)
        assert llm.add_lora(LoRARequest("a0", 3, three_adapters[0]))
        with pytest.raises(BadRequestError, match="lora_int_id=3 is already the adapter 'a0'"):
            llm.generate(prompt, GREEDY, lora_request=LoRARequest("a1", 3, three_adapters[1]), use_tqdm=False)
        with pytest.raises(BadRequestError, match="lora_request has 2 entries for 1 prompts"):
            llm.generate(prompt, GREEDY, lora_request=[None, None], use_tqdm=False)
        assert llm.stats()["lora_slots"] == [3]  # add_lora loaded it at once
        out = llm.generate(prompt, GREEDY, lora_request=LoRARequest("a0", 3, three_adapters[0]), use_tqdm=False)
        assert out[0].outputs[0].token_ids == peft_greedy(llama_dir, three_adapters[0], prompt, 10)[0]
        assert llm.remove_lora(3) and not llm.remove_lora(3) and llm.list_loras() == set()
        assert llm.stats()["lora_slots"] == [None]
        # the id keeps naming a0 (its prefix-cache entries outlive it): another adapter under it is refused, a0 back
        with pytest.raises(BadRequestError, match="lora_int_id=3 was the adapter 'a0' .* for the engine's life"):
            llm.add_lora(LoRARequest("a1", 3, three_adapters[1]))
        assert llm.add_lora(LoRARequest("a0", 3, three_adapters[0])) and llm.list_loras() == {3}
    finally:
        llm.shutdown()
    plain = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    try:
        with pytest.raises(BadRequestError, match="needs an engine started with enable_lora=True"):
            plain.generate(prompt, GREEDY, lora_request=LoRARequest("a0", 1, three_adapters[0]), use_tqdm=False)
    finally:
        plain.shutdown()


def _finals(streams) -> list:
    """Each stream's last output, or the exception it ended with."""
    ends = []
    for stream in streams:
        try:
            ends.append(list(stream)[-1])
        except Exception as e:  # noqa: BLE001  (the outcome under test)
            ends.append(e)
    return ends


def test_an_adapter_removed_after_it_was_accepted_ends_only_its_requests(llama_dir, three_adapters, tmp_path):
    """An adapter's folder removed after its requests were accepted: when a step needs it read, those requests end
    with RequestFailedError naming the adapter's file, while the requests batched with them (another adapter, the
    base model) finish with transformers + peft's tokens; the engine keeps serving, and the adapter works again once
    its folder is back."""
    import shutil

    from ember.errors import RequestFailedError
    from ember.sampling_params import OutputKind

    gone = str(tmp_path / "gone")
    shutil.copytree(three_adapters[1], gone)
    prompts = random_prompts(3, 8, 16, 49152, seed=65)
    a0, a1 = LoRARequest("a0", 1, three_adapters[0]), LoRARequest("a1", 2, gone)
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        assert llm.add_lora(a0) and llm.add_lora(a1)  # accepted (checked and loaded)
        llm.remove_lora(2)  # out of its slot: its next request must read the folder again
        llm.client.adapters.check(a1)  # ... still accepted by the front end
        shutil.rmtree(gone)
        streams = [llm.client.stream(p, GREEDY, kind=OutputKind.FINAL_ONLY, lora=lora)
                   for p, lora in zip(prompts, (a0, a1, None))]
        ends = _finals(streams)
        assert isinstance(ends[1], RequestFailedError) and "gone" in str(ends[1]) and "no such folder" in str(ends[1])
        assert ends[0].outputs[0].token_ids == peft_greedy(llama_dir, three_adapters[0], [prompts[0]], 10)[0]
        assert ends[2].outputs[0].token_ids == peft_greedy(llama_dir, None, [prompts[2]], 10)[0]
        assert llm.client.is_alive() and llm.stats()["running"] == 0 and llm.stats()["waiting"] == 0
        shutil.copytree(three_adapters[1], gone)
        out = llm.generate(prompts[1:2], GREEDY, lora_request=a1, use_tqdm=False)
        assert out[0].outputs[0].token_ids == peft_greedy(llama_dir, three_adapters[1], prompts[1:2], 10)[0]
    finally:
        llm.shutdown()


# ----- the APIs: the server (--lora-modules, `model` = adapter name) and the CLI (--lora) -----

def test_server_serves_adapters_as_models(llama_dir, three_adapters):
    """`ember serve --lora-modules`: /v1/models lists each adapter with its folder and base model; a request whose
    `model` names an adapter gets transformers + peft's greedy tokens with it, the base name gets the base model."""
    import openai
    from server_utils import running_server

    from ember.tokenizer import Tokenizer

    prompts = random_prompts(2, 8, 16, 49152, seed=64)
    want = {name: peft_greedy(llama_dir, path, prompts, 8)
            for name, path in (("a0", three_adapters[0]), ("a1", three_adapters[1]), ("tiny", None))}
    decode = Tokenizer.load(llama_dir).decode
    modules = ["a0=" + three_adapters[0], json.dumps({"name": "a1", "path": three_adapters[1]})]
    with running_server(llama_dir, "--dtype", "float32", "--max-num-seqs", "8", "--max-model-len", "256",
                        "--served-model-name", "tiny", "--lora-modules", *modules, "--max-loras", "1") as srv:
        api = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        cards = {m.id: m for m in api.models.list().data}
        assert list(cards) == ["tiny", "a0", "a1"]
        assert cards["a0"].root == three_adapters[0] and cards["a0"].parent == "tiny"
        for name in ("a0", "a1", "tiny", "a0"):  # one slot: a1 swaps a0 out, a0 comes back
            r = api.completions.create(model=name, prompt=prompts, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
            assert r.model == name and [c.text for c in r.choices] == [decode(t) for t in want[name]]
        with pytest.raises(openai.NotFoundError):
            api.completions.create(model="a9", prompt=prompts[0], max_tokens=2)
    proc = subprocess.run([sys.executable, "-m", "ember", "serve", llama_dir, "--lora-modules", "x=/no/such/dir"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "lora adapter /no/such/dir: no such folder" in proc.stderr


def test_cli_generates_with_an_adapter(llama_dir, three_adapters, capsys):
    from ember.entrypoints import cli
    from ember.tokenizer import Tokenizer

    prompt = "The capital of France is"
    ids = Tokenizer.load(llama_dir).encode(prompt)
    want = Tokenizer.load(llama_dir).decode(peft_greedy(llama_dir, three_adapters[1], [ids], 6)[0])
    assert cli.main(["generate", prompt, "--model", llama_dir, "--no-chat", "--dtype", "float32", "--temperature",
                     "0", "--max-tokens", "6", "--lora", three_adapters[1], "--kv-cache-memory", "16MiB"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == want
    assert cli.main(["generate", prompt, "--model", llama_dir, "--lora", "/no/such/dir"]) == 2
    assert "lora adapter /no/such/dir: no such folder" in capsys.readouterr().err
