"""Programs written exactly as for SGLang (only the import differs), end to end on SmolLM2
through one real server; plus the fork prefix-once and run_batch checks on the server. The
same server is an OpenAI API for sgl.OpenAI (its /v1): the same programs give the same text
as over the runtime endpoint, greedy, in chat and completion form; API speculative execution
saves calls (counted by the server's /metrics) and keeps the result; gen(n) and stop_regex
through every door."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

import radixflow as sgl
from conftest import emptied

IP_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"


@pytest.fixture(scope="module")
def runtime(shared_server: Any) -> Any:
    sgl.set_default_backend(
        emptied(shared_server)
    )  # its endpoint waits 300 s: 2 cores may be shared
    yield shared_server
    sgl.set_default_backend(None)


def test_mt_bench_roles(runtime: Any) -> None:
    @sgl.function
    def answer_mt_bench(s, question_1, question_2):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question_1)
        s += sgl.assistant(sgl.gen("answer_1"))
        with s.user():
            s += question_2
        with s.assistant():
            s += sgl.gen("answer_2")

    state = answer_mt_bench.run(
        question_1="Name a fruit.", question_2="Name another.", temperature=0, max_new_tokens=6
    )
    assert len(state.messages()) in (4, 5)
    roles = [m["role"] for m in state.messages()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert state.text().count("<|im_start|>") == 5 and state.text().endswith("<|im_end|>\n")
    assert state.get_meta_info("answer_1")["completion_tokens"] <= 6


def test_select_and_gen_choices(runtime: Any) -> None:
    @sgl.function
    def true_or_false(s, statement):
        s += "Determine whether the statement below is True or False.\n\n"
        s += "Statement: The capital of France is Paris.\nAnswer: True\n\n"
        s += "Statement: Fish can fly to the moon.\nAnswer: False\n\n"
        s += "Statement: " + statement + "\n"
        s += "Answer: " + sgl.select("answer", ["True", "False"])
        s += "\nConfidence: " + sgl.gen("level", choices=["high", "low"])

    state = true_or_false.run(statement="The capital of Germany is Berlin.")
    assert state["answer"] in ("True", "False") and state["level"] in ("high", "low")
    assert state.text().endswith(f"Answer: {state['answer']}\nConfidence: {state['level']}")
    meta = state.get_meta_info("answer")
    assert len(meta["normalized_prompt_logprobs"]) == 2


def test_regex_and_dtype(runtime: Any) -> None:
    @sgl.function
    def regex_gen(s):
        s += "Q: What is the IP address of the Google DNS servers?\n"
        s += "A: " + sgl.gen("answer", temperature=0, regex=IP_REGEX, max_tokens=16)

    assert re.fullmatch(IP_REGEX, regex_gen.run()["answer"])

    @sgl.function
    def dtype_gen(s):
        s += "Q: Which year was DNS invented?\n"
        s += "A: " + sgl.gen("int_res", dtype=int, max_tokens=6) + "\n"
        s += "Q: What is the value of pi?\n"
        s += "A: " + sgl.gen("float_res", dtype=float, max_tokens=6) + "\n"
        s += "Q: Is the sky blue?\n"
        s += "A: " + sgl.gen("bool_res", dtype=bool) + "\n"
        s += "Q: What is the name of the DNS protocol?\n"
        s += "A: " + sgl.gen_string("str_res", max_tokens=12) + "\n"

    state = dtype_gen.run(temperature=0)
    # the dtype regexes held (a prefix of one where max_tokens cut it): digits, not just text
    # that int() or float() would take
    assert re.fullmatch(r"[-+]?\d+", state["int_res"]), state["int_res"]
    assert re.fullmatch(r"[-+]?\d*\.?\d*", state["float_res"]), state["float_res"]
    assert re.search(r"\d", state["float_res"]), state["float_res"]
    assert state["bool_res"] in ("True", "False")
    assert re.fullmatch(r'"[\w\d\s]*"?', state["str_res"])  # closed unless cut at max_tokens


def test_parallel_decoding_fork_join(runtime: Any) -> None:
    @sgl.function
    def parallel_decoding(s, topic):
        s += "Act as a helpful assistant.\n"
        s += "USER: Give some tips for " + topic + ".\n"
        s += "ASSISTANT: Okay. Here are two tips for " + topic + ": 1. "
        s += sgl.gen("tip_1", max_tokens=6, stop=[".", "\n"]) + ". 2. "
        s += sgl.gen("tip_2", max_tokens=6, stop=[".", "\n"]) + ".\n"
        branches = s.fork(2)
        for i in range(2):
            branches[i] += f"Now, I expand tip {i + 1} into a detailed paragraph:\n"
            branches[i] += sgl.gen("detailed_tip", max_tokens=6, stop=["\n\n"])
        branches.join()
        s += "Expansion of tip 1: " + branches[0]["detailed_tip"] + "\n"
        s += "Expansion of tip 2: " + branches[1]["detailed_tip"] + "\n"
        s += "In summary," + sgl.gen("summary", max_tokens=6)

    state = parallel_decoding.run(topic="staying healthy", temperature=0)
    assert len(state["detailed_tip"]) == 2
    assert "Expansion of tip 2: " + state["detailed_tip"][1] in state.text()
    assert state.error() is None


def test_streaming_text_iter(runtime: Any) -> None:
    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=8))

    state = qa.run(question="What is the capital of Spain?", stream=True, temperature=0)
    chunks = list(state.text_iter("answer"))
    assert "".join(chunks) == state["answer"] and len(chunks) >= 2
    whole = qa.run(question="What is the capital of Spain?", stream=True, temperature=0)
    assert "".join(whole.text_iter()) == whole.text()
    assert whole["answer"] == state["answer"]


def test_json_schema(runtime: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}, "year": {"type": "integer"}},
        "required": ["city", "year"],
    }

    @sgl.function
    def city(s):
        s += "Give a city and the year it was founded as JSON.\n"
        s += sgl.gen("json", json_schema=json.dumps(schema), max_tokens=48, temperature=0)

    value = json.loads(city.run()["json"])
    assert isinstance(value["city"], str) and isinstance(value["year"], int)


def test_fork_of_8_prefills_shared_prefix_once(runtime: Any) -> None:
    shared = "Here is a list of facts about the sea.\n" + "".join(
        f"Fact {i}: the sea covers much of the planet and holds {i} kinds of fish.\n"
        for i in range(20)
    )

    @sgl.function
    def eight_branches(s):
        s += shared
        forks = s.fork(8)
        forks += lambda i: f"Branch {i}:" + sgl.gen("x", max_tokens=2, temperature=0)
        forks.join()

    assert sgl.flush_cache()
    before = sgl.get_server_info()
    state = eight_branches.run()
    assert len(state["x"]) == 8
    after = sgl.get_server_info()
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    prompt = runtime.get_tokenizer()(shared, add_special_tokens=False)["input_ids"]
    assert len(prompt) > 300
    # once for the shared prefix, then a few new tokens per branch (plus each one's 2 outputs)
    assert computed < len(prompt) + 8 * 16, (computed, len(prompt))


def test_run_batch_64_in_order_with_progress_bar(
    runtime: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    @sgl.function
    def count(s, i):
        s += f"Number {i}. The next number is" + sgl.gen("next", max_tokens=2)

    states = count.run_batch(
        [{"i": i} for i in range(64)], temperature=0, progress_bar=True, num_threads=64
    )
    assert len(states) == 64
    assert all(state.text().startswith(f"Number {i}.") for i, state in enumerate(states))
    assert all(isinstance(state["next"], str) for state in states)
    assert "64/64" in capsys.readouterr().err


# ---- sgl.OpenAI on the server's /v1; gen(n) and stop_regex on every door ----------------


@pytest.fixture(scope="module")
def chat(runtime: Any) -> sgl.OpenAI:
    return sgl.OpenAI("smollm2", base_url=runtime.url + "/v1", api_key="EMPTY")


@pytest.fixture(scope="module")
def completion(runtime: Any) -> sgl.OpenAI:
    return sgl.OpenAI("smollm2", is_chat_model=False, base_url=runtime.url + "/v1", api_key="x")


def calls_to(runtime: Any, route: str) -> int:
    """The server's count of answered requests on `route` (/metrics)."""
    text = httpx.get(runtime.url + "/metrics").text
    found = re.search(rf'radixflow:http_requests_total{{route="{route}",status="200"}} (\d+)', text)
    return int(found.group(1)) if found else 0


