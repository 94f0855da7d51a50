# EasyDeL's "vSurge Inference Engine Example" (../shared/reference/easydel-vsurge-example.rst), its code blocks in
# order. Changed: the `import easydel as ed` line names ember.compat.easydel; the model path is set from
# EMBER_EASYDEL_MODEL (default: ember's default model); and the two `# asyncio.run(...)` lines the page gives under
# "To run this in a script" are run. The rest, between the markers, is the page's code unchanged.
#
# transformers' AutoTokenizer reads a tokenizer out of a GGUF file only through gguf_file=, so for a .gguf the
# preamble lays the file out as GGUF repositories on the hub are: a folder holding the .gguf beside its tokenizer
# files (ember loads a folder holding one .gguf), and the page's `AutoTokenizer.from_pretrained(path)` reads it.
import os
import tempfile

from ember.config import default_model_path

_model = os.environ.get("EMBER_EASYDEL_MODEL") or default_model_path()
if _model.endswith(".gguf"):
    from transformers import AutoTokenizer as _Tok

    _folder = tempfile.mkdtemp(prefix="easydel-example-")
    os.symlink(_model, os.path.join(_folder, os.path.basename(_model)))
    _Tok.from_pretrained(os.path.dirname(_model), gguf_file=os.path.basename(_model)).save_pretrained(_folder)
    _model = _folder

# ----- the page's code -----
import jax
from jax import numpy as jnp
from transformers import AutoTokenizer

import ember.compat.easydel as ed

pretrained_model_name_or_path = (
    _model
)
dtype = param_dtype = jnp.bfloat16
max_length = 8192
prefill_length = 4096
partition_axis = ed.PartitionAxis()
processor = AutoTokenizer.from_pretrained(pretrained_model_name_or_path)
processor.padding_side = "left"
processor.pad_token_id = processor.eos_token_id

model = ed.AutoEasyDeLModelForCausalLM.from_pretrained(
    pretrained_model_name_or_path,
    auto_shard_model=True,
    sharding_axis_dims=(1, 1, 1, -1, 1),
    config_kwargs=ed.EasyDeLBaseConfigDict(
        freq_max_position_embeddings=max_length,
        mask_max_position_embeddings=max_length,
        kv_cache_quantization_method=ed.EasyDeLQuantizationMethods.NONE,
        gradient_checkpointing=ed.EasyDeLGradientCheckPointers.NONE,
        attn_mechanism=ed.AttentionMechanisms.AUTO,
        decode_attn_mechanism=ed.AttentionMechanisms.REGRESSIVE_DECODE,
        kvdtype=jnp.bfloat16,
    ),
    quantization_method=ed.EasyDeLQuantizationMethods.NONE,
    param_dtype=param_dtype,
    dtype=dtype,
    partition_axis=partition_axis,
    precision=jax.lax.Precision.DEFAULT,
)

max_concurrent_decodes = 64
max_concurrent_prefill = 1

surge = ed.vSurge.from_model(
    model=model,
    processor=processor,
    max_prefill_length=prefill_length,
    max_concurrent_prefill=max_concurrent_prefill,
    max_concurrent_decodes=max_concurrent_decodes,
    seed=877,
)

surge.compile()
surge.start()

non_streaming_prompts = [
    "USER:What is the capital of France?\nASSISTANT:",
    "USER:Explain the concept of recursion\nASSISTANT:",
]
non_streaming_sampling_params = [
    ed.SamplingParams(max_tokens=30, temperature=0.1),
    ed.SamplingParams(max_tokens=80, temperature=0.6, top_p=0.9),
]

# For non-streaming, the generate method returns a list of final results
# Note: generate is an async method, so it should be awaited in an async context.
import asyncio

async def run_non_streaming():
    final_results = await surge.generate(
        prompts=non_streaming_prompts,
        sampling_params=non_streaming_sampling_params,
        stream=False,
    )

    # final_results is a list of ReturnSample objects (one per prompt)
    for i, result in enumerate(final_results):
        print(f"Non-Streaming Result for Prompt {i + 1}:")
        print(f"  Generated Text: {result.text}")
        print(f"  Tokens per second: {result.tokens_per_second}")

# To run this in a script:
asyncio.run(run_non_streaming())

streaming_prompts = [
    "USER:Tell me a short story about a cat.\nASSISTANT:",
    "USER:Describe the process of photosynthesis.\nASSISTANT:",
]
streaming_sampling_params = [
    ed.SamplingParams(max_tokens=50, temperature=0.7),
    ed.SamplingParams(max_tokens=100, temperature=0.5),
]

async def run_streaming():
    # generate with stream=True returns an async iterator
    async for request_output in surge.generate(
        prompts=streaming_prompts,
        sampling_params=streaming_sampling_params,
        stream=True,
    ):
        # request_output is a list of ReturnSample objects, one for each prompt
        for i, sample in enumerate(request_output):
            # The text field in streaming provides the cumulative generated text so far
            print(f"Streaming Update for Prompt {i + 1}: {sample.text}")
        # Add a small delay to simulate processing time if needed
        # await asyncio.sleep(0.01)

# To run this in a script:
asyncio.run(run_streaming())

surge.stop()
