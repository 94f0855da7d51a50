#!/usr/bin/env python3
"""TensorRT-LLM's examples/high-level-api/llm_examples.py (v0.10) on ember: the same tasks, options and printed
output, with ``tensorrt_llm`` replaced by ``ember.compat.tensorrt_llm`` in the imports.

Two command-line forms, as the reference page shows them:

    python3 llm_examples.py run_llm_generate --prompt="What is LLM?" --model_dir=<llama-model-path>
    python3 llm_examples.py --task run_llm_on_tensor_parallel --prompt="<prompt>" --hf_model_dir=<llama-model-path>

The first is v0.10's (a click group upstream, argparse here: the same subcommands and options); the second is the
older ``--task`` form (v0.8-0.9), whose task names map onto the same functions. Upstream skips the multi-GPU
examples on a machine with fewer GPUs than ranks; ember runs tensor / pipeline ranks as local processes (CPU ranks
over gloo where there is no GPU), so nothing is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import List, Optional, Union

from ember.compat.tensorrt_llm import LLM, ModelConfig
from ember.compat.tensorrt_llm.hlapi import KvCacheConfig, SamplingConfig
from ember.compat.tensorrt_llm.quantization import QuantAlgo

# NOTE, Currently, the following examples are only available for LLaMA models.


def run_llm_generate(prompt: str,
                     model_dir: str,
                     engine_dir: Optional[str] = None,
                     tp_size: int = 1,
                     pp_size: int = 1,
                     prompt_is_digit: bool = False,
                     end_id: int = 2):
    ''' Running LLM with arbitrary model formats including:
        - HF model
        - TRT-LLM checkpoint
        - TRT-LLM engine (here: a folder written by LLM.save)

    It will dump the engine to `engine_dir` if specified.
    '''
    config = ModelConfig(model_dir)
    # Avoid the tp_size and pp_size setting override the ones loaded from built engine
    if tp_size > 1:
        config.parallel_config.tp_size = tp_size
    if pp_size > 1:
        config.parallel_config.pp_size = pp_size
    if tp_size * pp_size > 1:
        print(f'Running LLM with Tensor Parallel on {tp_size} ranks'
              + (f', Pipeline Parallel on {pp_size} stages.' if pp_size > 1 else '.'))

    llm = LLM(config)

    if engine_dir and os.path.abspath(model_dir) != os.path.abspath(engine_dir):
        print(f"Saving engine to {engine_dir}...")
        llm.save(engine_dir)

    prompts = parse_prompts(prompt, prompt_is_digit)

    sampling_config = SamplingConfig(end_id=end_id, pad_id=end_id) if prompt_is_digit else None

    for output in llm.generate(prompts, sampling_config=sampling_config):
        print("OUTPUT:", output)
    llm.shutdown()


def run_llm_generate_async_example(prompt: str,
                                   model_dir: str,
                                   streaming: bool = False,
                                   tp_size: int = 1,
                                   pp_size: int = 1):
    ''' Running LLM generation asynchronously. '''
    config = ModelConfig(model_dir)
    # Avoid the tp_size and pp_size setting override the ones loaded from built engine
    if tp_size > 1:
        config.parallel_config.tp_size = tp_size
        print(f'Running LLM with Tensor Parallel on {tp_size} ranks.')
    if pp_size > 1:
        config.parallel_config.pp_size = pp_size

    llm = LLM(config, kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.4))
    prompts = parse_prompts(prompt, False)

    async def task(prompt: str):
        outputs = []
        async for output in llm.generate_async(prompt, streaming=streaming):
            outputs.append(output.text)
        print(' '.join(outputs))

    async def main():
        tasks = [task(prompt) for prompt in prompts]
        await asyncio.gather(*tasks)

    asyncio.run(main())
    llm.shutdown()


def run_llm_with_quantization(prompt: str, model_dir: str, quant_type: str = 'int4_awq'):
    ''' Running LLM with quantization.
    quant_type could be 'int4_awq' or 'fp8'.

    Upstream needs an Ampere GPU (Hopper for fp8). ember quantizes int4 AWQ on any device; it has no fp8 (weights
    or KV cache), so 'fp8' prints the facade's reason and returns, as upstream does on a GPU without fp8.
    '''
    config = ModelConfig(model_dir)
    if quant_type == 'int4_awq':
        config.quant_config.quant_algo = QuantAlgo.W4A16_AWQ
    else:
        config.quant_config.quant_algo = QuantAlgo.FP8
        config.quant_config.kv_cache_quant_algo = QuantAlgo.FP8

    try:
        llm = LLM(config)
    except ValueError as e:
        if quant_type == 'int4_awq':
            raise
        print(f"Skip the example for {quant_type}: ember has no fp8 quantization ({e})")
        return
    prompts = parse_prompts(prompt, False)

    for output in llm.generate(prompts):
        print(output)
    llm.shutdown()


def run_llm_with_async_future(prompt: str, model_dir: str):
    config = ModelConfig(model_dir)
    llm = LLM(config, kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.4))

    prompts = parse_prompts(prompt)
    # The result of generate_async() is similar to a Future, it won't block the main thread, call .result() to
    # explicitly wait for the result
    futures = [llm.generate_async(prompt) for prompt in prompts]
    for future in futures:
        # .result() is a blocking call, call it when you want to wait for the result
        output = future.result()
        print(output.text)

    # Similar to .result(), there is an async version of .result(), which is .aresult(), and it works with the
    # generate_async().
    async def task(prompt: str):
        generation = llm.generate_async(prompt, streaming=False)
        output = await generation.aresult()
        print(output.text)

    async def main():
        tasks = [task(prompt) for prompt in prompts]
        await asyncio.gather(*tasks)

    asyncio.run(main())
    llm.shutdown()


def run_llm_with_auto_parallel(prompt: str, model_dir: str, world_size: int = 1):
    ''' Running LLM with auto parallel enabled. '''
    if world_size > 1:
        print(f'Running LLM with Auto Parallel on {world_size} ranks.')

    config = ModelConfig(model_dir)
    config.parallel_config.auto_parallel = True
    config.parallel_config.world_size = world_size

    llm = LLM(config)
    prompts = parse_prompts(prompt)

    for output in llm.generate(prompts):
        print(output)
    llm.shutdown()


def parse_prompts(prompt: str, is_digit: bool = False) -> Union[List[str], List[List[int]]]:
    ''' Process a single prompt. '''
    if is_digit:
        return [[int(i) for i in prompt.split()]]
    else:
        return [prompt]


# ----- the command line: v0.10's subcommands, and the older --task form -----

COMMANDS = ("run_llm_generate", "run_llm_generate_async_example", "run_llm_with_quantization",
            "run_llm_with_async_future", "run_llm_with_auto_parallel")
# the --task form's names (v0.8-0.9): each is one of the functions above
TASKS = ("run_llm_from_huggingface_model", "run_llm_from_tllm_engine", "run_llm_on_tensor_parallel") + COMMANDS


def _bool(value: str) -> bool:
    """click's BOOL: true/false, 1/0, yes/no, y/n, on/off, t/f."""
    v = value.strip().lower()
    if v in ("1", "true", "t", "yes", "y", "on"):
        return True
    if v in ("0", "false", "f", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{value!r} is not a valid boolean")


def _commands(prog: str, doc: str):
    """(parser, command): a parser of subcommands; ``command(name, help)`` adds one taking the examples' common
    --prompt and --model_dir (this file's and run_examples.py's)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument('--prompt', type=str, default="What is LLM?")
        p.add_argument('--model_dir', type=str, required=True, help='The directory of the model.')
        return p

    return parser, command


def _command_parser() -> argparse.ArgumentParser:
    parser, command = _commands("llm_examples.py", __doc__)

    p = command("run_llm_generate", "Run LLM on a HF model, a TRT-LLM checkpoint or a saved engine; save it to "
                                    "--engine_dir if given.")
    p.add_argument('--engine_dir', type=str, default=None, help='The directory of the engine.')
    p.add_argument('--tp_size', type=int, default=1, help='The number of ranks for Tensor Parallel.')
    p.add_argument('--pp_size', type=int, default=1, help='The number of ranks for Pipeline Parallel.')
    p.add_argument('--prompt_is_digit', type=_bool, default=False,
                   help='Whether the prompt is a list of integers.')
    p = command("run_llm_generate_async_example", "Running LLM generation asynchronously.")
    p.add_argument('--streaming', action='store_true', help='Whether to enable streaming generation.')
    p.add_argument('--tp_size', type=int, default=1, help='The number of ranks for Tensor Parallel.')
    p.add_argument('--pp_size', type=int, default=1, help='The number of ranks for Pipeline Parallel.')
    p = command("run_llm_with_quantization", "Running LLM with quantization.")
    p.add_argument('--quant_type', type=str, default='int4_awq', choices=['int4_awq', 'fp8'],
                   help='The quantization type.')
    command("run_llm_with_async_future", "Running LLM with futures: .result() and await .aresult().")
    p = command("run_llm_with_auto_parallel", "Running LLM with auto parallel enabled.")
    p.add_argument('--world_size', type=int, default=1, help='The number of ranks for Auto Parallel.')
    return parser


def _task_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm_examples.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__ + "\nSubcommands: " + ", ".join(COMMANDS) + " (llm_examples.py COMMAND --help).")
    parser.add_argument('--task', type=str, choices=TASKS, required=True)
    parser.add_argument('--hf_model_dir', '--model_dir', dest='hf_model_dir', type=str,
                        help='The directory of the model.')
    parser.add_argument('--dump_engine_dir', type=str, default=None, help='The directory to dump the engine.')
    parser.add_argument('--quant_type', type=str, choices=['int4_awq', 'fp8'], default='int4_awq')
    parser.add_argument('--prompt', type=str, default="What is LLM?")
    parser.add_argument('--world_size', type=int, default=1)
    parser.add_argument('--tp_size', type=int, default=1)
    parser.add_argument('--streaming', action='store_true')
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        args = vars(_command_parser().parse_args(argv))
        globals()[args.pop("command")](**args)
        return

    parser = _task_parser()
    args = parser.parse_args(argv)
    model_dir = args.dump_engine_dir if args.task == "run_llm_from_tllm_engine" else args.hf_model_dir
    if not model_dir:
        parser.error(f"--task {args.task} needs " + ("--dump_engine_dir" if args.task == "run_llm_from_tllm_engine"
                                                      else "--hf_model_dir"))
    tasks = dict(
        run_llm_from_huggingface_model=lambda: run_llm_generate(args.prompt, model_dir, args.dump_engine_dir,
                                                                tp_size=args.tp_size),
        run_llm_from_tllm_engine=lambda: run_llm_generate(args.prompt, model_dir, tp_size=args.tp_size),
        run_llm_on_tensor_parallel=lambda: run_llm_generate(args.prompt, model_dir, tp_size=2),
        run_llm_generate=lambda: run_llm_generate(args.prompt, model_dir, args.dump_engine_dir,
                                                  tp_size=args.tp_size),
        run_llm_generate_async_example=lambda: run_llm_generate_async_example(
            args.prompt, model_dir, streaming=args.streaming, tp_size=args.tp_size),
        run_llm_with_quantization=lambda: run_llm_with_quantization(args.prompt, model_dir, args.quant_type),
        run_llm_with_async_future=lambda: run_llm_with_async_future(args.prompt, model_dir),
        run_llm_with_auto_parallel=lambda: run_llm_with_auto_parallel(args.prompt, model_dir, args.world_size),
    )

    print(f'Running {args.task} ...')

    tasks[args.task]()


if __name__ == '__main__':
    main()
