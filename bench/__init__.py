"""radixflow.bench: `radixflow bench`, the benchmark suite (entry: `radixflow.bench.cli.main`).

rounds     RoundResult, System, Arrivals, statistics (stdlib only: peers load it by path)
workloads  the seven workloads; the program ones defined once as steps, rounds derived
harness    runs a workload on a system: timing, RSS sampling, the result row
engine     radixflow: the Engine through its public API only
dsl        radixflow-dsl: the same program steps through the DSL over a live server
baselines  transformers (generate, continuous batching); the peers' parent side
peers      llama.cpp and vLLM workers (stdlib only at the top: run in the peers' venvs)
roofline   this CPU's matmul roofline at the model's shapes
report     tables, notes, machine info, the PNG chart
cli        flags, systems, the run

Studies, each `python -m radixflow.bench.<study>` (public APIs only):

engine_features  decode vs transformers, load time, radix cache, chunked prefill, JSON schema
server           tiny requests through the server's doors (ZeroMQ, HTTP, OpenAI) and the Engine
router           data-parallel replicas behind sglang-router, routing policies side by side
speculative      n-gram speculative decoding off vs on
draft_speculative  draft-model speculative decoding off vs on (and llama-cpp-python's hook)
kernels          the Triton attention kernels vs the torch reference and SDPA (CUDA)
tp_step          decode step time of tensor parallelism, tp=1 against tp=N
"""
