"""The baselines: Hugging Face transformers as a naive server (`generate` per round, batched
with left padding, no reuse) and with its own continuous batching manager; and the parent
side of the peers (llama.cpp, vLLM), whose workers run bench/peers.py in their own venvs."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cache import PagedAttentionCache

from radixflow.bench.rounds import Arrivals, BenchError, RoundResult, System, argmax, diffs

HF_MAX_ROWS, HF_MAX_TOKENS = 64, 32768  # the naive server's batch: rows, padded tokens


class StepClock:
    """A `generate` streamer that records when each step's tokens come out (the first `put`
    is the prompt): every row of the batch shares these token times."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._puts = 0

    def put(self, value: Any) -> None:
        self._puts += 1
        if self._puts > 1:
            self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    """-> (input_ids, attention_mask), both (batch, max_len), padded on the left."""

    width = max(map(len, seqs))
    ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask


def score_options(model: Any, calls: list[Any], pad_id: int) -> tuple[list[int], int]:
    """Select by one forward pass over every prefix + option, nothing reused:
    -> (chosen option per call, padded tokens computed)."""

    seqs = [[*c.input_ids, *o] for c in calls for o in c.options]
    keep = max(len(o) for c in calls for o in c.options) + 1
    ids, mask = left_pad(seqs, pad_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() does under left padding
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep
        ).logits
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (rows, keep, vocab)
    rows, choices = iter(range(len(seqs))), []
    for call in calls:
        scores = []
        for option in call.options:  # positions keep-len-1 .. keep-2 predict the option
            row = logprobs[next(rows), keep - len(option) - 1 : keep - 1]
            scores.append(row.gather(-1, torch.tensor(option)[:, None]).mean().item())
        choices.append(argmax(scores))
    return choices, ids.numel()


def plan_batches(calls: list[Any], indices: list[int]) -> list[list[int]]:
    """Consecutive calls of one kind (same max_new_tokens, or select) in batches of at most
    HF_MAX_ROWS rows and HF_MAX_TOKENS padded prompt tokens."""
    batches: list[list[int]] = []
    kind = lambda i: (bool(calls[i].options), calls[i].max_new_tokens)
    for _, group in itertools.groupby(indices, key=kind):
        batch: list[int] = []
        rows = width = 0
        for i in group:
            num_rows = len(calls[i].options) or 1
            length = len(calls[i].input_ids) + max(map(len, calls[i].options), default=0)
            too_big = (rows + num_rows) * max(width, length) > HF_MAX_TOKENS
            if batch and (rows + num_rows > HF_MAX_ROWS or too_big):
                batches.append(batch)
                batch, rows, width = [], 0, 0
            batch.append(i)
            rows, width = rows + num_rows, max(width, length)
        batches.append(batch)
    return batches


class TransformersSystem(System):
    """A naive server: a round's calls in left-padded `generate` batches, nothing reused;
    late calls queue behind the batches that arrived before them."""

    name = "transformers"

    def __init__(self, model: Any, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id

    def run_round(self, calls: list[Any]) -> RoundResult:
        arrivals, result = Arrivals(calls, time.monotonic()), RoundResult([None] * len(calls))
        early, lead_times = arrivals.due([], False), []
        late = [i for i in range(len(calls)) if i not in early]
        for batch in plan_batches(calls, early) + plan_batches(calls, late):
            if calls[batch[0]].options:
                choices, tokens = score_options(self.model, [calls[i] for i in batch], self.pad_id)
                result.prefill_tokens += tokens
                for i, choice in zip(batch, choices):
                    result.outputs[i] = choice
                continue
            outputs, times, tokens = self._generate([calls[i] for i in batch])
            lead_times = times if 0 in batch else lead_times
            arrivals.due(lead_times, True)
            result.prefill_tokens += tokens
            for i, output in zip(batch, outputs):
                result.outputs[i] = output
                result.ttfts.append(times[0] - arrivals.times[i])
                result.itls += diffs(times)
        return result

    def _generate(self, calls: list[Any]) -> tuple[list[list[int]], list[float], int]:

        ids, mask = left_pad([list(c.input_ids) for c in calls], self.pad_id)
        config = GenerationConfig(
            max_new_tokens=calls[0].max_new_tokens,
            do_sample=False,
            eos_token_id=-1,  # never stops early: EOS ignored, like the other systems
            pad_token_id=self.pad_id,
        )
        clock = StepClock()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, generation_config=config, streamer=clock
            )
        return out[:, ids.shape[1] :].tolist(), clock.times, ids.numel()


