"""Workers: the model, its KV pool and sampling, driven by plain batch descriptions."""
