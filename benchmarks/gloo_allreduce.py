"""Latency of one gloo all-reduce between two local processes (one thread each): what each collective of a
tensor-parallel step costs on this machine (docs/parallel.md).

    python benchmarks/gloo_allreduce.py [--calls 2000] [--hidden 896]
"""

from __future__ import annotations

import argparse
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROWS = (1, 16, 256)


def _rank(rank: int, port: int, calls: int, hidden: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for rows in ROWS:
        x = torch.randn(rows, hidden)
        for _ in range(50):
            dist.all_reduce(x)
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(x)
        if rank == 0:
            out.put((rows, (time.perf_counter() - start) / calls * 1e6))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--hidden", type=int, default=896, help="values a row (Qwen2.5-0.5B's hidden size)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, port, args.calls, args.hidden, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    while not out.empty():
        rows, us = out.get()
        print(f"{rows:4d} rows x {args.hidden}: {us:7.0f} us an all-reduce")


if __name__ == "__main__":
    main()
