"""HTTP request bodies: SGLang's and the router's field tables, validation of `/generate`
bodies into typed `Generate` messages, and errors in OpenAI's shape (`HttpError`, statuses of
the protocol's error codes). Shared by the native routes (http_api.py) and the OpenAI routes
(openai_api.py); aiohttp appears only in `error_response` / `json_response`.

The door is tolerant, as vLLM's is: a field no table here knows is ignored, with a warning
once per name; a known field at a value this server cannot honour is refused (400).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from radixflow.runtime.protocol import messages as m
from radixflow.runtime.protocol.messages import Generate
from radixflow.runtime.protocol.sampling import SamplingParams
from radixflow.runtime.server.fields import FieldError, translate
from radixflow.runtime.server.validation import GENERATION_ROUTES

log = logging.getLogger("radixflow.server")

STATUS_OF_CODE = {
    m.ERROR_BAD_MESSAGE: 400,
    m.ERROR_INVALID_REQUEST: 400,
    m.ERROR_DUPLICATE_RID: 400,
    m.ERROR_FAILED: 400,  # the scheduler refused it: a bad grammar, a prompt that cannot fit
    m.ERROR_UNAUTHORIZED: 401,
    m.ERROR_TOO_LARGE: 413,
    m.ERROR_UNAVAILABLE: 503,
    m.ERROR_SHUTDOWN: 503,
    m.ERROR_INTERNAL: 500,
}
TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# /generate fields SGLang's clients and its router send that change nothing here at these
# values (None, the default, or an empty list or map: `is_noop`); any other value is refused
# as unsupported.
GENERATE_NOOP = {
    "model": None,
    "log_metrics": None,  # any bool: metrics are always kept
    "no_logs": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "background": False,
    "return_bytes": False,
    "return_entropy": False,
    "return_prompt_token_ids": False,
    "video_data": None,
    "audio_data": None,
    "input_embeds": None,
    "modalities": None,
    "session_params": None,
    "lora_id": None,  # SGLang's internal id of an adapter; requests name it by lora_path
    "custom_logit_processor": None,
    "token_ids_logprob": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "data_parallel_rank": None,
    "extra_key": None,
    "custom_labels": None,
    "routing_key": None,
    "conversation_id": None,
}
ANY_BOOL = ("log_metrics", "no_logs")
ANY_VALUE = ("model",)  # the router adds model=None; /generate serves the one model anyway
GENERATE_FIELDS = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "stream",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "priority",
    "lora_path",  # a loaded LoRA adapter's name, or a list of them (None: the base), per prompt
    "image_data",
}
# sampling_params names of SGLang's that are no-ops here at these values
SAMPLING_NOOP = {
    "spaces_between_special_tokens": None,  # any bool: fast tokenizers ignore it
    "stream_interval": None,  # any value: every step's tokens are streamed
    "no_stop_trim": False,
    "custom_params": None,
    "beam_width": None,
}
SAMPLING_ANY = ("spaces_between_special_tokens", "stream_interval")
# sampling_params names honoured (SamplingParams' own, and SGLang's other spellings)
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} | {
    "max_tokens",
    "sampling_seed",
}
NO_OP_EMPTY = ([], {})  # what clients send for "none" of a list or map field (tools: [])
MAX_LOGGED_NAME = 80


class HttpError(Exception):
    """An HTTP error answer (status and OpenAI's error fields)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: Any = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def request_error(e: Exception) -> HttpError:
    """A server RequestError (or error reply) as an HttpError."""
    code = getattr(e, "code", m.ERROR_INVALID_REQUEST)
    return HttpError(STATUS_OF_CODE.get(code, 400), str(e), code=code)


def error_body(status: int, message: str, param: str | None = None, code: Any = None) -> dict:
    kind = TYPE_OF_STATUS.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or status}}


def error_response(e: HttpError) -> web.Response:
    return web.json_response(error_body(e.status, str(e), e.param, e.code), status=e.status)


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def json_response(value: Any, status: int = 200) -> web.Response:
    return web.json_response(value, status=status, dumps=dumps)


# ---- sinks: where a request's replies wait for their handler ----------------------------


def new_rid() -> str:
    return uuid.uuid4().hex