@sgl.function
def two_turns(s: Any, question: str) -> None:
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=16))
    s += sgl.user("Say it again in one word.")
    s += sgl.assistant(sgl.gen("again", max_tokens=6))


def test_chat_model_answers_as_the_runtime_endpoint(runtime: Any, chat: sgl.OpenAI) -> None:
    question = "What is the capital of France?"
    direct = two_turns.run(question=question, temperature=0, backend=runtime.endpoint)
    over_api = two_turns.run(question=question, temperature=0, backend=chat)
    assert over_api.error() is None, over_api.error()
    assert "Paris" in direct["answer"]
    assert (over_api["answer"], over_api["again"]) == (direct["answer"], direct["again"])
    # the endpoint's text carries SmolLM2's default system prompt; the server adds it to the
    # chat call's messages the same way
    assert over_api.messages() == direct.messages()[1:]


def test_anthropic_backend_on_our_messages_door_answers_as_the_endpoint(runtime: Any) -> None:
    """sgl.Anthropic against the server's own /v1/messages: the same greedy turns."""
    backend = sgl.Anthropic("smollm2", base_url=runtime.url, api_key="x", max_retries=0)
    question = "What is the capital of France?"
    direct = two_turns.run(question=question, temperature=0, backend=runtime.endpoint)
    before = calls_to(runtime, "/v1/messages")
    over_api = two_turns.run(question=question, temperature=0, backend=backend)
    assert over_api.error() is None, over_api.error()
    assert (over_api["answer"], over_api["again"]) == (direct["answer"], direct["again"])
    assert calls_to(runtime, "/v1/messages") == before + 2  # one call per assistant turn


