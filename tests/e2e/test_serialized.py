"""ember's serialized format (.asmodel + .asparam): `ember convert`, native loading, validation, and the prefix
cache TTL that DashInfer's runtime config exposes."""

from __future__ import annotations

import json
import os
import time

import pytest

from ember import LLM, SamplingParams
from ember.entrypoints.cli import main as cli_main
from ember.model_loader import asmodel

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[101, 202, 303], [404, 505, 606, 707, 808]]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_convert_cli_then_native_load_gives_the_sources_tokens(kind, tiny_models, tmp_path, capsys):
    src = tiny_models[kind]
    dst = str(tmp_path / f"{kind}.asmodel")
    assert cli_main(["convert", src, dst, "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip() == dst
    assert asmodel.validate(dst) is None
    with LLM(src, dtype="float32", max_num_seqs=2, kv_cache_memory="16MiB") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    for model in (dst, str(tmp_path)):  # the file, or a folder holding one .asmodel
        with LLM(model, max_num_seqs=2, kv_cache_memory="16MiB") as llm:  # auto: the stored float32
            assert llm.model_info.dtype == "float32"
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
            assert llm.tokenizer.has_chat_template
        assert got == want


def test_convert_into_a_folder_names_the_model_after_the_source(tiny_models, tmp_path, capsys):
    src = tiny_models["llama"]
    assert cli_main(["convert", src, str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    path = capsys.readouterr().out.strip()
    assert path == os.path.join(str(tmp_path / "out"), os.path.basename(src) + ".asmodel")
    assert asmodel.read_meta(path)["dtype"] == "bfloat16"
    stamp = os.stat(path).st_mtime_ns
    assert cli_main(["convert", src, str(tmp_path / "out"), "--skip-if-exists"]) == 0
    assert os.stat(path).st_mtime_ns == stamp


def test_bad_serialized_files_fail_clearly(tiny_models, tmp_path, capsys):
    foreign = tmp_path / "x.asmodel"
    foreign.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not an ember .asmodel file"):
        LLM(str(foreign))
    dst = str(tmp_path / "m.asmodel")
    cli_main(["convert", tiny_models["llama"], dst])
    os.remove(str(tmp_path / "m.asparam"))
    with pytest.raises(ValueError, match="weights file .* is missing"):
        LLM(dst)
    assert cli_main(["convert", str(tmp_path / "nothing"), dst]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_prefix_cache_ttl_forgets_unused_blocks(tiny_models):
    prompt = list(range(100, 164))  # four full blocks of 16
    params = SamplingParams(temperature=0, max_tokens=2)
    with LLM(tiny_models["llama"], dtype="float32", max_num_seqs=2, kv_cache_memory="16MiB",
             prefix_cache_ttl=0.3) as llm:
        llm.generate(prompt, params, use_tqdm=False)
        again = llm.generate(prompt, params, use_tqdm=False)[0]
        assert again.num_cached_tokens == 48  # reused at once (the last block is always computed again)
        time.sleep(1.0)
        late = llm.generate(prompt, params, use_tqdm=False)[0]
        assert late.num_cached_tokens == 0
        assert llm.stats()["prefix_cache_expired_blocks"] >= 3
    with pytest.raises(ValueError, match="prefix_cache_ttl"):
        LLM(tiny_models["llama"], prefix_cache_ttl=-1)
