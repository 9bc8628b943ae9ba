"""The documentation runs: every ```python block of README.md and docs/*.md, every ```bash
block made only of `curl` commands, and the README's main command's program; every
`radixflow` command line in a ```bash block parses with that command's own parser, and every
repository path and `python -m` module the docs name exists.

Blocks that name the documented default addresses (http://localhost:30000,
tcp://127.0.0.1:30001) run against the session's shared `radixflow serve` (conftest's
`shared_server`); its live addresses replace the documented ones. Blocks that start their own
`sgl.Runtime` or `Engine` run as they are. Each block runs as a user runs it: written to a file
and started with this Python, from the repository root; it fails on an exception (the
blocks assert what they show)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import emptied

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
READY = re.compile(r"radixflow ready on http://([\w.\[\]:-]+) \(HTTP\) and (tcp://\S+) \(ZeroMQ\)")
# documented default address -> what replaces it ({http} host:port, {zmq} tcp://host:port)
ADDRESSES = {
    "tcp://127.0.0.1:30001": "{zmq}",
    "localhost:30000": "{http}",
    "127.0.0.1:30000": "{http}",
}
BLOCK_TIMEOUT_S = 300  # a model load plus a few dozen tokens on 2 shared cores


def code_blocks(language: str) -> list[tuple[str, str]]:
    """(file:line, code) of every ```language block in the docs, in reading order."""
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == language:
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{path.relative_to(ROOT)}:{line}", match.group(2)))
    return found


def needs_server(code: str) -> bool:
    return any(address in code for address in ADDRESSES)


def is_curl_block(code: str) -> bool:
    commands = [line for line in code.splitlines() if line and not line.startswith(" ")]
    return bool(commands) and all(line.startswith("curl ") for line in commands)


PYTHON = code_blocks("python")
STANDALONE = [(where, code) for where, code in PYTHON if not needs_server(code)]
WITH_SERVER = [(where, code) for where, code in PYTHON if needs_server(code)]
CURL = [(where, code) for where, code in code_blocks("bash") if is_curl_block(code)]


def run_python(code: str, tmp_path: Path) -> str:
    script = tmp_path / "block.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, f"the block failed:\n{code}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def server(shared_server: Any) -> dict[str, str]:
    """The session's shared `radixflow serve`: {"http": host:port, "zmq": tcp://host:port}."""
    server = emptied(shared_server)
    return {"http": server.url.split("://", 1)[1], "zmq": server.address}


def live(code: str, server: dict[str, str]) -> str:
    for documented, placeholder in ADDRESSES.items():
        code = code.replace(documented, placeholder.format(**server))
    return code


def as_a_user() -> dict[str, str]:
    """The environment without the test command's PYTHONSAFEPATH: a script's own folder is
    on sys.path, as for a user (the programs import their `common.py`)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}


def test_the_main_program_answers_three_turns() -> None:
    """The README's main command's program, as a user types it: it starts its own Runtime,
    chats three turns, and the radix cache serves each turn's history."""
    done = subprocess.run(
        [sys.executable, "programs/multi_turn_chat.py"],
        cwd=ROOT,
        env=as_a_user(),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    body = "\n".join(line for line in done.stdout.splitlines() if not line.startswith("# "))
    result = json.loads(body)
    assert len(result["answers"]) == 3
    assert all(answer.strip() for answer in result["answers"]), result["answers"]
    assert "Paris" in result["answers"][0], result["answers"]
    # turns 2 and 3 resend the conversation: its earlier turns come from the cache
    assert result["cached_tokens"][1] > 0 and result["cached_tokens"][2] > 0, result


def test_the_docs_have_examples_of_each_kind() -> None:
    """The extraction itself: a block the fence pattern missed would silently go untested."""
    assert len(STANDALONE) >= 2 and len(WITH_SERVER) >= 4 and CURL, (STANDALONE, WITH_SERVER)
    fences = sum(path.read_text().count("```python") for path in DOCS)
    assert fences == len(PYTHON), f"{fences} python fences, {len(PYTHON)} blocks extracted"


@pytest.mark.parametrize("where, code", STANDALONE, ids=[where for where, _ in STANDALONE])
def test_standalone_block(where: str, code: str, tmp_path: Path) -> None:
    print(run_python(code, tmp_path))


@pytest.mark.parametrize("where, code", WITH_SERVER, ids=[where for where, _ in WITH_SERVER])
def test_block_against_a_server(
    where: str, code: str, server: dict[str, str], tmp_path: Path
) -> None:
    print(run_python(live(code, server), tmp_path))


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
@pytest.mark.parametrize("where, code", CURL, ids=[where for where, _ in CURL])
def test_curl_block(where: str, code: str, server: dict[str, str]) -> None:
    """Each curl command must succeed (-f: an HTTP error fails it) and print something."""
    script = live(code, server).replace("curl -s", "curl -sSf")
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert done.returncode == 0, f"{script}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), script


COMMAND = re.compile(r"^radixflow (serve|bench|diagnose|simulate|tree)\b")
FOLDERS = "frontend|runtime|kernels|lab|bench|programs|tests|docs|scripts"
PATH = re.compile(rf"`((?:{FOLDERS})/[\w/.-]*)`")
MODULE = re.compile(r"python -m (radixflow(?:\.\w+)*)")


def command_lines() -> list[tuple[str, list[str]]]:
    """(where, argv) of every `radixflow COMMAND ...` line of the bash blocks, continuation
    lines joined and comments dropped."""
    found = []
    for where, code in code_blocks("bash"):
        for line in code.replace("\\\n", " ").splitlines():
            if COMMAND.match(line):
                found.append((where, shlex.split(line, comments=True)[1:]))
    return found


def test_documented_commands_parse() -> None:
    """A flag the docs name that the command does not have fails here (argparse exits)."""
    # here, not at the top: the command line imports torch, which the other tests never need
    from radixflow.bench import cli as bench_cli
    from radixflow.lab import cli as lab_cli
    from radixflow.runtime import cli as runtime_cli

    parsers = {"serve": runtime_cli.build_parser(), "bench": bench_cli.build_parser()}
    lines = command_lines()
    assert {argv[0] for _, argv in lines} == {"serve", "bench", "diagnose", "simulate", "tree"}
    for where, argv in lines:
        parser = parsers.get(argv[0], lab_cli.build_parser())
        args = argv if argv[0] in ("serve", *lab_cli.LAB_COMMANDS) else argv[1:]
        try:
            parser.parse_args(args)
        except SystemExit as e:
            raise AssertionError(f"{where}: radixflow {shlex.join(argv)} does not parse") from e


def test_documented_paths_and_modules_exist() -> None:
    missing = []
    for path in DOCS:
        text = path.read_text()
        missing += [f"{path.name}: {p}" for p in PATH.findall(text) if not (ROOT / p).exists()]
        missing += [
            f"{path.name}: python -m {m}"
            for m in MODULE.findall(text)
            if importlib.util.find_spec(m) is None
        ]
    assert not missing, missing
