"""A desk of models: `radixflow serve` with several models behind one HTTP and one ZeroMQ
front door, each its own `radixflow serve` child started on the first request that names it,
stopped when idle (keep-alive) or to make room under a memory cap (docs/models.md, "Several
models")."""
