"""`radixflow bench --quick` on a small subset through the CLI: the report's structure and
sane values (equal work across systems, equal outputs, hit rates, prefix reuse), the chart;
and the package's seams (workloads, arrivals, batching, roofline, the DSL forms, the peers'
stdlib-only worker, the Engine's public API). No assertions on speed."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from radixflow.bench import dsl, engine_features, workloads
from radixflow.bench.baselines import WORKER_STUB, plan_batches
from radixflow.bench.roofline import best_of, compute_roofline, roofline_note
from radixflow.bench.rounds import Arrivals, BenchError, percentile

BENCH = Path(workloads.__file__).resolve().parent
KEYS = {
    "workload", "system", "wall_s", "output_tokens", "tokens_per_s", "ttft_mean_s",
    "ttft_p99_s", "itl_p99_s", "prefill_tokens", "cache_hit_rate", "best_hit_rate",
    "peak_rss_mb", "output_digest",
}  # fmt: skip
SYSTEMS = ("radixflow", "radixflow-dsl", "radixflow-nocache", "transformers")
WORKLOADS = ("few_shot", "independent")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # every system on two workloads: about 2 minutes (the suite's budget)
def test_quick_bench_writes_a_sane_report_and_a_chart(tmp_path: Path) -> None:
    import torch

    from radixflow.lab.cli import main  # the `radixflow` command

    path, plot = tmp_path / "out.json", tmp_path / "x.png"
    argv = ["bench", "--quick", "--json", str(path), "--plot", str(plot)]
    argv += ["--workloads", ",".join(WORKLOADS), "--systems", ",".join(SYSTEMS)]
    threads = torch.get_num_threads()
    try:  # one thread: on a shared machine, OpenMP stalls would make this take minutes
        assert main([*argv, "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(path.read_text())
    assert {"cpu", "cores", "torch", "date"} <= set(report["machine"])
    assert report["skipped"] == []
    rows = {(r["workload"], r["system"]): r for r in report["results"]}
    assert set(rows) == {(w, s) for w in WORKLOADS for s in SYSTEMS}
    for (_, system), row in rows.items():
        assert KEYS <= set(row)
        assert row["output_tokens"] > 0 and row["wall_s"] > 0 and row["tokens_per_s"] > 0
        if system == "radixflow-dsl":  # a program sees whole generations, not token times
            assert row["ttft_mean_s"] is None and row["itl_p99_s"] is None
        else:
            assert 0 < row["ttft_mean_s"] <= row["ttft_p99_s"] <= row["wall_s"]
        assert 0.0 <= row["cache_hit_rate"] <= row["best_hit_rate"] + 1e-9 <= 1.0 + 1e-9
        assert row["peak_rss_mb"] > 0
    for workload in WORKLOADS:  # equal work: same token counts, and (greedy) same outputs
        assert len({rows[workload, s]["output_tokens"] for s in SYSTEMS}) == 1
        ours = rows[workload, "radixflow"]["output_digest"]
        for system in ("radixflow-dsl", "radixflow-nocache"):
            assert rows[workload, system]["output_digest"] == ours, (workload, system)
    ours, ablation = rows["few_shot", "radixflow"], rows["few_shot", "radixflow-nocache"]
    assert ours["prefill_tokens"] < ablation["prefill_tokens"]
    assert rows["few_shot", "radixflow-dsl"]["prefill_tokens"] < ablation["prefill_tokens"]
    assert ours["cache_hit_rate"] >= 0.9 * ours["best_hit_rate"] > 0
    assert ablation["cache_hit_rate"] == rows["few_shot", "transformers"]["cache_hit_rate"] == 0
    speedups = {(s["workload"], s["baseline"]) for s in report["speedups"]}
    assert speedups == {(w, s) for w in WORKLOADS for s in SYSTEMS[1:]}
    picture = plot.read_bytes()
    assert picture.startswith(PNG_MAGIC) and len(picture) > 10_000


def test_a_saved_run_redraws_without_running(tmp_path: Path) -> None:
    from radixflow.bench.cli import main

    saved = {
        "machine": {"cpu": "Test CPU", "cores": 2, "date": "2026-12-01", "quick": True},
        "speedups": [{"workload": "few_shot", "baseline": "transformers", "speedup": 3.0}],
    }
    (tmp_path / "run.json").write_text(json.dumps(saved))
    plot = tmp_path / "again.png"
    assert main(["--from-json", str(tmp_path / "run.json"), "--plot", str(plot)]) == 0
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_the_engine_is_driven_only_through_its_public_api() -> None:
    """No module of the bench reaches into the scheduler or builds requests itself (but the
    GPU check, a check and not a benchmark, which inspects the runner's CUDA graphs and pool)."""
    internals = re.compile(
        r"radixflow\.runtime\.(request|scheduler|batch|radix_cache|kv_pool)\b|\bReq\(|\.scheduler\b"
    )
    for module in sorted(set(BENCH.glob("*.py")) - {BENCH / "gpu_check.py"}):
        hits = [line for line in module.read_text().splitlines() if internals.search(line)]
        assert not hits, f"{module.name}: {hits}"


def test_best_hit_rate_counts_the_token_trie() -> None:
    shared = (1, 2, 3, 4)
    assert workloads.best_hit_rate([([shared + (5,), shared + (6,)], [])]) == 1 - 6 / 10
    assert workloads.best_hit_rate([([(7, 8)], [(7, 8, 9)]), ([(7, 8, 9, 10)], [])]) == 0.5
    assert workloads.best_hit_rate([([(1,), (2,)], [])]) == 0.0


CHARS = workloads.Codec(
    lambda text: [ord(c) for c in text], lambda ids: "".join(chr(t) for t in ids)
)  # one id per character: ids and text convert both ways exactly


def test_workloads_are_deterministic_and_replayable() -> None:
    for name in workloads.WORKLOADS:
        first, again = (workloads.describe(name, CHARS, quick=True) for _ in range(2))
        assert first == again and first["prompt_tokens"] > 0 and first["new_tokens"] > 0


class RecordingBackend:
    """A stand-in server for the DSL programs: records every prompt text it is sent and
    answers deterministically from it (a generation's text, a select's favourite option)."""

    def __init__(self) -> None:
        self.generated: list[str] = []
        self.scored: list[str] = []

    def generate(self, text: str, sampling: dict[str, Any], **options: Any) -> dict[str, Any]:
        self.generated.append(text)
        n = sampling["max_new_tokens"]
        meta = {"completion_tokens": n}
        return {"text": f" w{len(text)}", "output_ids": [7] * n, "meta_info": meta}

    def score(self, prefix: str, continuations: list[str], unconditional: bool) -> list[dict]:
        self.scored.append(prefix)
        best = len(prefix) % len(continuations)
        return [
            {"text": c, "token_ids": [1], "logprobs": [0.0 if k == best else -1.0],
             "unconditional_logprobs": None}
            for k, c in enumerate(continuations)
        ]  # fmt: skip

    def cache_prefix(self, text: str) -> dict[str, Any]:
        return {}


PROGRAM_WORKLOADS = ("few_shot", "multi_turn", "tree_of_thought", "json_decode", "agent",
                     "independent")  # fmt: skip


def walk(workload: workloads.Workload, per_program: list[list[list[Any]]]) -> dict[str, list]:
    """Replay the programs' results through the workload's token-level rounds (what the
    Engine rows run) -> the prompt texts of its generations and selects, and every call."""
    calls, sent = next(workload.rounds), {"generated": [], "scored": [], "calls": []}
    for index in range(len(per_program[0])):
        outputs = [out for program in per_program for out in program[index]]
        sent["calls"] += calls
        for call in calls:
            kind = "scored" if call.options else "generated"
            sent[kind].append(CHARS.decode(list(call.input_ids)))
        try:
            calls = workload.rounds.send(
                [o if c.options else o["text"] for c, o in zip(calls, outputs)]
            )
        except StopIteration:
            break
    return sent


@pytest.mark.parametrize("name", PROGRAM_WORKLOADS)
def test_dsl_programs_send_exactly_the_rounds_prompts(name: str) -> None:
    """The DSL row and the Engine row of a program workload send the same prompts, round for
    round: the @function over the workload's programs (recorded by a stand-in server) against
    the token-level rounds replayed on the program's own results. The live test compares
    outputs on two workloads; this covers every program workload, forks and selects included."""
    workload = workloads.WORKLOADS[name](CHARS, True)
    backend = RecordingBackend()
    states = dsl.run_programs(workload.programs, backend)
    assert all(s.error() is None for s in states)
    per_program = [s.ret_value for s in states]
    sent = walk(workload, per_program)
    assert sorted(backend.generated) == sorted(sent["generated"]) and sent["generated"]
    assert sorted(backend.scored) == sorted(sent["scored"])
    assert (name == "agent") == bool(sent["scored"])
    again = dsl.replay(workloads.WORKLOADS[name](CHARS, True), per_program)
    assert len(again.rounds) == len(per_program[0])


def test_the_engine_and_dsl_rows_come_from_one_definition() -> None:
    """Every workload but long_mix has programs, and its token-level rounds are the ones
    derived from those programs (not a second, hand-kept copy): edit a step of the definition
    and both the rounds and the DSL's prompts change with it."""
    with_programs = {n for n in workloads.WORKLOADS if workloads.WORKLOADS[n](CHARS, True).programs}
    assert with_programs == set(PROGRAM_WORKLOADS)
    for name in PROGRAM_WORKLOADS:
        workload = workloads.WORKLOADS[name](CHARS, True)
        edited = [
            tuple(workloads.Text(s.text + "#") if isinstance(s, workloads.Text) else s for s in p)
            for p in workload.programs
        ]
        for programs in (workload.programs, edited):
            backend = RecordingBackend()
            states = dsl.run_programs(programs, backend)
            per_program = [s.ret_value for s in states]
            rounds = walk(workloads.program_workload(name, programs, CHARS), per_program)
            assert sorted(backend.generated) == sorted(rounds["generated"])
            if programs is workload.programs:  # the workload's own rounds are these rounds
                assert walk(workload, per_program)["calls"] == rounds["calls"]
                assert not any("#" in text for text in backend.generated)
            else:
                assert all("#" in text for text in backend.generated + backend.scored)


STUDIES = (
    "engine_features",
    "grammar_backends",
    "kernels",
    "quantized",
    "router",
    "server",
    "speculative",
    "tp_step",
)


@pytest.mark.parametrize("study", STUDIES)
def test_the_studies_run_as_modules_of_the_installed_package(study: str) -> None:
    """`python -m radixflow.bench.<study>` resolves by installed names alone (no sys.path
    edits, nothing from programs/), and exposes the `main` its __main__ block calls."""
    module = importlib.import_module(f"radixflow.bench.{study}")
    assert callable(module.main)
    source = Path(module.__file__).read_text()
    assert "sys.path" not in source and "import common" not in source


def test_engine_features_rejects_an_unknown_part() -> None:
    assert engine_features.main(["radix", "nonsense"]) == 2


def test_late_calls_arrive_when_the_lead_has_enough_tokens() -> None:
    calls = [SimpleNamespace(after_tokens=n) for n in (0, 0, 2, 5)]
    arrivals = Arrivals(calls, start=10.0)
    assert arrivals.due([], False) == [0, 1] and not arrivals.complete
    assert arrivals.due([11.0, 12.0, 13.0], False) == [2] and arrivals.times[2] == 12.0
    assert arrivals.due([11.0, 12.0, 13.0], True) == [3] and arrivals.times[3] == 13.0
    assert arrivals.complete


def test_naive_batches_respect_kind_rows_and_tokens() -> None:
    def call(length: int, new: int = 4, options: tuple = ()) -> SimpleNamespace:
        return SimpleNamespace(input_ids=(1,) * length, max_new_tokens=new, options=options)

    calls = [call(10)] * 70 + [call(10, new=8)] + [call(10, new=0, options=((1,), (2,)))] * 2
    batches = plan_batches(calls, list(range(len(calls))))
    assert [len(b) for b in batches] == [64, 6, 1, 2]
    assert [len(b) for b in plan_batches([call(20000), call(20000)], [0, 1])] == [1, 1]
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0 and percentile([], 0.5) is None


def test_the_peer_worker_runs_on_the_standard_library_alone() -> None:
    """`python -I -S`: no site-packages, so neither radixflow nor numpy; the worker still
    loads, answers a load it cannot do with an error line, and quits."""
    messages = [{"op": "load", "args": {"model_path": "x", "max_model_len": 8}}, {"op": "quit"}]
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", WORKER_STUB, str(BENCH / "peers.py"), "vllm"],
        input="".join(json.dumps(m) + "\n" for m in messages),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout.splitlines()[0])
    assert reply["error"].startswith("ModuleNotFoundError") and "vllm" in reply["error"]


