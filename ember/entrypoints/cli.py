"""The ``ember`` command line: generate, chat, serve, bench, convert."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from ember.config import INT4_GROUP_SIZES, KV_CACHE_DTYPES, QUANT_MODES
from ember.entrypoints.parallel_args import add_parallel_args
from ember.errors import ConfigError
from ember.quantization.config import QuantConfig
from ember.sampling_params import SamplingParams, StructuredOutputsParams
from ember.server.reasoning import REASONING_CHOICES
from ember.server.tools import TOOL_PARSER_CHOICES


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face folder, .gguf or .asmodel file, or a hub id org/name from the Hugging Face "
                        "cache (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 2GiB (default: 10%% of free RAM)")
    g.add_argument("--quantization", default=None, choices=["none", *QUANT_MODES],
                   help="weights: none (float), int8, int4, w8a8, or calibrated: awq (int4) or smoothquant (w8a8) "
                        "(default: as the checkpoint stores them)")
    g.add_argument("--int8-activations", action="store_true",
                   help="int4 / int8 weights multiply activations quantized to int8 per block of 32 (CPUs with "
                        "AVX512-BF16, VNNI and VBMI, without AMX: Zen 4 / 5): faster prefill and batches, "
                        "log-probabilities further from float (docs/int8_activations.md)")
    g.add_argument("--calibration", default=None, metavar="FILE",
                   help="awq / smoothquant: a UTF-8 text file to calibrate on (default: the shipped text)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache entries (default auto: the model's dtype)")
    g.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(default: off; docs/speculative.md)")
    add_parallel_args(g)


def _json_object(text: str) -> dict:
    """A JSON object from the command line (argparse names the flag when this raises)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object such as {{\"method\": \"ngram\"}}")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                   help="Hugging Face folder, .gguf or .asmodel file (or --model; default: the embedded model)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="clients must send `Authorization: Bearer KEY` (default: $EMBER_API_KEY, else no key)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model's name(s) in the API; the first is reported (default: the checkpoint's name)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting beyond the engine's running seats before new ones get 503 (default 256)")
    g.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="largest request body; larger ones get 413 (default 4 MiB)")
    g.add_argument("--allowed-origins", default=None,
                   help="comma-separated origins allowed by CORS, or * (default: CORS off)")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn's access log)")
    g.add_argument("--max-stored-responses", type=int, default=1000,
                   help="/v1/responses kept for previous_response_id and retrieval, least recently used dropped "
                        "(default 1000; 0: none kept)")
    g.add_argument("--max-stored-response-bytes", type=int, default=64 << 20,
                   help="the stored responses' JSON in bytes at most (default 64 MiB)")
    g.add_argument("--max-engine-restarts", type=int, default=3,
                   help="an engine whose loop stops (a rank or its process killed, an error in a step) is started "
                        "again at most this often in any ten minutes; then /health answers 503 (default 3; 0: never)")
    m = p.add_argument_group("images (vision-language models)")
    m.add_argument("--limit-mm-per-prompt", type=json.loads, default=None, metavar="JSON",
                   help='images a prompt may hold, as JSON: \'{"image": 4}\' (default 8)')
    m.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="image_url parts may name files (file:// URLs) under DIR (default: no files)")
    m.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="image_url parts may be http(s) URLs of these hosts, fetched by the server (default: none; "
                        "data: URIs always work)")
    t = p.add_argument_group("tools and reasoning")
    t.add_argument("--tool-call-parser", default="auto", choices=TOOL_PARSER_CHOICES,
                   help="how replies' tool calls are read: auto (default: the format the chat template teaches), "
                        "hermes (<tool_call>), llama3_json, mistral ([TOOL_CALLS]), or none (tools refused)")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto is on wherever a parser is known")
    t.add_argument("--reasoning-parser", default="auto", choices=REASONING_CHOICES,
                   help="<think> text into reasoning_content: auto (default: where the chat template has </think>), "
                        "deepseek_r1 / qwen3 (always), none (never)")
    e = p.add_argument_group("scheduling")
    e.add_argument("--max-num-seqs", type=int, default=64, help="sequences in the running batch at most")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step at most")
    e.add_argument("--max-num-prefill-seqs", type=int, default=None,
                   help="prompts prefilled in one step at most (default: as many as the token budget allows)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes seen before (default on)")
    e.add_argument("--seed", type=int, default=0, help="engine seed (requests without their own seed)")
    lo = p.add_argument_group("LoRA adapters")
    lo.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="PEFT adapters served as models of their own: NAME=PATH, or JSON {\"name\": ..., "
                         "\"path\": ...}; a request's `model` picks one (listed in /v1/models)")
    lo.add_argument("--max-loras", type=int, default=None,
                    help="adapters resident at once (default: all of --lora-modules); others wait for a slot")
    lo.add_argument("--max-lora-rank", type=int, default=None,
                    help="largest adapter rank (default: the largest of --lora-modules, at least 16)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's generation_config, else greedy)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None, help="seed of this request's sampling")
    so = g.add_mutually_exclusive_group()
    so.add_argument("--json-schema", default=None, metavar="FILE",
                    help="the reply is JSON following the schema in FILE (enforced token by token)")
    so.add_argument("--json-object", action="store_true", help="the reply is a JSON object")
    so.add_argument("--regex", default=None, help="the whole reply matches this regular expression")
    so.add_argument("--grammar", default=None, metavar="FILE",
                    help="the reply follows the Lark or GBNF grammar in FILE")
    g.add_argument("--lora", default=None, metavar="PATH",
                   help="generate with this PEFT LoRA adapter (a folder with adapter_config.json and "
                        "adapter_model.safetensors)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="ember: a small, fast LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a reply to one prompt",
                         description="Generate a reply to PROMPT and print it as it is produced. For instruct "
                                     "models the chat template is applied unless --no-chat is given.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--no-chat", action="store_true", help="send PROMPT as raw text, without the chat template")
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    gen.add_argument("--image", action="append", default=None, metavar="FILE",
                     help="an image for a vision-language model (repeat for several; with --no-chat, PROMPT holds "
                          "the model's image token where each goes)")
    _add_model_args(gen)
    _add_sampling_args(gen)
    chat = sub.add_parser("chat", help="interactive chat that keeps the conversation",
                          description="Chat with the model in the terminal; replies stream as they are generated. "
                                      "Type /reset to start over, /exit or Ctrl-D to leave.")
    chat.add_argument("--system", default=None, help="a system message for the conversation")
    _add_model_args(chat)
    _add_sampling_args(chat)
    conv = sub.add_parser("convert", help="serialize a model into ember's .asmodel/.asparam format",
                          description="Convert SRC (a Hugging Face folder, a .gguf file or an .asmodel file) into "
                                      "ember's serialized pair NAME.asmodel + NAME.asparam, which `--model "
                                      "DST/NAME.asmodel` and the DashInfer facade load directly.")
    conv.add_argument("src", help="the model to convert")
    conv.add_argument("dst", help="an output folder, or the path of the .asmodel file to write")
    conv.add_argument("--name", default=None, help="the model name (default: from DST, else from SRC)")
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                      help="weights' dtype (default: the checkpoint's own, bfloat16 for GGUF)")
    conv.add_argument("--skip-if-exists", action="store_true", help="keep a pair that exists and validates")
    conv.add_argument("--quantization", default=None, choices=list(QUANT_MODES),
                      help="store the linear weights quantized: int8 (per channel), int4 (groups), w8a8, awq (int4 "
                           "after AWQ's calibrated scales) or smoothquant (w8a8 after smoothing)")
    conv.add_argument("--calibration", default=None, metavar="FILE",
                      help="awq / smoothquant: a UTF-8 text file to calibrate on (default: the shipped text)")
    conv.add_argument("--group-size", type=int, default=128, choices=list(INT4_GROUP_SIZES),
                      help="int4 group size (default 128)")
    conv.add_argument("--quantize-embeddings", action="store_true",
                      help="also store the embedding table and LM head as int8")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with a web chat page and metrics",
                           description="Serve MODEL over HTTP: /v1/chat/completions, /v1/completions, /v1/models, "
                                       "/tokenize, /detokenize, /health, /metrics, and a chat page at /. "
                                       "See docs/server.md.")
    add_serve_args(serve)
    _add_model_args(serve)
    from ember.benchmarks.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


