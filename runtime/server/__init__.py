"""The server process: the client doors (radixflow's ZeroMQ protocol, SGLang's HTTP API, the
OpenAI routes), validation at the edge, tokenization and detokenization, the jobs in flight and
Prometheus `/metrics`. Torch-free: the model runs in the scheduler process."""
