"""How a gen's arguments become a request: run() defaults merged with the gen's own, dtype
as a regex, the chat template's stop strings added, logprob options split off."""

from __future__ import annotations

import logging
from typing import Any

from radixflow.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

logger = logging.getLogger(__name__)

LOGPROB_OPTIONS = ("return_logprob", "logprob_start_len", "top_logprobs_num")
DTYPE_REGEX = {
    "int": (REGEX_INT, (" ", "\n")),
    "float": (REGEX_FLOAT, (" ", "\n")),
    "str": (REGEX_STR, ()),
    "bool": (REGEX_BOOL, ()),
}


def resolve_sampling(
    defaults: dict[str, Any], overrides: dict[str, Any], stop_str: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Merge run() defaults with a gen's overrides -> (wire sampling params, logprob options).
    dtype becomes a regex; the template's stop strings are added. Raises ValueError for an
    unknown dtype."""
    params = {**defaults, **overrides}
    options = {k: params.pop(k) for k in LOGPROB_OPTIONS if k in params}
    params.pop("return_text_in_logprobs", None)  # entries carry token text None
    stop = list(params.get("stop") or ())
    dtype = params.pop("dtype", None)
    if dtype is not None:
        key = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", repr(dtype))
        if key not in DTYPE_REGEX:
            raise ValueError(f"unsupported dtype {dtype!r}; use int, float, str or bool")
        if params.get("regex"):
            logger.warning("gen got both dtype and regex; dtype=%s wins", key)
        params["regex"], extra_stop = DTYPE_REGEX[key]
        stop += extra_stop
    params["stop"] = list(dict.fromkeys(stop + list(stop_str)))
    # Names were checked by gen(); values are validated once, where the request enters the
    # runtime (server or Engine), and come back as a clear error.
    return params, options
