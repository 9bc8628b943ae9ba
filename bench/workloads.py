"""The seven `radixflow bench` workloads: deterministic programs of generation calls.

Every workload is a generator of *rounds*. It yields a list of `Call`s (token ids, a fixed
`max_new_tokens`, greedy, EOS ignored), receives one result per call (the generated token ids
or their text, or the chosen option's index for a select call) and builds the next round from
them. A program with dependent steps (a chat turn, an agent step, a tree level) is one round
per step, so every system replays the same structure on its own outputs with the same token
counts.

Prompts are text, encoded whole, and a round's outputs join the next prompt as decoded text:
exactly what a DSL program sends over the wire (the server encodes the whole text it is
given). So the token-level rounds and the `@function` forms in bench/dsl.py, which take
`Workload.programs` as their arguments, describe the same prompts id for id.

    python -m radixflow.bench.workloads     # sizes of each workload (full and --quick)

Sizes follow issue 9; `quick=True` is the CI smoke size.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

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
# The text that joins a program's steps; bench/dsl.py appends the same strings.
ASSISTANT = "<|im_start|>assistant\n"
END_TURN = "<|im_end|>\n"
APPROACH = "Approach {}:"
STEP = "\nStep {} of this approach:"
THOUGHT = "Thought {}:"
ACTION = "\nAction:"
OBSERVATION = "\nObservation: {}\n"

Result = list[int] | str | int  # generated ids (or their text), or the chosen option's index
Rounds = Generator[list["Call"], list[Result], None]


@dataclass(frozen=True)
class Codec:
    """The server's own text rules: encode without special tokens, decode skipping them (what
    a finished request's text is), so a program's text and a round's ids agree."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]

    def text(self, out: Result) -> str:
        """A generation's result as the text a program would append."""
        return out if isinstance(out, str) else self.decode(list(out))


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
    codec: Codec
    programs: list[dict[str, Any]] = field(default_factory=list)  # arguments of the DSL form


def sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words)).capitalize() + "."


def chat_turn(role: str, text: str) -> str:
    """One ChatML turn (SmolLM2's template), ending where the model's reply would start."""
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def few_shot(codec: Codec, quick: bool) -> Workload:
    """MMLU-style: questions behind one long few-shot prefix."""
    rng = random.Random(SEED)
    num_shots, num_questions, new = (3, 4, 4) if quick else (16, 64, 16)

    def question() -> str:
        options = "".join(f"\n{c}. {sentence(rng, 3)}" for c in "ABCD")
        return f"Question: {sentence(rng, 14)}{options}\nAnswer:"

    shots = "".join(f"{question()} {rng.choice('ABCD')}\n\n" for _ in range(num_shots))
    prefix = "The following are multiple choice questions about history.\n\n" + shots
    programs = [{"prompt": prefix + question(), "new": new} for _ in range(num_questions)]

    def rounds() -> Rounds:
        yield [Call(tuple(codec.encode(p["prompt"])), new) for p in programs]

    return Workload("few_shot", num_questions, rounds(), codec, programs)


def multi_turn(codec: Codec, quick: bool) -> Workload:
    """Chats: each turn appends ~40 user tokens to the history and generates a reply."""
    rng = random.Random(SEED + 1)
    num_chats, num_turns, new = (2, 2, 8) if quick else (16, 4, 32)
    system = chat_turn("system", "You are a helpful AI assistant named SmolLM.")
    users = [[""] * num_turns for _ in range(num_chats)]
    for turn in range(num_turns):
        for chat in range(num_chats):
            users[chat][turn] = chat_turn("user", sentence(rng, 30)) + ASSISTANT
    programs = [{"system": system, "users": u, "new": new} for u in users]

    def rounds() -> Rounds:
        history = [system + u[0] for u in users]
        for turn in range(num_turns):
            outputs = yield [Call(tuple(codec.encode(h)), new) for h in history]
            if turn + 1 < num_turns:
                history = [
                    h + codec.text(out) + END_TURN + u[turn + 1]
                    for h, out, u in zip(history, outputs, users)
                ]

    return Workload("multi_turn", num_chats, rounds(), codec, programs)


def tree_of_thought(codec: Codec, quick: bool) -> Workload:
    """Each problem forks `width` ways, then each branch forks again (two levels)."""
    rng = random.Random(SEED + 2)
    num_problems, width, new = (1, 2, 8) if quick else (8, 3, 32)
    header = "Solve the problem step by step, exploring several approaches.\n\n"
    roots = [f"{header}Problem: {sentence(rng, 40)}\n" for _ in range(num_problems)]
    programs = [{"root": root, "width": width, "new": new} for root in roots]

    def rounds() -> Rounds:
        level = [root + APPROACH.format(i + 1) for root in roots for i in range(width)]
        for depth in range(2):
            outputs = yield [Call(tuple(codec.encode(p)), new) for p in level]
            if depth == 0:
                level = [
                    p + codec.text(out) + STEP.format(j + 1)
                    for p, out in zip(level, outputs)
                    for j in range(width)
                ]

    return Workload("tree_of_thought", num_problems, rounds(), codec, programs)


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