FEW_SHOT = (
    "Country: France\nCapital: Paris\nLanguage: French\n\n"
    "Country: Japan\nCapital: Tokyo\nLanguage: Japanese\n\n"
    "Country: Germany\nCapital: Berlin\nLanguage: German\n\n"
)


def country(s: Any, name: str) -> None:
    s += FEW_SHOT + "Country: " + name + "\nCapital:" + sgl.gen("capital", stop="\n")
    s += "\nLanguage:" + sgl.gen("language", stop="\n")
    s += "\n\nCountry:" + sgl.gen("next", stop="\n")
    s += "\nCapital: " + sgl.select("guess", choices=["Madrid", "Rome", "Lisbon"])


plain, speculated = sgl.function(country), sgl.function(num_api_spec_tokens=48)(country)
VARIABLES = ("capital", "language", "next", "guess")


def test_completion_model_and_speculation_save_calls_not_text(
    runtime: Any, completion: sgl.OpenAI
) -> None:
    kwargs = {"name": "Italy", "temperature": 0, "max_new_tokens": 8}
    direct = plain.run(**kwargs, backend=runtime.endpoint)
    before = calls_to(runtime, "/v1/completions")
    over_api = plain.run(**kwargs, backend=completion)
    assert over_api.text() == direct.text()
    between = calls_to(runtime, "/v1/completions")
    spec = speculated.run(**kwargs, backend=completion)
    assert spec.text() == direct.text()
    after = calls_to(runtime, "/v1/completions")
    values = [direct[v] for v in VARIABLES]
    assert values[:2] == [" Rome", " Italian"]
    assert [over_api[v] for v in VARIABLES] == values == [spec[v] for v in VARIABLES]
    # a call per gen, one for select (echo + logprobs); speculated: the 3 gens in one call
    assert (between - before, after - between) == (4, 2)
    assert over_api.get_meta_info("guess")["normalized_prompt_logprobs"][1] == max(
        over_api.get_meta_info("guess")["normalized_prompt_logprobs"]
    )


