"""ServerConfig: every knob of the runtime, one frozen dataclass.

CLI flags are generated from the fields (name, type, default and the `help` metadata), so a
new knob is one new field. Values discovered at run time (the EOS id, the pool size actually
allocated) are returned by whoever discovers them and never written back here.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

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
DEFAULT_POOL_TOKENS = 65536  # a pool sized to the machine stops here (or at one full context)
ALIASES = {"model": "model_path"}  # older names still accepted (`--model`, Engine(model=))


def _knob(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerConfig:
    model_path: str = _knob(
        "smollm2",
        "'smollm2', a .gguf file, a local Hugging Face directory, or a hub id found in the "
        "local Hugging Face cache (HF_HOME / HF_HUB_CACHE; never downloaded); also --model. "
        "Given several times as NAME=PATH (or NAME=PATH,NAME=PATH), several models are served "
        "behind one front door, each loaded on demand (docs/models.md, 'Several models')",
    )
    revision: str = _knob("", "branch, tag or commit of a hub id in the local cache ('' = main)")
    served_model_name: str = _knob("", "model name reported to clients; '' = --model-path")
    chat_template: str = _knob("", "chat template file or Jinja string overriding the model's")
    spm_infill: bool = _knob(
        False, "fill-in-the-middle prompts put the suffix first (SPM; llama.cpp's flag)"
    )
    is_embedding: bool = _knob(
        False,
        "serve embeddings only (/v1/embeddings, /api/embed; generation is refused): an encoder "
        "(BertModel, XLMRobertaModel) needs it; a decoder embeds from its hidden states as it "
        "does without it",
    )
    trust_remote_code: bool = _knob(False, "refused: radixflow never runs a checkpoint's code")
    host: str = _knob("127.0.0.1", "address to bind; anything but loopback needs --api-key")
    port: int = _knob(
        30000,
        "HTTP port (SGLang's native API, OpenAI's /v1, /metrics); 0 picks free ports for "
        "HTTP and ZeroMQ both and the ready line prints them",
    )
    zmq_port: int = _knob(30001, "TCP port of radixflow's own ZeroMQ protocol; 0 picks a free one")
    api_key: str = _knob("", "shared secret checked on every message (required off loopback)")
    allowed_origins: str = _knob(
        "",
        "browser origins allowed to call the HTTP API (CORS), comma-separated "
        "(http://host:port), or '*' for any; '' = the loopback origins only (localhost, "
        "127.x.x.x, [::1], any port), as Ollama's default",
    )
    allowed_methods: str = _knob("GET,POST,PUT,DELETE,OPTIONS", "CORS: methods a page may use")
    allowed_headers: str = _knob(
        "*", "CORS: request headers a page may send ('*' = any it asks for, Authorization too)"
    )
    page_size: int = _knob(1, "KV slots per page (allocation granularity)")
    max_total_tokens: int = _knob(
        0,
        "KV pool size in token slots; 0 = sized to the machine (a share of the memory left "
        "after the weights and a reserve, capped at 65,536 tokens or one full context: "
        "runtime/model_executor/kv_sizing.py); a size that cannot fit is refused at start",
    )
    max_running_requests: int = _knob(64, "most requests decoding at once")
    max_prefill_tokens: int = _knob(2048, "token budget of one step's prefill work")
    chunked_prefill_size: int = _knob(512, "longest prefill chunk per step; -1 turns chunking off")
    schedule_policy: str = _knob("lpm", "waiting-queue order: lpm, dfs-weight or fcfs")
    enable_priority_scheduling: bool = _knob(
        False,
        "admit waiting requests by their `priority` (larger first; the policy orders each "
        "level); without it a request's non-zero priority is refused",
    )
    schedule_conservativeness: float = _knob(1.0, "scales the reserved decode estimate")
    new_token_ratio_decay_steps: int = _knob(
        600,
        "after a preemption raises the decode reserve, each step lowers it by (initial - "
        "floor) / this (SGLang's SGLANG_NEW_TOKEN_RATIO_DECAY idea; fewer steps: admits sooner, "
        "preempts more)",
    )
    disable_radix_cache: bool = _knob(False, "turn prefix reuse off (ablation)")
    enable_hierarchical_cache: bool = _knob(
        False,
        "a disk tier under the radix tree: KV blocks the pool evicts (or computes, with "
        "write_through) are stored in files and loaded back on a prefix hit, across restarts "
        "too (docs/disk-cache.md)",
    )
    hicache_storage_backend: str = _knob("file", "where the tier stores blocks: file")
    hicache_storage_dir: str = _knob(
        "",
        "the tier's directory (made 0700); '' = $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, "
        "else $RADIXFLOW_CACHE/hicache (~/.cache/radixflow/hicache)",
    )
    hicache_size: float = _knob(
        8.0, "the tier's cap in GB on disk; least recently used blocks go past it"
    )
    hicache_write_policy: str = _knob(
        "write_through",
        "write_through: store each block once its KV is computed (a restart, even after "
        "SIGKILL, finds everything computed); write_back: store a block only when the pool "
        "evicts it, and at shutdown what the pool still holds (less disk traffic)",
    )
    hicache_storage_dtype: str = _knob(
        "auto",
        "dtype of stored KV: auto (the pool's, exact), float16 or bfloat16 (half an "
        "fp32 pool's bytes, lossy)",
    )
    max_preemptions: int = _knob(8, "times one request may be preempted before it is failed")
    context_length: int = _knob(0, "max tokens per sequence; 0 = the model's own")
    max_new_tokens_limit: int = _knob(8192, "largest max_new_tokens a request may ask for")
    sampling_defaults: str = _knob(
        "model",
        "what a request leaves unset samples with: model (the checkpoint's "
        "generation_config.json, or a GGUF's general.sampling.* keys: temperature, top_p, "
        "top_k, min_p, repetition_penalty) or openai (1.0 / 1.0 / off, whatever the model says)",
    )
    attention_backend: str = _knob("auto", "auto (Triton on CUDA), torch or triton")
    device: str = _knob("auto", "auto, cpu or cuda")
    dtype: str = _knob("auto", "auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    kv_cache_dtype: str = _knob(
        "auto",
        "KV cache storage: auto (fp16 for quantized weights and fp32 models of 2 GiB or more "
        "on CPU, as llama.cpp's f16 default; else the model's dtype), fp16/float16 or "
        "bf16/bfloat16 (half an fp32 pool's memory; attention still computes in fp32), "
        "int8 (CPU only: one fp32 scale per token and KV head, about half a bf16 pool's "
        "memory, read by the native kernels without a dequantized copy), or fp32/float32 "
        "(the exact pool)",
    )
    num_threads: str = _knob(
        "auto",
        "compute threads: auto (all cores, one fewer for each core other processes keep busy "
        "while the steps' own threads wait for their cores, re-read every second: "
        "runtime/model_executor/threads.py; beside a busy process it keeps 54-58%% of quiet "
        "throughput where fixed threads kept 9-10%%, and it measures level on a quiet machine), "
        "or a fixed number (0 = torch's default, all cores)",
    )
    self_check: bool = _knob(False, "verify KV/tree invariants after every step (tests)")
    grammar_backend: str = _knob(
        "llguidance",
        "llguidance (grammars built in about a millisecond, masks computed per token; takes "
        "ebnf) or outlines (outlines-core: a DFA over the vocabulary, compiled in workers)",
    )
    tool_call_parser: str = _knob(
        "",
        "how the model writes tool calls: hermes, qwen25, qwen3, llama3, mistral, pythonic, "
        "generic; '' = inferred from the chat template (generic where it knows no tools)",
    )
    reasoning_parser: str = _knob(
        "", "qwen3 or deepseek-r1: split <think> text into reasoning_content; '' = off"
    )
    disable_jump_forward: bool = _knob(
        False,
        "constrained decoding: sample every token, even where the grammar forces the text "
        "(by default forced text, such as a schema's keys, is appended in one extend step)",
    )
    grammar_any_whitespace: bool = _knob(
        False,
        "JSON schemas: whitespace ('[ ]?', or --grammar-whitespace) may appear around every "
        '{ } [ ] , : (off: the canonical layout {"k": v, "l": [1, 2]}, whose separators '
        "jump-forward appends whole)",
    )
    grammar_whitespace: str = _knob(
        "",
        "whitespace regex for JSON schemas' flexible layout (implies --grammar-any-whitespace); "
        "'' = '[ ]?' with --grammar-any-whitespace, else the canonical layout",
    )
    grammar_workers: int = _knob(2, "grammar compiler processes (a slow grammar holds only one)")
    grammar_timeout_s: float = _knob(60.0, "a grammar compiling longer than this fails")
    max_message_bytes: int = _knob(64 << 20, "largest client frame accepted")
    # images (a vision model: docs/vision.md)
    max_image_bytes: int = _knob(8 << 20, "largest image accepted (its encoded bytes)")
    max_request_image_bytes: int = _knob(
        24 << 20, "largest total of one request's images (encoded bytes)"
    )
    max_image_pixels: int = _knob(
        40_000_000, "largest image accepted in decoded pixels (width x height)"
    )
    allow_local_media: bool = _knob(
        False,
        "accept images named by a path on the server's disk (/generate image_data, chat "
        "image_url file paths); off: refused",
    )
    allow_remote_media: bool = _knob(
        False, "fetch http(s) image URLs (chat image_url, /generate image_data); off: refused"
    )
    shutdown_timeout: float = _knob(
        30.0,
        "on SIGTERM/SIGINT: seconds the requests in flight get to finish (new ones are refused "
        "with 503 and /health answers 503 'draining') before the rest are aborted",
    )
    log_interval_s: float = _knob(5.0, "seconds between load log lines while busy")
    seed: int = _knob(0, "seed of the global sampler generator")
    mem_fraction_static: float = _knob(
        0.0,
        "KV pool share of the memory free after the weights (0 = --max-total-tokens, or "
        "sized to the machine when that is 0 too)",
    )
    disable_cuda_graph: bool = _knob(
        False, "run decode eagerly on CUDA instead of replaying captured CUDA graphs"
    )
    cuda_graph_max_bs: int = _knob(
        256, "largest decode batch captured as a CUDA graph (capped by --max-running-requests)"
    )
    cpu_matmul: str = _knob(
        "auto",
        "CPU fp32 matmuls: from weights prepacked once for oneDNN ('onednn') or MKL ('mkl'), "
        "or F.linear ('linear'); 'auto' times all three on the model's shapes at load and "
        "keeps the fastest (the packed copies cost one more copy of the weights)",
    )
    quantization: str = _knob(
        "",
        "int8: quantize an fp32/bf16 checkpoint's projections and head to int8 per output "
        "channel at load (weight-only); awq or gptq: the checkpoint's own 4-bit method (read "
        "from its quantization_config anyway; naming it checks it); '' = as stored",
    )
    quantized_activations: str = _knob(
        "auto",
        "quantized weights' matmuls: int8 (activations quantized per block to 8 bits, integer "
        "dot products and AMX tiles, as llama.cpp does: accuracy in docs/models.md), fp32 "
        "(exact: within 1e-4 of the dequantized reference), or auto (int8 for Q4_K/Q5_K/Q6_K "
        "weights, where it runs 2.5-3x faster, fp32 for the others, where it does not)",
    )
    disable_mmap: bool = _knob(
        False,
        "GGUF: read the weights into process memory instead of mapping the file (llama.cpp's "
        "--no-mmap): slower to start and a private copy, but pages the kernel never drops",
    )
    dequantize_weights: bool = _knob(
        False,
        "load a quantized model's weights dequantized to --dtype (the reference path: many "
        "times the memory, slower at batch 1) instead of multiplying from its blocks",
    )
    disable_cpu_weight_prepack: bool = _knob(
        False, "CPU fp32: multiply with F.linear, packing nothing (same as --cpu-matmul linear)"
    )
    disable_cpu_decode_loop: bool = _knob(
        False,
        "CPU: run decode steps' layers in Python, not in the compiled loop "
        "(kernels/cpu/decode_loop.py; built at load, for plain pre-norm models)",
    )
    disable_kv_prefault: bool = _knob(
        False,
        "CPU: leave the KV pool's pages unwritten until requests first use them (less memory "
        "at start; each first write then page-faults inside a serving step)",
    )
    disable_shared_prefix_attention: bool = _knob(
        False, "Triton decode: read KV runs shared by several requests per request (ablation)"
    )
    speculative_algorithm: str = _knob(
        "",
        "'ngram': speculative decoding drafted from the radix tree and prompt lookup; 'draft': "
        "drafted by a small model (--speculative-draft-model-path); '' = off",
    )
    speculative_draft_model_path: str = _knob(
        "",
        "with --speculative-algorithm draft: the draft model ('smollm2', a .gguf, a directory); "
        "same tokenizer as the target; loaded as it is (never dequantized)",
    )
    speculative_num_draft_tokens: int = _knob(8, "most draft tokens verified per request a step")
    speculative_disable_by_batch_size: int = _knob(
        4,
        "no drafts while more requests than this decode at once (verify rows cost more than "
        "they save in a large batch); 0 = speculate at any batch size (vLLM's name)",
    )
    dp_size: int = _knob(
        1, "data-parallel replicas (own scheduler and KV pool each) behind sglang-router on --port"
    )
    threads_per_replica: int = _knob(0, "with --dp-size on CPU: torch threads each; 0 = cores / N")
    router_policy: str = _knob(
        "cache_aware", "with --dp-size: sglang-router's --policy (cache_aware, round_robin, ...)"
    )
    models_dir: str = _knob(
        "",
        "serve every model in this folder behind one front door, each loaded on demand: a "
        ".gguf file under its file name's stem, a Hugging Face directory under its name",
    )
    keep_alive: str = _knob(
        "5m",
        "several models: how long an idle model stays loaded (Ollama's durations: 5m, 1h30m, "
        "or seconds; 0 = unloaded after each request; -1 = never); a request's keep_alive "
        "(Ollama's field) overrides it for its model",
    )
    models_memory: str = _knob(
        "",
        "several models: the memory the loaded models may take together (8G, 512M, bytes); "
        "'' = the available RAM at start less 5%% of the total; idle models are unloaded "
        "least recently used first to make room",
    )
    tp_size: int = _knob(
        1,
        "tensor-parallel ranks: one model sharded Megatron-style over torch.distributed (gloo "
        "on CPU, NCCL on CUDA, one GPU per rank); rank 0 schedules and samples",
    )
    nnodes: int = _knob(1, "machines the --tp-size ranks span; each runs serve with --node-rank")
    node_rank: int = _knob(
        0, "this machine's index among --nnodes: 0 runs the server, others only model ranks"
    )
    dist_init_addr: str = _knob(
        "",
        "host:port where rank 0 listens for the other ranks to join ('' = a free loopback port; "
        "required with --nnodes > 1)",
    )
    dist_timeout: float = _knob(
        60.0, "seconds a collective inside the forward waits for a stuck rank before failing"
    )
    lora_paths: tuple[str, ...] = _knob(
        (),
        "LoRA adapters loaded at start, each NAME=PATH (or PATH, named by itself): PEFT "
        "directories (adapter_config.json + adapter_model.safetensors); several after one flag "
        "or the flag repeated. Requests pick one by name (lora_path, or an OpenAI model)",
    )
    max_loras_per_batch: int = _knob(
        8, "most distinct LoRA adapters in one step; requests under others wait for a later one"
    )
    max_lora_rank: int = _knob(0, "largest rank a LoRA adapter may have (0 = any)")

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_threads", str(self.num_threads).strip().lower())
        object.__setattr__(self, "lora_paths", tuple(self.lora_paths))  # a list from JSON
        lora_names = list(lora_adapters(self))
        checks = [
            (
                self.num_threads == "auto" or self.num_threads.isdigit(),
                f"num_threads must be auto or a number >= 0, not {self.num_threads!r}",
            ),
            (self.page_size >= 1, "page_size must be >= 1"),
            (
                self.max_total_tokens == 0 or self.max_total_tokens >= 2 * self.page_size,
                "max_total_tokens must be 0 (sized to the machine) or at least 2 pages",
            ),
            (self.max_running_requests >= 1, "max_running_requests must be >= 1"),
            (self.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1"),
            (self.grammar_workers >= 1, "grammar_workers must be >= 1"),
            (self.grammar_timeout_s > 0, "grammar_timeout_s must be > 0"),
            (self.shutdown_timeout >= 0, "shutdown_timeout must be >= 0"),
            (self.grammar_backend in GRAMMAR_BACKENDS, f"grammar_backend: {GRAMMAR_BACKENDS}"),
            (
                self.sampling_defaults in SAMPLING_DEFAULTS,
                f"sampling_defaults must be one of {SAMPLING_DEFAULTS}",
            ),
            (self.tool_call_parser in TOOL_PARSERS, f"tool_call_parser: {TOOL_PARSERS}"),
            (self.reasoning_parser in REASONING, f"reasoning_parser: {REASONING}"),
            (
                self.chunked_prefill_size == -1 or self.chunked_prefill_size >= 1,
                "chunked_prefill_size must be -1 or >= 1",
            ),
            (self.schedule_policy in POLICIES, f"schedule_policy must be one of {POLICIES}"),
            (
                self.attention_backend in ATTENTION_BACKENDS,
                f"attention_backend must be one of {ATTENTION_BACKENDS}",
            ),
            (self.schedule_conservativeness > 0, "schedule_conservativeness must be > 0"),
            (self.new_token_ratio_decay_steps >= 1, "new_token_ratio_decay_steps must be >= 1"),
            (0 <= self.port < 65536, "port must be in [0, 65535]"),
            (0 <= self.mem_fraction_static < 1, "mem_fraction_static must be in [0, 1)"),
            (self.speculative_algorithm in SPECULATIVE, f"speculative_algorithm: {SPECULATIVE}"),
            (
                (self.speculative_algorithm == "draft") == bool(self.speculative_draft_model_path),
                "--speculative-algorithm draft and --speculative-draft-model-path go together",
            ),
            (
                1 <= self.speculative_num_draft_tokens <= 31,
                "speculative_num_draft_tokens must be in [1, 31]",
            ),
            (
                self.speculative_disable_by_batch_size >= 0,
                "speculative_disable_by_batch_size must be >= 0",
            ),
            (self.dtype in DTYPES, f"dtype must be one of {DTYPES}"),
            (
                self.kv_cache_dtype in KV_CACHE_DTYPES,
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported: choose one of "
                f"{KV_CACHE_DTYPES} (SGLang's fp8_e4m3, fp8_e5m2 and fp4_e2m1 are not built)",
            ),
            (
                self.quantization in QUANTIZATIONS,
                f"quantization must be one of {QUANTIZATIONS}",
            ),
            (self.cpu_matmul in CPU_MATMULS, f"cpu_matmul must be one of {CPU_MATMULS}"),
            (
                self.quantized_activations in QUANTIZED_ACTIVATIONS,
                f"quantized_activations must be one of {QUANTIZED_ACTIVATIONS}",
            ),
            (
                not self.trust_remote_code,
                "--trust-remote-code is not supported: radixflow never runs model code from a "
                "checkpoint; it serves the architectures it implements itself",
            ),
            (0 <= self.zmq_port < 65536, "zmq_port must be in [0, 65535]"),
            (self.dp_size >= 1, "dp_size must be >= 1"),
            (self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs must be >= 1"),
            (self.threads_per_replica >= 0, "threads_per_replica must be >= 0"),
            (self.router_policy in ROUTER_POLICIES, f"router_policy: {ROUTER_POLICIES}"),
            (self.tp_size >= 1, "tp_size must be >= 1"),
            (
                self.nnodes >= 1 and self.tp_size % self.nnodes == 0,
                "nnodes must be >= 1 and divide tp_size",
            ),
            (0 <= self.node_rank < self.nnodes, "node_rank must be in [0, nnodes)"),
            (
                self.nnodes == 1 or _is_host_port(self.dist_init_addr),
                "--nnodes > 1 needs --dist-init-addr host:port (rank 0's address)",
            ),
            (
                not self.dist_init_addr or _is_host_port(self.dist_init_addr),
                "dist_init_addr must be host:port",
            ),
            (self.dist_timeout > 0, "dist_timeout must be > 0"),
            (
                all(lora_names) and len(set(lora_names)) == len(self.lora_paths),
                "--lora-paths: each NAME=PATH needs a name and a path, names unique",
            ),
            (self.max_loras_per_batch >= 1, "max_loras_per_batch must be >= 1"),
            (self.max_lora_rank >= 0, "max_lora_rank must be >= 0"),
            (
                not self.lora_paths or self.tp_size == 1,
                "--lora-paths with --tp-size > 1 is not supported (adapters are not sharded)",
            ),
            (self.tp_size == 1 or self.dp_size == 1, "--tp-size with --dp-size is not supported"),
            (self.hicache_storage_backend == "file", "hicache_storage_backend must be file"),
            (self.hicache_size > 0, "hicache_size must be > 0 (GB)"),
            (
                self.hicache_write_policy in HICACHE_WRITE_POLICIES,
                f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}",
            ),
            (
                self.hicache_storage_dtype in HICACHE_DTYPES,
                f"hicache_storage_dtype must be one of {HICACHE_DTYPES}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


def lora_adapters(config: ServerConfig) -> dict[str, str]:
    """--lora-paths as {name: path}: NAME=PATH, or PATH named by itself (SGLang's forms)."""
    pairs = [entry.partition("=") for entry in config.lora_paths]
    return {name: path if sep else name for name, sep, path in pairs if not sep or path}


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and int(port) < 65536)


