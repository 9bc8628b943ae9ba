"""ModelRunner: the one place where a batch plan becomes tensors.

plan (numpy) -> tensors -> copy-on-write KV copies -> forward -> sample -> StepResult.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from radixflow.kernels import AttentionOps, get_ops
from radixflow.runtime import models
from radixflow.runtime.batch import BatchPlan, StepResult
from radixflow.runtime.config import ServerConfig
from radixflow.runtime.loader import load_hf_config, weight_files
from radixflow.runtime.models.layers import CausalLM, ForwardBatch, ModelConfig
from radixflow.runtime.sampler import sample

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
) -> CausalLM:
    """Build the family's decoder from `model_dir` (config.json + safetensors shards) and
    load its weights. Raises UnsupportedModelError (architecture, option or attention
    backend) or CheckpointError (missing, unexpected or misshapen weights)."""
    model_config = models.model_config(load_hf_config(model_dir))
    model = CausalLM(model_config, pick_ops(config.attention_backend, device, model_config))
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(model_dir):
        state.update(load_file(str(file)))
    model.load_hf_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


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


class ModelRunner:
    def __init__(self, model: CausalLM, num_slots: int, page_size: int, seed: int = 0) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        c = model.config
        shape = (c.num_layers, num_slots, c.num_kv_heads, c.head_dim)
        # Uninitialised except page 0: only written slots are read, and padded reads of the
        # dummy slot 0 must be finite (they are masked, and 0 * NaN would leak through).
        self.k_caches = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.v_caches = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.k_caches[:, :page_size].zero_()
        self.v_caches[:, :page_size].zero_()
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab_size = c.vocab_size

    def forward(self, plan: BatchPlan) -> StepResult:
        if len(plan.copy_src):
            src, dst = self._tensor(plan.copy_src), self._tensor(plan.copy_dst)
            self.k_caches[:, dst] = self.k_caches[:, src]
            self.v_caches[:, dst] = self.v_caches[:, src]
        batch = ForwardBatch(
            input_ids=self._tensor(plan.input_ids),
            positions=self._tensor(plan.positions),
            out_slots=self._tensor(plan.out_slots),
            num_extend_tokens=plan.num_extend_tokens,
            extend_qo_indptr=self._tensor(plan.extend_qo_indptr),
            extend_kv_indptr=self._tensor(plan.extend_kv_indptr),
            extend_kv_indices=self._tensor(plan.extend_kv_indices),
            decode_kv_indptr=self._tensor(plan.decode_kv_indptr),
            decode_kv_indices=self._tensor(plan.decode_kv_indices),
            logit_rows=self._tensor(plan.logit_rows),
        )
        with torch.inference_mode():
            logits = self.model(batch, self.k_caches, self.v_caches)  # (R, V) fp32
            return self._postprocess(logits, plan)

    def _postprocess(self, logits: torch.Tensor, plan: BatchPlan) -> StepResult:
        targets = self._tensor(plan.logprob_targets)
        target_logprobs = np.full(len(plan.logit_rows), np.nan)
        top_values = top_ids = None
        if (targets >= 0).any() or plan.top_logprobs_num:
            logprobs = torch.log_softmax(logits, dim=-1)
            has = targets >= 0
            picked = logprobs[has].gather(1, targets[has][:, None])[:, 0]
            target_logprobs[has.cpu().numpy()] = picked.cpu().numpy()
            if plan.top_logprobs_num:
                values, ids = logprobs.topk(plan.top_logprobs_num, dim=-1)
                top_values, top_ids = values.cpu().numpy(), ids.cpu().numpy()
        next_ids: list[int] = []
        next_logprobs: list[float] = []
        if len(plan.sample_rows):
            every_row = np.array_equal(plan.sample_rows, np.arange(len(logits)))
            rows = logits if every_row else logits[self._tensor(plan.sample_rows)]
            next_ids, next_logprobs = sample(rows, plan, self.generator)
        return StepResult(next_ids, next_logprobs, target_logprobs, top_values, top_ids)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)
