"""The example scripts of the TensorRT-LLM HLAPI page (../shared/reference/tensorrt-llm-hlapi.md; upstream
examples/high-level-api/ of v0.10) on ember: ``llm_examples.py`` (the tasks) and ``run_examples.py`` (runs them in
turn, one process each), with ``tensorrt_llm`` replaced by ``ember.compat.tensorrt_llm`` in their imports.

They live in this folder (``python -c "import ember.compat.tensorrt_llm.examples as m; print(m.__path__[0])"``) and
run as files or as modules::

    python3 <this folder>/run_examples.py run_single_gpu --model_dir <llama-model-path>
    python3 -m ember.compat.tensorrt_llm.examples.run_examples run_multi_gpu --model_dir <llama-model-path>
    python3 -m ember.compat.tensorrt_llm.examples.run_examples run_quant --model_dir <llama-model-path>
    python3 -m ember.compat.tensorrt_llm.examples.llm_examples --task run_llm_on_tensor_parallel \\
        --prompt="<prompt>" --hf_model_dir=<llama-model-path>

The multi-GPU ones start their ranks as local processes (CPU ranks over gloo on a machine without GPUs); the saved
engine (``--engine_dir``, default /tmp/hlapi.engine.example) is ember's .asmodel pair, which ``ModelConfig`` loads.
"""
