"""Shared fixtures: one loaded SmolLM2 per test session; engines with other configs share it
(released when their module is done); `radixflow serve` subprocesses that die with pytest."""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

_CUDA = torch.cuda.is_available()

# Tests use the machine's two cores; torch's default is fine, but keep tokenizers quiet.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The suite's own cache (converted GGUF, native kernels, decode loop), shared by the session
# and kept between runs: set before anything loads a model, so the suite never writes into
# the user's ~/.cache/radixflow; servers started below inherit it. Gitignored.
SUITE_CACHE = Path(__file__).resolve().parents[1] / ".pytest-cache" / "radixflow"
os.environ["RADIXFLOW_CACHE"] = str(SUITE_CACHE)

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Say hello in Spanish.",
]


def chat(text: str) -> str:
    """SmolLM2's ChatML prompt for one user turn (with its default system prompt)."""
    return (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        f"Face<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.fixture(scope="session")
def engine():
    from radixflow.runtime import Engine

    # the exact fp32 pool (auto's is fp16 for a GGUF) and fp32 activations against the
    # quantized blocks (the default's are int8: tests/runtime/models/test_int8_accuracy.py):
    # tests hold other paths to this one
    with Engine(
        model="smollm2",
        self_check=True,
        max_total_tokens=16384,
        kv_cache_dtype="fp32",
        quantized_activations="fp32",
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def make_engine(engine):
    """make_engine(**config) -> an Engine sharing the session's weights (self_check on); its
    KV pool and threads are released when the module is done."""
    made = []

    def make(**changes):
        eng = engine.with_config(**{"self_check": True, **changes})
        made.append(eng)
        return eng

    yield make
    for eng in made:
        eng.shutdown()


@pytest.fixture(scope="session")
def hf_model(engine):
    """transformers' LlamaForCausalLM on the same GGUF's weights, dequantised to fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from radixflow.runtime.models.loader import weight_files

    model_dir = engine.model_info["model_path"]
    weight_files(Path(model_dir))  # a GGUF's directory gets its fp32 safetensors here, once
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def finishes(fn: Any, timeout: float = 10.0) -> Any:
    """Run fn in a thread; fail the test if it does not return in time (a hang)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed back to the test thread
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "call did not return: a thread hangs"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---- Triton on CPU ---------------------------------------------------------------------------

# A kernel reads TRITON_INTERPRET when its module is imported, and any test module may be the
# first to import one (through radixflow.bench.gpu_check, the bench, a model on the Triton
# ops): without CUDA the interpreter is on from the session's start.
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def use_the_triton_interpreter() -> None:
    """Call at the top of a module that runs the Triton kernels on CPU tensors, before
    triton or radixflow.kernels.triton is imported.

    Without CUDA it sets TRITON_INTERPRET=1. On a CUDA machine it skips the calling module
    instead: the flag is read once per kernel, when its module is imported, and it is
    process-wide, so setting it here would make tests/kernels/test_kernels_gpu.py in the same
    run interpreted (or skipped). There, run these in a CPU-only process:
    `CUDA_VISIBLE_DEVICES= pytest tests/kernels/test_kernels.py`."""
    if _CUDA:
        pytest.skip(
            "Triton interpreter tests: CUDA is visible, so the kernels are compiled for it; "
            "run with CUDA_VISIBLE_DEVICES= to interpret them",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"


# ---- servers ---------------------------------------------------------------------------------

READY = re.compile(r"^radixflow ready on (https?://\S+)(?:.*?(tcp://\S+))?")  # --dp-size: HTTP


def imported_by(statements: str, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` a fresh interpreter has imported after running `statements`."""
    code = f"import sys\n{statements}\nprint(sorted(m for m in {modules!r} if m in sys.modules))"
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 (our own print of a list)


def die_with_parent() -> Callable[[], None]:
    """A Popen preexec_fn: the child gets SIGKILL when this process dies, SIGKILL included
    (Linux's PR_SET_PDEATHSIG; a server's scheduler follows its server the same way while
    it loads, then through its --parent-pid watch, as tensor-parallel ranks do). Popen from
    the main thread: the signal follows the thread that forked."""
    parent = os.getpid()
    # looked up here, not in the forked child (dlopen's lock may be held by another thread)
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def preexec() -> None:
        if prctl is not None:
            prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before the call above
                os._exit(1)

    return preexec


def serve_flags(config: dict[str, Any]) -> list[str]:
    """ServerConfig fields -> `radixflow serve` flags (booleans as --x / --no-x)."""
    flags = []
    for name, value in config.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):  # --lora-paths A=x B=y
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


class Server:
    """A `radixflow serve --port 0` child of pytest (`port`, with `zmq_port=0`: a restart on
    the port a killed server had), with radixflow.Runtime's attributes (`process`, `url` for
    HTTP, `address` for ZeroMQ or None behind --dp-size, `endpoint`, `generate()`,
    `get_tokenizer()`, `shutdown()`), so programs take it as their backend."""

    def __init__(
        self, model_path: str = "smollm2", log_level: str = "error",
        launch_timeout: float = 300.0, endpoint_timeout: float = 60.0, port: int = 0,
        **config: Any,
    ) -> None:  # fmt: skip
        from radixflow import RuntimeEndpoint
        from radixflow.runtime.config import config_from_kwargs

        checked = config_from_kwargs(model=model_path, port=port, **config)  # unknown names fail
        self.stop_wait_s = checked.shutdown_timeout + 30.0  # the server drains, then exits
        cmd = [sys.executable, "-m", "radixflow.runtime", "serve", "--model", model_path]
        cmd += ["--port", str(port), "--log-level", log_level, *serve_flags(config)]
        self.endpoint: Any = None
        self.process = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, preexec_fn=die_with_parent()
        )
        self.url, self.address = self._wait_ready(launch_timeout)
        address = self.address or self.url
        self.endpoint = RuntimeEndpoint(
            address, api_key=config.get("api_key"), timeout=endpoint_timeout
        )

    def _wait_ready(self, timeout: float) -> tuple[str, str | None]:
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:  # read stdout for good: a full pipe would block the server
            assert self.process.stdout is not None
            for raw in self.process.stdout:
                lines.put(raw.decode(errors="replace"))

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            with contextlib.suppress(queue.Empty):
                found = READY.match(lines.get(timeout=0.5))
                if found:
                    return found.group(1), found.group(2)
        self.shutdown()
        raise RuntimeError(
            f"`radixflow serve` not ready within {timeout:.0f}s (exit code "
            f"{self.process.returncode}; its log is on stderr)"
        )

    def generate(self, prompt: str, sampling_params: dict | None = None, **kwargs: Any) -> dict:
        return self.endpoint.generate(prompt, sampling_params, **kwargs)

    def get_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.endpoint.model_info()["model_path"])

    def shutdown(self) -> None:
        """SIGTERM (the server drains up to --shutdown-timeout, stops its scheduler), SIGKILL
        30 s after that; idempotent."""
        if self.endpoint is not None:
            self.endpoint.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_wait_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def start_server(**options: Any) -> Iterator[Server]:
    """with start_server(max_total_tokens=4096, api_key=KEY) as rt: ... -- Server's options
    (model_path, log_level, launch_timeout, endpoint_timeout) and ServerConfig fields."""
    server = Server(**options)
    try:
        yield server
    finally:
        server.shutdown()


@pytest.fixture(scope="session")
def shared_server() -> Iterator[Server]:
    """One plain server (SmolLM2, a 16,384-token pool, no key) shared by the modules that only
    send it requests and need no config of their own: each start costs the suite about 9 s."""
    with start_server(max_total_tokens=16384, endpoint_timeout=300.0) as server:
        yield server


def emptied(server: Server) -> Server:
    """A session server with an empty radix tree, as a module's own server starts: greedy text
    under the default int8 matmuls moves with what the tree already holds (a cached prefix
    changes the rows a prefill quantizes together)."""
    assert server.endpoint.flush_cache(), "requests still running on the shared server"
    return server


@pytest.fixture(scope="session")
def vision_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server on the tiny random Qwen2.5-VL checkpoint (tests/vision_models.py), shared by
    the image modules: local paths and remote URLs allowed, small image and context limits.
    `.root` holds the checkpoint's folder (images may be written there)."""
    from family_models import one_thread  # noqa: PLC0415 (transformers: only image modules)
    from vision_models import save_qwen2_5_vl  # noqa: PLC0415

    root = tmp_path_factory.mktemp("vl")
    with one_thread():
        path, _ = save_qwen2_5_vl(root)
    options = dict(
        model_path=str(path), max_total_tokens=2048, context_length=160, num_threads=1,
        allow_local_media=True, allow_remote_media=True, max_image_bytes=40_000,
        log_level="warning",
    )  # fmt: skip
    with start_server(**options) as server:
        server.root = root
        yield server


SHARED_KEY = "shared-secret"  # keyed_server's --api-key


@pytest.fixture(scope="session")
def keyed_server() -> Iterator[Server]:
    """One server behind --api-key SHARED_KEY (SmolLM2, an 8,192-token pool, one compute
    thread), shared by the door modules that need a key and no other config of their own."""
    options = dict(max_total_tokens=8192, api_key=SHARED_KEY, num_threads=1, log_level="warning")
    with start_server(**options) as server:
        yield server


@pytest.fixture(scope="module")
def runtime(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The module's server, configured by the module's `SERVER = {...}` (start_server's
    options), stopped when the module is done."""
    with start_server(**getattr(request.module, "SERVER", {})) as server:
        yield server