class TransformersCBSystem(System):
    """transformers' continuous batching manager (paged KV, block sharing on), one per
    workload. It has no prompt-logprob API, so select calls are scored by a forward pass while
    it is paused. Reused prompt tokens are counted by wrapping `search_prefix_match`."""

    name = "transformers-cb"

    def __init__(self, model: Any, pad_id: int) -> None:

        self.model, self.pad_id, self.manager, self.matched = model, pad_id, None, 0
        original = PagedAttentionCache.search_prefix_match

        def counting(cache: Any, *args: Any, **kwargs: Any) -> int:
            matched = original(cache, *args, **kwargs)
            self.matched += matched
            return matched

        PagedAttentionCache.search_prefix_match = counting
        self._unpatch = lambda: setattr(PagedAttentionCache, "search_prefix_match", original)

    def start_workload(self) -> None:

        generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=self.pad_id)
        paging = ContinuousBatchingConfig(  # sized like radixflow's defaults, not from free RAM
            page_size=16,
            num_blocks=2048,
            max_batch_tokens=2048,
            max_requests_per_batch=64,
            allow_block_sharing=True,
        )
        self.manager = self.model.init_continuous_batching(generation, paging)
        self.manager.start()

    def end_workload(self) -> None:
        self.manager.stop(block=True)
        self.manager.destroy()

    def close(self) -> None:
        self._unpatch()

    def run_round(self, calls: list[Any]) -> RoundResult:
        if calls[0].options:  # a round of selects (workloads never mix the two)
            with self.manager.pause():
                choices, tokens = score_options(self.model, calls, self.pad_id)
            return RoundResult(choices, prefill_tokens=tokens)
        matched, result = self.matched, RoundResult([None] * len(calls))
        arrivals, lead_times, rids = Arrivals(calls, time.perf_counter()), [], {}
        streaming = any(c.after_tokens for c in calls)  # then the lead's tokens are watched
        while None in result.outputs:
            for i in arrivals.due(lead_times, result.outputs[0] is not None):
                rid = self.manager.add_request(
                    list(calls[i].input_ids),
                    max_new_tokens=calls[i].max_new_tokens,
                    streaming=streaming and i == 0,
                    record_timestamps=True,
                )
                rids[rid] = i
            out = self.manager.get_result(timeout=0.05)
            if out is None and not self.manager.is_running():
                raise BenchError("transformers-cb: the generation thread stopped")
            if out is None:
                continue
            i = rids[out.request_id]
            lead_times = list(out.timestamps or []) if i == 0 else lead_times
            if out.is_finished():
                if out.error:
                    raise BenchError(f"transformers-cb: {out.error}")
                result.outputs[i] = list(out.generated_tokens)
                result.ttfts.append(out.timestamps[0] - arrivals.times[i])  # perf_counter
                result.itls += diffs(out.timestamps)
        result.cached_tokens = self.matched - matched
        result.prefill_tokens = sum(len(c.input_ids) for c in calls) - result.cached_tokens
        return result


WORKER_STUB = (
    "import runpy, sys; "
    "runpy.run_path(sys.argv[1], run_name='radixflow_bench_worker')['worker_main'](sys.argv[2])"
)


class WorkerSystem(System):
    """A peer run by `worker_main` in its own interpreter, JSON lines over stdin/stdout; its
    stderr goes to a log file that errors name."""

    def __init__(self, name: str, python: str, args: dict[str, Any]) -> None:
        self.name = name
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"radixflow-bench-{name}.log"
        self._log = self.log_path.open("w")
        worker = Path(__file__).resolve().with_name("peers.py")
        command = [python, "-I", "-c", WORKER_STUB, str(worker), name]
        self.proc = subprocess.Popen(  # cwd: not the checkout, whose kernels/ shadows a package
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=self.log_path.parent,
        )
        self.pid = self.proc.pid
        self._ask({"op": "load", "args": args})

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            reply = json.loads(self.proc.stdout.readline() or "null")
        except (BrokenPipeError, json.JSONDecodeError) as e:
            raise BenchError(f"worker failed (log: {self.log_path})") from e
        if reply is None or "error" in reply:
            problem = reply["error"] if reply else "worker died"
            raise BenchError(f"{problem} (log: {self.log_path})")
        return reply

    def start_workload(self) -> None:
        self._ask({"op": "reset"})

    def run_round(self, calls: list[Any]) -> RoundResult:
        reply = self._ask({"op": "round", "calls": [dataclasses.asdict(c) for c in calls]})
        return RoundResult(**reply)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self._log.close()
