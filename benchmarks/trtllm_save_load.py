"""Start-up of the TensorRT-LLM facade's LLM from a source model with a quantization to apply, against the folder
``LLM.save`` wrote from it (weights already quantized): each start in a fresh process (nothing cached in memory;
the OS file cache warm for both), interleaved, medians. Prints one JSON object.

    python benchmarks/trtllm_save_load.py [--model PATH] [--algo W4A16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import sys, time
t0 = time.perf_counter()
from ember.compat.tensorrt_llm import LLM, ModelConfig
from ember.compat.tensorrt_llm.quantization import QuantAlgo
config = ModelConfig(model_dir=sys.argv[1])
if sys.argv[2] != "-":
    config.quant_config.quant_algo = QuantAlgo[sys.argv[2]]
llm = LLM(config)
ready = time.perf_counter() - t0
if len(sys.argv) > 3:
    llm.save(sys.argv[3])
llm.shutdown()
print(ready)
"""


def start(model: str, algo: str, save: str | None = None) -> float:
    args = [sys.executable, "-c", CHILD, model, algo] + ([save] if save else [])
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    from ember.config import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--algo", default="W4A16")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    model = a.model or default_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "engine")
        start(model, a.algo, saved)  # the first run also fills ember's caches (calibration, converted tokenizer)
        convert, load = [], []
        for _ in range(a.repeats):
            convert.append(start(model, a.algo))
            load.append(start(saved, "-"))
    c, s = statistics.median(convert), statistics.median(load)
    print(json.dumps({"model": os.path.basename(model), "quant_algo": a.algo, "from_source_s": convert,
                      "from_saved_s": load, "median_from_source_s": round(c, 2), "median_from_saved_s": round(s, 2),
                      "ratio": round(c / s, 2)}))


if __name__ == "__main__":
    main()
