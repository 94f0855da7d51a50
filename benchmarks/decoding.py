"""Beam search and StreamingLLM on the default model (or --model): time and the KV blocks they hold.

- beams: the same prompts decoded greedily (n=1), as n=W sampled samples and as beam search of width W: output
  tokens/s (every returned sequence counted) and the most KV blocks in use at once (polled every 5 ms).
- window: one long generation with full attention and with a StreamingLLM window: the most blocks held, and decode
  tokens/s over the first and the last quarter of the tokens.
Interleaved repeats, medians; prints one JSON object.

    python benchmarks/decoding.py [--model PATH] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from ember import LLM, SamplingParams


class PeakBlocks:
    """The most KV blocks in use while the block runs (polled)."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.peak, self._stop = llm, 0, threading.Event()

    def _poll(self) -> None:
        while not self._stop.is_set():
            s = self.llm.stats()
            self.peak = max(self.peak, s["kv_blocks_total"] - s["kv_blocks_free"])
            time.sleep(0.005)

    def __enter__(self) -> "PeakBlocks":
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def beams(model: str | None, width: int, repeats: int) -> dict:
    llm = LLM(model, enable_prefix_caching=False, max_num_seqs=64)
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in (
        "Name three colors.", "What is the capital of France?", "Write a haiku about the sea.",
        "Explain photosynthesis in one sentence.", "List four fruits.", "What is 12 times 12?",
        "Describe a cat.", "Give me a tip for sleeping well.")]
    modes = {"greedy": SamplingParams(temperature=0, max_tokens=64),
             f"sample_n{width}": SamplingParams(temperature=0.8, n=width, max_tokens=64, seed=0),
             f"beam_w{width}": SamplingParams(temperature=0, beam_width=width, n=width, max_tokens=64)}
    runs: dict[str, list] = {m: [] for m in modes}
    llm.generate(prompts[:2], modes["greedy"], use_tqdm=False)  # warm
    for _ in range(repeats):
        for name, params in modes.items():
            with PeakBlocks(llm) as peak:
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            runs[name].append({"s": dt, "tokens": tokens, "tok_s": tokens / dt, "peak_blocks": peak.peak})
    llm.shutdown()
    return {name: {"median_tok_s": round(statistics.median(r["tok_s"] for r in rs), 1),
                   "median_s": round(statistics.median(r["s"] for r in rs), 2),
                   "peak_blocks": max(r["peak_blocks"] for r in rs), "runs": rs} for name, rs in runs.items()}


def window(model: str | None, new: int, size: int, sink: int, repeats: int) -> dict:
    out = {}
    for name, kw in (("full", {}), (f"window{size}_sink{sink}", dict(attention_window=size,
                                                                      sink_tokens=sink))):
        llm = LLM(model, max_num_seqs=4, **kw)
        rs = []
        for _ in range(repeats):
            stamps = []
            with PeakBlocks(llm) as peak:
                for delta in llm.stream("Once upon a time", SamplingParams(temperature=0, max_tokens=new,
                                                                            ignore_eos=True)):
                    stamps.extend([time.perf_counter()] * len(delta.outputs[0].token_ids))
            q = len(stamps) // 4
            rs.append({"peak_blocks": peak.peak, "first_quarter_tok_s": q / (stamps[q] - stamps[0]),
                       "last_quarter_tok_s": q / (stamps[-1] - stamps[-1 - q])})
        out[name] = {"peak_blocks": max(r["peak_blocks"] for r in rs),
                     "first_quarter_tok_s": round(statistics.median(r["first_quarter_tok_s"] for r in rs), 1),
                     "last_quarter_tok_s": round(statistics.median(r["last_quarter_tok_s"] for r in rs), 1),
                     "block_size": llm.model_info.block_size, "runs": rs}
        llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--new", type=int, default=2048)
    a = ap.parse_args()
    print(json.dumps({"beams": beams(a.model, a.width, a.repeats),
                      "streaming_llm": window(a.model, a.new, 256, 4, a.repeats)}))


if __name__ == "__main__":
    main()
