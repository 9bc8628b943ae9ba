"""Frontend DSL unit tests against a fake backend (no model, no server)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

import radixflow as sgl
from conftest import finishes
from radixflow.chat_template import ChatTemplateError, template_for_model
from radixflow.choices import ChoicesDecision
from radixflow.ir import Constant, ExprList, Gen, RoleBegin, RoleEnd, Select
from radixflow.sampling import resolve_sampling

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
SYSTEM_BLOCK = SYSTEM + "<|im_end|>\n"

# dsl-notes section 5's mock oracle, as per-token logprobs consistent with its numbers:
# means -0.1 / -0.2 / -0.05; greedy rows [-0.1]*8, [-0.1,-0.3,-0.2*6], ...; unconditional
# scores -0.1 / 0.5 / -0.05.
CHOICES = ["organ", "organism", "antidisestablishmentarianism"]
COND = [[-0.1], [-0.1, -0.3], [-0.1, -0.2, -0.02, -0.02, -0.02, -0.02, -0.01, -0.01]]
UNCOND = [[None], [None, -1.4], [None] + [0.0] * 7]


class FakeBackend:
    """Same methods as RuntimeEndpoint. Replies `reply(prompt, params)` (default: "<n>" with n
    the prompt length); raises for a prompt containing `fail_on`; records every call."""

    def __init__(self, reply: Any = None, fail_on: str | None = None, delay: float = 0.0):
        self.reply = reply or (lambda text, params: f"<{len(text)}>")
        self.fail_on, self.delay = fail_on, delay
        self.calls: list[tuple[str, Any, Any]] = []
        self.lock = threading.Lock()

    def _record(self, *call: Any) -> None:
        with self.lock:
            self.calls.append(call)

    def calls_of(self, kind: str) -> list[tuple[str, Any, Any]]:
        return [c for c in self.calls if c[0] == kind]

    def generate(self, text: str | None = None, sampling_params: Any = None, **kw: Any) -> Any:
        self._record("generate", text, {**sampling_params, **kw})
        time.sleep(self.delay)
        if self.fail_on and self.fail_on in text:
            raise RuntimeError(f"request failed on {self.fail_on!r}")
        out = self.reply(text, sampling_params)
        meta = {"prompt_tokens": len(text), "completion_tokens": len(out), "cached_tokens": 0}
        return {"text": out, "output_ids": [ord(c) for c in out], "meta_info": meta}

    def generate_stream(self, text: str | None = None, sampling_params: Any = None, **kw: Any):
        out = self.generate(text, sampling_params, **kw)["text"]
        for i in range(1, len(out) + 1):
            lp = [[-0.5, ord(out[i - 1]), None]]
            meta = {"completion_tokens": i, "output_token_logprobs": lp}
            yield {"text": out[:i], "output_ids": [], "meta_info": meta, "finished": False}
        yield {
            "text": out,
            "output_ids": [],
            "meta_info": {"completion_tokens": len(out)},
            "finished": True,
        }

    def score(self, prefix: str, continuations: list[str], unconditional: bool = False) -> Any:
        self._record("score", prefix, (list(continuations), unconditional))
        table = dict(zip(CHOICES, zip(COND, UNCOND)))
        out = []
        for c in continuations:
            cond, uncond = table.get(c.strip(), ([-1.0] * len(c), [-1.0] * len(c)))
            ids = list(range(len(cond)))
            out.append(
                {"token_ids": ids, "logprobs": cond, "text": c}
                | {"unconditional_logprobs": uncond if unconditional else None}
            )
        return out

    def cache_prefix(self, text: str) -> dict[str, Any]:
        self._record("cache_prefix", text, None)
        return {"prompt_tokens": len(text)}

    def model_info(self) -> dict[str, Any]:
        return {"model": "fake", "chat_template": SMOLLM2_TEMPLATE, "eos_token": "<|im_end|>"}

    def flush_cache(self) -> bool:
        self._record("flush_cache", None, None)
        return True

    def stats(self) -> dict[str, Any]:
        return {"cache_hit_rate": 0.5}

    def abort(self, rid: str) -> None:
        pass

    def health(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_import_leaves_torch_out() -> None:
    code = (
        "import sys, radixflow; radixflow.RuntimeEndpoint, radixflow.Runtime; "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_expressions_are_flat_and_frozen() -> None:
    expr = "Q: " + sgl.gen("a", 16, stop="\n") + " and " + sgl.select("b", ["x", "y"])
    assert isinstance(expr, ExprList) and len(expr.items) == 4
    assert expr.items[0] == Constant("Q: ")
    assert expr.items[1] == Gen("a", (("max_new_tokens", 16), ("stop", ("\n",))))
    assert isinstance(expr.items[3], Select) and expr.items[3].choices == ("x", "y")
    assert (expr + expr).items == expr.items * 2
    with pytest.raises(AttributeError):
        expr.items[1].name = "z"  # frozen
    assert sgl.user("hi").items == (RoleBegin("user"), Constant("hi"), RoleEnd("user"))
    assert sgl.assistant_begin() == RoleBegin("assistant")
    assert isinstance(sgl.gen("c", choices=["p", "q"]), Select)


def test_gen_validates_at_construction() -> None:
    with pytest.raises(re.error):
        sgl.gen("a", regex="[unclosed")
    with pytest.raises(TypeError):
        sgl.gen("a", not_a_param=1)
    with pytest.raises(ValueError):
        sgl.gen("a", json_schema="{not json")
    with pytest.raises(ValueError):
        sgl.select("a", [])
    schema = sgl.gen("a", json_schema={"type": "object"}).overrides()["json_schema"]
    assert json.loads(schema) == {"type": "object"}
    assert sgl.gen("a", seed=3, min_tokens=2).overrides() == {"seed": 3, "min_new_tokens": 2}


def test_resolve_sampling_defaults_dtype_and_template_stop() -> None:
    params, options = resolve_sampling(
        {"temperature": 0.0, "max_new_tokens": 5},
        {"max_new_tokens": 9, "dtype": int, "return_logprob": True},
        ("<|im_end|>",),
    )
    assert params["temperature"] == 0.0 and params["max_new_tokens"] == 9
    assert params["regex"] == sgl.REGEX_INT and params["stop"] == [" ", "\n", "<|im_end|>"]
    assert options == {"return_logprob": True}
    assert resolve_sampling({}, {"dtype": "bool"}, ())[0]["regex"] == sgl.REGEX_BOOL
    assert resolve_sampling({}, {"n": 2}, ())[0]["n"] == 2  # n samples, on every backend
    with pytest.raises(ValueError):
        resolve_sampling({}, {"dtype": list}, ())


@sgl.function
def qa(s: Any, question: str) -> None:
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=4, stop="\n")
    s += " (" + sgl.gen_int("n") + ")"


def test_run_sends_text_so_far_and_program_defaults() -> None:
    backend = FakeBackend()
    state = qa.run(question="why?", backend=backend, temperature=0, max_new_tokens=7)
    assert state["answer"] == "<10>"  # len("Q: why?\nA:")
    assert state.text() == "Q: why?\nA:<10> (<16>)"
    (_, text1, params1), (_, text2, params2) = backend.calls_of("generate")
    assert (text1, text2) == ("Q: why?\nA:", "Q: why?\nA:<10> (")
    assert params1["temperature"] == 0.0 and params1["max_new_tokens"] == 4
    assert params1["stop"] == ["\n", "<|im_end|>"]
    assert params2["max_new_tokens"] == 7 and params2["regex"] == sgl.REGEX_INT
    assert state.get_meta_info("answer")["prompt_tokens"] == 10
    assert qa("ok", backend=backend)["answer"] == "<8>"  # positional, __call__
    inline = qa.run(question="why?", backend=backend, use_thread=False, temperature=0)
    assert inline.text() == state.text()


def test_function_decorator_forms_bind_and_no_backend() -> None:
    @sgl.function()
    def greet(s: Any, name: str, punct: str = "!") -> str:
        s += "Hi " + name + punct
        return "done"

    backend = FakeBackend()
    state = greet.bind(name="Ann").run(backend=backend)
    assert state.text() == "Hi Ann!" and state.ret_value == "done"
    assert greet.arg_names == ["name", "punct"] and greet.arg_defaults == ["!"]
    with pytest.raises(ValueError):
        greet.bind(nope=1)
    with pytest.raises(TypeError):
        greet.run(backend=backend)  # missing argument: raised at the call
    with pytest.raises(RuntimeError, match="no backend"):
        greet.run("x")
    with pytest.raises(TypeError, match="named s"):
        sgl.function(lambda state: None)
    sgl.set_default_backend(backend)
    try:
        assert greet.run("Bo").text() == "Hi Bo!"
        assert sgl.flush_cache() is True and sgl.get_server_info()["cache_hit_rate"] == 0.5
    finally:
        sgl.set_default_backend(None)
    assert sgl.flush_cache() is False


def test_roles_follow_the_models_chat_template() -> None:
    @sgl.function
    def chat(s: Any) -> None:
        s += sgl.user("Hello")
        s += sgl.assistant(sgl.gen("reply", max_tokens=4))
        with s.user():
            s += "  Again"
        s += sgl.assistant_begin() + sgl.gen("reply2") + sgl.assistant_end()

    state = chat.run(backend=FakeBackend(reply=lambda t, p: "Hey"))
    user_block = "<|im_start|>user\nHello<|im_end|>\n"
    assert state.text().startswith(SYSTEM_BLOCK + user_block + "<|im_start|>assistant\nHey")
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert state.messages()[0]["content"] == SYSTEM.split("\n", 1)[1]
    assert state.messages()[3]["content"] == "Again"  # left-stripped only
    assert "<|im_start|>user\n  Again<|im_end|>\n" in state.text()


def test_own_template_and_system_first() -> None:
    @sgl.function
    def chat(s: Any) -> None:
        s += sgl.system("Be brief.") + sgl.user("Hi") + sgl.assistant(sgl.gen("r"))

    backend = FakeBackend(reply=lambda t, p: "Yo")
    state = chat.run(backend=backend, chat_template="default")
    assert state.text() == "SYSTEM:Be brief.\nUSER:Hi\nASSISTANT:Yo\n"
    assert backend.calls_of("generate")[0][2]["stop"] == []
    state = chat.run(backend=backend)  # ChatML, no default system prompt when one is given
    assert state.text().startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert len(state.messages()) == 3


def test_template_derivation_from_jinja() -> None:
    template = template_for_model({"chat_template": SMOLLM2_TEMPLATE})
    assert template.name == "chatml" and template.stop_str == ("<|im_end|>",)
    assert template.default_system_prompt == SYSTEM.split("\n", 1)[1]
    plain = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}"
    )
    assert template_for_model({"chat_template": plain}).default_system_prompt is None
    assert template_for_model({}).name == "default"
    broken = template_for_model({"model": "m1", "chat_template": "{{ raise_exception('no') }}"})
    with pytest.raises(ChatTemplateError, match="chat template of m1.*no"):
        broken.get_prefix_and_suffix("user")


def test_unusable_template_fails_role_programs_only() -> None:
    """A model template that cannot be split is an error naming it when a program uses a
    role, never a silent switch to another format; programs without roles still run."""

    class BrokenTemplateBackend(FakeBackend):
        def model_info(self) -> dict[str, Any]:
            return {"model": "m1", "chat_template": "{% if %}"}

    @sgl.function
    def chat(s: Any) -> None:
        s += sgl.user("Hi") + sgl.assistant(sgl.gen("a", max_tokens=2))

    state = chat.run(backend=BrokenTemplateBackend())
    assert isinstance(state.error(), ChatTemplateError) and "m1" in str(state.error())
    state = qa.run(question="2+2?", backend=BrokenTemplateBackend())
    assert state.error() is None and isinstance(state["answer"], str)


def test_nested_role_is_an_error() -> None:
    @sgl.function
    def bad(s: Any) -> None:
        s += sgl.user_begin() + sgl.assistant_begin()

    state = bad.run(backend=FakeBackend())
    assert isinstance(state.error(), ValueError)
    with pytest.raises(sgl.ProgramError):
        state.text()


def test_var_scope_and_set_var() -> None:
    @sgl.function
    def scoped(s: Any) -> None:
        s += "a"
        with s.var_scope("mid"):
            s += "b" + sgl.gen("g")
        s += "c"
        s["manual"] = 5

    state = scoped.run(backend=FakeBackend())
    assert state["mid"] == "b<2>" and state.text() == "ab<2>c"
    assert state["manual"] == 5 and "mid" in state
    with pytest.raises(KeyError):
        state["missing"]


def test_fork_caches_prefix_once_and_join_gathers_nested_lists() -> None:
    backend = FakeBackend(reply=lambda t, p: f"[{t.count('|')}]")

    @sgl.function
    def tree(s: Any) -> None:
        s += "root|"
        forks = s.fork(2)
        forks += lambda i: f"b{i}|"
        for branch in forks:
            leaves = branch.fork(3)
            leaves += [f"l{j}|" for j in range(3)]
            leaves += sgl.gen("leaf")
            leaves.join()
            branch += sgl.gen("summary")
        forks.join()
        s += "end"

    state = tree.run(backend=backend)
    assert state.text() == "root|end"
    assert state["leaf"] == [["[3]"] * 3] * 2  # nested lists: 2 branches x 3 leaves
    assert state["summary"] == ["[2]", "[2]"]
    cached = [c[1] for c in backend.calls_of("cache_prefix")]
    assert cached == ["root|", "root|b0|", "root|b1|"]  # one per fork, the shared text


def test_fork_branches_run_in_parallel_streams() -> None:
    backend = FakeBackend(delay=0.3)

    @sgl.function
    def parallel(s: Any) -> None:
        s += "x"
        forks = s.fork(4)
        forks += sgl.gen("y")
        forks.join()

    start = time.perf_counter()
    state = parallel.run(backend=backend)
    assert state["y"] == ["<1>"] * 4
    assert time.perf_counter() - start < 0.3 * 3, "branches ran one after another"


def test_join_concate_and_copy() -> None:
    @sgl.function
    def merge(s: Any) -> None:
        s += "P:"
        forks = s.fork(3)
        forks += [f"({i})" for i in range(3)]
        forks[1] += "+"
        forks.join("concate_and_append")
        with s.copy() as c:
            c += sgl.gen("side")
        s += "."

    state = merge.run(backend=FakeBackend())
    assert state.text() == "P:(0)(1)+(2)."
    assert state["side"] == ["<12>"]
    with pytest.raises(ValueError, match="join mode"):
        merge.run(backend=FakeBackend()).fork(2).join("bogus")


def test_run_batch_order_threads_and_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    backend = FakeBackend(reply=lambda t, p: t.split("#")[1], delay=0.01)

    @sgl.function
    def echo(s: Any, i: int, tag: str = "") -> None:
        s += f"#{i}{tag}#" + sgl.gen("out")

    states = echo.run_batch([{"i": i} for i in range(64)], backend=backend, progress_bar=True)
    assert [s["out"] for s in states] == [str(i) for i in range(64)]
    assert "64/64" in capsys.readouterr().err
    states = echo.run_batch([(i, "t") for i in range(5)], backend=backend, num_threads=2)
    assert [s["out"] for s in states] == [f"{i}t" for i in range(5)]
    gen_states = echo.run_batch([(1,), (2,)], backend=backend, generator_style=True)
    assert [s["out"] for s in gen_states] == ["1", "2"]
    assert echo.run_batch([], backend=backend) == []
    with pytest.raises(TypeError):
        echo.run_batch([(1, 2, 3)], backend=backend)


def test_failed_request_surfaces_without_hanging() -> None:
    backend = FakeBackend(fail_on="boom")

    @sgl.function
    def prog(s: Any) -> None:
        s += "boom" + sgl.gen("a") + sgl.gen("b")
        s += sgl.gen("c")

    state = finishes(lambda: prog.run(backend=backend))
    assert isinstance(finishes(state.error), RuntimeError)
    for read in (lambda: state["b"], lambda: state["c"], state.text):
        with pytest.raises(sgl.ProgramError) as info:
            finishes(read)
        assert isinstance(info.value.__cause__, RuntimeError)
    assert len(backend.calls_of("generate")) == 1  # later gens were skipped


def test_failed_branch_fails_parent_and_siblings_finish() -> None:
    backend = FakeBackend(fail_on="bad", delay=0.05)

    @sgl.function
    def prog(s: Any) -> None:
        s += "start "
        forks = s.fork(3)
        forks += ["ok", "bad", "ok"]
        forks += sgl.gen("x")
        forks.join()
        s += sgl.gen("after")

    state = finishes(lambda: prog.run(backend=backend))
    assert isinstance(finishes(state.error), RuntimeError)
    with pytest.raises(sgl.ProgramError):
        finishes(lambda: state["x"])
    assert "start " not in [c[1] for c in backend.calls_of("generate")]  # "after" skipped


def test_exception_in_body_surfaces_and_closes_branches() -> None:
    @sgl.function
    def prog(s: Any) -> None:
        s += "a" + sgl.gen("a")
        forks = s.fork(2)
        forks += sgl.gen("b")  # never joined: closed when the body ends
        raise KeyError("tool failed")

    state = finishes(lambda: prog.run(backend=FakeBackend()))
    assert isinstance(state.error(), KeyError)
    assert all(child.done.wait(5) for child in state.stream_executor.children)
    assert state["a"] == "<1>"  # produced before the failure
    with pytest.raises(sgl.ProgramError):
        state.text()

    @sgl.function
    def appends_none(s: Any) -> None:
        s += None

    assert isinstance(appends_none.run(backend=FakeBackend()).error(), ValueError)
    bad = qa.run(question=None, backend=FakeBackend())
    assert isinstance(bad.error(), TypeError)  # "Q: " + None inside the body


def test_choice_methods_on_mock_oracle() -> None:
    entries = [[[lp, i, None] for i, lp in enumerate(row)] for row in COND]
    uncond = [[[lp, i, None] for i, lp in enumerate(row)] for row in UNCOND]
    kwargs = {
        "choices": CHOICES,
        "normalized_prompt_logprobs": [sum(r) / len(r) for r in COND],
        "input_token_logprobs": entries,
        "output_token_logprobs": [[] for _ in CHOICES],
        "unconditional_token_logprobs": uncond,
    }
    assert kwargs["normalized_prompt_logprobs"] == pytest.approx([-0.1, -0.2, -0.05])
    decision = sgl.token_length_normalized(**kwargs)
    assert isinstance(decision, ChoicesDecision) and decision.decision == CHOICES[2]
    greedy = sgl.greedy_token_selection(**kwargs)
    assert greedy.decision == "organ"
    assert greedy.meta_info["greedy_logprob_matrix"][0] == [-0.1] * 8
    assert greedy.meta_info["greedy_logprob_matrix"][1] == pytest.approx([-0.1, -0.3] + [-0.2] * 6)
    unconditional = sgl.unconditional_likelihood_normalized(**kwargs)
    assert unconditional.decision == "organism"
    scores = unconditional.meta_info["normalized_unconditional_prompt_logprobs"]
    assert scores == pytest.approx([-0.1, 0.5, -0.05])


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        (sgl.token_length_normalized, CHOICES[2]),
        (sgl.greedy_token_selection, "organ"),
        (sgl.unconditional_likelihood_normalized, "organism"),
    ],
)
def test_select_scores_through_backend(method: Any, expected: str) -> None:
    backend = FakeBackend()

    @sgl.function
    def pick(s: Any) -> None:
        s += "Word: " + sgl.select("w", CHOICES, choices_method=method) + "."

    state = pick.run(backend=backend)
    assert state["w"] == expected and state.text() == f"Word: {expected}."
    ((_, prefix, (continuations, unconditional)),) = backend.calls_of("score")
    # token healing: the prefix's trailing space moves into every continuation
    assert prefix == "Word:" and continuations == [" " + c for c in CHOICES]
    assert unconditional is method.requires_unconditional_logprobs
    assert "input_token_logprobs" in state.get_meta_info("w")


def test_streaming_text_iter_and_async_iter() -> None:
    backend = FakeBackend(reply=lambda t, p: "abc", delay=0.05)

    @sgl.function
    def story(s: Any) -> None:
        s += "Once" + sgl.gen("a") + "|" + sgl.gen("b")

    state = story.run(backend=backend, stream=True)
    assert list(state.text_iter()) == ["Once", "a", "b", "c", "|", "a", "b", "c"]
    assert state["a"] == "abc" and state.text() == "Onceabc|abc"
    assert [m[0] for m in state.get_meta_info("b")["output_token_logprobs"]] == [-0.5] * 3

    state = story.run(backend=backend, stream=True)
    assert "".join(state.text_iter("b")) == "abc"

    async def collect() -> list[Any]:
        state = story.run(backend=backend, stream=True)
        return [x async for x in state.text_async_iter("a", return_meta_data=True)]

    chunks = asyncio.run(collect())
    assert [c for c, _ in chunks] == ["a", "b", "c"]
    assert all(len(meta["output_token_logprobs"]) == 1 for _, meta in chunks)
    state = story.run(backend=backend)  # not streaming: the final value once
    assert list(state.text_iter("a")) == ["abc"]
