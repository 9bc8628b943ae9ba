"""Jump-forward decoding: the SGLang paper's compressed finite-state machine (torch-free).

Where a request's grammar admits exactly one continuation (a JSON schema's keys, the
punctuation between fields, the rest of an enum value or of a regex's literal run), the
tokens of that text are appended without sampling them, and the next step computes their KV
in one extend instead of one decode step each. When, in `step()`:
  * after the step's tokens are appended (sampled tokens, verified drafts), before anything
    streams: the grammar's forced tokens (runtime/constrained/jump_forward.py) follow the last
    sampled token, which they may replace where the tokenizer merges it with the forced text
    (it has no KV and was not streamed yet; the grammar rolls back over it);
  * when a request's grammar is ready, before its prefill: text forced from the start (`{"`
    and the first key) is prefilled with the prompt.
Jumped tokens are ordinary output tokens from then on: they stream at once, count against
`max_new_tokens`, pass the same stop checks as sampled ones (EOS, stop ids, stop strings, the
grammar's end) one at a time, and enter the radix tree with the request's other KV. The next
step extends the request's last sampled token and its jumped tokens, and samples after them
(no n-gram drafts that step: `Speculator.propose` sees only requests with one token pending);
a request preempted before that recomputes them with its prompt on resume.

Logprobs: a jumped token's is the model's, from the logits of the extend that computes it
(as SGLang reports them); such a request streams a jumped token once that logprob is known,
and a jump that ends it finishes after that extend. With logprobs asked for, the last sampled
token is never replaced (its logprob is the one sampled).
"""

from __future__ import annotations

from collections.abc import Callable

from radixflow.runtime.scheduler.request import Req

MAX_JUMP_TOKENS = 128  # one jump's tokens; a longer forced text goes on after the next sample


class JumpForward:
    """Appends grammar-forced tokens to constrained requests. Mutates the request (output ids,
    grammar: rolled back over a replaced token, advanced over the jumped ones) through the
    scheduler's `append`, which returns True once the request is done."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.counters = {
            "jump_forward_tokens": 0,  # output tokens appended without sampling
            "jump_forward_jumps": 0,
            # each net jumped token is one decode forward of its request that did not run; a
            # jump that ends a logprob request costs one extend back
            "jump_forward_steps_saved": 0,
        }

    def jump(self, req: Req, append: Callable[[Req, int, float], bool], now: float) -> bool:
        """Append the tokens `req`'s grammar forces next; whether any were."""
        if not self.enabled or req.grammar is None or req.finished or req.jump_finish:
            return False
        last = req.output_ids[-1] if req.output_ids and not req.return_logprob else None
        replace, tokens = req.grammar.forced_tokens(last)
        tokens = tokens[:MAX_JUMP_TOKENS]
        if not tokens:
            return False
        if replace:
            req.grammar.rollback(1)
            req.drop_last_token()
        appended = 0
        for token in tokens:
            appended += 1
            if append(req, token, now):
                break
        c = self.counters
        c["jump_forward_tokens"] += appended
        c["jump_forward_jumps"] += 1
        c["jump_forward_steps_saved"] += appended - replace - (req.jump_finish is not None)
        return True

    def stats(self) -> dict[str, int]:
        return dict(self.counters)
