"""The seven `radixflow bench` workloads: deterministic programs of generation calls.

Every workload is a generator of *rounds*. It yields a list of `Call`s (token ids, a fixed
`max_new_tokens`, greedy, EOS ignored), receives one result per call (the generated token ids,
or the chosen option's index for a select call) and builds the next round from them. A
program with dependent steps (a chat turn, an agent step, a tree level) is one round per
step, so every system replays the same structure on its own outputs with the same token
counts. Prompts are token ids, built by concatenation, so all systems see identical ids.

    python programs/workloads.py           # sizes of each workload (full and --quick)

Sizes follow issue 9; `quick=True` is the CI smoke size.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass

SEED = 1234
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()

Encode = Callable[[str], list[int]]
Result = list[int] | int  # generated ids, or the index of the chosen option
Rounds = Generator[list["Call"], list[Result], None]


@dataclass(frozen=True)
class Call:
    """One generation (or select) request of a round."""

    input_ids: tuple[int, ...]
    max_new_tokens: int = 0
    json_schema: str | None = None  # constrained where the system supports it
    options: tuple[tuple[int, ...], ...] = ()  # non-empty: score these continuations instead
    after_tokens: int = 0  # arrives once the round's first call has generated this many tokens


@dataclass
class Workload:
    name: str
    num_programs: int
    rounds: Rounds


def sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words)).capitalize() + "."


def chat_turn(role: str, text: str) -> str:
    """One ChatML turn (SmolLM2's template), ending where the model's reply would start."""
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def few_shot(encode: Encode, quick: bool) -> Workload:
    """MMLU-style: questions behind one long few-shot prefix."""
    rng = random.Random(SEED)
    num_shots, num_questions, new = (3, 4, 4) if quick else (16, 64, 16)

    def question() -> str:
        options = "".join(f"\n{c}. {sentence(rng, 3)}" for c in "ABCD")
        return f"Question: {sentence(rng, 14)}{options}\nAnswer:"

    shots = "".join(f"{question()} {rng.choice('ABCD')}\n\n" for _ in range(num_shots))
    prefix = encode("The following are multiple choice questions about history.\n\n" + shots)

    def rounds() -> Rounds:
        yield [Call(tuple(prefix + encode(question())), new) for _ in range(num_questions)]

    return Workload("few_shot", num_questions, rounds())


def multi_turn(encode: Encode, quick: bool) -> Workload:
    """Chats: each turn appends ~40 user tokens to the history and generates a reply."""
    rng = random.Random(SEED + 1)
    num_chats, num_turns, new = (2, 2, 8) if quick else (16, 4, 32)
    system = chat_turn("system", "You are a helpful AI assistant named SmolLM.")

    def user() -> list[int]:
        return encode(chat_turn("user", sentence(rng, 30)) + "<|im_start|>assistant\n")

    def rounds() -> Rounds:
        history = [encode(system) + user() for _ in range(num_chats)]
        for turn in range(num_turns):
            outputs = yield [Call(tuple(h), new) for h in history]
            if turn + 1 < num_turns:
                history = [
                    h + out + encode("<|im_end|>\n") + user() for h, out in zip(history, outputs)
                ]

    return Workload("multi_turn", num_chats, rounds())


def tree_of_thought(encode: Encode, quick: bool) -> Workload:
    """Each problem forks `width` ways, then each branch forks again (two levels)."""
    rng = random.Random(SEED + 2)
    num_problems, width, new = (1, 2, 8) if quick else (8, 3, 32)
    header = "Solve the problem step by step, exploring several approaches.\n\n"

    def rounds() -> Rounds:
        roots = [encode(f"{header}Problem: {sentence(rng, 40)}\n") for _ in range(num_problems)]
        level: list[list[int]] = [
            root + encode(f"Approach {i + 1}:") for root in roots for i in range(width)
        ]
        for depth in range(2):
            outputs = yield [Call(tuple(p), new) for p in level]
            if depth == 0:
                level = [
                    p + out + encode(f"\nStep {j + 1} of this approach:")
                    for p, out in zip(level, outputs)
                    for j in range(width)
                ]

    return Workload("tree_of_thought", num_problems, rounds())


PERSON_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer"},
            "city": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    }
)


def json_decode(encode: Encode, quick: bool) -> Workload:
    """Extractions into a JSON schema behind one ~300-token shared instruction."""
    rng = random.Random(SEED + 3)
    num_items, new = (2, 24) if quick else (32, 48)
    rules = " ".join(sentence(rng, 12) for _ in range(2 if quick else 20))
    instruction = (
        "Extract the person described in the text as JSON with the keys name, age and city. "
        f"Follow these rules. {rules}\n\n"
    )

    def item() -> str:
        name = rng.choice(["Ada", "Lin", "Omar", "Sofia", "Kenji", "Maya"])
        city = rng.choice(["Paris", "Lagos", "Lima", "Osaka", "Oslo", "Pune"])
        return (
            f"Text: {sentence(rng, 10)} {name} is {rng.randint(18, 90)} years old and lives in "
            f"{city}. {sentence(rng, 10)}\nJSON:"
        )

    def rounds() -> Rounds:
        yield [
            Call(tuple(encode(instruction + item())), new, PERSON_SCHEMA) for _ in range(num_items)
        ]

    return Workload("json_decode", num_items, rounds())


ACTIONS = ("search", "calculate", "lookup", "finish")


def agent(encode: Encode, quick: bool) -> Workload:
    """Agents: each step thinks (generation), picks an action (select), gets an observation."""
    rng = random.Random(SEED + 4)
    num_agents, num_steps, new = (2, 2, 8) if quick else (16, 4, 24)
    tools = "Tools: " + ", ".join(f"{a} ({sentence(rng, 8)})" for a in ACTIONS) + "\n"
    options = tuple(tuple(encode(f" {a}")) for a in ACTIONS)

    def rounds() -> Rounds:
        traces = [encode(f"{tools}Task: {sentence(rng, 24)}\n") for _ in range(num_agents)]
        for step in range(num_steps):
            traces = [t + encode(f"Thought {step + 1}:") for t in traces]
            thoughts = yield [Call(tuple(t), new) for t in traces]
            traces = [t + out + encode("\nAction:") for t, out in zip(traces, thoughts)]
            chosen = yield [Call(tuple(t), options=options) for t in traces]
            traces = [
                t + list(options[c]) + encode(f"\nObservation: {sentence(rng, 20)}\n")
                for t, c in zip(traces, chosen)
            ]

    return Workload("agent", num_agents, rounds())


def independent(encode: Encode, quick: bool) -> Workload:
    """Unrelated prompts, long outputs: raw engine throughput, nothing to share."""
    rng = random.Random(SEED + 5)
    num_prompts, new = (4, 8) if quick else (64, 128)

    def rounds() -> Rounds:
        yield [Call(tuple(encode(sentence(rng, 20))), new) for _ in range(num_prompts)]

    return Workload("independent", num_prompts, rounds())


def long_mix(encode: Encode, quick: bool) -> Workload:
    """Short chats decoding while long prompts arrive one after another (chunked prefill)."""
    rng = random.Random(SEED + 6)
    num_chats, chat_new, num_long, long_words, long_new, gap = (
        (2, 24, 1, 300, 4, 8) if quick else (16, 128, 4, 3000, 16, 24)
    )

    def rounds() -> Rounds:
        chats = [Call(tuple(encode(sentence(rng, 30))), chat_new) for _ in range(num_chats)]
        longs = [
            Call(tuple(encode(sentence(rng, long_words))), long_new, after_tokens=gap * (i + 1))
            for i in range(num_long)
        ]
        yield chats + longs

    return Workload("long_mix", num_chats + num_long, rounds())


WORKLOADS: dict[str, Callable[[Encode, bool], Workload]] = {
    "few_shot": few_shot,
    "multi_turn": multi_turn,
    "tree_of_thought": tree_of_thought,
    "json_decode": json_decode,
    "agent": agent,
    "independent": independent,
    "long_mix": long_mix,
}


Ids = tuple[int, ...]


def best_hit_rate(rounds: list[tuple[list[Ids], list[Ids]]]) -> float:
    """The most of the prompt tokens a perfect, unbounded prefix cache could reuse. `rounds`
    holds each round's (prompts, finished sequences): a prompt may share with the round's other
    prompts and with every sequence of earlier rounds, generated tokens included (their KV
    exists). 1 - (new nodes of the token trie) / (prompt tokens)."""
    nodes: dict[tuple[int, int], int] = {}  # (parent node, token) -> node; the root is 0

    def insert(seq: Ids) -> int:
        node, before = 0, len(nodes)
        for token in seq:
            node = nodes.setdefault((node, token), len(nodes) + 1)
        return len(nodes) - before

    total = computed = 0
    for prompts, finished in rounds:
        total += sum(map(len, prompts))
        computed += sum(map(insert, prompts))
        for seq in finished:
            insert(seq)
    return 1.0 - computed / total if total else 0.0


def prompts_of(calls: list[Call]) -> list[Ids]:
    """Every sequence a round prefills: a select call scores each option after its prompt."""
    return [c.input_ids + o for c in calls for o in (c.options or ((),))]


def echo_outputs(calls: list[Call]) -> list[Result]:
    """Stand-in results (a fixed token per position, option 0) to walk a workload offline."""
    return [0 if c.options else [42] * c.max_new_tokens for c in calls]


def describe(name: str, encode: Encode, quick: bool) -> dict[str, float]:
    """Rounds, prefills and token counts of a workload, walked with `echo_outputs`."""
    workload = WORKLOADS[name](encode, quick)
    rounds: list[tuple[list[Ids], list[Ids]]] = []
    new_tokens, calls = 0, next(workload.rounds)
    while True:
        outputs = echo_outputs(calls)
        finished = [c.input_ids + tuple(o) for c, o in zip(calls, outputs) if not c.options]
        rounds.append((prompts_of(calls), finished))
        new_tokens += sum(c.max_new_tokens for c in calls)
        try:
            calls = workload.rounds.send(outputs)
        except StopIteration:
            break
    prompts = [p for round_prompts, _ in rounds for p in round_prompts]
    return {
        "programs": workload.num_programs,
        "rounds": len(rounds),
        "prefills": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "new_tokens": new_tokens,
        "best_hit_rate": round(best_hit_rate(rounds), 3),
    }


if __name__ == "__main__":
    from radixflow.runtime.loader import resolve_model_dir
    from radixflow.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir("smollm2"))

    def encode_text(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    for quick in (False, True):
        for workload_name in WORKLOADS:
            print(
                "quick" if quick else "full ",
                workload_name,
                describe(workload_name, encode_text, quick),
            )
