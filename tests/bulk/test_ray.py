"""The job on a real multi-node Ray cluster on this machine (ray.cluster_utils.Cluster: a head
and two worker nodes, each with resources of its own): two actors translate a corpus, a worker
node is killed in the middle (once an actor has translated a batch: a state, not a time), its
actor is restarted on the head, and the output is still complete, in order, and equal to
the one-machine output; then the CLI form (`translate --ray ADDRESS`) on the same cluster:
its lines read and written as the one-machine job reads and writes them, a bad line named,
and a driver killed with SIGKILL resumed from the journal.

The default run takes about 60 s on this 2-core machine when it is quiet (Ray's processes
start in a few seconds; the killed node's actor restarts in about 20); the sweeps over formats
and the killed driver, about 90 s more, are marked slow. Skipped without Ray."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import number_phrases
from test_file_job import expected, run_cli

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

ACTOR_RESOURCE = "tfserve_translator"  # only the worker nodes have it: the actors live there
POLLER = "data-usage-metrics-poller"  # Ray Data's usage thread (see the cluster fixture)


def gated_class(gate: Path, markers: Path) -> type:
    """TranslateBatch whose actors each translate one batch, leave a marker file, and wait
    for `gate` (a file) before any other: the job cannot finish before the test has killed a
    node, and the test kills it once a marker shows the job under way (states, polled)."""
    from tfserve.bulk.ray_job import TranslateBatch

    class GatedTranslateBatch(TranslateBatch):
        def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
            if getattr(self, "_first_done", False):
                while not gate.exists():
                    time.sleep(0.01)
            out = super().__call__(batch)
            self._first_done = True
            node = ray.get_runtime_context().get_node_id()
            (markers / f"{node}-{os.getpid()}-{time.monotonic_ns()}").touch()
            return out

    return GatedTranslateBatch


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        # no usage reporting: with it, Ray Data starts a driver thread that polls a Prometheus
        # server every 10 s for as long as the process lives and logs each failure with its
        # traceback; CPython 3.11 formats that traceback with ast.parse, whose state races
        # with another thread's (a SystemError in the suite's own ast readers, gh-106905)
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # the head has room for one actor too: where the killed node's actor is restarted
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 1, "resources": {ACTOR_RESOURCE: 1}})
        workers = [cluster.add_node(num_cpus=1, resources={ACTOR_RESOURCE: 1}) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False, include_dashboard=False)
        cluster.workers = workers
        try:
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
    # no thread of Ray's in the test process logs on after the cluster is gone
    assert POLLER not in {thread.name for thread in threading.enumerate()}


def test_a_killed_worker_node_loses_no_line(cluster: Any, tmp_path: Path, demo_model: Path,
                                            demo_translator: Any) -> None:
    from tfserve.bulk.progress import Counts
    from tfserve.bulk.ray_job import write_ordered
    from tfserve.bulk.ray_reader import read_dataset

    lines = number_phrases(24, seed=11)
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(lines) + "\n")
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    gate, markers = tmp_path / "gate", tmp_path / "markers"
    markers.mkdir()
    dataset = read_dataset(str(source), "lines", block_lines=4).map_batches(
        gated_class(gate, markers), batch_size=4, batch_format="numpy",
        fn_constructor_kwargs={"model": str(demo_model), "threads": 1},
        concurrency=2, num_cpus=0.5, resources={ACTOR_RESOURCE: 1})
    killed: list[int] = []

    def kill_a_node() -> None:
        workers = {node.node_id: node for node in cluster.workers}
        while True:  # a batch translated on a worker node: the job is under way there
            done = [marker.name.split("-")[0] for marker in markers.iterdir()]
            busy = [node_id for node_id in done if node_id in workers]
            if busy:
                break
            time.sleep(0.01)
        killed.append(len(done))
        cluster.remove_node(workers[busy[0]], allow_graceful=False)
        gate.touch()  # let the actors go on (the lost one restarts on the head)

    killer = threading.Thread(target=kill_a_node, daemon=True)
    killer.start()
    counts = Counts()
    write_ordered(dataset, str(out), "lines", "translation", "", counts)
    killer.join()
    assert killed and killed[0] < len(lines) // 4  # batches done when the node died
    assert out.read_text().splitlines() == expected(demo_translator, lines)
    assert counts.lines == len(lines)


def test_translate_dash_dash_ray(cluster: Any, tmp_path: Path, demo_model: Path,
                                 demo_translator: Any, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    lines = number_phrases(20, seed=12)
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(sys, "argv", ["tfserve"])
    code, err = run_cli(capsys, ["--ray", cluster.address, "--model", str(demo_model),
                                 "--input", str(source), "--output", str(out), "--threads", "1",
                                 "--ray-cpus", "0.5", "--read-buffer", "5",
                                 "--progress", "log"])
    assert code == 0, err
    assert out.read_text().splitlines() == expected(demo_translator, lines)
    assert f"done: {len(lines)} lines" in err


def test_translate_dash_dash_ray_into_a_directory(cluster: Any, tmp_path: Path,
                                                  demo_model: Path, demo_translator: Any,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An output ending in "/" (or an object-store URI) gets Ray's writers: JSON Lines files,
    one per block, every record with its translation."""
    import json

    lines = number_phrases(12, seed=13, blanks=False)
    source, out = tmp_path / "in.jsonl", tmp_path / "out"
    source.write_text("".join(json.dumps({"id": i, "text": t}) + "\n"
                              for i, t in enumerate(lines)))
    monkeypatch.setattr(sys, "argv", ["tfserve"])
    code, err = run_cli(capsys, ["--ray", cluster.address, "--model", str(demo_model),
                                 "--input", str(source), "--output", f"{out}/",
                                 "--output-format", "jsonl", "--threads", "1",
                                 "--ray-cpus", "0.5", "--progress", "log"])
    assert code == 0, err
    records = [json.loads(line) for path in sorted(out.glob("*.json*"))
               for line in path.read_text().splitlines()]
    want = dict(zip(lines, expected(demo_translator, lines)))
    assert sorted(r["id"] for r in records) == list(range(len(lines)))
    assert all(r["translation"] == want[r["text"]] for r in records)
    assert f"done: {len(lines)} lines" in err


