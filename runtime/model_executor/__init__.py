"""The one place where a batch plan becomes tensors: the model runner, the step's inputs on
the device, the sampler, CUDA graphs, and how many KV slots the pool gets."""
