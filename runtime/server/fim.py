"""Fill-in-the-middle prompts: which FIM tokens the served model has, and the token layout of
an insert (prefix, suffix, other files' text) for its family. Every door that completes code
(OpenAI's `suffix`, llama.cpp's `/infill`, Ollama's `suffix`) builds its prompt here.

The tokens come from the GGUF's metadata when it names them (llama.cpp's
`tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id`, read at load into model_info's
`fim_token_ids`), else from the vocabulary by each family's token strings (FAMILIES). A model
with neither gets a 400 naming the field that asked for an insert.

Layouts (ids; each text piece is tokenized on its own, as llama.cpp's /infill does, so a
prefix that grows keeps the ids it had):
- PSM (Qwen2.5-Coder, StarCoder2, DeepSeek-Coder, CodeLlama, and any GGUF naming its
  tokens): [BOS] context PRE prefix prompt SUF suffix MID.
- SPM (`--spm-infill`): [BOS] context SUF suffix PRE prefix prompt MID, llama.cpp's order;
  CodeLlama's own SPM is Meta's: BOS PRE SUF suffix MID prefix prompt.
- Codestral (mistral-common's encode_fim, always suffix first, no middle token):
  BOS context [SUFFIX] suffix [PREFIX] prefix prompt.
The context (other files) goes first, so it and everything before the suffix stay radix
cache hits while the user types: with the repository tokens (REP and SEP) it is llama.cpp's
repo-level pattern `REP myproject\\n (SEP filename\\n text)* SEP filename\\n`, else each
file's text after llama.cpp's `\\n\\n--- snippet ---\\n\\n` separator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixflow.runtime.server.http_request import HttpError

ROLES = ("pre", "suf", "mid", "pad", "rep", "sep")
SNIPPET = "\n\n--- snippet ---\n\n"  # llama.cpp's separator of context chunks without SEP
REPO = "myproject"  # llama.cpp's repository and current file names in its repo-level pattern
CURRENT_FILE = "filename"


@dataclass(frozen=True)
class Family:
    """A coder family's FIM token strings (role -> alternatives), order and end tokens."""

    name: str
    tokens: dict[str, tuple[str, ...]]
    order: str = "psm"  # psm, or "codestral" (always suffix first, no middle token)
    bos: bool = False  # its documented prompt starts with BOS
    ends: tuple[str, ...] = ()  # besides EOS and its FIM tokens


FAMILIES = (
    Family(
        "qwen2.5-coder",
        {r: (f"<|fim_{r}|>",) for r in ("prefix", "suffix", "middle", "pad")}
        | {"rep": ("<|repo_name|>",), "sep": ("<|file_sep|>",)},
        ends=("<|endoftext|>", "<|im_end|>"),
    ),
    Family(
        "starcoder2",
        {r: (f"<fim_{r}>",) for r in ("prefix", "suffix", "middle", "pad")}
        | {"rep": ("<repo_name>",), "sep": ("<file_sep>",)},
        ends=("<|endoftext|>",),
    ),
    Family(
        "codellama",
        {
            "prefix": ("▁<PRE>", "<PRE>"),
            "suffix": ("▁<SUF>", "<SUF>"),
            "middle": ("▁<MID>", "<MID>"),
        },  # fmt: skip
        bos=True,
        ends=("▁<EOT>", "<EOT>"),
    ),
    Family(
        "deepseek-coder",
        {
            "prefix": ("<｜fim▁begin｜>",),
            "suffix": ("<｜fim▁hole｜>",),
            "middle": ("<｜fim▁end｜>",),
        },  # fmt: skip
        bos=True,
        ends=("<｜end▁of▁sentence｜>", "<|EOT|>"),
    ),
    Family("codestral", {"prefix": ("[PREFIX]",), "suffix": ("[SUFFIX]",)}, "codestral", True),
)
FAMILY_ROLE = {"prefix": "pre", "suffix": "suf", "middle": "mid"}


@dataclass(frozen=True)
class Fim:
    """The served model's FIM tokens (ids, None where it has none) and how to lay them out."""

    family: str
    ids: dict[str, int | None]
    order: str
    bos: int | None  # prepended when the family's prompt starts with BOS
    stops: tuple[int, ...]  # ids that end an insert, besides the model's EOS