async def prepend(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first`, then what `rest` yields (a stream's first reply, read before its head)."""
    yield first
    async for item in rest:
        yield item


# ---- body validation -------------------------------------------------------------------


def image_lists(value: Any, count: int, batch: bool) -> list[list[str] | None]:
    """SGLang's `image_data`: one image (a string) or a list of them for one prompt; for a
    batch a list with one entry (a string, a list or null) per prompt. -> per prompt."""
    if value is None or value == []:
        return [None] * count
    if not batch:
        value = [value]
    if not isinstance(value, list) or len(value) != count:
        raise HttpError(400, f"image_data: one entry per prompt ({count})", "image_data")
    out: list[list[str] | None] = []
    for entry in value:
        entry = [entry] if isinstance(entry, str) else entry
        if entry is not None and not (
            isinstance(entry, list) and all(isinstance(x, str) for x in entry)
        ):
            raise HttpError(
                400, "image_data entries must be strings (data: URL, base64, path)", "image_data"
            )
        out.append(entry or None)
    return out


def check_fields(body: dict, honored: set[str], noop: dict, any_value: tuple, where: str) -> None:
    """Ignore unknown names (a warning, once per name); refuse the known no-op ones (`noop`:
    name -> the value that changes nothing) at values this server cannot honour."""
    for name, value in body.items():
        if name in honored:
            continue
        if name not in noop:
            warn_ignored(f"{where}{name}"[:MAX_LOGGED_NAME])
            continue
        if name in any_value or is_noop(value, noop[name]):
            continue
        if name in ANY_BOOL and isinstance(value, bool):
            continue
        raise HttpError(400, f"{where}{name}={value!r} is not supported by radixflow", name)


def is_noop(value: Any, noop: Any) -> bool:
    """Whether `value` changes nothing: None, empty, `noop`, or one of a tuple of such."""
    accepted = noop if isinstance(noop, tuple) else (noop,)
    return value is None or value in NO_OP_EMPTY or any(value == a for a in accepted)


@functools.lru_cache(maxsize=1024)  # once per name; bounded, as clients choose the names
def warn_ignored(name: str) -> None:
    log.warning("ignoring unknown request field %r (warned once per name)", name)


def typed(body: dict, name: str, kind: type | tuple, default: Any = None) -> Any:
    """body[name] if it has type `kind` (a bool is not an int), else 400; None -> default."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        names = "/".join(k.__name__ for k in kinds)
        raise HttpError(400, f"{name} must be {names}, got {type(value).__name__}", name)
    return value


def is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def clean_sampling(params: Any, where: str = "sampling_params.") -> dict[str, Any]:
    """SGLang's sampling_params with its no-op and unknown names dropped (SamplingParams
    checks the values of the rest)."""
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise HttpError(400, "sampling_params must be an object", "sampling_params")
    params = foreign_fields(params)
    known = {k for k in params if k in SAMPLING_FIELDS}
    check_fields(params, known, SAMPLING_NOOP, SAMPLING_ANY, where)
    out = {k: params[k] for k in known}
    if "sampling_seed" in out:
        out["seed"] = out.pop("sampling_seed")
    return out


def foreign_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Other runtimes' spellings renamed onto ours, or a 400 naming the one refused
    (fields.py)."""
    try:
        return translate(body)
    except FieldError as e:
        raise HttpError(400, str(e), e.param) from e


def per_item(body: dict, name: str, count: int, kind: type, default: Any) -> list[Any]:
    """A /generate option given once for all prompts or as a list, one per prompt."""
    value = body.get(name)
    if isinstance(value, list):
        if len(value) != count:
            raise HttpError(400, f"{name} has {len(value)} entries for {count} prompts", name)
        return [typed({name: v}, name, kind, default) for v in value]
    return [typed(body, name, kind, default)] * count


def parse_generate(body: Any) -> tuple[bool, list[Generate]]:
    """A /generate body -> (is_batch, one Generate per prompt and sample, prompt-major)."""
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    check_fields(body, GENERATE_FIELDS, GENERATE_NOOP, ANY_VALUE, "")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise HttpError(400, "give exactly one of text and input_ids", "text")
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        prompts: list[Any] = [("text", t) for t in text]
    elif isinstance(text, str):
        prompts = [("text", text)]
    elif isinstance(ids, list) and ids and all(is_int_list(i) for i in ids):
        prompts = [("input_ids", i) for i in ids]
    elif is_int_list(ids):
        prompts = [("input_ids", ids)]
    else:
        raise HttpError(
            400,
            "text must be a string or a non-empty list of strings; input_ids "
            "a list of ints or a non-empty list of such lists",
            "text",
        )
    batch = isinstance(text, list) or (bool(ids) and isinstance(ids[0], list))
    count = len(prompts)
    params = body.get("sampling_params")
    if isinstance(params, list):
        if len(params) != count:
            raise HttpError(400, f"{len(params)} sampling_params for {count} prompts")
        sampling = [clean_sampling(p) for p in params]
    else:
        sampling = [clean_sampling(params)] * count
    rids = per_item(body, "rid", count, str, None)
    stream = typed(body, "stream", bool, False)
    logprob = per_item(body, "return_logprob", count, bool, False)
    start = per_item(body, "logprob_start_len", count, int, -1)
    top = per_item(body, "top_logprobs_num", count, int, 0)
    priority = per_item(body, "priority", count, int, 0)
    lora = per_item(body, "lora_path", count, str, None)
    typed(body, "return_text_in_logprobs", bool, False)
    images = image_lists(body.get("image_data"), count, batch)
    msgs = []
    for i, (kind, prompt) in enumerate(prompts):
        n = sampling[i].get("n", 1)
        if type(n) is not int or not 1 <= n <= 64:
            raise HttpError(400, f"invalid sampling parameter n={n!r}", "n")
        for j in range(n):
            params_j = {**sampling[i], "n": 1}
            if n > 1 and type(params_j.get("seed")) is int:
                params_j["seed"] += j  # n equal seeds would give n equal samples
            rid = rids[i] if n == 1 else (f"{rids[i]}-{j}" if rids[i] else None)
            msgs.append(
                Generate(
                    rid or new_rid(),
                    sampling_params=params_j,
                    stream=stream,
                    return_logprob=logprob[i] or top[i] > 0,
                    logprob_start_len=start[i],
                    top_logprobs_num=top[i],
                    priority=priority[i],
                    lora_path=lora[i],
                    image_data=images[i],
                    **{kind: prompt},
                )
            )
    return batch or len(msgs) > 1, msgs


# ---- OpenAI's response_format -------------------------------------------------------------

# json_object under outlines-core: an object of scalar values. Any nesting ({"type": "object"})
# makes it build an index some 20x larger, which took 50 s on a loaded 2-core machine.
ANY_OBJECT = {"type": "object"}
JSON_OBJECT = {
    "type": "object",
    "additionalProperties": {"type": ["string", "number", "boolean", "null"]},
}


def response_format(value: Any, nested: bool = True) -> dict[str, Any]:
    """OpenAI's response_format as a constraint: json_object any JSON object (`nested`: the
    llguidance backend; outlines-core gets an object of scalar values, JSON_OBJECT), json_schema
    the given schema, numeric bounds included (both through the constrained decoder), SGLang's
    structural_tag (runtime/constrained/triggered.py)."""
    if value is None:
        return {}
    kinds = ("text", "json_object", "json_schema", "structural_tag")
    if not isinstance(value, dict) or value.get("type") not in kinds:
        raise HttpError(400, f"response_format.type must be one of {kinds}", "response_format")
    if value["type"] == "text":
        return {}
    if value["type"] == "structural_tag":  # SGLang's; checked by the grammar layer
        return {"structural_tag": json.dumps(value)}
    if value["type"] == "json_object":
        return {"json_schema": json.dumps(ANY_OBJECT if nested else JSON_OBJECT)}
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise HttpError(
            400, "response_format.json_schema.schema must be an object", "response_format"
        )
    return {"json_schema": json.dumps(schema)}


def check_generation(config: Any, request: web.Request) -> None:
    """--is-embedding: generation routes answer 400 before any templating."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else ""
    if config.is_embedding and route in GENERATION_ROUTES:
        raise HttpError(400, m.EMBEDDING_ONLY)


SHUTDOWN_GRACE_S = 5.0  # handlers get this long to write their final answers at shutdown


async def listen(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """`app` served on host:port (0: a free port; IPv6 literals too); -> its runner (cleanup
    stops it) and its http:// URL."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S
    )
    await runner.setup()
    await web.SockSite(runner, sock, shutdown_timeout=SHUTDOWN_GRACE_S).start()
    literal = f"[{host}]" if ":" in host else host
    return runner, f"http://{literal}:{sock.getsockname()[1]}"
