"""radixflow.bench: `radixflow bench`, the benchmark suite (entry: `radixflow.bench.cli.main`).

rounds     RoundResult, System, Arrivals, statistics (stdlib only: peers load it by path)
workloads  the seven workloads, as token-level rounds and as DSL program arguments
harness    runs a workload on a system: timing, RSS sampling, the result row
engine     radixflow: the Engine through its public API only
dsl        radixflow-dsl: the workloads as @function programs over a live server
baselines  transformers (generate, continuous batching); the peers' parent side
peers      llama.cpp and vLLM workers (stdlib only at the top: run in the peers' venvs)
roofline   this CPU's matmul roofline at the model's shapes
report     tables, notes, machine info, the PNG chart
cli        flags, systems, the run
"""