def token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the single token `text`, None when the vocabulary has no such token."""
    found = tokenizer.convert_tokens_to_ids(text)
    if found is None or (found == tokenizer.unk_token_id and text != tokenizer.unk_token):
        return None
    return int(found)


def find_fim(tokenizer: Any, model_info: dict[str, Any]) -> Fim | None:
    """The model's FIM tokens: the GGUF's when it names prefix, suffix and middle, else the
    first family whose prefix and suffix strings are tokens of its vocabulary; None if none."""
    named = {r: model_info.get("fim_token_ids", {}).get(r) for r in ROLES}
    if all(named[r] is not None for r in ("pre", "suf", "mid")):
        text = tokenizer.convert_ids_to_tokens(int(named["pre"]))
        family = next((f for f in FAMILIES if text in f.tokens["prefix"]), None)
        found = family_ids(tokenizer, family) if family else {}
        both = {r: found.get(r) if named[r] is None else named[r] for r in ROLES}
        return fim_of(tokenizer, family, both)  # the GGUF's ids, the rest by their strings
    for family in FAMILIES:
        ids = family_ids(tokenizer, family)
        if ids.get("pre") is not None and ids.get("suf") is not None:
            return fim_of(tokenizer, family, {r: ids.get(r) for r in ROLES})
    return None


def family_ids(tokenizer: Any, family: Family) -> dict[str, int | None]:
    """The ids of `family`'s FIM tokens in the vocabulary, by role (None: not a token)."""
    return {FAMILY_ROLE.get(r, r): first_id(tokenizer, t) for r, t in family.tokens.items()}


def first_id(tokenizer: Any, alternatives: tuple[str, ...]) -> int | None:
    return next((i for t in alternatives if (i := token_id(tokenizer, t)) is not None), None)


def fim_of(tokenizer: Any, family: Family | None, ids: dict[str, Any]) -> Fim:
    """A Fim of `family` (None: a GGUF's tokens of a family not listed: llama.cpp's PSM)."""
    ids = {r: None if i is None else int(i) for r, i in ids.items()}
    ends = [first_id(tokenizer, (t,)) for t in family.ends] if family else []
    stops = {i for i in (*ids.values(), *ends) if i is not None}
    bos = tokenizer.bos_token_id if family is not None and family.bos else None
    name, order = (family.name, family.order) if family else ("gguf", "psm")
    return Fim(name, ids, order, bos, tuple(sorted(stops)))


def context_ids(fim: Fim, encode: Callable[[str], list[int]], extra: list[dict]) -> list[int]:
    """Other files' text: llama.cpp's repo-level pattern where the model has REP and SEP."""
    if not extra:
        return []
    rep, sep = fim.ids["rep"], fim.ids["sep"]
    if rep is None or sep is None:
        return [i for chunk in extra for i in encode(SNIPPET) + encode(chunk["text"])]
    out = [rep, *encode(REPO + "\n")]
    for chunk in extra:
        out += [sep, *encode(chunk["filename"] + "\n"), *encode(chunk["text"])]
    return [*out, sep, *encode(CURRENT_FILE + "\n")]


def layout(
    fim: Fim,
    encode: Callable[[str], list[int]],
    prefix: str,
    suffix: str,
    extra: list[dict] | None = None,
    prompt: str = "",
    spm: bool = False,
) -> list[int]:
    """The prompt ids of an insert between `prefix` and `suffix` (see the module docstring);
    `prompt` continues the prefix (llama.cpp's /infill `prompt`)."""
    pre, suf, mid = fim.ids["pre"], fim.ids["suf"], fim.ids["mid"]
    head = ([fim.bos] if fim.bos is not None else []) + context_ids(fim, encode, extra or [])
    before, after = encode(prefix) + encode(prompt), encode(suffix)
    if fim.order == "codestral":
        return [*head, suf, *after, pre, *before]
    if spm and fim.family == "codellama":  # Meta's suffix-first order
        return [*head, pre, suf, *after, mid, *before]
    if spm:
        return [*head, suf, *after, pre, *before, mid]
    return [*head, pre, *before, suf, *after, mid]


def fim_prompt(
    server: Any, param: str, prefix: str, suffix: str, extra: list[dict] | None = None,
    prompt: str = "",
) -> tuple[list[int], list[int]]:  # fmt: skip
    """(prompt ids, stop token ids) of an insert on `server`'s model; a 400 naming `param`
    when the model has no FIM tokens."""
    fim = find_fim(server.tokenizer, server.model_info)
    if fim is None:
        why = "the model has no fill-in-the-middle tokens"
        raise HttpError(400, f"{param} (fill-in-the-middle) is not supported: {why}", param)

    def encode(text: str) -> list[int]:
        try:
            return server.tokenize(text) if text else []
        except ValueError as e:
            raise HttpError(400, str(e), param) from e

    ids = layout(fim, encode, prefix, suffix, extra, prompt, server.config.spm_infill)
    return ids, list(fim.stops)


def extra_chunks(value: Any, param: str = "input_extra") -> list[dict[str, str]]:
    """llama.cpp's input_extra: a list of {filename, text} objects (filename "tmp" if none)."""
    why = f"{param} must be a list of {{filename, text}} objects of strings"
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
        raise HttpError(400, why, param)
    chunks = [{"filename": c.get("filename", "tmp"), "text": c.get("text", "")} for c in value]
    if not all(isinstance(v, str) for c in chunks for v in c.values()):
        raise HttpError(400, why, param)
    return chunks
