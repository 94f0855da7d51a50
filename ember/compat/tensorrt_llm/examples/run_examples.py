#!/usr/bin/env python3
"""TensorRT-LLM's examples/high-level-api/run_examples.py (v0.10) on ember: runs llm_examples.py's tasks one after
another, each as its own process, as the reference page says:

    python3 ./run_examples.py run_single_gpu --model_dir <llama-model-path>
    python3 ./run_examples.py run_multi_gpu --model_dir <llama-model-path>
    python3 ./run_examples.py run_quant --model_dir <llama-model-path>

(or ``python -m ember.compat.tensorrt_llm.examples.run_examples ...``). The multi-GPU commands run their 2 ranks as
local processes: one GPU each on a machine with two, CPU ranks (gloo) on one without a GPU.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import List, Optional

from ember.compat.tensorrt_llm.examples.llm_examples import _bool, _commands  # upstream: from llm_examples import *

LLM_EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'llm_examples.py')
ENGINE_DIR = "/tmp/hlapi.engine.example"


def _hint(text: str) -> None:
    """The line printed before each step: green on a terminal, plain otherwise."""
    if sys.stdout.isatty() and not os.environ.get("NO_COLOR"):
        text = f"\033[32m{text}\033[0m"
    print(text, flush=True)


def _run_cmd(cmd: List[str], hint: str) -> None:
    _hint(f">> {hint}: {shlex.join(cmd)}")
    subprocess.run(cmd, check=True)


def _example(llm_examples: str, *args: str) -> List[str]:
    return [sys.executable, llm_examples, *args]


def run_single_gpu(prompt: str, model_dir: str, examples_root: Optional[str], llm_examples: str,
                   engine_dir: str) -> None:
    _run_cmd(_example(llm_examples, "run_llm_generate", f"--prompt={prompt}", f"--model_dir={model_dir}",
                      f"--engine_dir={engine_dir}"),
             "Running LLM from a HF model and saving the engine")
    _run_cmd(_example(llm_examples, "run_llm_generate_async_example", f"--prompt={prompt}",
                      f"--model_dir={engine_dir}", "--streaming"),
             "Running LLM from the saved engine, asynchronously with streaming")
    _run_cmd(_example(llm_examples, "run_llm_with_async_future", f"--prompt={prompt}", f"--model_dir={engine_dir}"),
             "Running LLM from the saved engine with futures")


def run_multi_gpu(prompt: str, model_dir: str, examples_root: Optional[str], llm_examples: str, engine_dir: str,
                  run_autopp: bool = True) -> None:
    _run_cmd(_example(llm_examples, "run_llm_generate", f"--prompt={prompt}", f"--model_dir={model_dir}",
                      "--tp_size=2", f"--engine_dir={engine_dir}.tp2"),
             "Running LLM with Tensor Parallel (tp_size=2) and saving the engine")
    _run_cmd(_example(llm_examples, "run_llm_generate_async_example", f"--prompt={prompt}",
                      f"--model_dir={engine_dir}.tp2", "--streaming"),
             "Running LLM from the saved TP engine, asynchronously with streaming")
    if run_autopp:
        _run_cmd(_example(llm_examples, "run_llm_with_auto_parallel", f"--prompt={prompt}",
                          f"--model_dir={model_dir}", "--world_size=2"),
                 "Running LLM with Auto Parallel (world_size=2)")


def run_quant(prompt: str, model_dir: str, examples_root: Optional[str], llm_examples: str) -> None:
    _run_cmd(_example(llm_examples, "run_llm_with_quantization", f"--prompt={prompt}", "--quant_type=int4_awq",
                      f"--model_dir={model_dir}"),
             "Running LLM with INT4 AWQ quantization")


def _parser() -> argparse.ArgumentParser:
    parser, common = _commands("run_examples.py", __doc__)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = common(name, help)
        p.add_argument('--examples_root', type=str, default=None,
                       help='The directory of the TensorRT-LLM examples (accepted; not used).')
        p.add_argument('--llm_examples', type=str, default=LLM_EXAMPLES, help='The path to llm_examples.py.')
        return p

    p = command("run_single_gpu", "Run the single-GPU examples: generate (saving the engine), async streaming and "
                                  "futures on the saved engine.")
    p.add_argument('--engine_dir', type=str, default=ENGINE_DIR, help='The directory to save the engine to.')
    p = command("run_multi_gpu", "Run the multi-GPU examples: tp_size=2 (saving the engine), async streaming on "
                                 "the saved engine, auto parallel with world_size=2.")
    p.add_argument('--engine_dir', type=str, default=ENGINE_DIR,
                   help='The directory to save the engine to (".tp2" is appended).')
    p.add_argument('--run_autopp', type=_bool, default=True, help='Whether to run the auto parallel example.')
    command("run_quant", "Run the quantization example (INT4 AWQ).")
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    args = vars(_parser().parse_args(argv))
    dict(run_single_gpu=run_single_gpu, run_multi_gpu=run_multi_gpu, run_quant=run_quant)[args.pop("command")](
        **args)


if __name__ == '__main__':
    main()
