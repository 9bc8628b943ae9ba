"""The layering of docs/architecture.md, read from the source: every import of every module
(function-level and TYPE_CHECKING ones included) must follow the table of allowed edges,
the module graph has no cycle (type-only imports, which never run, excepted), the torch-free
layers never import torch at module level, and a function-level import says why it is one (an
optional or heavy dependency, named on its line)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> installed package name (pyproject.toml's package-dir)
PACKAGES = {
    "frontend": "radixflow",
    "runtime": "radixflow.runtime",
    "kernels": "radixflow.kernels",
    "lab": "radixflow.lab",
    "bench": "radixflow.bench",
}
# module-name prefix -> layer; the longest prefix wins
LAYER_OF = {
    "radixflow": "frontend",
    "radixflow.runtime": "runtime",  # the root: engine, cli, the package's lazy names
    "radixflow.runtime.protocol": "protocol",
    "radixflow.runtime.config": "config",
    "radixflow.runtime.tokenizer": "tokenizer",
    "radixflow.runtime.server": "server",
    "radixflow.runtime.scheduler": "scheduler",
    # the scheduler process: it builds the model runner beside the scheduler (runtime.engine)
    "radixflow.runtime.scheduler.loop": "runtime",
    "radixflow.runtime.cache": "cache",
    "radixflow.runtime.constrained": "constrained",
    "radixflow.runtime.model_executor": "model_executor",
    "radixflow.runtime.models": "models",
    "radixflow.runtime.distributed": "distributed",
    "radixflow.runtime.desk": "desk",
    "radixflow.kernels": "kernels",
    "radixflow.lab": "lab",
    "radixflow.bench": "bench",
}
RUNTIME = {
    "runtime", "protocol", "config", "tokenizer", "server", "scheduler", "cache",
    "constrained", "model_executor", "models", "distributed", "desk",
}  # fmt: skip
# layer -> the layers it may import (itself always)
ALLOWED = {
    "frontend": {"protocol", "config"},
    "config": set(),
    "protocol": {"config"},
    "cache": {"config"},
    "constrained": {"protocol", "config"},
    "tokenizer": {"models", "config"},
    "server": {"protocol", "constrained", "config", "tokenizer"},
    "scheduler": {"protocol", "cache", "constrained", "config"},
    "models": {"kernels", "config"},
    "model_executor": {"models", "kernels", "protocol", "config"},
    "distributed": {
        "model_executor",
        "models",
        "kernels",
        "scheduler",
        "cache",
        "protocol",
        "config",
        "tokenizer",
    },  # fmt: skip
    # several models behind one door: it reuses the doors' error shapes and the replicas'
    # process plumbing; its planning child (desk.plan) reads checkpoints (function-level)
    "desk": {"server", "distributed", "model_executor", "models", "protocol", "config"},
    "runtime": RUNTIME | {"kernels"},
    "kernels": set(),
    "bench": RUNTIME | {"frontend", "kernels"},
    "lab": RUNTIME | {"frontend", "kernels", "bench"},
}
TORCH_FREE = {
    "frontend", "config", "protocol", "cache", "constrained", "scheduler", "server", "desk",
}  # fmt: skip
HEAVY = ("torch", "triton", "transformers")


def layer_of(module: str) -> str:
    best = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF[best]


def source_modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


class Imports(ast.NodeVisitor):
    """Every import of a module: (target, line, function-level?); `type_only` holds the lines
    of imports under `if TYPE_CHECKING:`."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package, self.depth = module, is_package, 0
        self.found: list[tuple[str, int, bool]] = []
        self.type_only: set[int] = set()

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            self.type_only |= {n.lineno for n in ast.walk(node) if hasattr(n, "lineno")}
        self.generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, node.lineno, self.depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.module.split(".")
            parent = parts if self.is_package else parts[:-1]
            parent = parent[: len(parent) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        for alias in node.names:
            self.found.append((f"{base}.{alias.name}", node.lineno, self.depth > 0))


TYPE_ONLY: dict[str, set[int]] = {}


def imports_of(modules: dict[str, Path]) -> dict[str, list[tuple[str, int, bool]]]:
    graph = {}
    for module, path in modules.items():
        visitor = Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        TYPE_ONLY[module] = visitor.type_only
        resolved = []
        for target, line, nested in visitor.found:
            # `from pkg import name` names a module when pkg.name is one, else pkg itself
            while target and target not in modules and "." in target:
                if not target.startswith("radixflow"):
                    break
                target = target.rsplit(".", 1)[0]
            resolved.append((target, line, nested))
        graph[module] = resolved
    return graph


MODULES = source_modules()
GRAPH = imports_of(MODULES)


def forbidden_edges(graph: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        source = layer_of(module)
        for target, line, _ in targets:
            if target not in MODULES:
                continue
            layer = layer_of(target)
            if layer != source and layer not in ALLOWED[source]:
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {source} -> {layer}")
    return bad


def find_cycle(graph: dict[str, list[tuple[str, int, bool]]]) -> list[str] | None:
    """One import cycle among the project's modules, or None."""
    edges = {
        m: sorted({t for t, line, _ in ts if t in MODULES and line not in TYPE_ONLY.get(m, ())})
        for m, ts in graph.items()
    }
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in edges.get(node, []):
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue  # a package and its own modules import each other by design
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in edges:
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_every_import_follows_the_layer_table() -> None:
    bad = forbidden_edges(GRAPH)
    assert not bad, "imports against the layer table:\n" + "\n".join(bad)


def test_no_import_cycle() -> None:
    assert find_cycle(GRAPH) is None, f"import cycle: {' -> '.join(find_cycle(GRAPH) or [])}"


def test_torch_free_layers_never_import_torch() -> None:
    bad = [
        f"{MODULES[m].relative_to(ROOT)}:{line}: {target}"
        for m, targets in GRAPH.items()
        if layer_of(m) in TORCH_FREE
        for target, line, nested in targets
        if target.split(".")[0] in HEAVY and not nested
    ]
    assert not bad, "torch-free layers importing torch:\n" + "\n".join(bad)


def test_function_level_imports_say_why() -> None:
    """A function-level import is for an optional or heavy dependency, with its reason on the
    line (`# noqa: PLC0415 (why)`); one of our own modules only where it keeps torch out of a
    process that does not need it (`(torch...)`), never to dodge a cycle."""
    bad = []
    for module, targets in GRAPH.items():
        lines = MODULES[module].read_text().splitlines()
        for target, line, nested in targets:
            if not nested:
                continue
            text = lines[line - 1]
            # ours only to keep torch (or triton, optional on a CPU machine) out of a process
            # that has no use for it, saying so: the server process, the lab on a laptop, the
            # frontend (which imports the protocol through radixflow.runtime's lazy names)
            ours = target.startswith("radixflow") and not (
                target.startswith("radixflow.kernels.triton")
                or module == "radixflow.runtime"
                or "(torch" in text
            )
            reason = "(" in text.split("#", 1)[1] if "#" in text else False
            if ours or not reason:
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {text.strip()}")
    assert not bad, "function-level imports:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "edge",
    [
        ("radixflow.runtime.scheduler.scheduler", "radixflow.runtime.model_executor.sampler"),
        ("radixflow.kernels.reference", "radixflow.runtime.models.layers"),
        ("radixflow.api", "radixflow.runtime.engine"),
        ("radixflow.runtime.server.server", "radixflow.lab.diagnose"),
        ("radixflow.runtime.engine", "radixflow.bench.harness"),  # the GPU check lives in bench
    ],
)
def test_a_forbidden_edge_fails(edge: tuple[str, str]) -> None:
    """The checker itself: one forbidden import added to the real graph is reported."""
    source, target = edge
    graph = {m: list(ts) for m, ts in GRAPH.items()}
    graph[source].append((target, 1, False))
    assert len(forbidden_edges(graph)) == len(forbidden_edges(GRAPH)) + 1


def test_a_cycle_is_found() -> None:
    graph = {m: list(ts) for m, ts in GRAPH.items()}
    graph["radixflow.runtime.cache.kv_pool"].append(("radixflow.runtime.cache.radix_cache", 1, 0))
    graph["radixflow.runtime.cache.radix_cache"].append(("radixflow.runtime.cache.kv_pool", 1, 0))
    assert find_cycle(graph) is not None


def test_the_dsl_package_names_only_the_engine_from_the_runtime() -> None:
    """frontend/__init__.py resolves its public names lazily from a table of module names,
    which the import checks above cannot see: each module there is the DSL's own, except
    radixflow.runtime for `Engine` (SGLang exports its engine at the top too). The DSL itself
    only takes an engine as an object (radixflow.backends.engine)."""
    tree = ast.parse((ROOT / "frontend" / "__init__.py").read_text())
    table = next(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
    )
    exports = ast.literal_eval(table)
    foreign = {module: names for module, names in exports.items() if layer_of(module) != "frontend"}
    assert foreign == {"radixflow.runtime": ("Engine",)}, foreign
