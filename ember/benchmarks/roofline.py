"""The weight-streaming roofline of batch-1 decode: a decode step reads every weight once (the token embedding
only a row of it, unless it is also the LM head), so no backend decodes one sequence faster than the machine's
memory bandwidth over those bytes. ``ember bench latency`` measures both before its runs, on the same machine and
thread count, and prints each backend's decode speed as a share of it. The KV cache a step reads (about 15 MB at
512 tokens of context for a 1.5B model) is left out: it is under 2% of the weights at these lengths."""

from __future__ import annotations

import os
import statistics
import textwrap
import time

_BUFFER_BYTES = 1 << 30  # far past any last-level cache, so every pass streams from memory
_PASSES = 5
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def stream_bandwidth(threads: int, nbytes: int = _BUFFER_BYTES, passes: int = _PASSES) -> float:
    """Bytes a second that a sum over a ``nbytes`` float32 buffer reads with ``threads`` threads: the median of
    ``passes`` passes after one warm pass (the same reduction every backend's decode loop resembles: read once,
    front to back, a few vector instructions a cache line)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        buf.sum()
        times = []
        for _ in range(passes):
            start = time.perf_counter()
            buf.sum()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return nbytes / statistics.median(times)


def decode_bytes(model: str, dtype: str = "bfloat16") -> tuple[int, str]:
    """(bytes of weights one decode step reads, how they were counted) for a GGUF file (its tensors as stored)
    or a Hugging Face folder (its parameters in ``dtype``)."""
    if model.endswith(".gguf"):
        from ember.model_loader.gguf_file import GGUFFile

        sizes = {t.name: t.data.nbytes for t in GGUFFile(model).tensors}
        embed = sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0
        return sum(sizes.values()) - embed, "the GGUF's tensors as stored" + (
            ", less the token embedding, read a row a token" if embed else "; its embedding is the LM head")
    counts = _folder_counts(model)
    per = _DTYPE_BYTES.get(dtype, 2)
    embed = counts.get("embed", 0) if counts.get("untied") else 0
    return (counts["params"] - embed) * per, f"the parameters in {dtype}" + (
        ", less the token embedding, read a row a token" if embed else "")


def _folder_counts(folder: str) -> dict:
    """Parameter counts from a folder's safetensors headers (no tensor is read); untied when it holds an LM head of
    its own."""
    from safetensors import safe_open

    params = embed = 0
    head = False
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")] if os.path.isdir(folder) else []
    if not files:
        raise ValueError(f"{folder!r} has no .safetensors files to count the weights of")
    for name in files:
        with safe_open(os.path.join(folder, name), "np") as f:
            for key in f.keys():
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                params += n
                if key.endswith("embed_tokens.weight"):
                    embed = n
                head = head or key.endswith("lm_head.weight")
    return {"params": params, "embed": embed, "untied": head}


def roofline(model: str, threads: int, dtype: str = "bfloat16") -> dict:
    """The record's ``roofline`` entry: measured bandwidth, bytes a token and the tokens a second they allow."""
    bandwidth = stream_bandwidth(threads)
    nbytes, counted = decode_bytes(model, dtype)
    return {"bandwidth_gb_s": bandwidth / 1e9, "bytes_per_token": nbytes, "counted": counted,
            "tokens_per_s": bandwidth / nbytes, "threads": threads,
            "method": f"torch.sum over {_BUFFER_BYTES >> 20} MiB of float32, median of {_PASSES} passes"}


def share_line(record: dict) -> str | None:
    """One line for the latency table: the roofline and each backend's decode speed as a share of it."""
    roof = record.get("roofline")
    if not roof:
        return None
    from ember.benchmarks.runner import BACKEND_NAMES

    shares = []
    for b, fig in record["median"].items():
        parts = [f"{100 * f['decode_tokens_per_s'] / roof['tokens_per_s']:.0f}% (prompt {k[7:]})"
                 for k, f in fig.items() if k.startswith("prompt_")]
        shares.append(f"{BACKEND_NAMES.get(b, b)} {', '.join(parts)}")
    line = (f"Roofline: {roof['tokens_per_s']:.1f} tok/s = {roof['bandwidth_gb_s']:.1f} GB/s measured "
            f"({roof['method']}, {roof['threads']} threads) / {roof['bytes_per_token'] / 1e6:.0f} MB a token "
            f"({roof['counted']}). Of it: {'; '.join(shares)}.")
    return textwrap.fill(line, 120, break_on_hyphens=False)
