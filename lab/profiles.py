"""Cost models for `radixflow simulate`: how long one forward step of a batch plan takes.

A step is described by five numbers (`StepShape`): prefill (extend) tokens, decode rows,
KV tokens the decodes read, prefill attention pairs (query x key, causal) and the prefill
attention area (the padded query x key rectangle a dense masked kernel computes: the CPU
path pads every extend to the batch's longest and masks, so one whole 3,000-token prompt
costs twice its causal pairs). Two kinds of profile:

* `LinearProfile` - measured on this machine (`radixflow simulate --calibrate PATH`): the
  real ModelRunner runs a set of prefill, decode and mixed steps, and least squares fits
  t = overhead + per_extend_token*E + per_decode_row*D + per_kv_token*K + per_pair*P
  + per_area*A. The steps include whole long prompts as well as chunks of them, so the
  fit can tell the pairs from the area.
* `RooflineProfile` - a named device/model pair from first principles, for planning
  hardware you do not have. t = overhead + max(bytes moved / bandwidth, decode FLOPs /
  peak + prefill FLOPs / (peak * MFU)): one weight read serves every row of a step. Bytes
  moved: the weights once per step plus every KV token the decodes read; FLOPs: 2 * params
  per token plus attention (4 * layers * heads * head dim per query-key pair).

PROFILES["h100-llama-3.3-70b-fp8"] - assumptions (the seed material's own table was not
available to us, so this is built from public specifications, not fitted to it):
  H100 SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense FP8 (1979 is with 2:4 sparsity; not used).
  Llama-3.3-70B in FP8: 70.6e9 params at 1 byte = 70.6 GB of weights read per step;
  80 layers, 64 query heads, 8 KV heads, head dim 128; FP8 KV cache: 2 x 80 x 8 x 128 x 1
  = 163,840 B per token. Prefill runs at MFU 0.5; decode matmuls at peak (they are
  bandwidth-bound at any batch this pool holds). 2 ms fixed overhead per step (launches,
  sampling, scheduling; CUDA graphs assumed). KV pool: 80 GB - 70.6 GB weights - ~3 GB
  activations/workspace = ~6 GB -> about 37,000 tokens (why a 70B FP8 on one H100 is KV-bound).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from radixflow.runtime.protocol.plan import BatchPlan


@dataclass(frozen=True)
class StepShape:
    extend_tokens: int
    decode_rows: int
    decode_kv_tokens: int
    attention_pairs: float
    attention_area: float = 0.0

    @staticmethod
    def of(plan: BatchPlan) -> StepShape:
        new = np.diff(plan.extend_qo_indptr)
        prefix = np.diff(plan.extend_kv_indptr)
        pairs = float((new * prefix + new * (new + 1) / 2).sum())
        area = float(len(new) * new.max() * (prefix.max() + new.max())) if len(new) else 0.0
        return StepShape(
            plan.num_extend_tokens,
            len(plan.decode_kv_indptr) - 1,
            len(plan.decode_kv_indices),
            pairs,
            area,
        )

    def features(self) -> list[float]:
        return [
            1.0,
            self.extend_tokens,
            self.decode_rows,
            self.decode_kv_tokens,
            self.attention_pairs,
            self.attention_area,
        ]


@dataclass(frozen=True)
class LinearProfile:
    name: str
    overhead_s: float
    per_extend_token_s: float
    per_decode_row_s: float
    per_kv_token_s: float
    per_pair_s: float
    per_area_s: float = 0.0  # profiles saved before the area term read as 0
    kind: str = "linear"
    notes: str = ""

    def step_time(self, shape: StepShape) -> float:
        coefficients = (
            self.overhead_s,
            self.per_extend_token_s,
            self.per_decode_row_s,
            self.per_kv_token_s,
            self.per_pair_s,
            self.per_area_s,
        )
        return float(np.dot(coefficients, shape.features()))

    @staticmethod
    def fit(
        name: str, shapes: list[StepShape], times: list[float], notes: str = ""
    ) -> LinearProfile:
        """Non-negative least squares (drop a negative coefficient, refit) on relative error,
        so short decode steps weigh as much as long prefills."""
        x = np.array([s.features() for s in shapes])
        y = np.array(times)
        keep = list(range(x.shape[1]))
        while True:
            weights = 1.0 / np.maximum(y, 1e-6)
            coef, *_ = np.linalg.lstsq(x[:, keep] * weights[:, None], y * weights, rcond=None)
            if (coef >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(coef)))
        full = np.zeros(x.shape[1])
        full[keep] = np.maximum(coef, 0)
        return LinearProfile(name, *map(float, full), notes=notes)


@dataclass(frozen=True)
class RooflineProfile:
    name: str
    bandwidth_bytes_per_s: float
    peak_flops: float
    prefill_mfu: float
    weight_bytes: float
    params: float
    kv_bytes_per_token: int
    num_layers: int
    num_heads: int
    head_dim: int
    overhead_s: float
    kv_pool_tokens: int  # what the device holds after weights, for the simulated config
    kind: str = "roofline"
    notes: str = ""

    def step_time(self, shape: StepShape) -> float:
        attention_flops = 4 * self.num_layers * self.num_heads * self.head_dim
        moved = self.weight_bytes + shape.decode_kv_tokens * self.kv_bytes_per_token
        decode_flops = 2 * self.params * shape.decode_rows
        decode_flops += attention_flops * shape.decode_kv_tokens
        prefill_flops = 2 * self.params * shape.extend_tokens
        prefill_flops += attention_flops * shape.attention_pairs
        compute = decode_flops / self.peak_flops
        compute += prefill_flops / (self.peak_flops * self.prefill_mfu)
        # one weight read serves every row of the step, so a prefill chunk's compute hides
        # it (why mixing prefill into decode steps pays on a GPU)
        return self.overhead_s + max(moved / self.bandwidth_bytes_per_s, compute)


Profile = LinearProfile | RooflineProfile

PROFILES: dict[str, Profile] = {
    "h100-llama-3.3-70b-fp8": RooflineProfile(
        name="h100-llama-3.3-70b-fp8",
        bandwidth_bytes_per_s=3.35e12,
        peak_flops=989e12,
        prefill_mfu=0.5,
        weight_bytes=70.6e9,
        params=70.6e9,
        kv_bytes_per_token=2 * 80 * 8 * 128 * 1,
        num_layers=80,
        num_heads=64,
        head_dim=128,
        overhead_s=0.002,
        kv_pool_tokens=37_000,
        notes="first principles, see radixflow.lab.profiles",
    ),
}


def load_profile(name_or_path: str) -> Profile:
    """A named profile, or a JSON file written by `radixflow simulate --calibrate`.
    Raises ValueError for an unknown name or a malformed file."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"no profile {name_or_path!r}: name one of {sorted(PROFILES)} or a file")
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        kind = data.pop("kind")
        return {"linear": LinearProfile, "roofline": RooflineProfile}[kind](**data)
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a radixflow profile ({e})") from e


def save_profile(profile: Profile, path: str) -> None:
    Path(path).write_text(json.dumps(asdict(profile), indent=1) + "\n")
