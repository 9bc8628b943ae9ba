"""ServerConfig: every knob of the runtime, one frozen dataclass.

CLI flags are generated from the fields (name, type, default and the `help` metadata:
`config.cli`), so a new knob is one new field; its allowed values and rules live in
`config.checks`. Values discovered at run time (the EOS id, the pool size actually allocated)
are returned by whoever discovers them and never written back here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from radixflow.runtime.config.checks import check

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
    num_continuous_decode_steps: int = _knob(
        8,
        "CPU decode loop: up to N greedy decode steps of 1-4 requests in one compiled call, "
        "when no request waits and none wants logprobs, sampling, penalties or a grammar "
        "(tokens stream N at a time); 1 = a scheduling step per token (SGLang's name)",
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
        check(self)

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


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
