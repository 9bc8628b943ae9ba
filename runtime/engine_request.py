"""EngineRequest: the caller's handle on one request of the offline Engine, and what it shows
while it runs (stream chunks) and once it finished (the result). Torch-free, like the server's
jobs (runtime/server/jobs.py), whose chunk rules it shares: cumulative text held back at half a
UTF-8 character or a possible stop string, and logprobs only for the tokens the chunk adds."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from radixflow.runtime.scheduler.request import Req
from radixflow.runtime.server.jobs import visible_text
from radixflow.runtime.tokenizer import IncrementalDetokenizer, build_output


class EngineRequest:
    """A read-only view of one submitted request, for callers that drive `Engine.step()`
    themselves (per-request timing, arrivals during decoding, streaming from another loop).
    Times are time.monotonic(). Not thread-safe: read it from the thread that steps."""

    def __init__(self, req: Req, tokenizer: PreTrainedTokenizerBase) -> None:
        self._req, self._tokenizer = req, tokenizer
        self._detokenizer: IncrementalDetokenizer | None = None
        self._num_sent = 0  # output tokens shown by next_chunk so far

    @property
    def rid(self) -> str:
        return self._req.rid

    @property
    def finished(self) -> bool:
        return self._req.finished

    @property
    def output_ids(self) -> list[int]:
        return list(self._req.output_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._req.output_ids)

    @property
    def arrival(self) -> float:
        return self._req.arrival

    @property
    def token_times(self) -> list[float]:
        return list(self._req.token_times)

    def result(self) -> dict[str, Any]:
        """The final {text, output_ids, meta_info} (as `generate` returns it). Raises
        RuntimeError while the request runs."""
        if not self._req.finished:
            raise RuntimeError(f"request {self.rid} has not finished")
        return finished_output(self._req, self._tokenizer)

    def next_chunk(self) -> dict[str, Any] | None:
        """What a stream shows after the tokens produced since the last call; None when there
        are none. A chunk is {"text" (cumulative, held back as the server's are), "output_ids"
        (cumulative), "meta_info" (with return_logprob, output_token_logprobs and
        output_top_logprobs of the new tokens only), "finished"}; the finished request's last
        chunk is its result with finished=True (logprobs: those not sent before)."""
        req = self._req
        if req.finished:
            if self._num_sent < 0:
                return None
            out = self.result()
            meta = dict(out["meta_info"])
            for key in ("output_token_logprobs", "output_top_logprobs"):
                if key in meta:
                    meta[key] = meta[key][self._num_sent :]
            self._num_sent = -1  # the last chunk went out
            return {**out, "meta_info": meta, "finished": True}
        if len(req.output_ids) == self._num_sent:
            return None
        if self._detokenizer is None:
            skip = req.sampling.skip_special_tokens
            self._detokenizer = IncrementalDetokenizer(self._tokenizer, req.input_ids, skip)
        text = visible_text(self._detokenizer.update(req.output_ids), req.sampling.stop)
        meta = req.meta_info()
        if req.return_logprob:
            new = slice(self._num_sent, len(req.output_ids))
            pairs = zip(req.output_logprobs[new], req.output_ids[new])
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in pairs]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = list(req.output_top_logprobs[new])
        self._num_sent = len(req.output_ids)
        return {
            "text": text,
            "output_ids": list(req.output_ids),
            "meta_info": meta,
            "finished": False,
        }


def finished_output(req: Req, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The result dict of a finished request: text trimmed at its stop, ids, meta data."""
    out = build_output(
        tokenizer,
        req.output_ids,
        req.input_ids,
        req.sampling,
        req.finish_reason,
        req.meta_info(),
        return_logprob=req.return_logprob,
        logprob_start_len=req.logprob_start_len,
        top_logprobs_num=req.top_logprobs_num,
        output_logprobs=req.output_logprobs,
        input_logprobs=req.input_logprobs,
        output_top_logprobs=req.output_top_logprobs,
        input_top_logprobs=req.input_top_logprobs,
    )
    if req.error:
        out["error"] = req.error
    return out
