"""The scheduler: admission, cache-aware ordering, batching, chunked prefill, preemption,
speculative drafting, its own stats and the KV invariants. Torch-free, except `loop`, the
scheduler process, which owns the model runner."""
