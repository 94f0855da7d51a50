"""The reference page's example commands (../shared/reference/tensorrt-llm-hlapi.md, "High-level API"), run as the page
runs them, each as its own process: ``run_examples.py run_single_gpu | run_multi_gpu | run_quant --model_dir <path>``
and ``llm_examples.py --task run_llm_on_tensor_parallel --prompt=... --hf_model_dir=<path>``, the scripts shipped in
ember/compat/tensorrt_llm/examples (TensorRT-LLM v0.10's examples/high-level-api with ember's imports).

On a small random Llama (hidden 256 for AWQ's groups of 128, 4 heads and 2 KV heads for tp_size=2) with the default
model's tokenizer. The facade runs this float32 checkpoint as TensorRT-LLM would, in half precision (dtype "auto":
bf16 on a CPU with fast bf16, float32 elsewhere), where a split is not bit-identical to one rank
(docs/parallel.md): each script's tokens are checked against the native engine run with the same split and dtype
(float32 splits themselves are checked against one rank in tests/e2e/test_parallel.py). Engines start at
TensorRT-LLM's default limits (128 sequences, 512 + 200 tokens each); the multi-rank ones with CPU ranks over gloo,
which share the machine's cores (ember gives each rank its share of the threads). Last, the page's MGMN script under
``trtllm-hlapi-launch`` in two processes with mpirun's variables faked: it runs once, on rank 0."""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys

import pytest
from conftest import save_random_model

from ember import LLM as NativeLLM
from ember import SamplingParams

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ember",
                        "compat", "tensorrt_llm", "examples")
RUN_EXAMPLES = os.path.join(EXAMPLES, "run_examples.py")
LLM_EXAMPLES = os.path.join(EXAMPLES, "llm_examples.py")
PROMPT = "What is LLM?"  # the scripts' default prompt
NEW_TOKENS = 32  # the facade's default max_new_tokens
OUTPUT = re.compile(r"^(OUTPUT: )?GenerationOutput\(text=(?P<text>'.*'|\".*\"), token_ids=(?P<ids>\[[\d, ]*\]), "
                    r"logprobs=\[\]\)$")


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tokenizer_dir) -> str:
    """<llama-model-path>: as tests/compat/test_tensorrt_llm.py's random Llama (wide enough for AWQ's groups of 128,
    long enough for TensorRT-LLM's default 512 + 200 tokens)."""
    return save_random_model("LlamaConfig", str(tmp_path_factory.mktemp("llama")), tokenizer_dir, hidden_size=256,
                             intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=1024)


def _env() -> dict[str, str]:
    """CPU ranks (a machine with one GPU could not hold two), unbuffered output so the hint lines of run_examples.py
    and the outputs of its steps arrive in order."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}


def _run(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _outputs(stdout: str) -> list[tuple[str, list[int], bool]]:
    """(text, token_ids, printed with "OUTPUT: ") of each GenerationOutput line printed."""
    found = []
    for line in stdout.splitlines():
        m = OUTPUT.match(line)
        if m:
            found.append((ast.literal_eval(m["text"]), ast.literal_eval(m["ids"]), line.startswith("OUTPUT: ")))
    return found


def _steps(stdout: str) -> list[str]:
    """run_examples.py's output cut at its hint lines (">> what: command"): one chunk of lines a step."""
    return [chunk for chunk in re.split(r"^>> .*$\n", stdout, flags=re.M)[1:]]


@pytest.fixture(scope="module")
def native_tokens(llama) -> dict[str, list[int]]:
    """The native engine's greedy tokens for the scripts' prompt, with the facade's dtype ("auto"): one rank, two
    tensor-parallel ranks, and one rank with AWQ int4 g128 (the facade's W4A16_AWQ)."""
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    out = {}
    for name, kw in (("tp1", {}), ("tp2", dict(tensor_parallel_size=2)),
                     ("awq", dict(quantization="awq", quant_group_size=128))):
        with NativeLLM(llama, device="cpu", max_num_seqs=4, max_model_len=256, kv_cache_memory="16MiB", **kw) as llm:
            out[name] = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    return out


def test_run_single_gpu_generates_saves_the_engine_and_reuses_it(llama, native_tokens, tmp_path):
    engine = str(tmp_path / "hlapi.engine.example")
    proc = _run(RUN_EXAMPLES, "run_single_gpu", f"--model_dir={llama}", f"--engine_dir={engine}")
    generate, streaming, future = _steps(proc.stdout)

    # run_llm_generate on the HF folder: the engine saved, the output printed as the page prints it
    assert f"Saving engine to {engine}..." in generate
    assert sorted(os.listdir(engine)) == ["model.asmodel", "model.asparam"]
    [(text, ids, prefixed)] = _outputs(generate)
    assert prefixed and ids == native_tokens["tp1"] and text  # greedy, 32 new tokens: TensorRT-LLM's default

    # the next two steps load the saved engine (--model_dir=<engine_dir>): same greedy output
    assert f"--model_dir={engine} --streaming" in proc.stdout
    snapshots = streaming.strip("\n")
    assert snapshots.endswith(text) and len(snapshots) > 2 * len(text)  # one cumulative text a step, joined by ' '
    assert future.splitlines() == [text, text]  # .result(), then await .aresult()


