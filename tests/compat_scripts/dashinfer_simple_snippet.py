# DashInfer's "Simple Python API Code Snippet" (../shared/reference/dashinfer-offline-inference.rst). The snippet
# uses names the page defines elsewhere (imports, model_local_path, safe_model_name, device_list): they are set here,
# with the import lines naming ember.compat.dashinfer and the model set to ember's default model. The snippet
# itself, between the markers, is unchanged.
from ember.compat.dashinfer import allspark
from ember.compat.dashinfer.allspark import *
from ember.compat.dashinfer.allspark.engine import *

from ember.config import default_model_path

model_local_path = default_model_path()
safe_model_name = "SmolLM2-135M-Instruct"
device_list = [0]

# ----- the snippet -----
generated_ids = []

engine = allspark.Engine()

model_loader = allspark.HuggingFaceModel(model_local_path, safe_model_name)

(model_loader.load_model()
    .read_model_config()
    .serialize_to_memory(engine)
    .free_model())

# create engine runtime config.
runtime_cfg_builder = model_loader.create_reference_runtime_config_builder(safe_model_name, TargetDevice.CUDA, device_list, max_batch=8)
runtime_cfg = runtime_cfg_builder.build()

# install and start.
engine.install_model(runtime_cfg)
engine.start_model(safe_model_name)

# generation request.
gen_cfg = model_loader.create_reference_generation_config_builder(runtime_cfg)

status, handle, queue = engine.start_request_text(safe_model_name, model_loader, "who are you?", gen_cfg)


# sync request will block request until request is finished.
engine.sync_request(safe_model_name, handle)

# sync output
generated_elem = queue.Get()
generated_ids += generated_elem.ids_from_generate

# free request and model
engine.release_request(safe_model_name, handle)
engine.stop_model(safe_model_name)
# ----- end of the snippet -----

import json  # for the test: what the snippet generated, with which config
print(json.dumps({"ids": generated_ids, "gen_cfg": gen_cfg.build(), "max_length": runtime_cfg.engine_max_length}))