def _awkward_lines(tmp_path: Path) -> Path:
    """Lines as a corpus has them: a form feed and a U+2028 inside lines (one line each for
    the job, where str.splitlines would cut them), and line 7 not UTF-8."""
    lines = number_phrases(10, seed=14, blanks=False)
    source = tmp_path / "in.txt"
    source.write_bytes(
        ("\n".join(lines[:3]) + "\n" + lines[3] + "\x0c" + lines[4] + "\n" + lines[5]
         + "\u2028" + lines[6] + "\n" + lines[7] + "\n").encode()
        + b"\xff\xfe not text\n" + ("\n".join(lines[8:]) + "\n").encode())
    return source


def _awkward_json_lines(tmp_path: Path) -> Path:
    """JSON Lines with a U+2028 and a form feed inside strings (raw, not escaped), a line that
    does not parse, one that is not UTF-8, one without the text field, and a blank line."""
    import json

    lines = number_phrases(8, seed=16, blanks=False)
    records = [json.dumps({"id": i, "text": text, "note": "a\u2028b\x0cc"}, ensure_ascii=False)
               for i, text in enumerate(lines)]
    source = tmp_path / "in.jsonl"
    source.write_bytes(("\n".join(records[:3]) + "\n{not json\n").encode() + b"\xff\xfe\n"
                       + ("\n".join(records[3:6]) + '\n{"id": 99}\n\n'
                          + "\n".join(records[6:]) + "\n").encode())
    return source


@pytest.mark.slow  # three Ray jobs and three one-machine jobs
@pytest.mark.parametrize(("kind", "output"), [("lines", "out.txt"), ("lines", "out.jsonl"),
                                              ("jsonl", "out.jsonl")])
