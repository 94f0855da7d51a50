"""Every code block of ../shared/reference/tensorrt-llm-hlapi.md, as written there, with two changes: the imports
name ember.compat.tensorrt_llm instead of tensorrt_llm, and <llama_model_path> / <prompt> / <engine-path> /
<my_faster_one> are filled in (the arguments of each function). Each block is one function; tests call them."""

from __future__ import annotations


def basic_usage(llama_model_path):
    from ember.compat.tensorrt_llm import LLM, ModelConfig

    config = ModelConfig(model_dir=llama_model_path)
    llm = LLM(config)

    prompts = ["To tell a story"]
    for output in llm.generate(prompts):
        print(output)
    return llm


def save_and_reload(llama_model_path, engine_path):
    from ember.compat.tensorrt_llm import LLM, ModelConfig

    config = ModelConfig(llama_model_path)
    llm = LLM(config)

    # Save engine to local disk
    llm.save(engine_path)
    llm.shutdown()

    # next time
    config = ModelConfig(model_dir=engine_path)
    llm = LLM(config)
    return llm


def quantization(llama_model_path):
    from ember.compat.tensorrt_llm import LLM, ModelConfig
    from ember.compat.tensorrt_llm.quantization import QuantAlgo

    config = ModelConfig(model_dir=llama_model_path)

    config.quant_config.quant_algo = QuantAlgo.W4A16_AWQ

    llm = LLM(config)
    return llm


def tensor_parallel(llama_model_path):
    from ember.compat.tensorrt_llm import LLM, ModelConfig

    config = ModelConfig(model_dir=llama_model_path)
    config.parallel_config.tp_size = 2
    return LLM(config)


def pipeline_parallel(llama_model_path):
    from ember.compat.tensorrt_llm import LLM, ModelConfig

    config = ModelConfig(model_dir=llama_model_path)
    config.parallel_config.pp_size = 4
    # you can also mix TP and PP
    # config.parallel_config.tp_size = 2
    return LLM(config)


def auto_parallel(llama_model_path):
    from ember.compat.tensorrt_llm import LLM, ModelConfig

    config = ModelConfig(model_dir=llama_model_path)
    config.parallel_config.auto_parallel = True
    config.parallel_config.world_size = 2
    return LLM(config)


def multi_node(llama_model_path):
    from ember.compat.tensorrt_llm import LLM, ModelConfig

    config = ModelConfig(model_dir=llama_model_path)
    # Set the parallel_config to the number of GPUs you want to use
    config.parallel_config.tp_size = 4
    config.parallel_config.pp_size = 2

    llm = LLM(config)
    for output in llm.generate([[32, 12]]):
        print(output)
    return llm


async def asyncio_generation(llama_model_path, prompt):
    from ember.compat.tensorrt_llm import LLM, ModelConfig

    config = ModelConfig(model_dir=llama_model_path)

    llm = LLM(config, async_mode=True)

    async for output in llm.generate_async(prompt, streaming=True):
        print(output)
    return llm


def future_generation(llm, prompt):
    # This will not block the main thread
    generation = llm.generate_async(prompt)
    # Do something else here
    # call .result() to explicitly block the main thread and wait for the result when needed
    output = generation.result()
    generation = llm.generate_async(prompt)
    output = generation.result(timeout=10)
    return output


async def future_generation_async(llm, prompt):
    generation = llm.generate_async(prompt)
    output = await generation.aresult()
    return output


def beam_search(llama_model_path, prompt):
    from ember.compat.tensorrt_llm import LLM, ModelConfig

    config = ModelConfig(model_dir=llama_model_path, max_beam_width=4)

    llm = LLM(config)
    # Let the LLM object generate text with the default sampling strategy, or
    # you can create a SamplingConfig object as well with several fields set manually
    sampling_config = llm.get_default_sampling_config()
    sampling_config.beam_width = 4  # current limitation: beam_width should be equal to max_beam_width

    for output in llm.generate(prompt, sampling_config=sampling_config):
        print(output)
    return llm


def runtime_customization(llama_model_path):
    from ember.compat.tensorrt_llm import LLM, ModelConfig
    from ember.compat.tensorrt_llm.hlapi import CapacitySchedulerPolicy, KvCacheConfig

    config = ModelConfig(model_dir=llama_model_path)
    llm = LLM(config,
              kv_cache_config=KvCacheConfig(
                  max_new_tokens=128,
                  free_gpu_memory_fraction=0.8),
              capacity_scheduling_policy=CapacitySchedulerPolicy.GUARANTEED_NO_EVICT)
    return llm


def tokenizer_customization(config, my_faster_one):
    from ember.compat.tensorrt_llm import LLM

    llm = LLM(config, tokenizer=my_faster_one)
    return llm


def token_ids_input(llm):
    outputs = []
    for output in llm.generate([32, 12]):
        outputs.append(output)
    return outputs


def disabling_tokenizer(llama_model_path):
    from ember.compat.tensorrt_llm import LLM, ModelConfig

    config = ModelConfig(model_dir=llama_model_path)

    llm = LLM(config)
    for output in llm.generate([[32, 12]]):
        print(output)
    return llm
