"""Scale-out: tensor parallelism over torch.distributed (`tensor_parallel`, the ranks in
`tp_worker`) and data parallelism, N replicas behind SGLang's router (`data_parallel`)."""