def json_decode(codec: Codec, quick: bool) -> Workload:
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

    programs = [
        {"prompt": instruction + item(), "new": new, "schema": PERSON_SCHEMA}
        for _ in range(num_items)
    ]

    def rounds() -> Rounds:
        yield [Call(tuple(codec.encode(p["prompt"])), new, PERSON_SCHEMA) for p in programs]

    return Workload("json_decode", num_items, rounds(), codec, programs)


ACTIONS = ("search", "calculate", "lookup", "finish")


def agent(codec: Codec, quick: bool) -> Workload:
    """Agents: each step thinks (generation), picks an action (select), gets an observation."""
    rng = random.Random(SEED + 4)
    num_agents, num_steps, new = (2, 2, 8) if quick else (16, 4, 24)
    tools = "Tools: " + ", ".join(f"{a} ({sentence(rng, 8)})" for a in ACTIONS) + "\n"
    starts = [f"{tools}Task: {sentence(rng, 24)}\n" for _ in range(num_agents)]
    observations = [[""] * num_steps for _ in range(num_agents)]
    for step in range(num_steps):
        for k in range(num_agents):
            observations[k][step] = sentence(rng, 20)
    choices = [f" {a}" for a in ACTIONS]  # a select continuation keeps its leading space
    options = tuple(tuple(codec.encode(c)) for c in choices)
    programs = [
        {"start": s, "observations": o, "choices": choices, "new": new}
        for s, o in zip(starts, observations)
    ]

    def rounds() -> Rounds:
        traces = list(starts)
        for step in range(num_steps):
            traces = [t + THOUGHT.format(step + 1) for t in traces]
            thoughts = yield [Call(tuple(codec.encode(t)), new) for t in traces]
            traces = [t + codec.text(out) + ACTION for t, out in zip(traces, thoughts)]
            chosen = yield [Call(tuple(codec.encode(t)), options=options) for t in traces]
            traces = [
                t + choices[c] + OBSERVATION.format(obs[step])
                for t, c, obs in zip(traces, chosen, observations)
            ]

    return Workload("agent", num_agents, rounds(), codec, programs)


def independent(codec: Codec, quick: bool, num_prompts: int = 0) -> Workload:
    """Unrelated prompts, long outputs: raw engine throughput, nothing to share.
    `num_prompts` > 0 sets the number of streams (the GPU check's 1, 64 and 256)."""
    rng = random.Random(SEED + 5)
    default_prompts, new = (4, 8) if quick else (64, 128)
    num_prompts = num_prompts or default_prompts
    programs = [{"prompt": sentence(rng, 20), "new": new} for _ in range(num_prompts)]

    def rounds() -> Rounds:
        yield [Call(tuple(codec.encode(p["prompt"])), new) for p in programs]

    return Workload("independent", num_prompts, rounds(), codec, programs)


def long_mix(codec: Codec, quick: bool) -> Workload:
    """Short chats decoding while long prompts arrive one after another (chunked prefill).
    No DSL form: its long prompts arrive when the first chat has produced N tokens, which
    only a caller stepping the scheduler sees."""
    rng = random.Random(SEED + 6)
    num_chats, chat_new, num_long, long_words, long_new, gap = (
        (2, 24, 1, 300, 4, 8) if quick else (16, 128, 4, 3000, 16, 24)
    )

    def rounds() -> Rounds:
        chats = [Call(tuple(codec.encode(sentence(rng, 30))), chat_new) for _ in range(num_chats)]
        longs = [
            Call(
                tuple(codec.encode(sentence(rng, long_words))),
                long_new,
                after_tokens=gap * (i + 1),
            )
            for i in range(num_long)
        ]
        yield chats + longs

    return Workload("long_mix", num_chats + num_long, rounds(), codec)


WORKLOADS: dict[str, Callable[[Codec, bool], Workload]] = {
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


def describe(name: str, codec: Codec, quick: bool) -> dict[str, float]:
    """Rounds, prefills and token counts of a workload, walked with `echo_outputs`."""
    workload = WORKLOADS[name](codec, quick)
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


def server_codec(tokenizer: Any) -> Codec:
    """The Codec of a Hugging Face tokenizer, by the server's rules."""
    return Codec(
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )


if __name__ == "__main__":
    from radixflow.runtime.models.loader import resolve_model_dir
    from radixflow.runtime.tokenizer import load_tokenizer

    codec = server_codec(load_tokenizer(resolve_model_dir("smollm2")))
    for quick in (False, True):
        for workload_name in WORKLOADS:
            sizes = describe(workload_name, codec, quick)
            print("quick" if quick else "full ", workload_name, sizes)
