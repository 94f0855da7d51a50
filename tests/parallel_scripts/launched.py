"""Run under a launcher (torchrun): every rank builds the same LLM; rank 0 writes the tokens to OUT as JSON."""

import json
import sys

from ember import LLM, SamplingParams

model, out, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
prompts = json.loads(sys.argv[5])
llm = LLM(model, dtype="float32", device="cpu", tensor_parallel_size=tp, pipeline_parallel_size=pp,
          kv_cache_memory="16MiB",
          max_model_len=256)
# only rank 0 gets here: the other ranks served inside LLM(...) and ended there
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
with open(out, "w") as f:
    json.dump({"executor": llm.model_info.executor, "tokens": [o.outputs[0].token_ids for o in outs]}, f)
llm.shutdown()
