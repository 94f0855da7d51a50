"""The engine core's own cost of a decode step, without a model: the core over a scripted executor
(``ember.executor.scripted``) runs R sequences at L tokens of context; each step is timed from schedule to the
after-step work (and the part of it spent in the executor, which plans the rows as a model runner
does), and the step's ``SchedulerOutput`` is pickled as the distributed executor broadcasts it.

    python benchmarks/core_step.py --rows 64 --context 400 [--penalties] [--out result.json]

Prints the median host time a step (microseconds) and the bytes broadcast a step, for plain rows and for rows whose
penalties read the token history (before SchedulerOutput the core sent it whole every step).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time


def measure(rows: int, context: int, penalties: bool, steps: int, block_size: int = 16) -> dict[str, float]:
    from ember.core.engine_core import EngineCore
    from ember.executor.scripted import EOS, ScriptedExecutor, scripted_configs
    from ember.protocol import EngineRequest
    from ember.sampling_params import SamplingParams

    max_len = context + steps + 64
    blocks = rows * (-(-max_len // block_size)) + 8
    executor = ScriptedExecutor(blocks, block_size)
    executor.keep = False
    sched, resolved = scripted_configs(rows, max_len, max(2048, rows), block_size, prefix_caching=False)
    core = EngineCore(executor, sched, resolved)
    extra = dict(repetition_penalty=1.1, presence_penalty=0.2) if penalties else {}
    for i in range(rows):
        sp = SamplingParams(temperature=0.0, max_tokens=steps + 32, ignore_eos=True, **extra)
        sp.eos_token_ids = (EOS,)
        prompt = [(i * 13 + j) % 900 + 3 for j in range(context)]
        core.add(EngineRequest(f"r{i}", prompt, sp, len(prompt) + sp.max_tokens))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # the prompts, chunk by chunk; what follows is decode only
    sent: list[int] = []
    execute = executor.execute_model
    inside = [0.0]

    def timed(batch):
        start = time.perf_counter()
        try:
            return execute(batch)
        finally:
            inside[0] += time.perf_counter() - start

    def recording(batch):
        sent.append(len(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)))
        return execute(batch)

    times, executor_times = [], []
    executor.execute_model = timed
    for _ in range(steps):
        inside[0] = 0.0
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
        executor_times.append(inside[0])
    executor.execute_model = recording
    for _ in range(5):
        core.step()
    return {"rows": rows, "context": context, "penalties": penalties, "steps": steps,
            "host_us_median": round(1e6 * statistics.median(times), 1),
            "host_us_p90": round(1e6 * sorted(times)[int(0.9 * len(times))], 1),
            # of which in the scripted executor (it plans the rows as a model runner does: a worker's cost)
            "executor_us_median": round(1e6 * statistics.median(executor_times), 1),
            "bytes_per_step": int(statistics.median(sent))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=400)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = [measure(args.rows, args.context, p, args.steps) for p in (False, True)]
    for r in results:
        print(f"{r['rows']} rows at {r['context']} tokens, penalties {r['penalties']}: host {r['host_us_median']} us "
              f"a step (p90 {r['host_us_p90']}; in the executor {r['executor_us_median']}), "
              f"{r['bytes_per_step']} bytes broadcast a step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
