"""What a step's forward pass hands back to its extends, beside the sampled tokens: the input
logprobs of prompts (and of tokens a grammar forced), and the pooled hidden states of
embedding requests. Torch-free: the result's arrays are numpy."""

from __future__ import annotations

from radixflow.runtime.protocol.plan import BatchPlan, StepResult
from radixflow.runtime.scheduler.request import Req


def store_logprobs(plan: BatchPlan, result: StepResult, extends: list[Req]) -> None:
    """The extends' input logprobs, and the logprobs of the jumped tokens they computed."""
    row_of = {int(r): i for i, r in enumerate(plan.logit_rows)}
    row = 0
    for req in extends:
        start, end = req.kv_len, req.extend_target
        for p in req.jumped_logprob_positions(start, end):
            i = row_of[row + p - start]
            req.output_logprobs.append(float(result.target_logprobs[i]))
            if result.top_logprobs is not None and req.top_logprobs_num:
                req.output_top_logprobs.append(top_of(result, i, req.top_logprobs_num))
        positions = req.input_logprob_positions(start, end)
        if positions or (not req.input_logprobs_done and end >= len(req.input_ids)):
            if not req.input_logprobs and req.logprob_start_len == 0:
                req.input_logprobs.append(None)
                req.input_top_logprobs.append([])
            for p in positions:
                i = row_of[row + p - start]
                req.input_logprobs.append(float(result.target_logprobs[i]))
                if result.top_logprobs is not None and req.top_logprobs_num:
                    k = req.top_logprobs_num
                    req.input_top_logprobs.append(
                        list(
                            zip(
                                result.top_logprobs[i][:k].tolist(),
                                result.top_ids[i][:k].tolist(),
                            )
                        )
                    )
        if end >= len(req.input_ids):
            req.input_logprobs_done = True
        row += end - start


def pool_hidden(result: StepResult, extends: list[Req]) -> None:
    """Hand each embedding request its rows of `result.hidden` (the plan's hidden_rows,
    in extend order, as build_plan laid them out)."""
    row = 0
    for req in extends:
        count = len(req.hidden_positions(req.kv_len, req.extend_target))
        if count:
            assert result.hidden is not None, "the runner returned no hidden states"
            req.pool_hidden(result.hidden[row : row + count])
            row += count


def top_of(result: StepResult, row: int, k: int) -> list[tuple[float, int]]:
    """The top-k (logprob, id) pairs of a logit row."""
    assert result.top_logprobs is not None and result.top_ids is not None
    return list(zip(result.top_logprobs[row][:k].tolist(), result.top_ids[row][:k].tolist()))
