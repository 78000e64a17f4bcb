"""The HTTP port's hard edges: connections that are idle, slow or too many, a client that
leaves in the middle of a stream, malformed requests that carry the bearer token, and refused
tokens (with the token read from a file).

Real servers on loopback (a thread, or a `python -m tfserve serve` process) and raw sockets on
127.0.0.1, so that a test sends exactly the bytes it means, as slowly as it means. Timeouts are
set small by flag; every wait is for a state (the server closing a socket, a metric, a log
record, the calls in flight), with a generous socket timeout only as a safety net.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import select
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from server_helpers import ServerProcess, ServerThread, free_port, server_args, tfserve_records

from tfserve.client import Client, ServerError
from tfserve.frontends.http_api import HttpApi
from tfserve.serving.auth import BearerAuth
from tfserve.telemetry.metrics import Metrics

SAFETY = 60.0  # seconds: how long a socket waits before a test fails, never a measurement
TOKEN = "tOk3n-SECRET-4b1d9e7fa2"
STREAM_BODY = json.dumps({"texts": ["seven"], "options": {"maxNewTokens": 12,
                                                          "minNewTokens": 12}}).encode()


@pytest.fixture(scope="module")
def runtime(random_model: Path) -> Any:
    from tfserve.runtime import Runtime

    return Runtime(random_model, intra_op_threads=1)


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture,
           monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    return tfserve_records(caplog, monkeypatch, logging.DEBUG, logger=None)


# -- raw HTTP on loopback ---------------------------------------------------------------------


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=SAFETY)


def until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed);
    fails if it is still open after SAFETY seconds."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        except TimeoutError:
            raise AssertionError(
                f"the server kept the connection open; got {received!r}") from None
        if not chunk:
            return received
        received += chunk


def closes_while_trickling(sock: socket.socket, data: bytes) -> bool:
    """Send `data` one byte at a time, each after the previous one found the connection still
    open (a wait of up to 50 ms for the server to close it paces the bytes); whether the
    server closed it before the last byte."""
    for byte in data:
        readable, _, _ = select.select([sock], [], [], 0.05)
        if readable:
            return until_closed(sock) == b""
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=SAFETY)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def dropped(server: ServerThread, reason: str) -> float:
    return server.metrics.value("tfserve_http_connections_dropped_total", {"reason": reason})


def open_connections(server: ServerThread) -> float:
    return server.metrics.value("tfserve_http_connections")


# -- 1. slow, idle and too many connections ----------------------------------------------------


NEW_FLAGS = [("--http-max-connections", 1, 1_000_000),
             ("--http-header-timeout-seconds", 0.01, 3600),
             ("--http-body-timeout-seconds", 0.01, 3600),
             ("--http-keepalive-timeout-seconds", 0.01, 86_400)]


@pytest.mark.parametrize("flag, low, high", NEW_FLAGS, ids=[flag for flag, _, _ in NEW_FLAGS])
def test_connection_settings_are_bounded_and_documented(flag: str, low: float, high: float,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    from tfserve.serving.settings import ServerConfig, parse_config

    name = flag[2:].replace("-", "_")
    for value in (low, high):
        assert getattr(parse_config([flag, str(value)], environ={}), name) == value
    for value in (low - 0.005 if low < 1 else low - 1, high + 1, float("nan")):
        with pytest.raises(ValueError, match=re.escape(f"{flag} must be in [{low}, {high}]")):
            ServerConfig(**{name: value}).validate()
    env = "TFSERVE_" + name.upper()
    assert getattr(parse_config([], environ={env: str(high)}), name) == high
    docs = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    assert f"`{flag}`" in docs and f"`{env}`" in docs


def test_slow_headers_and_bodies_are_closed(random_model: Path, runtime: Any) -> None:
    """Headers that never end, headers trickled a byte at a time, a body shorter than its
    Content-Length and a chunked body that never ends: each connection is closed by its
    deadline (counted by reason), and a client that sends its request at once is answered."""
    port = free_port()
    with ServerThread(server_args(random_model, "--http-port", str(port),
                                  "--http-header-timeout-seconds", "0.2",
                                  "--http-body-timeout-seconds", "0.2"),
                      runtime=runtime) as server:
        with connect(port) as sock:  # the headers never end
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            assert until_closed(sock) == b""
        assert dropped(server, "header_timeout") == 1
        with connect(port) as sock:  # bytes keep coming, but not the end of the headers
            assert closes_while_trickling(sock, b"GET /healthz HTTP/1.1\r\nX-Slow: "
                                          + b"a" * 4000)
        assert dropped(server, "header_timeout") == 2
        head = (b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        with connect(port) as sock:  # 8 of 100 bytes
            sock.sendall(head + b"Content-Length: 100\r\n\r\n{\"texts\"")
            assert until_closed(sock) == b""
        with connect(port) as sock:  # one chunk, then nothing
            sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"tex\r\n")
            assert until_closed(sock) == b""
        assert dropped(server, "body_timeout") == 2
        server.wait_until(lambda: open_connections(server) == 0)
        assert server.in_flight == 0  # bodies never read: no call began
        assert server.metrics.value("tfserve_requests_total", {
            "rpc": "Translate", "code": "CANCELLED"}) == 0  # nor ended
        # a request that arrives at once is answered, and its connection serves the next one
        # (an idle keep-alive connection is not a slow request)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=SAFETY)
        for _ in range(2):
            connection.request("POST", "/v1/translate", body=json.dumps({
                "texts": ["seven"], "options": {"maxNewTokens": 2}}),
                headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            assert response.status == 200, response.read()
            response.read()
        connection.close()
        assert dropped(server, "header_timeout") == 2 and dropped(server, "body_timeout") == 2


def test_idle_connections_are_closed(random_model: Path, runtime: Any) -> None:
    """A connection that sends nothing, and one idle after its answer, are closed after
    --http-keepalive-timeout-seconds (not counted as dropped: idle is not a fault)."""
    port = free_port()
    with ServerThread(server_args(random_model, "--http-port", str(port),
                                  "--http-keepalive-timeout-seconds", "0.2"),
                      runtime=runtime) as server:
        with connect(port) as sock:
            assert until_closed(sock) == b""
        with connect(port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = until_closed(sock)  # the answer, then the close
            assert answer.startswith(b"HTTP/1.1 200") and b'{"live": true}' in answer
        server.wait_until(lambda: open_connections(server) == 0)
        assert sum(dropped(server, reason) for reason in (
            "limit", "header_timeout", "body_timeout")) == 0


def test_a_flood_of_connections_leaves_grpc_metrics_and_http_answered(
        random_model: Path, runtime: Any) -> None:
    """--http-max-connections 8, held by idle and slow clients: the connections over it are
    closed as soon as they are accepted; meanwhile gRPC and the metrics port answer, and once
    a held connection closes, a new HTTP client is answered."""
    port, metrics_port = free_port(), free_port()
    held: list[socket.socket] = []
    try:
        with ServerThread(server_args(random_model, "--http-port", str(port), "--metrics-port",
                                      str(metrics_port), "--http-max-connections", "8"),
                          runtime=runtime) as server:
            for index in range(8):
                sock = connect(port)
                if index % 2:  # a slow client: headers begun, not ended
                    sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\n")
                held.append(sock)
            server.wait_until(lambda: open_connections(server) == 8)
            for _ in range(8):
                with connect(port) as extra:
                    assert until_closed(extra) == b""
            assert dropped(server, "limit") == 8
            with Client(server.target, timeout=SAFETY) as client:
                assert client.health() == "SERVING"
                assert len(client.translate(["seven"], max_new_tokens=2)) == 1
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                        timeout=SAFETY) as scrape:
                text = scrape.read().decode()
            assert "tfserve_http_connections 8.0" in text
            assert 'tfserve_http_connections_dropped_total{reason="limit"} 8.0' in text
            held.pop().close()
            server.wait_until(lambda: open_connections(server) == 7)
            assert get(port, "/healthz") == (200, b'{"live": true}')
            server.wait_until(lambda: open_connections(server) == 7)  # that client left
            # the slow clients still hold their places: their headers are not late yet
            assert dropped(server, "header_timeout") == 0
    finally:
        for sock in held:
            sock.close()


# -- 3. a client that leaves in the middle of a stream ----------------------------------------


def test_a_client_leaving_mid_stream_is_one_cancelled_record_and_no_error(
        random_model: Path, runtime: Any, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection is lost just as the server writes the stream's second event (the write
    finds the transport closing before aiohttp cancels the handler; here made certain by
    closing it from the write): one access record, CANCELLED, and nothing logged at warning
    or above, no traceback."""
    start_events = HttpApi._start_events

    async def leaving(request: Any, call: Any) -> Any:
        response = await start_events(request, call)
        if call.request_id == "leaving":
            write, writes = response.write, []

            async def write_then_lose(data: bytes) -> None:
                writes.append(data)
                if len(writes) == 2:
                    request.transport.abort()  # the client is gone at this write
                await write(data)

            response.write = write_then_lose
        return response

    monkeypatch.setattr(HttpApi, "_start_events", staticmethod(leaving))
    port = free_port()
    with ServerThread(server_args(random_model, "--http-port", str(port)),
                      runtime=runtime) as server:
        cancelled = server.metrics.value("tfserve_requests_total", {
            "rpc": "TranslateStream", "code": "CANCELLED"})
        with connect(port) as sock:
            sock.sendall(b"POST /v1/translate:stream HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nx-request-id: leaving\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(STREAM_BODY) + STREAM_BODY)
            assert until_closed(sock).count(b"data: ") == 1  # the first event, then the loss
        server.wait_until(lambda: server.in_flight == 0
                          and open_connections(server) == 0)
    records = [record for record in caplog.records if record.name == "tfserve.access"
               and getattr(record, "fields", {}).get("request_id") == "leaving"]
    assert [(r.fields["rpc"], r.fields["status"]) for r in records] == [  # type: ignore[attr-defined]
        ("TranslateStream", "CANCELLED")]
    assert server.metrics.value("tfserve_requests_total", {
        "rpc": "TranslateStream", "code": "CANCELLED"}) == cancelled + 1
    loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == []


# -- 4. malformed requests in the log -----------------------------------------------------------


def token_parts(token: str, size: int = 6) -> set[str]:
    """Every `size`-character piece of the token: none may show in a log."""
    return {token[start:start + size] for start in range(len(token) - size + 1)}


MALFORMED = [
    b"GET /v1/model HTTP/1.1\r\nHost: x\r\nAuthorization : Bearer %s\r\n\r\n",  # space, colon
    b"GET /v1/model HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\x00\r\n\r\n",  # NUL
    b"GET /v1/model HTTP/1.1\r\nHost: x\r\nAuth\x01orization: Bearer %s\r\n\r\n",
    b"GET /v1/model HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s" + b"x" * 9000 + b"\r\n\r\n",
    b"G\x01T /v1/model HTTP/1.1\r\nAuthorization: Bearer %s\r\n\r\n",
    b"GET /v1/model HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
    b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
]


def test_malformed_requests_log_one_json_line_without_the_token(random_model: Path) -> None:
    """The real server process, JSON logs: malformed requests that carry the bearer token
    (a space before the colon, a NUL, a bad header name, a header over the size limit, a bad
    method, a repeated Content-Length), a wrong token over HTTP and over gRPC, and a stream
    whose client leaves. Every line the process writes is one JSON object, none holds the
    token or a piece of it, and each malformed request is one record naming what was wrong."""
    port = free_port()
    server = ServerProcess([*server_args(random_model), "--http-port", str(port)],
                           env={"TFSERVE_AUTH_TOKEN": TOKEN})
    try:
        target = server.wait_serving()
        for raw in MALFORMED:
            with connect(port) as sock:
                sock.sendall(raw % TOKEN.encode())
                assert until_closed(sock).startswith(b"HTTP/1.")  # a 400 (or 431)
        wrong = TOKEN[:-1] + "x"
        assert get(port, "/v1/model", {"Authorization": f"Bearer {wrong}"})[0] == 401
        with Client(target, timeout=SAFETY, token=wrong) as client:
            with pytest.raises(ServerError):
                client.translate(["seven"])
        with connect(port) as sock:
            sock.sendall(b"POST /v1/translate:stream HTTP/1.1\r\nHost: x\r\n"
                         b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (TOKEN.encode(), len(STREAM_BODY))
                         + STREAM_BODY)
            assert sock.recv(1)
        server.wait_for(lambda r: r.get("rpc") == "TranslateStream")
        # each but the bad method's: aiohttp keeps an unknown method on a new connection
        # (a port scan, TLS sent to a plain port) at debug level, and so does the server
        malformed = server.wait_for_all(lambda r: r.get("event") == "bad_http_request",
                                        len(MALFORMED) - 1)
        assert all(record["reason"] and record["http_status"] >= 400 for record in malformed)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(SAFETY) == 0
        server.wait_for(lambda r: r.get("event") == "stopped")
    finally:
        server.kill()
    assert server.lines
    for line in server.lines:
        assert isinstance(json.loads(line), dict), line
        assert not [part for part in token_parts(TOKEN) if part in line], line


# -- 9. the token from a file; refused tokens counted, recorded and warned about ----------------


def test_auth_token_file(random_model: Path, runtime: Any, tmp_path: Path,
                         capsys: pytest.CaptureFixture[str]) -> None:
    """--auth-token-file (and TFSERVE_AUTH_TOKEN_FILE): the file's token, its final newline
    dropped, guards both transports; a file that cannot give a token is one line naming the
    flag, never the token."""
    from tfserve.serving.settings import parse_config

    secret = tmp_path / "token"
    secret.write_text(TOKEN + "\n")
    port = free_port()
    with ServerThread(server_args(random_model, "--http-port", str(port), "--auth-token-file",
                                  str(secret)), runtime=runtime) as server:
        assert get(port, "/v1/model")[0] == 401
        assert get(port, "/v1/model", {"Authorization": f"Bearer {TOKEN}"})[0] == 200
        with Client(server.target, timeout=SAFETY, token=TOKEN) as client:
            assert len(client.translate(["seven"], max_new_tokens=2)) == 1
        with Client(server.target, timeout=SAFETY) as client, pytest.raises(ServerError) as error:
            client.translate(["seven"])
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert parse_config([], environ={"TFSERVE_AUTH_TOKEN_FILE": str(secret)}).auth_token == TOKEN
    spaced = tmp_path / "spaced"
    spaced.write_text("two words\n")
    for argv, environ, message in (
            (["--auth-token-file", str(tmp_path / "absent")], {},
             f"--auth-token-file {tmp_path / 'absent'}: cannot read it"),
            (["--auth-token-file", str(tmp_path)], {}, "cannot read it"),
            (["--auth-token-file", str(spaced)], {}, "one line of printable ASCII"),
            (["--auth-token-file", str(secret), "--auth-token", TOKEN], {},
             "--auth-token and --auth-token-file are mutually exclusive"),
            (["--auth-token-file", str(secret)], {"TFSERVE_AUTH_TOKEN": TOKEN},
             "mutually exclusive")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            parse_config(argv, environ=environ)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and message in err and err.count("\n") == 1, err
        assert TOKEN not in err and "two words" not in err
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit):
        parse_config(["--auth-token-file", str(tmp_path / "empty")], environ={})
    assert "--auth-token-file" in capsys.readouterr().err


def test_refused_tokens_are_counted_recorded_and_warned_about(
        random_model: Path, runtime: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Missing, wrong and repeated tokens over HTTP and gRPC: each refusal is counted by
    transport and reason and has its access record (UNAUTHENTICATED, the client's request id),
    and a warning says so; none of them holds the token or a piece of it."""
    port = free_port()
    wrong = {"Authorization": f"Bearer {TOKEN[:-1]}x", "x-request-id": "http-wrong"}
    with ServerThread(server_args(random_model, "--http-port", str(port), "--auth-token",
                                  TOKEN), runtime=runtime) as server:
        assert get(port, "/v1/model", wrong)[0] == 401
        assert get(port, "/v1/models")[0] == 401
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=SAFETY)
        connection.putrequest("GET", "/openapi.json")
        for _ in range(2):
            connection.putheader("Authorization", f"Bearer {TOKEN}")
        connection.endheaders()
        assert connection.getresponse().status == 401
        connection.close()
        with Client(server.target, timeout=SAFETY, token=TOKEN[:-1] + "x") as client:
            client.metadata.append(("x-request-id", "grpc-wrong"))
            with pytest.raises(ServerError):
                client.translate(["seven"])
        with Client(server.target, timeout=SAFETY) as client, pytest.raises(ServerError):
            client.model_info()
        assert get(port, "/healthz")[0] == 200  # exempt: not a refusal
        counts = {(transport, reason): server.metrics.value("tfserve_auth_failures_total", {
            "transport": transport, "reason": reason})
            for transport in ("http", "grpc") for reason in ("missing", "wrong", "repeated")}
        assert counts == {("http", "missing"): 1, ("http", "wrong"): 1, ("http", "repeated"): 1,
                          ("grpc", "missing"): 1, ("grpc", "wrong"): 1, ("grpc", "repeated"): 0}
        assert server.metrics.value("tfserve_requests_total", {
            "rpc": "Translate", "code": "UNAUTHENTICATED"}) == 0  # not a call: its own count
    access = [record.fields for record in caplog.records  # type: ignore[attr-defined]
              if record.name == "tfserve.access"]
    assert [(f["rpc"], f["status"], f["error"]) for f in access] == [
        ("GET /v1/model", "UNAUTHENTICATED", "wrong bearer token"),
        ("GET /v1/models", "UNAUTHENTICATED", "missing bearer token"),
        ("GET /openapi.json", "UNAUTHENTICATED", "repeated bearer token"),
        ("Translate", "UNAUTHENTICATED", "wrong bearer token"),
        ("GetModelInfo", "UNAUTHENTICATED", "missing bearer token")]
    assert [f["request_id"] for f in access[::3]] == ["http-wrong", "grpc-wrong"]
    assert access[0]["peer"].startswith("http:127.0.0.1:")
    assert access[3]["peer"].startswith("ipv4:127.0.0.1:")
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert [record.fields["event"] for record in warnings] == ["auth_failed"]  # type: ignore[attr-defined]
    for record in caplog.records:
        text = f"{record.getMessage()} {getattr(record, 'fields', '')}"
        assert not [part for part in token_parts(TOKEN) if part in text], text


def test_refusal_warnings_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """One warning per interval, each counting the refusals since the one before."""
    now = [100.0]
    auth = BearerAuth(TOKEN, Metrics(), clock=lambda: now[0], interval=60.0)
    assert auth.check([f"Bearer {TOKEN}"]) == ""
    assert auth.check([f"Bearer {TOKEN}".encode()]) == ""
    assert [auth.check(given) for given in ([], [f"Bearer {TOKEN}"] * 2, ["Bearer x"])] == [
        "missing", "repeated", "wrong"]

    def warned() -> list[int]:
        return [record.fields["refused"] for record in caplog.records  # type: ignore[attr-defined]
                if record.levelno == logging.WARNING]

    for _ in range(3):
        auth.refused("http", "wrong", "GET /v1/model", "http:127.0.0.1:1")
    assert warned() == [1]
    now[0] += 59.0
    auth.refused("grpc", "missing", "Translate", "ipv4:127.0.0.1:2")
    assert warned() == [1]
    now[0] += 1.0
    auth.refused("grpc", "missing", "Translate", "ipv4:127.0.0.1:2")
    assert warned() == [1, 4]
    assert auth.metrics.value("tfserve_auth_failures_total", {
        "transport": "http", "reason": "wrong"}) == 3


OPEN_FILES = r"""
import logging, resource, sys
from tfserve.telemetry.logs import setup_logging
from tfserve.server.translator_server import open_files_for
from tfserve.serving.settings import ServerConfig
setup_logging("json", "info")
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, int(sys.argv[1])))
open_files_for(ServerConfig(max_connections=1000, http_max_connections=1000))
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
"""


def test_the_open_file_limit_is_raised_for_the_connection_limits() -> None:
    """A soft limit of 1024 open files is under what 1000 gRPC and 1000 HTTP connections
    need: it is raised to them (2256) where the hard limit allows, and a warning says so
    where it does not."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2256:
        pytest.skip(f"the hard limit on open files is {hard}")
    root = Path(__file__).resolve().parents[2]
    for given, soft, warned in ((hard if hard != resource.RLIM_INFINITY else 4096, 2256, False),
                                (1500, 1500, True)):
        done = subprocess.run([sys.executable, "-c", OPEN_FILES, str(given)], cwd=root,
                              capture_output=True, text=True, timeout=SAFETY, check=True)
        assert int(done.stdout) == soft
        records = [json.loads(line) for line in done.stderr.splitlines()]
        assert [r.get("event") for r in records] == (["open_files"] if warned else []), records


# -- 2. request bodies that break their framing -------------------------------------------------


BODY_HEAD = (b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Expect: 100-continue\r\nx-request-id: %s\r\n")


def until_continued(sock: socket.socket) -> None:
    """Wait for the server's `100 Continue`: the request's headers are in and its handler
    runs, so the bytes sent next reach it as its body (sent with the headers, bytes that break
    the body's framing are refused with the headers, before any handler)."""
    received = b""
    while not received.endswith(b"\r\n\r\n"):
        chunk = sock.recv(1)
        assert chunk, f"the server closed the connection; got {received!r}"
        received += chunk
    assert received.startswith(b"HTTP/1.1 100 "), received


def call_records(caplog: pytest.LogCaptureFixture, request_id: str) -> list[tuple[str, str]]:
    return [(r.fields["rpc"], r.fields["status"])  # type: ignore[attr-defined]
            for r in caplog.records if r.name == "tfserve.access"
            and getattr(r, "fields", {}).get("request_id") == request_id]


BAD_CHUNKS = {  # bodies that break chunked encoding, each followed by a valid end
    "bad-size": b"zz\r\n{\"texts\": [\"seven\"]}\r\n0\r\n\r\n",
    "no-crlf-after-data": b"2\r\n{}XX\r\n0\r\n\r\n",
}


def test_a_body_breaking_chunked_encoding_is_a_400_naming_it(
        random_model: Path, runtime: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A chunked body whose framing is broken (a chunk size that is not hexadecimal, chunk data
    not followed by CRLF) while its handler reads it: a 400 naming the problem without the
    body's bytes, the connection closed after it (its bytes no longer frame requests), one
    access record (INVALID_ARGUMENT) and the call counted; no error logged, no traceback."""
    port = free_port()
    with ServerThread(server_args(random_model, "--http-port", str(port)),
                      runtime=runtime) as server:
        counted = server.metrics.value("tfserve_requests_total", {
            "rpc": "Translate", "code": "INVALID_ARGUMENT"})
        for name, body in BAD_CHUNKS.items():
            with connect(port) as sock:
                sock.sendall(BODY_HEAD % name.encode() + b"Transfer-Encoding: chunked\r\n\r\n")
                until_continued(sock)
                sock.sendall(body)
                answer = until_closed(sock)
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 "), answer
            error = json.loads(payload)["error"]
            assert error["code"] == "INVALID_ARGUMENT", answer
            assert error["message"].startswith(
                "the request body is not valid chunked encoding"), answer
            assert "\n" not in error["message"] and "zz" not in error["message"]
            assert "XX" not in error["message"]
            assert call_records(caplog, name) == [("Translate", "INVALID_ARGUMENT")]
        assert server.metrics.value("tfserve_requests_total", {
            "rpc": "Translate", "code": "INVALID_ARGUMENT"}) == counted + len(BAD_CHUNKS)
    loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.levelno >= logging.ERROR or r.exc_info]
    assert loud == []


CUT_BODIES = {  # the client sends part of the body, then closes the connection
    "cut-chunked": b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n",
    "cut-length": b"Content-Length: 100\r\n\r\n{\"texts\"",
}


def test_a_client_leaving_mid_body_is_one_cancelled_record(
        random_model: Path, runtime: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A body that ends before its last chunk, or before its Content-Length, because the
    client closed the connection: the call is CANCELLED (one access record, counted), and
    nothing is logged at error level, no traceback."""
    port = free_port()
    with ServerThread(server_args(random_model, "--http-port", str(port)),
                      runtime=runtime) as server:
        for count, (name, rest) in enumerate(CUT_BODIES.items(), 1):
            with connect(port) as sock:
                sock.sendall(BODY_HEAD % name.encode() + rest.partition(b"\r\n\r\n")[0]
                             + b"\r\n\r\n")
                until_continued(sock)
                sock.sendall(rest.partition(b"\r\n\r\n")[2])
            server.wait_until(lambda count=count: server.metrics.value(
                "tfserve_requests_total", {"rpc": "Translate", "code": "CANCELLED"}) == count)
            assert call_records(caplog, name) == [("Translate", "CANCELLED")]
        server.wait_until(lambda: server.in_flight == 0
                          and open_connections(server) == 0)
    loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records
            if r.levelno >= logging.ERROR or r.exc_info]
    assert loud == []


# -- 4. aiohttp's answer to a malformed request -------------------------------------------------


def test_the_answer_to_a_malformed_request_holds_none_of_its_bytes(
        random_model: Path, runtime: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Malformed requests that carry the bearer token (MALFORMED, and a broken chunked body
    sent with its headers): each is answered with the server's JSON error, a fixed message
    naming what is wrong, and neither the answer nor the log holds the token or a piece of it."""
    port = free_port()
    broken_body = (b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\nzz%s\r\n")
    with ServerThread(server_args(random_model, "--http-port", str(port), "--auth-token",
                                  TOKEN), runtime=runtime):
        for raw in (*MALFORMED, broken_body):
            with connect(port) as sock:
                sock.sendall(raw.replace(b"%s", TOKEN.encode()))
                answer = until_closed(sock)
            assert not [part for part in token_parts(TOKEN) if part.encode() in answer], answer
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert re.match(rb"HTTP/1\.[01] (400|431) ", head), answer
            assert b"application/json" in head, answer
            error = json.loads(payload)["error"]
            assert error["code"] == "INVALID_ARGUMENT", answer
            assert error["message"].startswith("malformed HTTP request: "), answer
            assert "Bearer" not in error["message"] and "\n" not in error["message"]
    for record in caplog.records:
        text = f"{record.getMessage()} {getattr(record, 'fields', '')} {record.exc_info}"
        assert not [part for part in token_parts(TOKEN) if part in text], text


def test_timeout_header_digits_are_compared_by_length_before_int() -> None:
    # int() of a string past Python's digit limit (4300) raises ValueError: a 500 before
    from multidict import CIMultiDict, CIMultiDictProxy

    from tfserve.frontends.http_api import TIMEOUT_HEADER, request_timeout
    from tfserve.serving import InvalidArgument

    def timeout(value: str) -> float:
        return request_timeout(CIMultiDictProxy(CIMultiDict({TIMEOUT_HEADER: value})))

    with pytest.raises(InvalidArgument, match=TIMEOUT_HEADER):
        timeout("9" * 5000)
    assert timeout("0" * 5000 + "1500") == 1.5