def config_from_kwargs(**kwargs: Any) -> ServerConfig:
    for old, new in ALIASES.items():
        if old in kwargs:
            if new in kwargs:
                raise ValueError(f"give {new} or {old}, not both")
            kwargs[new] = kwargs.pop(old)
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(f"unknown config option(s): {', '.join(unknown)}")
    return ServerConfig(**kwargs)


def fixed_threads(config: ServerConfig) -> int:
    """--num-threads as a fixed count (0: torch's default, and for auto: the governor then
    follows the free cores, runtime/model_executor/threads.py)."""
    return 0 if config.num_threads == "auto" else int(config.num_threads)


class JoinRepeated(argparse.Action):
    """A flag given several times: its values joined by commas (the first replaces the
    default)."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        seen = f"_{self.dest}_given"
        if getattr(namespace, seen, False):
            value = f"{getattr(namespace, self.dest)},{value}"
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, value)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per ServerConfig field (`--max-total-tokens`, `--disable-radix-cache`),
    and the ALIASES' old flags (`--model` for `--model-path`)."""
    old_names = {new: old for old, new in ALIASES.items()}
    for f in dataclasses.fields(ServerConfig):
        flags = ["--" + f.name.replace("_", "-")]
        if f.name in old_names:
            flags.append("--" + old_names[f.name].replace("_", "-"))
        help_text = f"{f.metadata['help']} (default: {f.default!r})"
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": help_text}
        if f.type in (bool, "bool"):
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif f.name == "model_path":  # several: NAME=PATH each, joined by commas
            parser.add_argument(*flags, action=JoinRepeated, **kw)
        elif f.type == "tuple[str, ...]":  # several values after the flag, or it repeated
            kw["default"] = list(f.default)
            parser.add_argument(*flags, nargs="+", action="extend", **kw)
        else:
            parser.add_argument(*flags, type={"int": int, "float": float, "str": str}[f.type], **kw)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})
