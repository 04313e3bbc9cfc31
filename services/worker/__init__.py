"""The worker process: model weights, KV cache, attention backends, sampler, model runner."""
