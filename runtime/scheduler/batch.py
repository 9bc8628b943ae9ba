"""Building a step's BatchPlan from the requests the scheduler chose (torch-free); the plan
itself is the scheduler's contract with the model executor (radixflow.runtime.protocol.plan).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from radixflow.runtime.protocol.plan import I64, BatchPlan
from radixflow.runtime.scheduler.images import add_images

if TYPE_CHECKING:
    from radixflow.runtime.scheduler.request import Req


def build_plan(
    extends: list[Req],
    decodes: list[Req],
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
    verifies: list[Req] | None = None,
    jump_rows: list[Req] | None = None,
) -> tuple[BatchPlan, list[Req]]:
    """The step's flat ragged batch: extend rows (each request's new tokens, after its
    cached prefix: prompts, chunks, a running request's last token and the tokens a grammar
    forced after it, whose logprobs are logit rows too; an embedding request's pooled rows
    listed in hidden_rows), then the verify rows of speculating requests (their last token and
    drafts, a logit row each), then one row per decode, then `jump_rows`' pending tokens (a
    running request's last token and the tokens a grammar forced after it: `as_decode_rows`)
    as decode rows, each attending to its request's keys up to itself, only the last a logit
    row. Returns the plan and the requests that sample once, in sample-row order; the verify
    rows sample after them, request by request, 1 + len(draft_ids) rows each. Consumes each
    extend's pending copy-on-write."""
    input_ids, positions, out_slots = [], [], []
    qo, kv, kv_indices = [0], [0], []
    logit_rows, targets, sample_rows, sample_reqs = [], [], [], []
    copy_src, copy_dst, hidden_rows, lora_ids = [], [], [], []
    row = 0
    for req in extends:
        start, end = req.kv_len, req.extend_target
        hidden_rows += [row + p - start for p in req.hidden_positions(start, end)]
        fill = req.fill_ids
        input_ids.append(fill[start:end])
        positions.append(np.arange(start, end, dtype=I64))
        lora_ids.append([req.lora] * (end - start))
        out_slots.append(req.slots[start:end])
        kv_indices.append(req.slots[:start])
        qo.append(qo[-1] + end - start)
        kv.append(kv[-1] + start)
        if req.copy_src is not None:
            copy_src.append(req.copy_src)
            copy_dst.append(req.copy_dst)
            req.copy_src = None
        for p in req.input_logprob_positions(start, end):
            logit_rows.append(row + p - start)
            targets.append(req.input_ids[p + 1])
        for p in req.jumped_logprob_positions(start, end):
            logit_rows.append(row + p - start)
            targets.append(fill[p + 1])
        if end == req.seq_len and req.remaining_new_tokens() > 0 and req.jump_finish is None:
            sample_rows.append(len(logit_rows))
            logit_rows.append(row + end - 1 - start)
            targets.append(-1)
            sample_reqs.append(req)
        row += end - start
    verify_rows = []
    for req in verifies or []:
        start, ids = req.kv_len, [req.output_ids[-1], *req.draft_ids]
        input_ids.append(ids)
        positions.append(np.arange(start, start + len(ids), dtype=I64))
        lora_ids.append([req.lora] * len(ids))
        out_slots.append(req.slots[start : start + len(ids)])
        kv_indices.append(req.slots[:start])
        qo.append(qo[-1] + len(ids))
        kv.append(kv[-1] + start)
        verify_rows += range(len(logit_rows), len(logit_rows) + len(ids))
        logit_rows += range(row, row + len(ids))
        targets += [-1] * len(ids)
        row += len(ids)
    num_extend = row
    dkv, dkv_indices = [0], []
    for req in decodes:
        slot = int(req.slots[req.kv_len])
        input_ids.append([req.output_ids[-1]])
        positions.append(np.array([req.kv_len], dtype=I64))
        lora_ids.append([req.lora])
        out_slots.append(np.array([slot], dtype=I64))
        dkv_indices.append(req.slots[: req.kv_len + 1])
        dkv.append(dkv[-1] + req.kv_len + 1)
        sample_rows.append(len(logit_rows))
        logit_rows.append(row)
        targets.append(-1)
        sample_reqs.append(req)
        row += 1
    for req in jump_rows or []:
        start, end = req.kv_len, req.seq_len
        input_ids.append(req.fill_ids[start:end])
        positions.append(np.arange(start, end, dtype=I64))
        lora_ids.append([req.lora] * (end - start))
        out_slots.append(req.slots[start:end])
        for p in range(start, end):  # each row's keys: the request's, up to its own
            dkv_indices.append(req.slots[: p + 1])
            dkv.append(dkv[-1] + p + 1)
        row += end - start
        sample_rows.append(len(logit_rows))
        logit_rows.append(row - 1)
        targets.append(-1)
        sample_reqs.append(req)
    cat = lambda parts: (
        np.concatenate([np.asarray(p, dtype=I64) for p in parts]) if parts else np.zeros(0, I64)
    )
    plan = BatchPlan(
        input_ids=cat(input_ids),
        positions=cat(positions),
        out_slots=cat(out_slots),
        num_extend_tokens=num_extend,
        extend_qo_indptr=np.asarray(qo, I64),
        extend_kv_indptr=np.asarray(kv, I64),
        extend_kv_indices=cat(kv_indices),
        decode_kv_indptr=np.asarray(dkv, I64),
        decode_kv_indices=cat(dkv_indices),
        logit_rows=np.asarray(logit_rows, I64),
        logprob_targets=np.asarray(targets, I64),
        sample_rows=np.asarray(sample_rows + verify_rows, I64),
        copy_src=cat(copy_src),
        copy_dst=cat(copy_dst),
        hidden_rows=np.asarray(hidden_rows, I64),
    )
    stepped = [*extends, *(verifies or []), *decodes, *(jump_rows or [])]
    if any(r.lora for r in stepped):  # else every row the base's
        plan.lora_ids = cat(lora_ids)
    # verify row j samples as a decode would after the first j drafts were accepted
    rows = [(r, 0) for r in sample_reqs]
    rows += [(r, j) for r in verifies or [] for j in range(1 + len(r.draft_ids))]
    _fill_sampling(plan, rows, extends, vocab_size, eos_token_ids)
    # verify rows of drafts sampled from a draft model's q: their p comes back (draft_model.py)
    at, wanted = len(sample_reqs), []
    for req in verifies or []:
        if getattr(req.spec, "q", None) is not None:
            wanted += range(at, at + 1 + len(req.draft_ids))
        at += 1 + len(req.draft_ids)
    plan.prob_rows = np.asarray(wanted, I64)
    add_images(plan, extends, verifies or [], decodes)  # jump_rows hold no images
    return plan, sample_reqs


