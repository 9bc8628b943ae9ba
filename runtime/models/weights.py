"""Hugging Face checkpoint names -> the decoder's parameters, strictly.

Every parameter must be filled and every checkpoint tensor used: a missing, unexpected or
misshapen weight raises `CheckpointError` naming it. The only tensors skipped are the ones
listed in `IGNORED_SUFFIXES` (buffers some old checkpoints saved, not weights).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
SHOWN = 8  # names listed in an error


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model its config describes."""


def _rename(
    state: dict[str, torch.Tensor], renamed: tuple[tuple[str, str], ...], skipped: tuple[str, ...]
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        for saved, ours in renamed:
            if name.startswith(saved):
                name = ours + name.removeprefix(saved)
                break
        if not name.startswith(skipped):
            out[name] = value
    if len(out) < len(state):
        log.info("skipped %d weights under %s (text model only)", len(state) - len(out), skipped)
    return out


def checkpoint_names(name: str) -> list[list[str]]:
    """Our parameter name -> the checkpoint names it may come from, as alternatives, each a
    list concatenated along dim 0 (split q/k/v, or Phi-3's fused qkv_proj)."""
    if name == "embed_tokens.weight":
        return [["model.embed_tokens.weight"]]
    if name == "norm":
        return [["model.norm.weight"]]
    if name == "lm_head.weight":
        return [["lm_head.weight"]]
    _, index, own, *rest = name.split(".")
    p, kind = f"model.layers.{index}.", ".".join(rest)
    norms = {
        "input_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "pre_feedforward_norm": "pre_feedforward_layernorm",
        "post_feedforward_norm": "post_feedforward_layernorm",
    }
    if own in norms:
        return [[f"{p}{norms[own]}.weight"]]
    if own in ("q_norm", "k_norm"):
        return [[f"{p}self_attn.{own}.weight"]]
    if own == "qkv_proj":
        return [[f"{p}self_attn.qkv_proj.{kind}"], [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv"]]
    if own == "o_proj":
        return [[f"{p}self_attn.o_proj.{kind}"]]
    if own == "gate_up_proj":
        return [
            [f"{p}mlp.gate_up_proj.{kind}"],
            [f"{p}mlp.{x}_proj.{kind}" for x in ("gate", "up")],
        ]
    if own == "down_proj":
        return [[f"{p}mlp.down_proj.{kind}"]]
    raise AssertionError(f"no checkpoint name for parameter {name}")


def load_weights(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    renamed: tuple[tuple[str, str], ...] = (),
    skipped: tuple[str, ...] = (),
) -> None:
    """Copy `state` (Hugging Face names) into `model`'s parameters, in place. `renamed`
    (saved prefix, ours) pairs rename first; names starting with a `skipped` prefix (another
    modality's tower) are left out and counted in the log."""
    if renamed or skipped:
        state = _rename(state, renamed, skipped)
    used: set[str] = {k for k in state if k.endswith(IGNORED_SUFFIXES)}
    missing: list[str] = []
    for name, param in model.named_parameters():
        found = [names for names in checkpoint_names(name) if all(n in state for n in names)]
        if not found:
            missing.append(" + ".join(checkpoint_names(name)[-1]))
            continue
        value = torch.cat([state[n] for n in found[0]]) if len(found[0]) > 1 else state[found[0][0]]
        if value.shape != param.shape:
            raise CheckpointError(
                f"weight {' + '.join(found[0])}: shape {tuple(value.shape)}, "
                f"the config implies {tuple(param.shape)}"
            )
        param.data.copy_(value)
        used.update(found[0])
    embed = state.get("model.embed_tokens.weight")
    tied = getattr(model, "lm_head", None) is None and "lm_head.weight" in state
    if tied and embed is not None and torch.equal(state["lm_head.weight"], embed):
        used.add("lm_head.weight")  # a tied head saved anyway, equal to the embedding
    unexpected = sorted(set(state) - used)
    if missing or unexpected:
        raise CheckpointError(
            "checkpoint does not match its config: "
            + (f"missing {len(missing)} weight(s) {missing[:SHOWN]}" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"unexpected {len(unexpected)} weight(s) {unexpected[:SHOWN]}" if unexpected else "")
        )
