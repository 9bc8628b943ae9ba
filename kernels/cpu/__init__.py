"""The CPU fast path: native C kernels (`native`, built at first use), the compiled decode loop
(`decode_loop`, a torch C++ extension), and the layouts a decode batch reads its keys by. Each is
held equal to `radixflow.kernels.reference`."""