# A jump of at most this many pending tokens runs as decode rows. On a CPU an extend goes
# through the general attention path (a padded gather of its keys, per request), which cost
# as much as the decode rows of the whole batch at json_decode's 330-token contexts; as rows
# of the decode batch its tokens take the decode kernel's one call per layer. Each row reads
# its request's keys again, so a long jump stays an extend.
JUMP_ROWS_MAX = 16


def as_decode_rows(req: Req) -> bool:
    """Whether a request's jumped tokens can run as decode rows: no logprobs wanted for them
    (those take logit rows an extend lays out), no images (their rows need mrope positions),
    a jump that did not end the request, and a short jump."""
    pending = req.seq_len - req.kv_len
    return (
        1 < pending <= JUMP_ROWS_MAX
        and not req.return_logprob
        and not req.images
        and req.jump_finish is None
        and req.copy_src is None
    )


def _fill_sampling(
    plan: BatchPlan,
    rows: list[tuple[Req, int]],
    extends: list[Req],
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
) -> None:
    """Per sample row (request, drafts ahead of it): parameters, seed, penalty history,
    bans and grammar mask of the position len(output_ids) + drafts."""
    plan.sampling = [r.sampling for r, _ in rows]
    plan.sample_seeds = [
        None
        if r.sampling.seed is None
        else (r.sampling.seed * 1_000_003 + len(r.output_ids) + j) % 2**63
        for r, j in rows
    ]
    plan.output_ids = [r.output_ids + r.draft_ids[:j] if j else r.output_ids for r, j in rows]
    plan.banned_ids = [_banned(r, j, eos_token_ids) for r, j in rows]
    plan.sampled_logprobs = any(r.return_logprob for r, _ in rows)
    plan.top_logprobs_num = max(
        (r.top_logprobs_num for r in extends + [r for r, _ in rows] if r.return_logprob),
        default=0,
    )
    if any(r.grammar is not None for r, _ in rows):
        words = (vocab_size + 31) // 32
        masks = np.full((len(rows), words), -1, dtype=np.int32)
        for i, (req, j) in enumerate(rows):
            if req.grammar is None:
                continue
            masks[i] = 0
            if req.draft_ids:  # speculative.Speculator built the verify rows' masks
                masks[i] = req.spec.masks[j]
            else:
                req.grammar.fill_mask(masks[i])
        plan.vocab_masks = masks


def _banned(req: Req, ahead: int, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """Ending tokens are banned until min_new_tokens outputs exist (`ahead` drafts count)."""
    if len(req.output_ids) + ahead >= req.sampling.min_new_tokens:
        return ()
    return eos_token_ids + req.sampling.stop_token_ids
