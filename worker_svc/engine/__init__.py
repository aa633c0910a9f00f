"""The worker's engine: paged block-causal KV cache, batched decode steps, device sampler,
continuous batching at step granularity. See engine.py for the public API."""
