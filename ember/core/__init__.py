"""The engine core: requests and sequences, KV block manager, scheduler, model runner, engine loop."""