@sgl.function(num_api_spec_tokens=32)
def scientist(s: Any, discovery: str) -> None:
    s += sgl.user("Who discovered gravity?")
    s += sgl.assistant("Name: Isaac Newton\nField: physics")
    s += sgl.user("Who discovered radium?")
    s += sgl.assistant("Name: Marie Curie\nField: chemistry")
    s += sgl.user(f"Who discovered {discovery}?")
    s += sgl.assistant("Name: " + sgl.gen("name", stop="\n") + "\nField: " + sgl.gen("field"))


def test_speculation_writes_a_chat_turn_in_one_call(runtime: Any, chat: sgl.OpenAI) -> None:
    before = calls_to(runtime, "/v1/chat/completions")
    state = scientist.run(discovery="penicillin", temperature=0, backend=chat)
    assert state.error() is None, state.error()
    assert calls_to(runtime, "/v1/chat/completions") - before == 1
    turn = state.messages()[-1]["content"]
    assert turn == f"Name: {state['name']}\nField: {state['field']}" and state["name"]
    # the turn is the model's one answer to the conversation (a call per gen is impossible
    # here: the chat API does not continue a started assistant message)
    client = openai.OpenAI(base_url=runtime.url + "/v1", api_key="x")
    reply = client.chat.completions.create(
        model="smollm2", messages=state.messages()[:-1], max_tokens=32, temperature=0
    )
    assert reply.choices[0].message.content == turn


@sgl.function
def samples(s: Any) -> None:
    s += SHARED + "Fact 20:" + sgl.gen("fact", max_tokens=4, n=4, temperature=1.0)


SHARED = "Here are facts about the sea.\n" + "".join(
    f"Fact {i}: the sea covers much of the planet and holds {i + 3} kinds of fish.\n"
    for i in range(10)
)


def test_gen_n_gives_n_samples_and_prefills_their_prefix_once(
    runtime: Any, completion: sgl.OpenAI
) -> None:
    http = sgl.RuntimeEndpoint(runtime.url)
    prompt = len(runtime.get_tokenizer()(SHARED, add_special_tokens=False)["input_ids"])
    assert prompt > 200
    for backend in (runtime.endpoint, http):
        assert backend.flush_cache()
        before = backend.stats()["prefill_tokens_computed"]
        state = samples.run(backend=backend)
        fact = state["fact"]
        assert isinstance(fact, list) and len(fact) == 4 and all(isinstance(f, str) for f in fact)
        assert state.text().endswith("Fact 20:" + fact[0])  # the text goes on with the first
        computed = backend.stats()["prefill_tokens_computed"] - before
        assert prompt <= computed < prompt + 4 * 8, (computed, prompt)  # once, not 4 times
    state = samples.run(backend=completion)
    assert len(state["fact"]) == 4 and all(isinstance(f, str) for f in state["fact"])


@sgl.function
def sentence(s: Any, stop_regex: str | None) -> None:
    s += "The capital of France is" + sgl.gen("rest", max_tokens=16, stop_regex=stop_regex)


def test_stop_regex_stops_at_its_match(runtime: Any, completion: sgl.OpenAI) -> None:
    pattern = r"[.!?]"
    full = sentence.run(stop_regex=None, temperature=0, backend=runtime.endpoint)["rest"]
    http = sgl.RuntimeEndpoint(runtime.url)
    for backend in (runtime.endpoint, http, completion):
        rest = sentence.run(stop_regex=pattern, temperature=0, backend=backend)["rest"]
        # ends at the first match: the match is kept (SGLang's), nothing follows it
        assert re.search(pattern, rest).end() == len(rest), (backend, rest)
        assert full.startswith(rest) and len(rest) < len(full), (rest, full)
