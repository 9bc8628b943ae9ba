"""Triton kernels for CUDA: decode (split-KV), extend, and cascade attention over shared KV
runs. Same signatures as `radixflow.kernels.reference`, which the tests hold them to."""
