"""Replicas of `python -m tfserve serve` behind a balancer (issue 30): HAProxy from Debian's
packages running docker/proxy/haproxy.cfg as shipped, and tfserve's client balancing on its
own (round robin over the replicas' addresses, no proxy).

Each scenario shows, on three real server processes on loopback ports serving the bundled
demo:
- every replica answers some of the calls (its own Prometheus counters);
- a replica killed (SIGKILL) while it holds calls fails exactly those calls for a client
  without retries, and none for tfserve's client, whose retry policy sends them again;
- a replica draining on SIGTERM gets no new call once the balancer saw its health go
  NOT_SERVING, while the others keep answering.

Nothing here waits on time: a replica holds calls because its decoder steps are held
(ProcessGate), the kill happens once its metrics count every load thread's call in flight,
and the waits are for states (a log record, a health status, HAProxy's view of a server, a
counter), each in a bounded loop with a generous deadline as a safety net.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from server_helpers import ROOT, ProcessGate, ServerProcess, free_port, server_args

from tfserve.client import Client, ServerError, translate_request
from tfserve.proto import translator_pb2_grpc as pb2_grpc

HAPROXY_CONFIG = ROOT / "docker" / "proxy" / "haproxy.cfg"
REPLICAS = 3
TEXTS = ["seven", "twenty-one", "three hundred and forty-two"]
SPREAD_CALLS = 30  # calls that show every replica answers
THREADS = 3  # load threads per client kind during the kill
LOAD_CALLS = 30  # calls per client kind during the kill
AFTER_DRAIN_CALLS = 12  # calls sent once the balancer took the draining replica out
WAIT_S = 60.0  # the safety net of every wait for a state


def _wait(predicate: Callable[[], bool], what: str, poll: Callable[[], None] = lambda: None,
          timeout: float = WAIT_S) -> None:
    """Wait until predicate() holds, calling poll() between checks (a call that moves the
    state along, or a short pause while another process changes it)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        poll()


def scrape(metrics_port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A replica's Prometheus samples, keyed by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class Replica:
    """One `tfserve serve` process with its own gRPC, HTTP and metrics ports."""

    def __init__(self, model: Path, gate: ProcessGate | None = None) -> None:
        self.metrics_port = free_port()
        self.http_port = free_port()
        self.process = ServerProcess(
            server_args(model, "--metrics-port", str(self.metrics_port), "--http-port",
                        str(self.http_port), "--grace-seconds", "60"), gate=gate)
        self.address = ""

    def wait_serving(self) -> str:
        self.address = self.process.wait_serving()
        return self.address

    def calls(self) -> int:
        """Translate calls this replica finished, whatever their status (a call it refused
        while draining counts too: it reached the replica)."""
        return int(sum(value for (name, labels), value in scrape(self.metrics_port).items()
                       if name == "tfserve_requests_total" and ("rpc", "Translate") in labels))

    def in_flight(self) -> int:
        return int(scrape(self.metrics_port)[("tfserve_in_flight_requests", ())])

    def health(self) -> str:
        with Client(self.address, timeout=30, retry=False) as client:
            return client.health("tfserve.v1.Translator")

    def kill(self) -> None:
        self.process.kill()


@pytest.fixture(scope="module")
def demo_model() -> Path:
    from exported import demo_artifacts, demo_trained

    if not demo_trained():
        pytest.skip("the demo checkpoint (tfserve/demo/checkpoint/model.safetensors) is not "
                    "trained yet")
    return demo_artifacts()


@pytest.fixture
def replicas(demo_model: Path) -> Iterator[tuple[list[Replica], ProcessGate, ProcessGate]]:
    """Three replicas, started together; the last is held by the first gate (the one to
    kill), the second by the second gate (the one to drain)."""
    with ProcessGate() as kill_gate, ProcessGate() as drain_gate:
        started = [Replica(demo_model), Replica(demo_model, drain_gate),
                   Replica(demo_model, kill_gate)]
        try:
            for replica in started:
                replica.wait_serving()
            yield started, kill_gate, drain_gate
        finally:
            for replica in started:
                replica.kill()


class Proxy:
    """haproxy -f docker/proxy/haproxy.cfg in the foreground, addresses from the
    environment as the file's header describes."""

    def __init__(self, replicas: list[Replica], log: Path) -> None:
        self.port = free_port()
        self.stats_port = free_port()
        env = dict(os.environ, TFSERVE_PROXY_BIND=f"127.0.0.1:{self.port}",
                   TFSERVE_PROXY_STATS_BIND=f"127.0.0.1:{self.stats_port}")
        for number, replica in enumerate(replicas, 1):
            env[f"TFSERVE_REPLICA{number}"] = replica.address
            env[f"TFSERVE_REPLICA{number}_HTTP_PORT"] = str(replica.http_port)
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(HAPROXY_CONFIG)],
                                         env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def servers(self) -> dict[str, str]:
        """HAProxy's status of each replica ('UP', 'DOWN', 'UP 1/2' while going down, ...);
        empty while HAProxy is not answering yet."""
        url = f"http://127.0.0.1:{self.stats_port}/stats;csv"
        try:
            with urllib.request.urlopen(url, timeout=30) as answer:
                text = answer.read().decode().removeprefix("# ")
        except (urllib.error.URLError, ConnectionError):
            assert self.proc.poll() is None, self.log.read_text()
            return {}
        return {row["svname"]: row["status"] for row in csv.DictReader(io.StringIO(text))
                if row["pxname"] == "tfserve" and row["svname"].startswith("replica")}

    def wait_status(self, expected: dict[str, str]) -> None:
        try:
            # each check is a request to HAProxy's stats page: the reads pace the wait
            _wait(lambda: all(self.servers().get(name) == status
                              for name, status in expected.items()),
                  f"HAProxy to see {expected}")
        except AssertionError as error:
            raise AssertionError(f"{error}; it sees {self.servers()}; its log:\n"
                                 f"{self.log.read_text()[-3000:]}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def outcome(client: Client) -> str:
    """One short Translate call: 'OK' or the status it failed with."""
    try:
        client.translate(TEXTS, max_new_tokens=8)
        return "OK"
    except ServerError as error:
        return error.code().name


def spread(client: Client, replicas: list[Replica], calls: int) -> list[int]:
    """`calls` calls from 3 threads: every one answered, and how many each replica took."""
    before = [replica.calls() for replica in replicas]
    with ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(lambda _: outcome(client), range(calls)))
    assert outcomes == ["OK"] * calls, outcomes
    return [replica.calls() - first for replica, first in zip(replicas, before, strict=True)]


