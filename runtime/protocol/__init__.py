"""The wire contract: every message that crosses a process boundary (the protocol's
specification is `messages`' docstring), the sampling parameters, and the typed ZeroMQ queues
between the server and the scheduler. Torch-free."""
