"""ModelRunner: the one place where a batch plan becomes tensors.

plan (numpy) -> tensors -> copy-on-write KV copies -> forward -> sample -> StepResult.
"""

from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from radixflow.kernels import AttentionOps, get_ops, quant
from radixflow.kernels.cpu import decode_loop
from radixflow.kernels.kv_int8 import Int8KV, copy_slots
from radixflow.runtime import models
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.model_executor.cuda_graph import DecodeGraphs
from radixflow.runtime.model_executor.kv_sizing import check_kv_device
from radixflow.runtime.model_executor.prefault import prefault as start_prefault
from radixflow.runtime.model_executor.sampler import sample
from radixflow.runtime.model_executor.split import SplitTuner
from radixflow.runtime.model_executor.step_inputs import StepInputs, upload_int64
from radixflow.runtime.model_executor.threads import ThreadGovernor
from radixflow.runtime.model_executor.vision_step import load_vision
from radixflow.runtime.models import checkpoint_quant, gguf_file, quantized
from radixflow.runtime.models.bert import Encoder, EncoderConfig
from radixflow.runtime.models.layers import CausalLM, ModelConfig
from radixflow.runtime.models.loader import gguf_source, load_hf_config, weight_files
from radixflow.runtime.models.lora import LoraError, LoraStore
from radixflow.runtime.models.prepack import prepack
from radixflow.runtime.models.progress import Progress
from radixflow.runtime.models.rope import Rope
from radixflow.runtime.protocol.plan import BatchPlan, StepResult

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_model(
    model_dir: Path, config: ServerConfig, device: torch.device, dtype: torch.dtype
) -> CausalLM | Encoder:
    """Build the family's decoder from `model_dir` (config.json + safetensors shards, or a
    GGUF's directory) and load its weights: a GGUF's and an AWQ/GPTQ checkpoint's matrices
    kept quantized (unless --dequantize-weights), an fp32/bf16 checkpoint's quantized to int8
    with --quantization int8. Raises UnsupportedModelError (architecture, option or attention
    backend) or CheckpointError (missing, unexpected or misshapen weights). An encoder
    (models/bert.py) loads only with --is-embedding."""
    hf_config = load_hf_config(model_dir)
    model_config = models.model_config(hf_config)
    method = checkpoint_quant.quant_method(hf_config)
    if config.quantization not in ("", "int8", method):
        raise models.UnsupportedModelError(
            f"--quantization {config.quantization}: the checkpoint is "
            + (f"{method}-quantized" if method else "not quantized (int8 quantizes at load)")
        )
    if isinstance(model_config, EncoderConfig):
        return load_encoder(model_dir, model_config, config, device, dtype)
    ops = pick_ops(config.attention_backend, device, model_config)
    source = gguf_source(model_dir)
    if source is not None and not config.dequantize_weights:
        state = gguf_file.read_state(source, hf_config, mapped=not config.disable_mmap)
        return load_quantized(source.name, model_config, ops, state, config, device, dtype)
    start = time.perf_counter()
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(model_dir):
        state.update(load_file(str(file)))
    if method:
        converted = checkpoint_quant.convert_state(state, method)
        if not config.dequantize_weights:
            return load_quantized(
                model_dir.name, model_config, ops, converted, config, device, dtype
            )
        state = {
            k: quant.dequantize(v) if isinstance(v, quant.QuantWeight) else v
            for k, v in converted.items()
        }
    model = CausalLM(model_config, ops)
    model.load_hf_state_dict(state)
    model = model.to(device=device, dtype=dtype).eval()
    model.vision = load_vision(model, model_dir, hf_config, state)  # None: text only
    del state
    if config.quantization == "int8":
        _quantized_only_on_cpu(device, dtype)
        checkpoint_quant.quantize_int8(model)
        _log_quantized(model, model_dir.name, start)
        quantized.set_activations(model, config.quantized_activations)
        quantized.choose_dense_rows(model)
    return finish_load(model, config)


