"""The server under bad input, misbehaving clients and faults: it never dies, never fails an
innocent request, never loses an answer, and names what was wrong.

Real servers on loopback (a thread, or a `python -m tfserve serve` process) and real clients
(in-process channels, or client processes that cancel, time out and are killed mid-stream).
Work is long by construction (min_new_tokens on a random model that rarely emits eos) and the
tests wait on states (a chunk received, a log record, a process exit), never on time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from server_helpers import (
    ROOT,
    ProcessGate,
    ServerProcess,
    ServerThread,
    free_port,
    rss_bytes,
    server_args,
)

from tfserve.client import Client, ServerError
from tfserve.proto import load as load_stubs

pb2, pb2_grpc = load_stubs()
TRANSLATE = "/tfserve.v1.Translator/Translate"
STREAM = "/tfserve.v1.Translator/TranslateStream"
ENCODE = "/tfserve.v1.Translator/Encode"


@pytest.fixture(scope="module")
def model(random_model: Path) -> Path:
    return random_model


def long_request(request_id: str = "", tokens: int = 100) -> bytes:
    """A request that decodes exactly `tokens` tokens: work long by construction."""
    return pb2.TranslateRequest(texts=["seven"], request_id=request_id, options=pb2.DecodingOptions(
        max_new_tokens=tokens, min_new_tokens=tokens)).SerializeToString()


def raw_call(target: str, method: str, payload: bytes, metadata: tuple = (),
             timeout: float = 60.0) -> tuple[grpc.StatusCode, str, bytes | None]:
    """A unary call with the bytes as given (no client-side serialization)."""
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            return grpc.StatusCode.OK, "", call(payload, metadata=metadata, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", None


def requests_counted(server: ServerThread, rpc: str, code: str) -> float:
    return server.metrics.value("tfserve_requests_total", {"rpc": rpc, "code": code})


# -- client processes that go away mid-stream ------------------------------------------

CLIENT = r"""
import sys, grpc
sys.path.insert(0, sys.argv[4])
from tfserve.proto import load
pb2, pb2_grpc = load()
target, mode, request_id = sys.argv[1], sys.argv[2], sys.argv[3]
channel = grpc.insecure_channel(target)
stub = pb2_grpc.TranslatorStub(channel)
request = pb2.TranslateRequest(texts=["seven", "twelve"], request_id=request_id,
    options=pb2.DecodingOptions(max_new_tokens=120, min_new_tokens=120,
                                do_sample=mode.endswith("sample"), seed=1))
stream = stub.TranslateStream(request, timeout=0.3 if mode.startswith("deadline") else None)
try:
    for number, chunk in enumerate(stream):
        if number == 1:
            print("streaming", flush=True)
            if mode.startswith("cancel"):
                stream.cancel()
                print("cancelled", flush=True)
                break
    else:
        print("OK", flush=True)
except grpc.RpcError as exc:
    print(exc.code().name, flush=True)
