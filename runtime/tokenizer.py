"""Tokenizer loading, model facts for clients, and incremental detokenization."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Tokens of left context decoded with the first new token, so a tokenizer that drops a
# leading space on the first token of a decode (SentencePiece) still emits it.
DETOKENIZE_CONTEXT = 5


# Model types whose tokenizer AutoTokenizer loads as the plain `tokenizers` backend when
# tokenizer_config.json names that class (transformers 5 maps no model-specific class over it
# for these; for others, qwen2 say, it may).
PLAIN_TOKENIZER_TYPES = frozenset({"llama"})


def plain_backend(model_dir: Path) -> bool:
    """Whether AutoTokenizer would load `model_dir`'s tokenizer as transformers' plain
    TokenizersBackend (what a GGUF file's converted llama-family tokenizer is): a
    tokenizer.json, tokenizer_config.json naming that class and no custom code, a model type
    of PLAIN_TOKENIZER_TYPES."""
    try:
        settings = json.loads((model_dir / "tokenizer_config.json").read_text())
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return (
        isinstance(settings, dict)
        and settings.get("tokenizer_class") == "TokenizersBackend"
        and "auto_map" not in settings
        and model_type in PLAIN_TOKENIZER_TYPES
        and (model_dir / "tokenizer.json").is_file()
    )


def load_tokenizer(model_dir: Path | str, chat_template: str = "") -> PreTrainedTokenizerBase:
    """The model's tokenizer; `chat_template` (a file, or a Jinja template string) replaces
    its chat template. Raises ValueError for a value that is neither.

    The class AutoTokenizer would pick, loaded directly where that is the plain backend
    (`plain_backend`): AutoTokenizer first reads the model's config through AutoConfig,
    whose imports (torch.distributed, sympy) cost 3-4 s of a server's start on 2 cores."""
    import transformers  # noqa: PLC0415 (transformers: heavy, see preload)

    model_dir = Path(model_dir)
    fast = transformers.PreTrainedTokenizerFast  # transformers 5: TokenizersBackend itself
    if fast.__name__ == "TokenizersBackend" and plain_backend(model_dir):
        tokenizer = fast.from_pretrained(str(model_dir))
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    if chat_template:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def preload() -> None:
    """Import what load_tokenizer needs (transformers, torch: seconds). The server calls it
    once it has started its scheduler process, so the two processes' imports run side by side
    instead of one after the other."""
    import transformers  # noqa: F401, PLC0415 (transformers: heavy, imported while the scheduler loads)


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file holding a Jinja template (or a tokenizer_config.json-style
    JSON with a `chat_template` key), or the template itself."""
    path = Path(value).expanduser()
    if len(value) < 4096 and path.is_file():
        text = path.read_text()
        if path.suffix == ".json":
            try:
                return json.loads(text)["chat_template"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"chat template file {path} has no 'chat_template' key") from e
        return text
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template string")


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, config: dict[str, Any]) -> tuple[int, ...]:
    """Every id that ends a generation: the tokenizer's EOS and the config's eos_token_id(s)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = config.get("eos_token_id")
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif isinstance(config_eos, list):
        ids.update(int(i) for i in config_eos)
    return tuple(sorted(ids))


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of output ids into text, never emitting half a UTF-8 character.

    `prompt_tail` gives the decoder left context; only text after it is returned.
    """

    tokenizer: PreTrainedTokenizerBase
    prompt_tail: list[int]
    skip_special_tokens: bool = True
    text: str = ""
    _read_offset: int = 0  # output ids already reflected in `text`

    def __post_init__(self) -> None:
        self.prompt_tail = list(self.prompt_tail[-DETOKENIZE_CONTEXT:])

    def update(self, output_ids: list[int], final: bool = False) -> str:
        """Advance to `output_ids`; return the full committed text so far."""
        new_ids = output_ids[self._read_offset :]
        if not new_ids:
            return self.text
        read = self._read_offset
        if read >= DETOKENIZE_CONTEXT:
            context = output_ids[read - DETOKENIZE_CONTEXT : read]
        else:
            context = self.prompt_tail[read:] + output_ids[:read]
        before = self._decode(context)
        after = self._decode(context + new_ids)
        new_text = after[len(before) :]
        if new_text.endswith("\ufffd") and not final:
            return self.text  # an incomplete UTF-8 sequence: wait for its next byte
        self.text += new_text
        self._read_offset = len(output_ids)
        return self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def trim_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Cut `text` at the earliest stop string; return (text, matched stop or None)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at != -1 and (best is None or at < best[0]):
            best = (at, stop)
    if best is None:
        return text, None
    return text[: best[0]], best[1]


def build_output(
    tokenizer: PreTrainedTokenizerBase,
    output_ids: list[int],
    input_ids: list[int],
    sampling: Any,
    finish_reason: dict[str, Any] | None,
    meta: dict[str, Any],
    *,
    return_logprob: bool = False,
    logprob_start_len: int = -1,
    top_logprobs_num: int = 0,
    output_logprobs: list[float] = (),
    input_logprobs: list[float | None] = (),
    output_top_logprobs: list[Any] = (),
    input_top_logprobs: list[Any] = (),
) -> dict[str, Any]:
    """A finished request's {text, output_ids, meta_info}, the same offline and served: the
    matched stop token is left out of the text, which is cut at the first stop string. The
    logprob entries are one per generated token, the matched stop token's too, as SGLang's
    are (`output_token_logprobs_length` == `completion_tokens`); OpenAI's shapes drop it."""
    ids = output_ids
    reason = finish_reason or {}
    if reason.get("type") == "stop" and type(reason.get("matched")) is int:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens)
    if sampling.stop:
        text, _ = trim_at_stop(text, sampling.stop)
    meta = dict(meta)
    if return_logprob:
        pairs = zip(output_logprobs, output_ids)
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in pairs]
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if logprob_start_len >= 0:
            pairs = zip(input_logprobs, input_ids[logprob_start_len:])
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in pairs]
        if top_logprobs_num:
            meta["output_top_logprobs"] = list(output_top_logprobs)
            meta["input_top_logprobs"] = list(input_top_logprobs)
    return {"text": text, "output_ids": list(output_ids), "meta_info": meta}
