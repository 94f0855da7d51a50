"""A script that ends with a split engine still running: normally, by an exception, or waiting for Ctrl-C.
It prints the ranks' pids first so the test can check that none outlives it."""

import sys
import time

from ember import LLM, SamplingParams

model, how = sys.argv[1], sys.argv[2]
llm = LLM(model, dtype="float32", device="cpu", tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=256)
print("PIDS", *llm.client.engine_core.executor.pids, flush=True)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
if how == "exception":
    raise RuntimeError("the user's code failed")
if how == "sigint":
    print("READY", flush=True)
    while True:
        for _ in llm.stream([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)):
            time.sleep(0.01)
