"""How a program stream runs its gens and selects on a hosted-API backend (radixflow.backends):
one API call per gen, the program's text or conversation as its prompt, select through the
backend, and API speculative execution (`radixflow.speculative`) when the program or the
backend sets num_api_spec_tokens. The interpreter calls in here from the stream's worker
thread; a RuntimeEndpoint or an Engine never comes here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixflow.backends.api import ApiBackend, Prompt
from radixflow.speculative import ChatSpeculation, CompletionSpeculation

if TYPE_CHECKING:
    from radixflow.interpreter import StreamExecutor


class ApiRun:
    """One stream's calls to `backend` and its speculation state."""

    def __init__(self, backend: ApiBackend, num_api_spec_tokens: int | None) -> None:
        self.backend = backend
        num = num_api_spec_tokens or backend.num_api_spec_tokens
        chat = backend.is_chat_model
        self.completion_spec = CompletionSpeculation(num) if num and not chat else None
        self.chat_spec = ChatSpeculation(num) if num and chat else None

    def fork(self) -> ApiRun:
        """A branch's: the same backend and setting, no speculation carried over."""
        num = (self.completion_spec or self.chat_spec or _NoSpec).num_tokens
        return ApiRun(self.backend, num)

    def defers(self, ex: StreamExecutor) -> bool:
        """Inside an assistant turn on a chat model with speculation: text and gens wait."""
        return self.chat_spec is not None and ex.role is not None and ex.role[0] == "assistant"

    def fill(self, ex: StreamExecutor, text: str) -> None:
        """Constant text (or a role's markup) the program appends."""
        if self.defers(ex):
            assert self.chat_spec is not None
            self.chat_spec.add_text(text)
            return
        if self.completion_spec is not None:
            self.completion_spec.on_text(text)
        ex.append(text)

    def gen(self, ex: StreamExecutor, name: str | None, params: dict[str, Any]) -> None:
        if self.defers(ex):
            assert self.chat_spec is not None
            if ex.stream:
                raise ValueError("stream=True cannot run with API speculative execution")
            self.chat_spec.add_gen(name, params)
            ex.defer(name)
            return
        if ex.stream:
            self._gen_stream(ex, name, params)
            return
        value = self._speculated(ex, params)
        if value is not None:
            ex.append(value, name)
            ex.set_var(name, value, {"speculated": True})
            return
        out = self.backend.complete(prompt_of(ex), params)
        ex.append(out.texts[0], name)
        metas = [{"finish_reason": reason} for reason in out.finish_reasons]
        if params.get("n", 1) > 1:
            ex.set_var(name, list(out.texts), metas)
        else:
            ex.set_var(name, out.texts[0], metas[0])

    def _speculated(self, ex: StreamExecutor, params: dict[str, Any]) -> str | None:
        """A completion model's gen value from speculated text (calling for more when there is
        none), or None when this gen needs its own call."""
        spec = self.completion_spec
        if spec is None:
            return None
        stops = list(params.get("stop") or ())
        if not stops or params.get("n", 1) != 1:
            spec.clear()
            return None
        value = spec.take(stops)
        if value is None:
            out = self.backend.complete(prompt_of(ex), spec.call_params(params))
            spec.refill(out.texts[0], out.finish_reasons[0] == "stop")
            value = spec.take(stops)
        if value is None:
            spec.clear()
        return value

    def _gen_stream(self, ex: StreamExecutor, name: str | None, params: dict[str, Any]) -> None:
        if self.completion_spec is not None:
            raise ValueError("stream=True cannot run with API speculative execution")
        if params.get("n", 1) != 1:
            raise ValueError("gen(n>1) cannot stream")
        shown = ""
        for piece in self.backend.complete_stream(prompt_of(ex), params):
            shown += piece
            ex.set_var(name, shown)
            ex.append(piece, name)
        ex.set_var(name, shown, {})

    def select(self, ex: StreamExecutor, name: str | None, choices: list[str], method: Any) -> None:
        if self.defers(ex):
            raise ValueError(
                "select inside an assistant turn cannot run with API speculative execution on "
                "a chat model: put it in its own assistant turn, or use gen"
            )
        if self.completion_spec is not None:
            self.completion_spec.clear()
        decision = self.backend.select(prompt_of(ex), choices, method)
        ex.append(decision.decision, name)
        ex.set_var(name, decision.decision, decision.meta_info)

    def end_turn(self, ex: StreamExecutor) -> None:
        """The assistant turn ends: one call writes it, its text and gens are matched."""
        spec = self.chat_spec
        if spec is None or not spec.terms:
            return
        terms = spec.terms
        if spec.has_gen:
            prompt = prompt_of(ex)
            for _ in range(spec.tries()):
                answer = self.backend.complete(prompt, spec.call_params()).texts[0]
                terms = spec.match(answer)
                if terms is not None:
                    break
            else:
                spec.clear()
                raise RuntimeError(
                    f"API speculative execution: the model's answer {answer!r} does not follow "
                    "the text of the program's assistant turn; show the model the format (an "
                    "example, an instruction), or run without num_api_spec_tokens"
                )
        spec.clear()
        for term in terms:
            ex.append(term.text or "", term.name if term.is_gen else None)
            if term.is_gen:
                ex.set_var(term.name, term.text, {"speculated": True})
        ex.release_deferred()


class _NoSpec:
    num_tokens = None


def prompt_of(ex: StreamExecutor) -> Prompt:
    """The stream's state as a backend sees it."""
    role, start = ex.role if ex.role is not None else (None, len(ex.text))
    return Prompt(ex.text, list(ex.messages), role, ex.text[start:])