"""


def test_streams_that_end_early_never_take_the_server_down(model: Path) -> None:
    """Greedy and sampling streams cancelled by the client, ended by their deadline, or whose
    client process is killed mid-stream, in a loop: the server process lives on and answers
    as it did before them (before, the first such stream killed it with SIGSEGV).

    Each round starts its six clients while the server's decoder steps are held (a
    ProcessGate): the deadline streams cannot finish before their deadline, whatever the
    machine's speed, and end DEADLINE_EXCEEDED; then the steps go on and the other streams
    are cancelled or killed once they have a chunk."""
    modes = ["cancel", "cancel-sample", "deadline", "deadline-sample", "kill", "kill-sample"]
    with ProcessGate() as gate:
        server = ServerProcess(server_args(model, "--max-batch-size", "8"), gate=gate)
        try:
            target = server.wait_serving()
            with Client(target) as client:
                before = client.translate(["seven"], max_new_tokens=5)
            for round_ in range(3):
                gate.hold()
                clients = {mode: subprocess.Popen(
                    [sys.executable, "-c", CLIENT, target, mode, f"r{round_}-{mode}", str(ROOT)],
                    stdout=subprocess.PIPE, text=True) for mode in modes}
                outputs: dict[str, list[str]] = {}
                for mode in ("deadline", "deadline-sample"):
                    out, _ = clients[mode].communicate(timeout=60)
                    outputs[mode] = out.split()
                gate.release()
                for mode, proc in clients.items():
                    if mode.startswith("kill"):
                        assert proc.stdout is not None
                        assert proc.stdout.readline().strip() == "streaming"
                        proc.send_signal(signal.SIGKILL)
                    if mode not in outputs:
                        out, _ = proc.communicate(timeout=60)
                        outputs[mode] = out.split()
                assert {mode: outputs[mode] for mode in modes} == {
                    "cancel": ["streaming", "cancelled"],
                    "cancel-sample": ["streaming", "cancelled"],
                    "deadline": ["DEADLINE_EXCEEDED"], "deadline-sample": ["DEADLINE_EXCEEDED"],
                    "kill": [], "kill-sample": []}, round_  # killed: after its first line
                assert server.proc.poll() is None, "".join(server.lines[-30:])
            with Client(target) as client:
                assert client.translate(["seven"], max_new_tokens=5) == before
            # every stream ends with exactly one access-log record (the server writes it when
            # it has seen the stream end, which may come after the client has gone)
            expected = sorted(f"r{r}-{m}" for r in range(3) for m in modes)
            server.wait_for_all(lambda record: record.get("rpc") == "TranslateStream",
                                len(expected))
            ids = [record["request_id"] for record in server.records()
                   if record.get("rpc") == "TranslateStream"]
            assert sorted(ids) == expected
            codes = {record["request_id"]: record.get("status") for record in server.records()
                     if record.get("rpc") == "TranslateStream"}
            assert {codes[f"r{r}-{m}"] for r in range(3) for m in ("deadline",
                                                                   "deadline-sample")} == {
                "DEADLINE_EXCEEDED"}
        finally:
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
                assert server.proc.wait(60) == 0
            server.kill()


# -- bad input ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(model: Path):  # type: ignore[no-untyped-def]
    with ServerThread(server_args(model, "--max-batch-size", "8")) as running:
        yield running


@pytest.mark.parametrize("payload", [
    b"\xff\xff\xff\xff",  # not a message
    long_request()[:-3],  # truncated
    bytes(b ^ 0x55 for b in long_request()),  # bit-flipped
    b"\x0a\x03\xff\xfe\xfd",  # texts[0] is invalid UTF-8
], ids=["random", "truncated", "flipped", "utf8"])
def test_malformed_messages_are_invalid_argument_logged_and_counted(
        server: ServerThread, payload: bytes, caplog: pytest.LogCaptureFixture) -> None:
    before = requests_counted(server, "Translate", "INVALID_ARGUMENT")
    with caplog.at_level("INFO", logger="tfserve.access"):
        code, details, _ = raw_call(server.target, TRANSLATE, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid tfserve.v1.TranslateRequest message" in details
    assert requests_counted(server, "Translate", "INVALID_ARGUMENT") == before + 1
    assert any(getattr(r, "fields", {}).get("status") == "INVALID_ARGUMENT"
               for r in caplog.records)


@pytest.mark.parametrize("request_id", ["a\nb", "café", "nul\x00", "x" * 20_000],
                         ids=["newline", "non-ascii", "nul", "20k"])
def test_request_ids_are_checked_before_any_work(server: ServerThread, request_id: str) -> None:
    steps = server.scheduler.stats.steps
    for method in (TRANSLATE, STREAM):
        payload = pb2.TranslateRequest(texts=["seven"], request_id=request_id).SerializeToString()
        if method == STREAM:
            with grpc.insecure_channel(server.target) as channel:
                call = channel.unary_stream(method)
                with pytest.raises(grpc.RpcError) as raised:
                    list(call(payload, timeout=60))
                code, details = raised.value.code(), raised.value.details()
        else:
            code, details, _ = raw_call(server.target, method, payload)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "request_id" in details and len(details) < 300
    assert server.scheduler.stats.steps == steps  # refused up front: no work done


def test_a_huge_text_is_refused_by_its_length_without_tokenizing(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = server.runtime.tokenizer
    seen: list[int] = []
    real_encode = tokenizer.encode_text  # what the server tokenizes a text's own words with
    monkeypatch.setattr(tokenizer, "encode_text", lambda text: seen.append(len(text)) or
                        real_encode(text))
    huge = "seven " * 1_000_000  # 6 MB
    # a document (split_sentences, the default) over --max-document-characters is refused
    # before it is split or tokenized
    payload = pb2.TranslateRequest(texts=["seven", huge]).SerializeToString()
    code, details, _ = raw_call(server.target, TRANSLATE, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("texts[1] is 6000000 characters, over the limit of 1000000 "
                              "characters per document")
    assert all(length < 10_000 for length in seen)
    # one sequence (split_sentences false): refused by the source limit's characters
    payload = pb2.TranslateRequest(texts=["seven", huge],
                                   split_sentences=False).SerializeToString()
    code, details, _ = raw_call(server.target, TRANSLATE, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("texts[1] is 6000000 characters, over the limit of 8192")
    assert all(length < 10_000 for length in seen)
    # truncate=true cuts it before the tokenizer sees it, and translates
    payload = pb2.TranslateRequest(texts=[huge], truncate=True, split_sentences=False,
                                   options=pb2.DecodingOptions(
                                       max_new_tokens=3)).SerializeToString()
    code, details, _ = raw_call(server.target, TRANSLATE, payload)
    assert code == grpc.StatusCode.OK, details
    assert max(seen) <= 8192


def test_unbounded_strings_are_never_echoed(server: ServerThread) -> None:
    payload = pb2.EncodeRequest(texts=["seven"], pooling="p" * 1_000_000).SerializeToString()
    code, details, _ = raw_call(server.target, ENCODE, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("pooling must be one of") and len(details) < 200


@pytest.mark.parametrize("penalty", [1e308, -1e308, 1000.0, -1000.0])
def test_extreme_length_penalties_are_refused_and_hurt_nobody(
        server: ServerThread, penalty: float) -> None:
    with Client(server.target) as client:
        with pytest.raises(ServerError,
                           match=r"INVALID_ARGUMENT: options.length_penalty must be in"):
            client.translate(["seven"], num_beams=4, length_penalty=penalty)
        assert client.translate(["seven"], num_beams=4, length_penalty=9.5, max_new_tokens=8)


def test_a_response_over_the_message_limit_is_counted_as_what_the_client_sees(
        model: Path) -> None:
    with ServerThread(server_args(model, "--max-message-bytes", "4096")) as small:
        payload = pb2.EncodeRequest(texts=["seven twelve"] * 8,
                                    return_hidden_states=True).SerializeToString()
        code, details, _ = raw_call(small.target, ENCODE, payload)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "over the server's --max-message-bytes of 4096" in details
        assert requests_counted(small, "Encode", "RESOURCE_EXHAUSTED") == 1
        assert requests_counted(small, "Encode", "OK") == 0


def test_two_authorization_headers_are_refused(model: Path) -> None:
    with ServerThread(server_args(model, "--auth-token", "right")) as guarded:
        payload = pb2.TranslateRequest(texts=["seven"], options=pb2.DecodingOptions(
            max_new_tokens=2)).SerializeToString()
        ok, _, _ = raw_call(guarded.target, TRANSLATE, payload,
                            metadata=(("authorization", "Bearer right"),))
        assert ok == grpc.StatusCode.OK
        for headers in ((("authorization", "Bearer wrong"), ("authorization", "Bearer right")),
                        (("authorization", "Bearer right"), ("authorization", "Bearer right"))):
            code, details, _ = raw_call(guarded.target, TRANSLATE, payload, metadata=headers)
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert "more than one" in details


# -- faults through a running server -------------------------------------------------

FAULTS = r"""
import contextlib, fcntl, json, os, random, socket, sys, grpc
sys.path.insert(0, sys.argv[3])
from tfserve.proto import load
pb2, pb2_grpc = load()
target, seed, gate_path = sys.argv[1], int(sys.argv[2]), sys.argv[5]


