"""`python -m tfserve serve --workers N`: N server processes on one port
(tfserve.server.worker_processes).

Real processes on a loopback port, real gRPC channels (one TCP connection each, as the kernel
spreads connections, not calls, over the workers).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from server_helpers import ROOT, ProcessGate, ServerProcess, server_args

from tfserve.client import translate_request
from tfserve.proto import translator_pb2_grpc as pb2_grpc
from tfserve.server.worker_processes import metrics_url, worker_configs
from tfserve.serving.settings import parse_config

TEXTS = ["seven", "twenty-one", "three hundred and forty-two", "ninety-nine"]


def free_ports(count: int) -> int:
    """A port p with p + 1 ... p + count - 1 free too (the parent's metrics, then each
    worker's)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            if port + count - 1 > 65535:
                continue
            taken = []
            try:
                for offset in range(1, count):
                    sock = socket.socket()
                    taken.append(sock)
                    sock.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
            finally:
                for sock in taken:
                    sock.close()
            return port
    raise RuntimeError(f"no {count} consecutive free ports")


def own_connection(target: str) -> grpc.Channel:
    """A channel with a TCP connection of its own (channels to one target share one by default)."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def samples(metrics_port: int, name: str, **labels: str) -> dict[str, int]:
    """The values of metric `name` with these labels at a metrics port, by worker label ("" for
    none)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=60) as response:
        text = response.read().decode()
    return {sample.labels.get("worker", ""): int(sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name
            and all(sample.labels.get(key) == value for key, value in labels.items())}


def translate_ok(metrics_port: int) -> dict[str, int]:
    """tfserve_requests_total{code="OK",rpc="Translate"} by worker label ("" for none)."""
    return samples(metrics_port, "tfserve_requests_total", code="OK", rpc="Translate")


def in_flight(metrics_port: int) -> int:
    """The calls a worker holds (its own metrics port)."""
    return samples(metrics_port, "tfserve_in_flight_requests")[""]


def start_streams(channels: list[grpc.Channel], request: Any) -> list[Any]:
    """A TranslateStream call on each channel, returned once every one is queued at its worker
    (a stream's headers are sent then)."""
    streams = [pb2_grpc.TranslatorStub(c).TranslateStream(request, timeout=120)
               for c in channels]
    for stream in streams:
        stream.initial_metadata()
    return streams


def finals(stream: Any) -> int | grpc.StatusCode:
    """The inputs a stream answered in full, or the status it failed with."""
    try:
        return sum(chunk.done for chunk in stream)
    except grpc.RpcError as error:
        return error.code()


def test_worker_settings() -> None:
    config = parse_config(["--workers", "2", "--metrics-port", "9100"], environ={})
    configs = worker_configs(config, 50099)
    assert [c.metrics_port for c in configs] == [9101, 9102]  # 9100: the parent's, all of them
    assert all(c.port == 50099 and c.workers == 1 for c in configs)
    assert configs[0].threads == max(1, (os.cpu_count() or 1) // 2)
    pinned = worker_configs(parse_config(["--workers", "3", "--threads", "2",
                                          "--metrics-port", "0"], environ={}), 1)
    assert [(c.threads, c.metrics_port) for c in pinned] == [(2, 0)] * 3
    for bad in (["--workers", "0"], ["--workers", "3", "--metrics-port", "65533"],
                ["--port", "70000"]):
        with pytest.raises(SystemExit):
            parse_config(bad, environ={})
    assert parse_config(["--workers", "3", "--metrics-port", "65532"], environ={})
    assert metrics_url("0.0.0.0", 9101) == "http://127.0.0.1:9101/metrics"
    assert metrics_url("::", 9101) == "http://[::1]:9101/metrics"
    assert metrics_url("10.1.2.3", 9101) == "http://10.1.2.3:9101/metrics"


def test_workers_share_the_port_and_drain_together(random_model: Path) -> None:
    metrics = free_ports(3)
    with ProcessGate() as gate:
        process = ServerProcess(server_args(random_model, "--workers", "2",
                                            "--max-batch-size", "2", "--metrics-port",
                                            str(metrics), "--grace-seconds", "30"), gate=gate)
        channels: list[grpc.Channel] = []
        try:
            target = process.wait_serving(workers=2)
            serving = [r for r in process.records() if r.get("event") == "serving"]
            assert sorted(r["worker"] for r in serving) == [0, 1]
            assert len({r["pid"] for r in serving}) == 2
            assert len({r["port"] for r in serving}) == 1
            # one call per connection, on new connections until both workers have answered
            # (the kernel spreads connections over SO_REUSEPORT sockets by a hash: which
            # worker takes the next one is not the test's to choose), 16 at least: both
            # answer the same
            request = translate_request(TEXTS, max_new_tokens=8)
            answers = set()
            counts = [0, 0]
            while len(channels) < 16 or min(counts) == 0:
                assert len(channels) < 256, f"every connection went to one worker: {counts}"
                channels.append(own_connection(target))
                response = pb2_grpc.TranslatorStub(channels[-1]).Translate(request, timeout=60)
                answers.add(tuple(tuple(h.token_ids) for t in response.translations
                                  for h in t.hypotheses))
                counts = [translate_ok(port).get("", 0) for port in (metrics + 1, metrics + 2)]
            assert len(answers) == 1
            assert sum(counts) == len(channels) and min(counts) > 0, counts
            assert translate_ok(metrics) == {"0": counts[0], "1": counts[1]}  # one scrape, all
            # SIGTERM to the parent: every worker drains, and the calls in flight are
            # answered in full. The workers' decoder steps are held from before the calls
            # until the drain has begun: all 8 calls are in flight when it starts
            gate.hold()
            long = translate_request(TEXTS * 2, max_new_tokens=20, min_new_tokens=20)
            streams = start_streams(channels[:8], long)
            process.proc.send_signal(signal.SIGTERM)
            draining = process.wait_for_all(lambda r: r.get("event") == "draining", 2)
            assert sum(r["in_flight"] for r in draining) == 8
            gate.release()
            assert [finals(stream) for stream in streams] == [len(TEXTS) * 2] * 8
            assert process.proc.wait(60) == 0
            records = process.records()
            assert len([r for r in records if r.get("event") == "stopped"]) == 2
            tokens = [r["tokens"] for r in records if r.get("rpc") == "TranslateStream"]
            assert tokens == [20 * len(TEXTS) * 2] * 8
        finally:
            for channel in channels:
                channel.close()
            process.kill()


def test_a_worker_that_dies_is_restarted(random_model: Path) -> None:
    """Worker 0 is killed while both workers hold calls (their decoder steps are held): its
    calls fail UNAVAILABLE, the other's are answered; a new worker 0 takes its place."""
    metrics = free_ports(3)
    with ProcessGate() as gate:
        process = ServerProcess(server_args(random_model, "--workers", "2",
                                            "--max-batch-size", "2", "--metrics-port",
                                            str(metrics)), gate=gate)
        try:
            target = process.wait_serving(workers=2)
            victim = next(r["pid"] for r in process.records() if r.get("worker") == 0)
            gate.hold()
            long = translate_request(TEXTS, max_new_tokens=20, min_new_tokens=20)
            channels: list[grpc.Channel] = []
            streams: list[Any] = []
            held = [0, 0]
            while min(held) == 0:  # calls on both workers (16 connections: almost surely)
                more = [own_connection(target) for _ in range(16 if not channels else 4)]
                channels += more
                streams += start_streams(more, long)
                held = [in_flight(metrics + 1), in_flight(metrics + 2)]
            assert sum(held) == len(streams)
            os.kill(victim, signal.SIGKILL)
            gate.release()
            outcomes = [finals(stream) for stream in streams]
            for channel in channels:
                channel.close()
            assert outcomes.count(grpc.StatusCode.UNAVAILABLE) == held[0], outcomes
            assert outcomes.count(len(TEXTS)) == held[1], outcomes  # not touched
            process.wait_serving(workers=3)  # a new worker 0
            records = process.records()
            assert any("exited with code -9; restarting it" in str(r.get("msg"))
                       for r in records)
            reborn = [r for r in records if r.get("event") == "serving"][-1]
            assert reborn["worker"] == 0 and reborn["pid"] != victim
            channels = [own_connection(target) for _ in range(8)]
            request = translate_request(TEXTS, max_new_tokens=4)
            for channel in channels:
                pb2_grpc.TranslatorStub(channel).Translate(request, timeout=60)
                channel.close()
            process.proc.send_signal(signal.SIGTERM)
            assert process.proc.wait(60) == 0
            stopped = [r for r in process.records() if r.get("event") == "workers_stopped"]
            assert stopped and stopped[0]["exit_codes"] == [0, 0]
        finally:
            process.kill()


def test_a_worker_that_cannot_start_stops_the_set(random_model: Path) -> None:
    """A bad setting fails every worker before it serves: no restart loop, exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "tfserve", "serve", *server_args(random_model),
         "--workers", "2", "--default-max-new-tokens", "100000", "--log-level", "info"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--default-max-new-tokens 100000 is over" in done.stderr
    assert "before serving; stopping the others" in done.stderr
    assert "restarting" not in done.stderr


def test_restarts_are_limited() -> None:
    """Workers that keep dying after they served stop the set after RESTARTS restarts a
    window, and none is restarted once the set was told to stop."""
    import threading

    from tfserve.server import worker_processes as workers

    pool = workers._Workers(worker_configs(parse_config([], environ={}), 50051))
    pool.serving[0] = threading.Event()
    assert not pool.may_restart(0)  # it never served
    pool.serving[0].set()
    assert [pool.may_restart(0) for _ in range(workers.RESTARTS + 1)] == (
        [True] * workers.RESTARTS + [False])
    pool.restarts = [time.monotonic() - workers.RESTART_WINDOW_S - 1] * workers.RESTARTS
    assert pool.may_restart(0)  # the old ones left the window
    pool.signals = 1
    assert not pool.may_restart(0)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_busy_ports_are_clear_errors(random_model: Path, workers: str) -> None:
    """A held gRPC or metrics port: exit 2 naming the flag, and no traceback (a server must
    not outlive the event loop it started on)."""
    for flag in ("--port", "--metrics-port"):
        with socket.socket() as holder:
            holder.bind(("0.0.0.0", 0))
            holder.listen()
            port = holder.getsockname()[1]
            done = subprocess.run(
                [sys.executable, "-m", "tfserve", "serve", *server_args(random_model),
                 "--workers", workers, flag, str(port)],
                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"{flag} {port}: cannot" in done.stderr, done.stderr[-2000:]
        assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_loadgen_counts_the_cpu_of_the_workers() -> None:
    """--server-pid on a parent whose work runs in child processes counts the children."""
    from tfserve.bench.common import process_cpu_seconds

    # the child spends 0.8 s of CPU, says so, and waits (alive) for the test to end it
    spin = ("import os, signal, time\nend = time.process_time() + 0.8\n"
            "while time.process_time() < end: pass\nprint(os.getpid(), flush=True)\n"
            "signal.pause()")
    parent = subprocess.Popen(["bash", "-c", f"{sys.executable} -c '{spin}' & wait"],
                              stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        seconds = process_cpu_seconds(parent.pid)
        assert seconds is not None and seconds >= 0.6  # the child's, not bash's own ~0
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_parent_scrape_merges_workers_and_marks_the_silent_one() -> None:
    """The parent's collector: each worker's samples with a worker label, one family each;
    a worker that does not answer is tfserve_worker_up 0 and does not fail the scrape."""
    from prometheus_client import CollectorRegistry, generate_latest

    from tfserve.telemetry.metrics import Metrics, WorkersCollector

    live = Metrics()
    live.requests.labels("Translate", "OK").inc(3)
    port = live.serve_http(0, "127.0.0.1")
    with socket.socket() as closed:  # a port that nothing listens on
        closed.bind(("127.0.0.1", 0))
        silent = closed.getsockname()[1]
    try:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(WorkersCollector([f"http://127.0.0.1:{port}/metrics",
                                            f"http://127.0.0.1:{silent}/metrics"]))
        text = generate_latest(registry).decode()
    finally:
        live.close()
    assert 'tfserve_worker_up{worker="0"} 1.0' in text
    assert 'tfserve_worker_up{worker="1"} 0.0' in text
    assert 'tfserve_requests_total{code="OK",rpc="Translate",worker="0"} 3.0' in text
    assert text.count("# TYPE tfserve_requests_total counter") == 1
