"""Frozen expression nodes of the DSL and the dtype regexes.

`str + expr`, `expr + str` and `expr + expr` build one flat `ExprList`; `s += expr` hands the
flattened leaves to the state's stream, which executes them in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# dtype constraints (SGLang's meanings): gen(dtype=int) == gen(regex=REGEX_INT, stop=[" ", "\n"]).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_STR = r"\"[\w\d\s]*\""
REGEX_STRING = REGEX_STR  # the older SGLang name
REGEX_BOOL = r"(True|False)"


class Expr:
    """Base of every node: supports `+` with strings and other expressions."""

    def __add__(self, other: object) -> ExprList:
        return concat(self, other)

    def __radd__(self, other: object) -> ExprList:
        return concat(other, self)


@dataclass(frozen=True)
class Constant(Expr):
    value: str


@dataclass(frozen=True)
class Gen(Expr):
    """A generation; `params` holds only what the call set (None means: use the defaults)."""

    name: str | None
    params: tuple[tuple[str, Any], ...] = ()

    def overrides(self) -> dict[str, Any]:
        return dict(self.params)


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    choices_method: Any


@dataclass(frozen=True)
class Image(Expr):
    """An image for the prompt (radixflow.media): its encoded file's bytes."""

    data: bytes = field(repr=False)


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True)
class ExprList(Expr):
    items: tuple[Expr, ...]


def as_expr(value: object) -> Expr:
    """A string becomes a Constant; an Expr passes through. None raises ValueError, anything
    else TypeError (both at the call site, so a program bug shows up where it was written)."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    if value is None:
        raise ValueError("cannot append None to a program state")
    raise TypeError(f"cannot append {type(value).__name__} to a program state; use str()")


def flatten(expr: Expr) -> list[Expr]:
    """The leaves of `expr` in execution order."""
    if isinstance(expr, ExprList):
        return [leaf for item in expr.items for leaf in flatten(item)]
    return [expr]


def concat(*parts: object) -> ExprList:
    return ExprList(tuple(leaf for part in parts for leaf in flatten(as_expr(part))))


def produced_name(node: Expr) -> str | None:
    """The variable a node sets when it runs (what `s[name]` waits for), if any."""
    if isinstance(node, (Gen, Select)):
        return node.name
    if isinstance(node, VarScopeEnd):
        return node.name
    return None