def test_run_multi_gpu_splits_over_two_cpu_ranks(llama, native_tokens, tmp_path):
    engine = str(tmp_path / "hlapi.engine.example")
    proc = _run("-m", "ember.compat.tensorrt_llm.examples.run_examples", "run_multi_gpu", f"--model_dir={llama}",
                f"--engine_dir={engine}")
    tp2, streaming, auto = _steps(proc.stdout)

    assert "Tensor Parallel on 2 ranks" in tp2 and sorted(os.listdir(engine + ".tp2")) == ["model.asmodel",
                                                                                          "model.asparam"]
    [(text, ids, prefixed)] = _outputs(tp2)
    assert prefixed and ids == native_tokens["tp2"]
    assert streaming.strip("\n").endswith(text)  # the saved engine, on the 2 ranks it was saved with
    [(auto_text, auto_ids, _)] = _outputs(auto)
    assert auto_ids == native_tokens["tp2"] and auto_text == text
    assert "auto_parallel: world_size=2 runs as tp_size=2 x pp_size=1" in proc.stderr


def test_run_quant_runs_awq_int4(llama, native_tokens):
    proc = _run(RUN_EXAMPLES, "run_quant", f"--model_dir={llama}")
    assert "--quant_type=int4_awq" in proc.stdout
    [(text, ids, _)] = _outputs(_steps(proc.stdout)[0])
    assert ids == native_tokens["awq"] and text  # AWQ int4 g128, as the native engine's quantization="awq"


def test_task_run_llm_on_tensor_parallel(llama, native_tokens):
    proc = _run(LLM_EXAMPLES, "--task", "run_llm_on_tensor_parallel", f"--prompt={PROMPT}", f"--hf_model_dir={llama}")
    assert "Running run_llm_on_tensor_parallel ..." in proc.stdout
    assert "Tensor Parallel on 2 ranks" in proc.stdout
    [(_, ids, _)] = _outputs(proc.stdout)
    assert ids == native_tokens["tp2"]


def test_fp8_is_refused_with_the_reason(llama):
    proc = _run(LLM_EXAMPLES, "run_llm_with_quantization", f"--model_dir={llama}", "--quant_type=fp8")
    assert "Skip the example for fp8: ember has no fp8 quantization" in proc.stdout
    assert "QuantAlgo.W4A16_AWQ" in proc.stdout and not _outputs(proc.stdout)


# ----- trtllm-hlapi-launch: the page's MGMN script runs once, on rank 0; the other ranks serve -----

MGMN_SCRIPT = """
import os, sys
from ember.compat.tensorrt_llm import LLM, ModelConfig

with open(sys.argv[2], "a") as f:  # one line each time this script runs
    f.write(os.environ["OMPI_COMM_WORLD_RANK"] + "\\n")
for _ in range(2):  # two engines one after another: the worker nodes serve both
    config = ModelConfig(model_dir=sys.argv[1])
    # Set the parallel_config to the number of GPUs you want to use
    config.parallel_config.tp_size = 2
    config.parallel_config.pp_size = 1

    llm = LLM(config)
    for output in llm.generate([[32, 12]]):
        print(output)
    print("executor:", llm.client.model_info.executor)
    llm.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trtllm_hlapi_launch_runs_the_script_once_on_rank_0(llama, tmp_path):
    with NativeLLM(llama, device="cpu", tensor_parallel_size=2, max_num_seqs=4, max_model_len=256,
                   kv_cache_memory="16MiB") as llm:
        want = llm.generate([[32, 12]], SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                            use_tqdm=False)[0].outputs[0].token_ids
    script, runs = tmp_path / "mgmn.py", tmp_path / "runs.txt"
    script.write_text(MGMN_SCRIPT)
    port = str(_free_port())
    launcher = [sys.executable, "-c", "import sys; from ember.compat.tensorrt_llm.hlapi.mgmn_worker_node import "
                                      "launch; sys.exit(launch())"]  # what the trtllm-hlapi-launch entry point runs
    base = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    procs = []
    for rank in (0, 1):  # what mpirun -np 2 (PMIx) sets in each process
        env = {**base, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2", "PMIX_RANK": str(rank),
               "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(launcher + [sys.executable, str(script), llama, str(runs)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs
    assert runs.read_text().split() == ["0"]  # the script ran once, on rank 0
    printed = _outputs(logs[0])
    assert [ids for _, ids, _ in printed] == [want, want] and not _outputs(logs[1])
    assert logs[0].count("executor: launched") == 2  # rank 1, the worker node, held the other half of both engines