def kill_under_load(plain: Client, retrying: Client, victim: Replica,
                    gate: ProcessGate) -> tuple[list[str], list[str]]:
    """LOAD_CALLS calls from THREADS threads for each client, at once; the victim's decoder
    steps are held, so each thread stops at the first call that lands on it. Once the victim
    holds one call of every thread it is killed and the gate opened: the others answer the
    rest. The outcomes of the client without retries, then of the one with them."""
    gate.hold()
    with ThreadPoolExecutor(THREADS) as plain_pool, ThreadPoolExecutor(THREADS) as retry_pool:
        plain_runs = plain_pool.map(lambda _: outcome(plain), range(LOAD_CALLS))
        retry_runs = retry_pool.map(lambda _: outcome(retrying), range(LOAD_CALLS))
        try:
            # each check scrapes the victim's /metrics: the reads pace the wait
            _wait(lambda: victim.in_flight() == 2 * THREADS,
                  f"the victim to hold {2 * THREADS} calls")
        finally:  # killed first, then the gate opened: the calls it holds never finish
            victim.process.proc.send_signal(signal.SIGKILL)
            gate.release()
        assert victim.process.proc.wait(WAIT_S) == -signal.SIGKILL
        return list(plain_runs), list(retry_runs)


def spread_then_kill(client: Client, plain: Client, replicas: list[Replica], victim: Replica,
                     gate: ProcessGate) -> None:
    """Every replica takes some of SPREAD_CALLS calls; then, the victim killed under load,
    the calls it held (one per thread) fail without retries and are answered with them,
    and every other call is answered."""
    per_replica = spread(client, replicas, SPREAD_CALLS)
    assert sum(per_replica) == SPREAD_CALLS and min(per_replica) > 0, per_replica
    plain_runs, retry_runs = kill_under_load(plain, client, victim, gate)
    assert sorted(plain_runs) == ["OK"] * (LOAD_CALLS - THREADS) + (
        ["UNAVAILABLE"] * THREADS), plain_runs
    assert retry_runs == ["OK"] * LOAD_CALLS, retry_runs


