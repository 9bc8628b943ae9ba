"""ServerConfig as command-line flags: one flag per field, generated from the fields' names,
types, defaults and help."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from radixflow.runtime.config import ALIASES, ServerConfig


class JoinRepeated(argparse.Action):
    """A flag given several times: its values joined by commas (the first replaces the
    default)."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option: Any = None) -> None:
        seen = f"_{self.dest}_given"
        if getattr(namespace, seen, False):
            value = f"{getattr(namespace, self.dest)},{value}"
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, value)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per ServerConfig field (`--max-total-tokens`, `--disable-radix-cache`),
    and the ALIASES' old flags (`--model` for `--model-path`)."""
    old_names = {new: old for old, new in ALIASES.items()}
    for f in dataclasses.fields(ServerConfig):
        flags = ["--" + f.name.replace("_", "-")]
        if f.name in old_names:
            flags.append("--" + old_names[f.name].replace("_", "-"))
        help_text = f"{f.metadata['help']} (default: {f.default!r})"
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": help_text}
        if f.type in (bool, "bool"):
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, **kw)
        elif f.name == "model_path":  # several: NAME=PATH each, joined by commas
            parser.add_argument(*flags, action=JoinRepeated, **kw)
        elif f.type == "tuple[str, ...]":  # several values after the flag, or it repeated
            kw["default"] = list(f.default)
            parser.add_argument(*flags, nargs="+", action="extend", **kw)
        else:
            parser.add_argument(*flags, type={"int": int, "float": float, "str": str}[f.type], **kw)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)})