def test_roofline_is_measured_on_the_models_shapes_and_stated_as_a_share() -> None:
    """A tiny Llama config: the rate is positive, the token bound is batch / pass time, and
    the note states radixflow's `independent` throughput as a share of it."""
    import tempfile

    import torch

    from radixflow.runtime.models import prepack

    config = {
        "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100,
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        machine = compute_roofline(Path(tmp), batch=16)
    assert machine["roofline_batch"] == 16
    assert machine["fp32_matmul_gflops"] > 0 and machine["roofline_tokens_per_s"] > 0
    rate = machine["roofline_tokens_per_s"]
    rows = [{"workload": "independent", "system": "radixflow", "tokens_per_s": rate / 4}]
    note = roofline_note(rows, machine)
    assert "= 25% of the fp32 compute roofline" in note
    # the faster way is the roofline; the first definition's figure is kept beside it
    assert rate >= machine["roofline_linear_tokens_per_s"]
    ways = prepack.available_ways(torch.device("cpu"), torch.float32)
    want = {"F.linear"} | {f"{way} prepacked" for way in ways}
    assert machine["roofline_way"] in want
    assert set(machine["roofline_ways_tokens_per_s"]) == want
    share = rate / 4 / machine["roofline_reused_tokens_per_s"]
    assert f"{share:.0%} of the first definition's" in note
    assert roofline_note(rows, {}) is None
    assert roofline_note([{**rows[0], "system": "vllm"}], machine) is None


def test_the_roofline_is_the_best_of_the_runs_measurements() -> None:
    """A start measurement caught in a slow phase does not set the roofline: each way takes
    its best rate over the start and end measurements, the fastest way is the roofline (its
    GFLOP/s scaled alike), and the note names both measurements."""

    def measured(linear: float, onednn: float, reused: float) -> dict[str, Any]:
        fastest = max(linear, onednn)
        return {
            "cpu": "test", "roofline_batch": 64, "fp32_matmul_gflops": fastest / 4,
            "roofline_tokens_per_s": fastest,
            "roofline_way": "onednn prepacked" if onednn >= linear else "F.linear",
            "roofline_ways_tokens_per_s": {"F.linear": linear, "onednn prepacked": onednn},
            "roofline_linear_tokens_per_s": linear, "roofline_reused_tokens_per_s": reused,
        }  # fmt: skip

    start, end = measured(240.0, 357.0, 349.0), measured(452.0, 700.0, 300.0)
    machine = best_of(start, end)
    assert machine["roofline_tokens_per_s"] == 700.0
    assert machine["roofline_way"] == "onednn prepacked"
    assert machine["fp32_matmul_gflops"] == 175.0 and machine["cpu"] == "test"
    assert machine["roofline_ways_tokens_per_s"] == {"F.linear": 452.0, "onednn prepacked": 700.0}
    assert machine["roofline_linear_tokens_per_s"] == 452.0
    assert machine["roofline_reused_tokens_per_s"] == 349.0
    assert machine["roofline_measurements_tokens_per_s"] == [357.0, 700.0]
    rows = [{"workload": "independent", "system": "radixflow", "tokens_per_s": 378.0}]
    note = roofline_note(rows, machine)
    assert "= 54% of the fp32 compute roofline (700 tok/s" in note
    assert "start and end (357, 700 tok/s)" in note
    mixed = best_of(measured(500.0, 400.0, 1.0), measured(300.0, 450.0, 1.0))
    assert mixed["roofline_way"] == "F.linear" and mixed["roofline_tokens_per_s"] == 500.0


def test_rss_sampler_counts_a_child_and_lists_the_tree_about_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peak includes a child started inside the block (300 MB held for 1.5 s), and the
    process table is scanned about once a second, not on every 50 ms sample."""
    import os
    import time

    import psutil

    from radixflow.bench.harness import RssSampler

    listings = []
    children = psutil.Process.children

    def counted(self: psutil.Process, *args: Any, **kwargs: Any) -> list[psutil.Process]:
        listings.append(time.monotonic())
        return children(self, *args, **kwargs)

    monkeypatch.setattr(psutil.Process, "children", counted)
    own_mb = psutil.Process().memory_info().rss / 2**20
    hold = "x = bytearray(300 << 20); import time; time.sleep(1.5)"
    with RssSampler(os.getpid()) as rss:
        start = time.monotonic()
        time.sleep(0.3)  # the first listing comes before the child
        subprocess.run([sys.executable, "-c", hold], check=True)
        time.sleep(0.2)
    elapsed = time.monotonic() - start
    assert rss.peak_mb > own_mb + 250
    assert 1 <= len(listings) <= elapsed + 2  # once a second, not every 50 ms sample


def test_fp32_peers_get_a_gguf_dequantized_on_a_fresh_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """radixflow keeps a GGUF in its blocks, so a fresh machine's converted directory holds
    no safetensors; the transformers and vLLM peers read only those, so the bench writes
    them before handing the directory over (CI's own cache has them already)."""
    import torch
    from gguf_models import build_model, write_gguf

    from radixflow.bench.cli import Models
    from radixflow.runtime.models.loader import resolve_model_dir

    monkeypatch.setenv("RADIXFLOW_CACHE", str(tmp_path / "cache"))
    source = build_model("llama")
    path = tmp_path / "tiny.gguf"
    write_gguf(path, source, "Q8_0")
    model_dir = resolve_model_dir(str(path))
    assert not list(model_dir.glob("*.safetensors"))  # fresh: metadata only
    models = Models(str(path), model_dir, 1)
    hf, _ = models.transformers()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        got = hf(ids).logits
        want = source(ids).logits  # write_gguf quantized `source` in place: the file's values
    assert torch.allclose(got, want, atol=1e-4)


def test_repeats_interleave_the_systems_and_keep_the_median_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from radixflow.bench import cli

    walls = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}
    order: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> None:
            order.append(f"close {self.name}")

    def fake_run(system: Fake, workload: Any, references: dict) -> dict[str, Any]:
        order.append(system.name)
        return {"workload": "w", "system": system.name, "wall_s": next(walls[system.name])}

    monkeypatch.setattr(cli, "make_system", lambda name, models: Fake(name))

    def fake_warm_up(system: Fake, call: Any) -> None:
        order.append(f"warm {system.name}")
        if system.name == "c":
            raise BenchError("no warm-up")

    monkeypatch.setattr(cli, "warm_up", fake_warm_up)
    monkeypatch.setattr(cli, "run_workload", fake_run)
    monkeypatch.setattr(cli, "wait_until_quiet", lambda: 0.0)

    def rounds() -> Any:
        yield [workloads.Call(input_ids=(1,))]

    make = lambda name: SimpleNamespace(rounds=rounds(), programs=())  # noqa: E731
    models = SimpleNamespace(release=lambda remaining: None)
    rows, _, skipped = cli.run_interleaved(["a", "c", "b"], ["w"], models, make, 3)
    # c failed its warm-up: closed at once, never timed
    assert order == [
        "warm a", "warm c", "close c", "warm b",
        "a", "b", "b", "a", "a", "b", "close a", "close b",
    ]  # fmt: skip
    assert skipped == [{"system": "c", "reason": "failed: no warm-up"}]
    got = {r["system"]: (r["wall_s"], r["runs_wall_s"]) for r in rows}
    assert got == {"a": (3.0, [5.0, 1.0, 3.0]), "b": (4.0, [2.0, 9.0, 4.0])}


def test_a_timed_run_waits_while_another_process_still_works() -> None:
    """A peer's workers busy after its run (vLLM's spun about a second) share the cores with
    the next system's run unless the bench waits them out."""
    import subprocess
    import sys

    from radixflow.bench.harness import wait_until_quiet

    busy = "import time\nend = time.monotonic() + 1.5\nwhile time.monotonic() < end: pass"
    proc = subprocess.Popen([sys.executable, "-c", busy])
    try:
        waited = wait_until_quiet(settle_s=0.0, window_s=0.1, limit_s=10.0)
    finally:
        proc.kill()
        proc.wait()
    assert 1.0 <= waited <= 12.0


def test_an_in_process_systems_memory_leaves_out_the_peers_workers(tmp_path: Path) -> None:
    """The bench's own tree holds the peers' workers (vLLM, llama.cpp) beside an in-process
    radixflow: a worker (its command names bench/peers.py) and its children are theirs."""
    import os
    import time

    import psutil

    from radixflow.bench.harness import RssSampler

    peer = tmp_path / "bench" / "peers.py"
    peer.parent.mkdir()
    peer.write_text("x = bytearray(400 << 20)\nimport time\ntime.sleep(2)\n")
    own_mb = psutil.Process().memory_info().rss / 2**20
    with RssSampler(os.getpid()) as rss:
        time.sleep(0.2)
        worker = subprocess.Popen([sys.executable, str(peer)])
        time.sleep(1.6)  # a listing (once a second) sees it holding its memory
        worker.wait(30)
    assert rss.peak_mb < own_mb + 150
    with RssSampler(os.getpid()) as counted:
        time.sleep(0.2)
        other = subprocess.Popen([sys.executable, "-c", peer.read_text()])
        time.sleep(1.6)
        other.wait(30)
    assert counted.peak_mb > own_mb + 300  # the same child, not a peer's: counted