def test_ray_reads_and_writes_as_the_one_machine_job(
        cluster: Any, tmp_path: Path, demo_model: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, kind: str, output: str) -> None:
    source = _awkward_lines(tmp_path) if kind == "lines" else _awkward_json_lines(tmp_path)
    common = ["--model", str(demo_model), "--input", str(source), "--threads", "1",
              "--bad-lines", "skip", "--skip-marker", "SKIPPED", "--progress", "log"]
    (tmp_path / "one").mkdir()
    (tmp_path / "ray").mkdir()
    one, on_ray = tmp_path / "one" / output, tmp_path / "ray" / output
    code, err = run_cli(capsys, [*common, "--output", str(one)])
    assert code == 0, err
    monkeypatch.setattr(sys, "argv", ["tfserve"])
    code, err = run_cli(capsys, ["--ray", cluster.address, *common, "--output", str(on_ray),
                                 "--ray-cpus", "0.5", "--read-buffer", "3"])
    assert code == 0, err
    assert on_ray.read_bytes() == one.read_bytes()
    lines = source.read_bytes().count(b"\n")
    assert len(one.read_bytes().split(b"\n")) - 1 == lines
    skipped = 1 if kind == "lines" else 3  # not UTF-8; and not JSON, no text field
    assert f"{lines} lines" in err and f"{skipped} skipped" in err
    if output == "out.txt":
        assert one.read_text().splitlines()[6] == "SKIPPED"


def test_ray_fails_at_a_bad_line_naming_it(cluster: Any, tmp_path: Path, demo_model: Path,
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    source = _awkward_lines(tmp_path)
    monkeypatch.setattr(sys, "argv", ["tfserve"])
    code, err = run_cli(capsys, ["--ray", cluster.address, "--model", str(demo_model),
                                 "--input", str(source), "--output", str(tmp_path / "out.txt"),
                                 "--threads", "1", "--ray-cpus", "0.5", "--read-buffer", "3",
                                 "--progress", "log"])
    assert code != 0
    assert "line 7: not valid UTF-8" in err
    assert "ray::" not in err and "Traceback" not in err  # the line, not the actor's trace


@pytest.mark.slow  # a driver process of its own, then two more jobs
def test_kill_9_of_the_driver_then_resume(cluster: Any, tmp_path: Path, demo_model: Path,
                                          demo_translator: Any,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`translate --ray` into a local file keeps the one-machine job's journal: its driver
    killed (SIGKILL) once the journal shows committed blocks, the same command finishes the
    file, and the one-machine command then finds it complete (the same fingerprint)."""
    import subprocess

    from server_helpers import ROOT
    from test_kill import kill_9_once_committed

    lines = number_phrases(200, seed=15)
    source, out = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(lines) + "\n")
    journal = tmp_path / "out.txt.tfserve-job.json"
    common = ["--model", str(demo_model), "--input", str(source), "--output", str(out),
              "--threads", "1", "--read-buffer", "3", "--progress", "log"]
    on_ray = ["--ray", cluster.address, "--ray-cpus", "0.5"]

    process = subprocess.Popen(
        [sys.executable, "-m", "tfserve", "translate", *on_ray, *common], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = kill_9_once_committed(process, journal, 4 * 3)  # four blocks: under way
    assert not state["finished"] and state["lines"] < len(lines), "killed too late to test"
    monkeypatch.setattr(sys, "argv", ["tfserve"])
    code, err = run_cli(capsys, [*on_ray, *common])
    assert code == 0, err
    assert out.read_text().splitlines() == expected(demo_translator, lines)
    assert f"done: {len(lines)} lines" in err
    code, err = run_cli(capsys, common)  # the one-machine job: nothing left to do
    assert code == 0, err
    assert "already complete" in err
    assert out.read_text().splitlines() == expected(demo_translator, lines)