@contextlib.contextmanager
def steps_held():
    # the server's decoder steps wait while this listener is at the gate's path (a
    # ProcessGate's): a request cannot finish before its deadline, whatever the machine's
    # speed; one client at a time holds it (the lock), and closing lets every step go on
    with open(gate_path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(gate_path)
        listener.listen(64)
        try:
            yield
        finally:
            os.unlink(gate_path)
            listener.close()


rng = random.Random(seed)
channel = grpc.insecure_channel(target)
stub = pb2_grpc.TranslatorStub(channel)
raw = channel.unary_unary("/tfserve.v1.Translator/Translate")
texts = ["seven", "twelve", "three hundred and forty-two", "nine"]
outcomes = []
for number in range(int(sys.argv[4])):
    kind = rng.choice(["innocent", "innocent", "innocent", "cancel", "deadline", "invalid",
                       "malformed", "penalty", "beams"])
    request_id = f"s{seed}-{number}-{kind}"
    text = rng.choice(texts)
    options = pb2.DecodingOptions(max_new_tokens=rng.choice([4, 9, 30]))
    if kind == "beams":
        options = pb2.DecodingOptions(max_new_tokens=9, num_beams=3, num_return_sequences=2)
    if kind == "penalty":
        options = pb2.DecodingOptions(num_beams=2, length_penalty=rng.choice([1e308, -5e3]))
    if kind == "invalid":
        options = pb2.DecodingOptions(max_new_tokens=10**9)
    request = pb2.TranslateRequest(texts=[text], request_id=request_id, options=options)
    try:
        if kind == "malformed":
            raw(b"\x0a\x02\xff\xfe" + request.SerializeToString(), timeout=60)
        elif kind == "cancel":
            stream = stub.TranslateStream(pb2.TranslateRequest(
                texts=[text], request_id=request_id, options=pb2.DecodingOptions(
                    max_new_tokens=100, min_new_tokens=100)))
            next(stream)
            stream.cancel()
            raise grpc.RpcError()
        elif kind == "deadline":
            with steps_held():
                stub.Translate(pb2.TranslateRequest(texts=[text], request_id=request_id,
                    options=pb2.DecodingOptions(max_new_tokens=120, min_new_tokens=120)),
                    timeout=0.3)
        else:
            response = stub.Translate(request, timeout=60)
            outcomes.append([kind, request_id, "OK", text, options.SerializeToString().hex(),
                             [list(h.token_ids) for h in response.translations[0].hypotheses]])
            continue
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") and exc.code() else "CANCELLED"
        outcomes.append([kind, request_id, code, text, "", []])
        continue
    outcomes.append([kind, request_id, "OK", text, "", []])
print(json.dumps(outcomes), flush=True)
"""


def test_random_faults_through_a_running_server(model: Path) -> None:
    """Client processes send a random mix of innocent requests, cancelled streams, deadlines,
    invalid and malformed requests and extreme options, all at once, a bounded number each.
    Invariants: the process lives; every innocent request is answered, with the answer it
    gets alone; each fault ends with its own status (a deadline request is sent while its
    client holds the server's decoder steps, so it ends DEADLINE_EXCEEDED on any machine);
    every request has exactly one access-log record; RSS comes back near its baseline."""
    with ProcessGate() as gate:
        server = ServerProcess(server_args(model, "--max-batch-size", "8"), gate=gate)
        try:
            target = server.wait_serving()
            with Client(target) as client:  # warm up, then take the baseline
                for text in ("seven", "twelve"):
                    client.translate([text], max_new_tokens=30)
            baseline = rss_bytes(server.proc.pid)
            clients = [subprocess.Popen([sys.executable, "-c", FAULTS, target, str(seed), str(ROOT),
                                         "40", str(gate.path)], stdout=subprocess.PIPE, text=True)
                       for seed in range(4)]
            outcomes = []
            for proc in clients:
                out, _ = proc.communicate(timeout=600)
                assert proc.returncode == 0
                outcomes += json.loads(out)
            assert server.proc.poll() is None, "".join(server.lines[-30:])
            innocent = [o for o in outcomes if o[0] in ("innocent", "beams")]
            assert innocent and all(o[2] == "OK" for o in innocent), [
                o for o in innocent if o[2] != "OK"]
            with Client(target) as client:
                for kind, _, _, text, options_hex, hypotheses in innocent:
                    options = pb2.DecodingOptions.FromString(bytes.fromhex(options_hex))
                    alone = client.translate_hypotheses(
                        [text], max_new_tokens=options.max_new_tokens,
                        num_beams=options.num_beams or 1,
                        num_return_sequences=options.num_return_sequences or 1)
                    assert [list(h.token_ids) for h in alone[0]] == hypotheses, kind
            assert {o[2] for o in outcomes if o[0] in ("invalid", "malformed", "penalty")} == {
                "INVALID_ARGUMENT"}
            assert {o[2] for o in outcomes if o[0] == "deadline"} == {"DEADLINE_EXCEEDED"}
            assert {o[2] for o in outcomes if o[0] == "cancel"} == {"CANCELLED"}
            # the server writes a record when it has seen the call end, which may come after
            # its client has gone: wait for one per request before counting them
            ids = {request_id for kind, request_id, *_ in outcomes if kind != "malformed"}
            server.wait_for_all(lambda record: record.get("logger") == "tfserve.access"
                                and record.get("request_id") in ids, len(ids))
            logged: dict[str, int] = {}
            for record in server.records():
                if record.get("logger") == "tfserve.access":
                    logged[record["request_id"]] = logged.get(record["request_id"], 0) + 1
            for kind, request_id, *_ in outcomes:
                if kind == "malformed":
                    continue  # its id is inside the bytes that did not parse
                assert logged.get(request_id) == 1, (request_id, logged.get(request_id))
            # memory: what the requests took is given back or reused (a leak per request of the
            # 160 would show as tens of MB)
            assert rss_bytes(server.proc.pid) < baseline + 64 * 2**20
        finally:
            if server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
                assert server.proc.wait(60) == 0
            server.kill()


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                                reason="reads process memory from /proc (Linux)")


# -- start-up: flags and their limits ------------------------------------------------------------


@pytest.mark.parametrize("flag, value, message", [
    ("--max-message-bytes", str(2**40), "--max-message-bytes must be in [1024, 2147483647]"),
    ("--max-wait-ms", "inf", "--max-wait-ms must be in [0, 10000], got inf"),
    ("--max-wait-ms", "nan", "--max-wait-ms must be in [0, 10000], got nan"),
    ("--grace-seconds", "1e9", "--grace-seconds must be in [0, 3600]"),
    ("--max-batch-size", "100000", "--max-batch-size must be in [1, 4096]"),
    ("--max-concurrent-streams", "0", "--max-concurrent-streams must be in [1, 100000]"),
    ("--max-connection-age-seconds", "-1", "--max-connection-age-seconds must be in [0, 86400]"),
])
def test_numeric_flags_are_bounded(flag: str, value: str, message: str) -> None:
    from tfserve.serving.settings import parse_config

    with pytest.raises(SystemExit) as exited:
        parse_config([flag, value], environ={})
    assert exited.value.code == 2
    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        from tfserve.serving.settings import ServerConfig

        ServerConfig(**{flag[2:].replace("-", "_"): float(value) if "." in value or value in (
            "inf", "nan") else int(float(value))}).validate()


def test_a_garbage_pem_is_named_at_start(tmp_path: Path, model: Path) -> None:
    garbage = tmp_path / "cert.pem"
    garbage.write_bytes(os.urandom(512))
    proc = subprocess.run(
        [sys.executable, "-m", "tfserve", "serve", *server_args(model), "--tls-cert",
         str(garbage), "--tls-key", str(garbage)], cwd=ROOT, capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert proc.returncode == 2
    assert f"--tls-cert {garbage}: not a PEM file" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- security: limits on what clients hold, mutual TLS, metrics bind address ----------------------


def test_connections_beyond_the_limit_are_refused(model: Path) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with ServerThread(server_args(model, "--max-connections", "2")) as limited:
        channels = [grpc.insecure_channel(limited.target, options=[
            ("grpc.use_local_subchannel_pool", 1)]) for _ in range(3)]
        try:
            codes = []
            for channel in channels:  # each holds its connection open
                try:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
            assert codes == [grpc.StatusCode.OK, grpc.StatusCode.OK,
                             grpc.StatusCode.UNAVAILABLE]
        finally:
            for channel in channels:
                channel.close()


def _certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for localhost and a client certificate, all from the CA."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    for name, extension in (("server", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
                            ("client", "extendedKeyUsage=clientAuth")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout",
            f"{name}.key", "-out", f"{name}.csr")
        (directory / f"{name}.ext").write_text(extension + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
    return {name: directory / name for name in (
        "ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.mark.skipif(not __import__("shutil").which("openssl"), reason="needs the openssl tool")
def test_mutual_tls_requires_a_client_certificate_from_the_ca(tmp_path: Path,
                                                              model: Path) -> None:
    files = _certificates(tmp_path)
    args = server_args(model, "--tls-cert", str(files["server.pem"]), "--tls-key",
                       str(files["server.key"]), "--tls-client-ca", str(files["ca.pem"]))
    with ServerThread(args) as secure:
        target = f"localhost:{secure.port}"
        payload = pb2.TranslateRequest(texts=["seven"], options=pb2.DecodingOptions(
            max_new_tokens=2)).SerializeToString()
        ca = files["ca.pem"].read_bytes()
        for credentials, expected in (
            (grpc.ssl_channel_credentials(ca), grpc.StatusCode.UNAVAILABLE),
            (grpc.ssl_channel_credentials(ca, files["client.key"].read_bytes(),
                                          files["client.pem"].read_bytes()),
             grpc.StatusCode.OK),
        ):
            with grpc.secure_channel(target, credentials) as channel:
                call = channel.unary_unary(TRANSLATE)
                try:
                    call(payload, timeout=20)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as exc:
                    code = exc.code()
            assert code == expected


def test_metrics_bind_their_own_host_and_answer_only_on_metrics(model: Path) -> None:
    import urllib.error
    import urllib.request

    port = free_port()
    args = ["--model", str(model), "--host", "0.0.0.0", "--port", "0", "--metrics-host",
            "127.0.0.1", "--metrics-port", str(port), "--http-port", "0", "--threads", "1",
            "--log-level", "warning"]
    with ServerThread(args) as running:
        assert running.metrics._http.server_address[0] == "127.0.0.1"
        url = f"http://127.0.0.1:{running.core.metrics_port}"
        assert b"tfserve_requests_total" in urllib.request.urlopen(f"{url}/metrics").read()
        for path in ("/healthz", "/v2/health/ready", "/"):
            with pytest.raises(urllib.error.HTTPError) as raised:
                urllib.request.urlopen(url + path)
            assert raised.value.code == 404


# -- connection limits in motion -----------------------------------------------------------------


def test_connections_are_recycled_after_their_age(model: Path) -> None:
    """--max-connection-age-seconds: the server closes a connection once it is that old and
    the client reconnects on its own (with --workers, the kernel then spreads it again, so a
    restarted worker gets traffic back). Seen as a second client port in the access log; no
    call fails."""
    server = ServerProcess(server_args(model, "--max-connection-age-seconds", "0.5"))
    try:
        target = server.wait_serving()
        peers: set[str] = set()
        with Client(target, timeout=60) as client:
            for number in range(100_000):  # ends when the state is seen
                request_id = f"age-{number}"
                client.translate(["seven"], max_new_tokens=1, request_id=request_id)
                record = server.wait_for(lambda r, rid=request_id: r.get("request_id") == rid)
                assert record["status"] == "OK"
                peers.add(record["peer"])
                if len(peers) == 2:
                    break
        assert len(peers) == 2
    finally:
        server.kill()


def test_streams_beyond_the_per_connection_limit_wait(model: Path) -> None:
    """--max-concurrent-streams 2: with two streams held open on a connection, a third call on
    it cannot start (it ends at its own deadline), while another connection is served."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with ServerThread(server_args(model, "--max-concurrent-streams", "2")) as limited:
        options = [("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(limited.target, options=options) as busy, \
                grpc.insecure_channel(limited.target, options=options) as other:
            stub = health_pb2_grpc.HealthStub(busy)
            watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
            for watch in watches:
                assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as raised:
                stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert health_pb2_grpc.HealthStub(other).Check(
                health_pb2.HealthCheckRequest(), timeout=60).status == (
                    health_pb2.HealthCheckResponse.SERVING)
            for watch in watches:
                watch.cancel()


def test_large_requests_are_tokenized_off_the_event_loop(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    tokenizer = server.runtime.tokenizer
    threads: list[tuple[int, str]] = []
    real_encode = tokenizer.encode_text  # what the server tokenizes a text's own words with

    def encode(text: str) -> list[int]:
        threads.append((len(text), threading.current_thread().name))
        return real_encode(text)

    monkeypatch.setattr(tokenizer, "encode_text", encode)
    with Client(server.target, timeout=60) as client:
        # each text one sequence (split_sentences false): one tokenization each
        client.translate(["seven"], max_new_tokens=1, split_sentences=False)
        client.translate(["seven " * 900], max_new_tokens=1, truncate=True,  # 5400 characters
                         split_sentences=False)
        (small, small_thread), (large, large_thread) = threads
        assert small == 5 and small_thread == "test-server"  # inline: cheaper than a hand-off
        assert large == 5400 and large_thread != "test-server"
        # a large document is split and tokenized off the event loop too
        threads.clear()
        client.translate(["seven. " * 800], max_new_tokens=1)
    assert threads and all(thread != "test-server" for _, thread in threads)
