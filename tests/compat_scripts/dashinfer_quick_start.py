# DashInfer's quick start (../shared/reference/dashinfer-quick-start.md), unchanged except: the import lines name
# ember.compat.dashinfer, and the model is ember's default model (no ModelScope download: use_modelscope = False and
# model_name is the local GGUF file). It prints the generated ids as JSON on its last line for the test to compare.
import os

from ember.compat.dashinfer import allspark
from ember.compat.dashinfer.allspark import *
from ember.compat.dashinfer.allspark.engine import *
from ember.compat.dashinfer.allspark.prompt_utils import PromptTemplate

from ember.config import default_model_path

# Configuration
in_memory = os.environ.get("IN_MEMORY") == "1"
device_list = [0] # single card by default, 4 cards replace with [0,1,2,3] 
model_name = default_model_path()
output_base_folder = "model_output"
user_data_type = "float16" # most device supports float16
use_modelscope = False

# Download and prepare the model
if use_modelscope:
   import modelscope
   from modelscope.utils.constant import DEFAULT_MODEL_REVISION
   model_local_path = modelscope.snapshot_download(model_name, DEFAULT_MODEL_REVISION)
else:
   model_local_path = model_name

safe_model_name = model_name.replace("/", "_")
model_convert_folder = os.path.join(output_base_folder, safe_model_name)

# Initialize model and engine
model_loader = allspark.HuggingFaceModel(model_local_path, safe_model_name,
                                         in_memory_serialize=in_memory,
                                         user_set_data_type=user_data_type)
engine = allspark.Engine()

# Load and serialize the model
model_loader.load_model().serialize(engine, model_output_dir=output_base_folder).free_model()

# Configure runtime settings
runtime_cfg = model_loader.create_reference_runtime_config_builder(
   safe_model_name, TargetDevice.CUDA, device_list, max_batch=8).max_length(2048).build()
engine.install_model(runtime_cfg)
engine.start_model(safe_model_name)

if in_memory: model_loader.free_memory_serialize_file()

# Prepare input
input_str = "How to protect our planet and build a green future?"
messages = [
   {"role": "system", "content": "You are a helpful assistant."},
   {"role": "user", "content": PromptTemplate.apply_chatml_template(input_str)}
]
templated_input_str = model_loader.init_tokenizer().get_tokenizer().apply_chat_template(
   messages, tokenize=False, add_generation_prompt=True)

# Configure generation settings
gen_cfg = model_loader.create_reference_generation_config_builder(runtime_cfg)
gen_cfg.update({"top_k": 1})

# Generate response
status, handle, queue = engine.start_request_text(
   safe_model_name, model_loader, templated_input_str, gen_cfg)
generated_ids = []

while True:
   elements = queue.Get()
   if elements:
      generated_ids += elements.ids_from_generate
   status = queue.GenerateStatus()
   if status in [GenerateRequestStatus.GenerateFinished,
                 GenerateRequestStatus.GenerateInterrupted]:
      break

# Decode and print output
output_text = model_loader.init_tokenizer().get_tokenizer().decode(generated_ids)
print(f"Model: {model_name}\nInput: {input_str}\nOutput: {output_text}")

# Clean up
engine.release_request(safe_model_name, handle)
engine.stop_model(safe_model_name)
print(f"Model: {model_name} have been released.")

import json  # for the test: what the script generated, from what prompt
print(json.dumps({"prompt": templated_input_str, "ids": generated_ids, "model_path": runtime_cfg.model_path}))
