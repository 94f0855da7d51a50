"""A script that ends with a split engine still running: normally, by an exception, or waiting for Ctrl-C.
It prints the ranks' pids first so the test can check that none outlives it."""

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for internals

from internals import core_of  # noqa: E402

from ember import LLM, SamplingParams  # noqa: E402

# Ctrl-C raises KeyboardInterrupt as in a terminal, even when this process inherited SIGINT ignored (a test run
# started in the background by a non-interactive shell: Python then installs no SIGINT handler)
signal.signal(signal.SIGINT, signal.default_int_handler)
model, how = sys.argv[1], sys.argv[2]
llm = LLM(model, dtype="float32", device="cpu", tensor_parallel_size=2, kv_cache_memory="16MiB", max_model_len=256)
print("PIDS", *core_of(llm).executor.pids, flush=True)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
if how == "exception":
    raise RuntimeError("the user's code failed")
if how == "sigint":
    print("READY", flush=True)
    while True:
        for _ in llm.stream([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True)):
            time.sleep(0.01)