def load_encoder(
    model_dir: Path,
    model_config: EncoderConfig,
    config: ServerConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> Encoder:
    """An encoder's weights as they are (no quantization, no CPU prepacking or decode loop:
    it neither decodes nor stores KV). Raises UnsupportedModelError without --is-embedding,
    or for a quantized or GGUF checkpoint."""
    if not config.is_embedding:
        raise models.UnsupportedModelError(
            f"{model_config.architecture} is an encoder: it serves embeddings only, "
            "pass --is-embedding"
        )
    if config.quantization or gguf_source(model_dir) is not None:
        raise models.UnsupportedModelError("encoders load from fp32/bf16 safetensors only")
    model = Encoder(model_config, get_ops("torch", device))
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(model_dir):
        state.update(load_file(str(file)))
    model.load_hf_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def _quantized_only_on_cpu(device: torch.device, dtype: torch.dtype) -> None:
    if device.type != "cpu" or dtype != torch.float32:
        raise models.UnsupportedModelError(
            f"quantized weights run on the CPU in float32 (asked: {device.type}, {dtype}); "
            "pass --dequantize-weights to load them dequantized"
        )


def _log_quantized(model: CausalLM, name: str, start: float) -> None:
    kinds = sorted({t for m in quantized.quant_layers(model) for t in m.types})
    log.info(
        "%s: weights kept quantized (%s), %.1f MiB in memory, loaded in %.1f s",
        name, ", ".join(kinds) or "fp32", quantized.weight_bytes(model) / 2**20,
        time.perf_counter() - start,
    )  # fmt: skip


def load_quantized(
    name: str,
    model_config: ModelConfig,
    ops: AttentionOps,
    state: dict[str, Any],
    config: ServerConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """A decoder whose matrices stay in the blocks `state` holds (QuantWeight values), built
    on the meta device so that no fp32 copy of them is ever made (CPU, fp32 activations)."""
    _quantized_only_on_cpu(device, dtype)
    start = time.perf_counter()
    with torch.device("meta"):
        model = CausalLM(model_config, ops)
    model.rope = Rope(model_config, model_config.rope_theta, model_config.rope_scaling)
    if model_config.sliding_rope:
        model.sliding_rope = Rope(model_config, *model_config.sliding_rope)
    quantized.install(model, state)
    model.eval()
    _log_quantized(model, name, start)
    quantized.set_activations(model, config.quantized_activations)
    quantized.choose_dense_rows(model)
    return finish_load(model, config)


def finish_load(model: CausalLM, config: ServerConfig) -> CausalLM:
    """The CPU's packed sgemm layouts and compiled decode loop, where they apply."""
    if not config.disable_cpu_weight_prepack:
        with Progress("packing the weights for the CPU's matmuls"):
            prepack(model, config.cpu_matmul)
    if not config.disable_cpu_decode_loop:
        with Progress("building the compiled decode loop (compiled once per machine)"):
            model.decode_loop = decode_loop.build(model)  # None where the model does not qualify
    return model


def pick_ops(backend: str, device: torch.device, model_config: ModelConfig) -> AttentionOps:
    """`get_ops`, unless the model needs an attention feature (sliding window, soft-capped
    scores) the chosen ops do not take: then `auto` falls back to the torch ops, and an
    explicitly named backend is refused."""
    needs = [
        name
        for name, used in (
            ("sliding_window", any(model_config.layer_windows)),
            ("logit_cap", bool(model_config.attn_logit_cap)),
        )
        if used
    ]
    ops = get_ops(backend, device)
    lacking = [name for name in needs if not _takes(ops, name)]
    if lacking and backend == "auto":
        log.warning("%s attention lacks %s: using the torch ops", ops.name, lacking)
        ops = get_ops("torch", device)
        lacking = [name for name in needs if not _takes(ops, name)]
    if lacking:
        raise models.UnsupportedModelError(
            f"{model_config.architecture} needs attention with {lacking}, which the "
            f"{ops.name!r} backend does not implement; try --attention-backend auto"
        )
    return ops


def _takes(ops: AttentionOps, keyword: str) -> bool:
    """Whether every op that needs `keyword` takes it: both attentions, and for a sliding
    window also the layout builders (the window decides which keys a layout gathers)."""
    functions = [ops.extend_attention, ops.decode_attention]
    if keyword == "sliding_window":
        functions += [f for f in (ops.prepare_extend, ops.prepare_decode) if f is not None]
    return all(keyword in inspect.signature(f).parameters for f in functions)


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache. Masked reads of slots never written (the padded slot 0, the
    CPU decode's grid view past a request's own keys) must be finite: 0 * NaN would leak
    through the mask. On CPU the zeros come from calloc (numpy), so pages the pool never
    touches cost no memory, as with torch.empty; bfloat16 goes through uint16 storage."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    storage = {torch.bfloat16: np.uint16}.get(dtype)
    if storage is None:
        return torch.from_numpy(np.zeros(shape, dtype=torch.empty(0, dtype=dtype).numpy().dtype))
    return torch.from_numpy(np.zeros(shape, dtype=storage)).view(dtype)


class ModelRunner:
    """`cuda_graph_max_bs` > 0 replays decode steps from CUDA graphs
    (runtime/model_executor/cuda_graph.py;
    `graph_backend` "record" is its CPU stand-in for tests); `shared_prefix` False is the
    Triton ablation that reads every key per request."""

    def __init__(
        self,
        model: CausalLM | Encoder,
        num_slots: int,
        seed: int = 0,
        *,
        shared_prefix: bool = True,
        cuda_graph_max_bs: int = 0,
        max_kv_len: int = 0,
        graph_backend: str = "cuda",
        prefault: bool = False,
        governor: ThreadGovernor | None = None,
        kv_dtype: torch.dtype | None = None,
        max_lora_rank: int = 0,
    ) -> None:
        self.model = model
        # LoRA adapters by id (models/lora.py); None where they cannot apply (an encoder)
        self.loras = LoraStore(model.config, max_lora_rank) if model.stores_kv else None
        self.governor = governor  # --num-threads auto: threads follow the free cores
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # quantized weights on CPU: small matmuls split over threads where that measures faster
        quant_cpu = self.device.type == "cpu" and bool(quantized.quant_layers(model))
        self.split = SplitTuner() if quant_cpu else None
        c = model.config
        # an encoder stores no KV: its pool is bookkeeping only (models/bert.py)
        layers = c.num_layers if model.stores_kv else 0
        shape = (layers, num_slots, c.num_kv_heads, c.head_dim)
        # --kv-cache-dtype: a bf16 pool beside fp32 weights halves the KV memory; attention
        # reads it upcast (the native CPU kernels convert as they load); an int8 pool keeps
        # its scales in a tensor of its own (kernels/kv_int8.py)
        self.kv_dtype = kv_dtype or self.dtype
        check_kv_device(self.kv_dtype, self.device.type, getattr(model, "ops", model).name)
        self.k_caches, self.v_caches = (self._pool(shape) for _ in "kv")
        # each layer's pool as a view, made once: indexing the stacked pool per layer and step
        # was 2 select ops a layer (60 a step for SmolLM2), each dispatched through torch
        self.k_layers, self.v_layers = self.k_caches.unbind(0), self.v_caches.unbind(0)
        # the pool's memory committed at start, as a GPU pool's is (prefault.py: on a
        # background thread where the kernel can, so the first request need not wait); a
        # thread to join, or None (done, or not asked)
        self.kv_prefault = None
        if prefault and self.device.type == "cpu":
            pools = [self.k_caches, self.v_caches]
            self.kv_prefault = start_prefault(
                [t for p in pools for t in ((p.data, p.scale) if isinstance(p, Int8KV) else (p,))]
            )
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.vocab_size = c.vocab_size
        self.inputs = StepInputs(model, shared_prefix)
        self.graphs = None
        if cuda_graph_max_bs:
            self.graphs = DecodeGraphs(
                model, self.k_caches, self.v_caches, cuda_graph_max_bs,
                max_kv_len or num_slots, shared_prefix, graph_backend,
            )  # fmt: skip

    def _pool(self, shape: tuple[int, ...]) -> torch.Tensor | Int8KV:
        """A zeroed pool (layers, num_slots, Hkv, D) of the runner's KV dtype."""
        if self.kv_dtype != torch.int8:
            return zeroed_cache(shape, self.kv_dtype, self.device)
        return Int8KV(
            zeroed_cache(shape, torch.int8, self.device),
            zeroed_cache(shape[:-1], torch.float32, self.device),  # (layers, num_slots, Hkv)
        )

    def forward(self, plan: BatchPlan) -> StepResult:
        if self.governor is None:
            return self._forward(plan)
        self.governor.tick()
        wall, cpu = time.perf_counter(), time.process_time()
        result = self._forward(plan)
        self.governor.stepped(time.perf_counter() - wall, time.process_time() - cpu)
        return result

    def _forward(self, plan: BatchPlan) -> StepResult:
        if len(plan.copy_src):
            src, dst = upload_int64([plan.copy_src, plan.copy_dst], self.device)
            copy_slots(self.k_caches, src, dst)  # an int8 pool's scales with its data
            copy_slots(self.v_caches, src, dst)
        hidden = None
        with torch.inference_mode():
            # graphs take 1-D positions and know no LoRA: a step with images (mrope positions)
            # or adapter rows runs eagerly
            eager = len(plan.lora_ids) or plan.mrope_positions is not None
            graphs = self.graphs if not eager else None
            logits = graphs.replay(plan) if graphs is not None else None
            if logits is None:
                batch = self.inputs.forward_batch(plan)
                batch.lora = self.loras.batch(plan.lora_ids) if self.loras is not None else None
                if plan.mrope_positions is not None:  # images: model_executor/vision_step.py
                    self.model.vision.splice(plan, batch)
                if self.split is not None:
                    self.split.start(len(batch.input_ids), batch.num_extend_tokens == 0)
                logits = self.model(batch, self.k_layers, self.v_layers)  # (R, V) fp32
                if self.split is not None:
                    self.split.stop()
                if batch.hidden_states is not None:
                    hidden = batch.hidden_states.cpu().numpy()  # (H, hidden) fp32
            result = self._postprocess(logits, plan)
            result.hidden = hidden
            return result

    def forward_steps(self, plan: BatchPlan, slots: np.ndarray) -> np.ndarray | None:
        """Greedy decode steps of a decode-only plan in one call (CausalLM.decode_steps):
        `slots` (steps, B) each step's KV slots, row 0 the plan's own. -> the tokens (done, B)
        of the steps done, or None where not taken (nothing ran: `forward` the plan). Not
        while the split tuner still times single steps, nor under graphs, LoRA or images."""
        if self.graphs is not None or len(plan.lora_ids) or plan.mrope_positions is not None:
            return None
        if len(plan.copy_src) or (self.split is not None and self.split.chosen is None):
            return None
        if self.governor is not None:
            self.governor.tick()
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            batch = self.inputs.forward_batch(plan)
            tokens = self.model.decode_steps(
                batch, self.k_layers, self.v_layers, torch.from_numpy(slots)
            )
        if self.governor is not None and tokens is not None:
            self.governor.stepped(time.perf_counter() - wall, time.process_time() - cpu)
        return None if tokens is None else tokens.numpy()

    def load_lora(self, uid: int, name: str, path: str) -> None:
        """Load a PEFT adapter under `uid` (the scheduler's LoraTable's); raises LoraError."""
        if self.loras is None:
            raise LoraError("LoRA adapters apply to a decoder served on one rank only")
        self.loras.load(uid, name, path)

    def unload_lora(self, uid: int) -> None:
        if self.loras is not None:
            self.loras.unload(uid)

    def _postprocess(self, logits: torch.Tensor, plan: BatchPlan) -> StepResult:
        has = plan.logprob_targets >= 0  # (R,) host-side: no device sync to decide
        target_logprobs = np.full(len(plan.logit_rows), np.nan)
        top_values = top_ids = None
        if has.any() or plan.top_logprobs_num:
            logprobs = torch.log_softmax(logits, dim=-1)
            if has.any():
                wanted = [np.flatnonzero(has), plan.logprob_targets[has]]
                rows, targets = upload_int64(wanted, self.device)
                target_logprobs[has] = logprobs[rows, targets].cpu().numpy()
            if plan.top_logprobs_num:
                values, ids = logprobs.topk(plan.top_logprobs_num, dim=-1)
                top_values, top_ids = values.cpu().numpy(), ids.cpu().numpy()
        next_ids: list[int] = []
        next_logprobs: list[float] = []
        probs: list[torch.Tensor] = []
        if len(plan.sample_rows):
            every_row = np.array_equal(plan.sample_rows, np.arange(len(logits)))
            if not every_row:
                logits = logits[upload_int64([plan.sample_rows], self.device)[0]]
            next_ids, next_logprobs = sample(logits, plan, self.generator, probs)
        result = StepResult(next_ids, next_logprobs, target_logprobs, top_values, top_ids)
        result.probs = probs[0].cpu().numpy() if probs else None  # draft-model speculation
        return result
