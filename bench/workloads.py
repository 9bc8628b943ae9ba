"""The seven `radixflow bench` workloads: deterministic programs of generation calls.

Every workload is a generator of *rounds*. It yields a list of `Call`s (token ids, a fixed
`max_new_tokens`, greedy, EOS ignored), receives one result per call (the generated token ids
or their text, or the chosen option's index for a select call) and builds the next round from
them. A program with dependent steps (a chat turn, an agent step, a tree level) is one round
per step, so every system replays the same structure on its own outputs with the same token
counts.

Six workloads are *programs*, each written once, as data: a tuple of steps per program
(`Text` appends, `Gen` generates, `Select` picks an option, `Fork` splits into branches).
Both forms every system runs are derived from that one definition: the token-level rounds
(`program_rounds`, what the Engine and the baselines replay) and the `@function` program
(bench/dsl.py interprets the same steps through the DSL over a live server). So the two
cannot drift. long_mix has no program form: its long prompts arrive when the first chat has
produced N tokens, which only a caller stepping the scheduler sees.

Prompts are text, encoded whole, and a round's outputs join the next prompt as decoded text:
exactly what a DSL program sends over the wire (the server encodes the whole text it is
given), so both forms send the same prompts id for id.

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
# The text that joins a program's steps.
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
class Text:
    """Append `text` to every live branch."""

    text: str


@dataclass(frozen=True)
class Gen:
    """Generate `new` tokens (greedy, EOS ignored) on every live branch: one round."""

    new: int
    schema: str | None = None  # a JSON schema, where the system supports it


@dataclass(frozen=True)
class Select:
    """Pick one of `choices` (scored continuations) on every live branch: one round."""

    choices: tuple[str, ...]


@dataclass(frozen=True)
class Fork:
    """Split every live branch `width` ways; branch i (from 1) appends `label.format(i)`."""

    width: int
    label: str


Step = Text | Gen | Select | Fork
Program = tuple[Step, ...]  # one program of a workload; a workload's programs step alike


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
    programs: list[Program] = field(default_factory=list)  # the definition; [] for long_mix


def program_rounds(programs: list[Program], codec: Codec) -> Rounds:
    """The programs side by side, step by step: each `Gen` or `Select` is one round of every
    live branch of every program (program-major); its results join each branch as text."""
    assert len({len(p) for p in programs}) == 1, "a workload's programs step alike"
    branches = [[""] for _ in programs]  # per program: the text of each live branch
    for column in zip(*programs):  # the same step of every program
        assert len({type(step) for step in column}) == 1, f"programs step apart: {column}"
        if isinstance(column[0], Text):
            branches = [[b + s.text for b in bs] for s, bs in zip(column, branches)]
        elif isinstance(column[0], Fork):
            branches = [
                [b + s.label.format(i + 1) for b in bs for i in range(s.width)]
                for s, bs in zip(column, branches)
            ]
        else:
            calls = [_call(s, b, codec) for s, bs in zip(column, branches) for b in bs]
            results = iter((yield calls))
            branches = [
                [b + _joined(s, next(results), codec) for b in bs]
                for s, bs in zip(column, branches)
            ]


def _call(step: Gen | Select, text: str, codec: Codec) -> Call:
    if isinstance(step, Select):
        options = tuple(tuple(codec.encode(c)) for c in step.choices)
        return Call(tuple(codec.encode(text)), options=options)
    return Call(tuple(codec.encode(text)), step.new, step.schema)


def _joined(step: Gen | Select, result: Result, codec: Codec) -> str:
    """The text a round's result appends: the generation, or the chosen option."""
    return step.choices[result] if isinstance(step, Select) else codec.text(result)


def program_workload(name: str, programs: list[Program], codec: Codec) -> Workload:
    """A workload defined by its programs: its rounds are derived from them."""
    return Workload(name, len(programs), program_rounds(programs, codec), codec, programs)


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
    programs = [(Text(prefix + question()), Gen(new)) for _ in range(num_questions)]
    return program_workload("few_shot", programs, codec)


def multi_turn(codec: Codec, quick: bool, num_chats: int = 0) -> Workload:
    """Chats: each turn appends ~40 user tokens to the history and generates a reply.
    `num_chats` > 0 sets the number of chats (bench/contention.py's 32 programs)."""
    rng = random.Random(SEED + 1)
    default_chats, num_turns, new = (2, 2, 8) if quick else (16, 4, 32)
    num_chats = num_chats or default_chats
    system = chat_turn("system", "You are a helpful AI assistant named SmolLM.")
    users = [[""] * num_turns for _ in range(num_chats)]
    for turn in range(num_turns):
        for chat in range(num_chats):
            users[chat][turn] = chat_turn("user", sentence(rng, 30)) + ASSISTANT
    programs = [
        (Text(system), *(step for user in u for step in (Text(user), Gen(new), Text(END_TURN))))
        for u in users
    ]
    return program_workload("multi_turn", programs, codec)


def tree_of_thought(codec: Codec, quick: bool) -> Workload:
    """Each problem forks `width` ways, then each branch forks again (two levels)."""
    rng = random.Random(SEED + 2)
    num_problems, width, new = (1, 2, 8) if quick else (8, 3, 32)
    header = "Solve the problem step by step, exploring several approaches.\n\n"
    roots = [f"{header}Problem: {sentence(rng, 40)}\n" for _ in range(num_problems)]
    programs = [
        (Text(root), Fork(width, APPROACH), Gen(new), Fork(width, STEP), Gen(new)) for root in roots
    ]
    return program_workload("tree_of_thought", programs, codec)


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

    programs = [(Text(instruction + item()), Gen(new, PERSON_SCHEMA)) for _ in range(num_items)]
    return program_workload("json_decode", programs, codec)


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
    choices = tuple(f" {a}" for a in ACTIONS)  # a select continuation keeps its leading space

    def program(start: str, observed: list[str]) -> Program:
        steps: list[Step] = [Text(start)]
        for step, observation in enumerate(observed):
            steps += [Text(THOUGHT.format(step + 1)), Gen(new), Text(ACTION), Select(choices)]
            steps.append(Text(OBSERVATION.format(observation)))
        return tuple(steps)

    programs = [program(s, o) for s, o in zip(starts, observations)]
    return program_workload("agent", programs, codec)


def independent(codec: Codec, quick: bool, num_prompts: int = 0) -> Workload:
    """Unrelated prompts, long outputs: raw engine throughput, nothing to share.
    `num_prompts` > 0 sets the number of streams (the GPU check's 1, 64 and 256)."""
    rng = random.Random(SEED + 5)
    default_prompts, new = (4, 8) if quick else (64, 128)
    num_prompts = num_prompts or default_prompts
    programs = [(Text(sentence(rng, 20)), Gen(new)) for _ in range(num_prompts)]
    return program_workload("independent", programs, codec)


def long_mix(codec: Codec, quick: bool) -> Workload:
    """Short chats decoding while long prompts arrive one after another (chunked prefill).
    No program form: its long prompts arrive when the first chat has produced N tokens."""
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
