"""ServerConfig's allowed values and its checks: each knob's choices, and one message per
rule a value breaks (raised as ValueError when a config is built)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixflow.runtime.config import ServerConfig

POLICIES = ("lpm", "dfs-weight", "fcfs")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
SPECULATIVE = ("", "ngram", "draft")
GRAMMAR_BACKENDS = ("llguidance", "outlines")
# SGLang's names (runtime/server/tool_calls.py, reasoning.py)
TOOL_PARSERS = ("", "hermes", "qwen25", "qwen3", "llama3", "mistral", "pythonic", "generic")
REASONING = ("", "qwen3", "deepseek-r1")
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")


DTYPES = ("auto", "float32", "bfloat16", "float16")
# SGLang's spellings plus fp16/fp32; its fp8/fp4 are not built
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32", "int8")
QUANTIZATIONS = ("", "int8", "awq", "gptq")
CPU_MATMULS = ("auto", "onednn", "mkl", "linear")
QUANTIZED_ACTIVATIONS = ("auto", "int8", "fp32")
SAMPLING_DEFAULTS = ("model", "openai")
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
HICACHE_DTYPES = ("auto", "float16", "bfloat16")


def check(config: ServerConfig) -> None:
    """Raise ValueError with the first rule `config` breaks (one table, hence its length)."""
    lora_names = list(lora_adapters(config))
    checks = [
        (
            config.num_threads == "auto" or config.num_threads.isdigit(),
            f"num_threads must be auto or a number >= 0, not {config.num_threads!r}",
        ),
        (config.page_size >= 1, "page_size must be >= 1"),
        (
            config.max_total_tokens == 0 or config.max_total_tokens >= 2 * config.page_size,
            "max_total_tokens must be 0 (sized to the machine) or at least 2 pages",
        ),
        (config.max_running_requests >= 1, "max_running_requests must be >= 1"),
        (config.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1"),
        (config.grammar_workers >= 1, "grammar_workers must be >= 1"),
        (config.grammar_timeout_s > 0, "grammar_timeout_s must be > 0"),
        (config.shutdown_timeout >= 0, "shutdown_timeout must be >= 0"),
        (config.grammar_backend in GRAMMAR_BACKENDS, f"grammar_backend: {GRAMMAR_BACKENDS}"),
        (
            config.sampling_defaults in SAMPLING_DEFAULTS,
            f"sampling_defaults must be one of {SAMPLING_DEFAULTS}",
        ),
        (config.tool_call_parser in TOOL_PARSERS, f"tool_call_parser: {TOOL_PARSERS}"),
        (config.reasoning_parser in REASONING, f"reasoning_parser: {REASONING}"),
        (
            config.chunked_prefill_size == -1 or config.chunked_prefill_size >= 1,
            "chunked_prefill_size must be -1 or >= 1",
        ),
        (config.schedule_policy in POLICIES, f"schedule_policy must be one of {POLICIES}"),
        (
            config.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}",
        ),
        (config.schedule_conservativeness > 0, "schedule_conservativeness must be > 0"),
        (config.new_token_ratio_decay_steps >= 1, "new_token_ratio_decay_steps must be >= 1"),
        (0 <= config.port < 65536, "port must be in [0, 65535]"),
        (0 <= config.mem_fraction_static < 1, "mem_fraction_static must be in [0, 1)"),
        (config.speculative_algorithm in SPECULATIVE, f"speculative_algorithm: {SPECULATIVE}"),
        (
            (config.speculative_algorithm == "draft") == bool(config.speculative_draft_model_path),
            "--speculative-algorithm draft and --speculative-draft-model-path go together",
        ),
        (
            1 <= config.num_continuous_decode_steps <= 64,
            "num_continuous_decode_steps must be in [1, 64]",
        ),
        (
            1 <= config.speculative_num_draft_tokens <= 31,
            "speculative_num_draft_tokens must be in [1, 31]",
        ),
        (
            config.speculative_disable_by_batch_size >= 0,
            "speculative_disable_by_batch_size must be >= 0",
        ),
        (config.dtype in DTYPES, f"dtype must be one of {DTYPES}"),
        (
            config.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype {config.kv_cache_dtype!r} is not supported: choose one of "
            f"{KV_CACHE_DTYPES} (SGLang's fp8_e4m3, fp8_e5m2 and fp4_e2m1 are not built)",
        ),
        (
            config.quantization in QUANTIZATIONS,
            f"quantization must be one of {QUANTIZATIONS}",
        ),
        (config.cpu_matmul in CPU_MATMULS, f"cpu_matmul must be one of {CPU_MATMULS}"),
        (
            config.quantized_activations in QUANTIZED_ACTIVATIONS,
            f"quantized_activations must be one of {QUANTIZED_ACTIVATIONS}",
        ),
        (
            not config.trust_remote_code,
            "--trust-remote-code is not supported: radixflow never runs model code from a "
            "checkpoint; it serves the architectures it implements itself",
        ),
        (0 <= config.zmq_port < 65536, "zmq_port must be in [0, 65535]"),
        (config.dp_size >= 1, "dp_size must be >= 1"),
        (config.cuda_graph_max_bs >= 1, "cuda_graph_max_bs must be >= 1"),
        (config.threads_per_replica >= 0, "threads_per_replica must be >= 0"),
        (config.router_policy in ROUTER_POLICIES, f"router_policy: {ROUTER_POLICIES}"),
        (config.tp_size >= 1, "tp_size must be >= 1"),
        (
            config.nnodes >= 1 and config.tp_size % config.nnodes == 0,
            "nnodes must be >= 1 and divide tp_size",
        ),
        (0 <= config.node_rank < config.nnodes, "node_rank must be in [0, nnodes)"),
        (
            config.nnodes == 1 or _is_host_port(config.dist_init_addr),
            "--nnodes > 1 needs --dist-init-addr host:port (rank 0's address)",
        ),
        (
            not config.dist_init_addr or _is_host_port(config.dist_init_addr),
            "dist_init_addr must be host:port",
        ),
        (config.dist_timeout > 0, "dist_timeout must be > 0"),
        (
            all(lora_names) and len(set(lora_names)) == len(config.lora_paths),
            "--lora-paths: each NAME=PATH needs a name and a path, names unique",
        ),
        (config.max_loras_per_batch >= 1, "max_loras_per_batch must be >= 1"),
        (config.max_lora_rank >= 0, "max_lora_rank must be >= 0"),
        (
            not config.lora_paths or config.tp_size == 1,
            "--lora-paths with --tp-size > 1 is not supported (adapters are not sharded)",
        ),
        (config.tp_size == 1 or config.dp_size == 1, "--tp-size with --dp-size is not supported"),
        (config.hicache_storage_backend == "file", "hicache_storage_backend must be file"),
        (config.hicache_size > 0, "hicache_size must be > 0 (GB)"),
        (
            config.hicache_write_policy in HICACHE_WRITE_POLICIES,
            f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}",
        ),
        (
            config.hicache_storage_dtype in HICACHE_DTYPES,
            f"hicache_storage_dtype must be one of {HICACHE_DTYPES}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def lora_adapters(config: ServerConfig) -> dict[str, str]:
    """--lora-paths as {name: path}: NAME=PATH, or PATH named by itself (SGLang's forms)."""
    pairs = [entry.partition("=") for entry in config.lora_paths]
    return {name: path if sep else name for name, sep, path in pairs if not sep or path}


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and int(port) < 65536)