# generate and chat run one stream: one seat, and 256-token prefill steps. The engine warms up at its worst case (every
# seat at max_model_len, a full prefill step, twice: once to measure, once beside the KV pool); at the serving defaults
# (64 seats, 2048 tokens) that warm-up is most of the command's start-up. Measured on the default model: 256-token
# steps start 0.22 s sooner than 512 (0.97 vs 1.19 s to a ready engine) and take a 500-token prompt's first token
# 4% longer (218 vs 210 ms).
CLI_MAX_NUM_SEQS = 1
CLI_PREFILL_TOKENS = 256


def _load(args: argparse.Namespace):
    from ember import LLM
    from ember.lora.adapter import lora_settings

    lora = lora_settings([args.lora]) if args.lora else {}  # the adapter's config is checked before the model loads
    return LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               kv_cache_memory=args.kv_cache_memory, max_num_seqs=CLI_MAX_NUM_SEQS,
               max_num_batched_tokens=CLI_PREFILL_TOKENS, quantization=args.quantization,
               int8_activations=args.int8_activations, calibration_data=args.calibration,
               kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
               pipeline_parallel_size=args.pipeline_parallel_size,
               distributed_executor_backend=args.distributed_executor_backend,
               speculative_config=args.speculative_config, **lora)


def _lora(args: argparse.Namespace):
    """The request's adapter from --lora (named after its folder), or None."""
    from ember.lora.request import LoRARequest

    return LoRARequest(os.path.basename(os.path.normpath(args.lora)), 1, args.lora) if args.lora else None


