"""The KV cache's bookkeeping: the pool of token slots (`kv_pool`), the radix tree from token
sequences to the slots that hold them (`radix_cache`) and its plain-data dump (`tree_dump`).
Torch-free: the KV tensors themselves live in the model executor."""
