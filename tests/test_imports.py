"""Import isolation (DESIGN.md section 2): the scheduler side never imports torch, the runtime
and the kernels never import the DSL, and the DSL never imports torch. Each check runs in a
fresh interpreter, since this test session has imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TORCH_FREE = [
    "radixflow.runtime.scheduler.scheduler",
    "radixflow.runtime.cache.radix_cache",
    "radixflow.runtime.cache.kv_pool",
    "radixflow.runtime.scheduler.request",
    "radixflow.runtime.config",
    "radixflow.runtime.protocol.messages",
    "radixflow.runtime.protocol.transport",
    "radixflow.runtime.protocol.sampling",
    "radixflow",
    "radixflow.backend",
    "radixflow.api",
    "radixflow.interpreter",
    "radixflow.backends.engine",
    "radixflow.backends.openai",
]
DSL_MODULES = (
    "radixflow.api",
    "radixflow.backend",
    "radixflow.backends.engine",
    "radixflow.backends.openai",
    "radixflow.chat_template",
    "radixflow.choices",
    "radixflow.interpreter",
    "radixflow.ir",
)


def loaded_after(statement: str) -> list[str]:
    """The module names loaded by a fresh interpreter after running `statement`."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_no_torch(module: str) -> None:
    loaded = loaded_after(f"import {module}")
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "transformers", "triton")]
    assert not heavy, f"{module} pulled in {heavy[:5]}"


@pytest.mark.parametrize(
    "statement",
    [
        "import radixflow.runtime",
        "import radixflow.runtime.engine",
        "import radixflow.runtime.scheduler.loop",
        "import radixflow.runtime.server.server",
        "import radixflow.kernels",
    ],
)
def test_runtime_and_kernels_import_no_dsl(statement: str) -> None:
    dsl = [m for m in loaded_after(statement) if m in DSL_MODULES]
    assert not dsl, f"{statement} ran DSL modules {dsl}"


def test_dsl_names_resolve_on_first_use() -> None:
    loaded = loaded_after("import radixflow")
    assert not [m for m in loaded if m in DSL_MODULES]
    loaded = loaded_after("import radixflow as sgl; sgl.gen; sgl.REGEX_INT")
    assert "radixflow.api" in loaded and "radixflow.backend" not in loaded
    import radixflow

    assert set(radixflow.__all__) <= set(dir(radixflow))
    for name in radixflow.__all__:
        assert getattr(radixflow, name) is not None


def test_api_backends_import_their_sdk_only_when_constructed() -> None:
    loaded = loaded_after("import radixflow as sgl; sgl.OpenAI, sgl.Anthropic, sgl.LiteLLM")
    sdks = [m for m in loaded if m.split(".")[0] in ("openai", "anthropic", "litellm")]
    assert "radixflow.backends.openai" in loaded and not sdks, sdks
    assert "torch" not in loaded