def start_drain(replica: Replica, gate: ProcessGate) -> tuple[grpc.Channel, Any]:
    """SIGTERM to a replica that holds one call (its decoder steps are held), so that it stays
    draining, NOT_SERVING, until the gate opens; the held call, a TranslateStream."""
    gate.hold()
    channel = grpc.insecure_channel(replica.address)
    stream = pb2_grpc.TranslatorStub(channel).TranslateStream(
        translate_request(TEXTS, max_new_tokens=8), timeout=WAIT_S)
    stream.initial_metadata()  # the server sends headers once the call is queued
    replica.process.proc.send_signal(signal.SIGTERM)
    replica.process.wait_for(lambda record: record.get("event") == "draining")
    assert replica.health() == "NOT_SERVING"
    return channel, stream


def finish_drain(replica: Replica, gate: ProcessGate, channel: grpc.Channel,
                 stream: Any) -> None:
    """Let the held call finish: it is answered in full, and the replica exits 0."""
    gate.release()
    assert sum(chunk.done for chunk in stream) == len(TEXTS)
    channel.close()
    assert replica.process.proc.wait(WAIT_S) == 0


def check_drain_is_skipped(client: Client, draining: Replica, others: list[Replica],
                           caught_up: Callable[[], bool]) -> None:
    """Calls through `client` until caught_up() (the balancer saw the drain), every one
    answered; then AFTER_DRAIN_CALLS more, none of which reaches the draining replica."""
    _wait(caught_up, "the balancer to take the draining replica out",
          lambda: assert_ok(outcome(client)))
    frozen = draining.calls()
    before = sum(replica.calls() for replica in others)
    for _ in range(AFTER_DRAIN_CALLS):
        assert_ok(outcome(client))
    assert draining.calls() == frozen
    assert sum(replica.calls() for replica in others) == before + AFTER_DRAIN_CALLS


class QuietRounds:
    """True once `rounds` calls in a row (counted by each check, one call between checks)
    left the replica's counter unchanged."""

    def __init__(self, replica: Replica, rounds: int) -> None:
        self.replica = replica
        self.rounds = rounds
        self.last = replica.calls()
        self.quiet = -1  # the first check only reads the counter

    def __call__(self) -> bool:
        now = self.replica.calls()
        self.quiet = self.quiet + 1 if now == self.last else 0
        self.last = now
        return self.quiet >= self.rounds


def assert_ok(status: str) -> None:
    assert status == "OK", status


@pytest.fixture
def haproxy() -> None:
    """Skips the test, before any replica starts, where haproxy is not installed."""
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (Debian's package haproxy: "
                    "bash .ci/proxy-setup.sh installs it)")


def test_haproxy_spreads_calls_survives_a_kill_and_skips_a_drain(
        haproxy: None, replicas: tuple[list[Replica], ProcessGate, ProcessGate],
        tmp_path: Path) -> None:
    started, kill_gate, drain_gate = replicas
    first, draining, victim = started
    proxy = Proxy(started, tmp_path / "haproxy.log")
    try:
        proxy.wait_status({f"replica{n}": "UP" for n in range(1, REPLICAS + 1)})
        with Client(proxy.target, timeout=WAIT_S) as client, \
                Client(proxy.target, timeout=WAIT_S, retry=False) as plain:
            spread_then_kill(client, plain, started, victim, kill_gate)

            channel, stream = start_drain(draining, drain_gate)
            check_drain_is_skipped(client, draining, [first], lambda: proxy.servers().get(
                "replica2") == "DOWN")
            finish_drain(draining, drain_gate, channel, stream)
    finally:
        proxy.stop()


def test_client_round_robin_spreads_calls_survives_a_kill_and_skips_a_drain(
        replicas: tuple[list[Replica], ProcessGate, ProcessGate]) -> None:
    """The same without a proxy: tfserve's client given the replicas' addresses."""
    started, kill_gate, drain_gate = replicas
    first, draining, victim = started
    addresses = [replica.address for replica in started]
    with Client(addresses, timeout=WAIT_S) as client, \
            Client(addresses, timeout=WAIT_S, retry=False) as plain:
        assert client.target.startswith("ipv4:127.0.0.1:")
        spread_then_kill(client, plain, started, victim, kill_gate)

        # the client watches each replica's health (healthCheckConfig): the draining one is
        # out once calls stop reaching it, one round over the live replicas in a row
        channel, stream = start_drain(draining, drain_gate)
        quiet = QuietRounds(draining, rounds=REPLICAS)
        check_drain_is_skipped(client, draining, [first], quiet)
        finish_drain(draining, drain_gate, channel, stream)