def _structured(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The reply's constraint from --json-schema / --json-object / --regex / --grammar, read before the model loads."""
    def read(path: str, flag: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot be read ({e.strerror})") from None

    if args.json_schema is not None:
        text = read(args.json_schema, "--json-schema")
        try:
            return StructuredOutputsParams(json=json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON ({e})") from None
    if args.json_object:
        return StructuredOutputsParams(json_object=True)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.grammar is not None:
        return StructuredOutputsParams(grammar=read(args.grammar, "--grammar"))
    return None


def _params(llm, args: argparse.Namespace, structured: StructuredOutputsParams | None = None) -> SamplingParams:
    params = llm.get_default_sampling_params()
    changes = {"max_tokens": args.max_tokens, "seed": args.seed, "structured_outputs": structured}
    if args.temperature is not None:
        changes["temperature"] = args.temperature
    elif "temperature" not in llm.client.generation_config:
        changes["temperature"] = 0.0
    if args.top_p is not None:
        changes["top_p"] = args.top_p
    if args.top_k is not None:
        changes["top_k"] = args.top_k
    return params.clone(**changes)


def _stream_reply(llm, prompt, params: SamplingParams, lora=None) -> str:
    start = time.perf_counter()
    text, n = "", 0
    for delta in llm.stream(prompt, params, lora):
        for out in delta.outputs:
            sys.stdout.write(out.text)
            sys.stdout.flush()
            text += out.text
            n += len(out.token_ids)
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"[ember] {n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tokens/s)", file=sys.stderr)
    return text


def _read(path: str) -> bytes:
    try:
        with open(os.path.expanduser(path), "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"--image {path!r} cannot be read: {e.strerror}") from None


def _messages(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


def cmd_generate(args: argparse.Namespace) -> int:
    structured = _structured(args)
    llm = _load(args)
    try:
        params = _params(llm, args, structured)
        images = [_read(path) for path in args.image or ()]  # bytes: checked like any image (format, size)
        if args.no_chat or not llm.tokenizer.has_chat_template:
            prompt = {"prompt": args.prompt, "multi_modal_data": {"image": images}} if images else args.prompt
        else:
            content = [{"type": "image", "image": img} for img in images] + [{"type": "text", "text": args.prompt}]
            prompt = llm.client.chat_prompt(_messages(args.system) + [{"role": "user",
                                                                       "content": content if images else args.prompt}])
        _stream_reply(llm, prompt, params, _lora(args))
    finally:
        llm.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    structured = _structured(args)
    llm = _load(args)
    params = _params(llm, args, structured)
    history = _messages(args.system)
    print("ember chat: /reset to start over, /exit or Ctrl-D to leave.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            history = _messages(args.system)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = _stream_reply(llm, llm.client.chat_prompt(history), params, _lora(args))
        history.append({"role": "assistant", "content": reply})
    llm.shutdown()
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from ember.model_loader.asmodel import MODEL_SUFFIX
    from ember.model_loader.convert import convert

    if not os.path.exists(args.src):
        raise ValueError(f"src={args.src!r} does not exist: pass a Hugging Face folder, a .gguf or an .asmodel file")
    if args.dst.endswith(MODEL_SUFFIX):
        out_dir, name = os.path.dirname(args.dst) or ".", args.name or os.path.basename(args.dst)[:-len(MODEL_SUFFIX)]
    else:
        stem = os.path.basename(os.path.normpath(args.src))
        for suffix in (".gguf", MODEL_SUFFIX):
            stem = stem.removesuffix(suffix)
        out_dir, name = args.dst, args.name or stem
    quant = QuantConfig.of(args.quantization, args.group_size, args.quantize_embeddings) if args.quantization else None
    if args.calibration is not None:  # the engine's own check of the file (exists, not empty, a calibrated mode)
        from ember.config import EngineConfig

        EngineConfig(quantization=args.quantization, calibration_data=args.calibration)
    start = time.perf_counter()
    path = convert(args.src, out_dir, name, args.dtype, skip_if_exists=args.skip_if_exists, show_progress=True,
                   quant_config=quant, calibration_data=args.calibration)
    size = os.path.getsize(path[:-len(MODEL_SUFFIX)] + ".asparam")
    print(f"[ember] wrote {path} (+ .asparam, {size / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    print(path)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ember.server.launch import serve  # FastAPI and uvicorn are imported by `ember serve` only

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from ember.benchmarks.bench import main as bench_main

        return bench_main(args)
    logging.basicConfig(level=logging.WARNING, format="[ember] %(message)s")
    try:
        return {"generate": cmd_generate, "chat": cmd_chat, "convert": cmd_convert,
                "serve": cmd_serve}[args.command](args)
    except ValueError as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The console script. After a one-shot command (generate, chat) the process leaves without the interpreter's
    teardown: unloading torch's modules takes ~0.4 s on this machine, a fifth of ``ember generate``'s start-up
    budget, and by then the engine is shut down and every output flushed."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv and argv[0] in ("generate", "chat"):
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
