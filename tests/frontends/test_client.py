"""tfserve.client's channel settings: the retry policy, several addresses, round robin; and
the server's refusals that the policy retries (a draining server's UNAVAILABLE)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from server_helpers import ServerThread, server_args

from tfserve.client import (
    RETRIED_METHODS,
    RETRY_POLICY,
    SERVICE,
    AsyncClient,
    Client,
    ServerError,
    _channel_options,
    channel_target,
    pb2,
    service_config,
)


def test_the_retry_policy_covers_every_rpc_of_the_service() -> None:
    """Every Translator RPC is read-only, so every one is retried; a method added to the
    proto must be added here (or left out on purpose)."""
    service = pb2.DESCRIPTOR.services_by_name["Translator"]
    assert service.full_name == SERVICE
    assert sorted(RETRIED_METHODS) == sorted(m.name for m in service.methods)
    config = service_config()
    [method_config] = config["methodConfig"]
    assert [n["method"] for n in method_config["name"]] == list(RETRIED_METHODS)
    assert method_config["retryPolicy"] == RETRY_POLICY
    assert RETRY_POLICY["retryableStatusCodes"] == ["UNAVAILABLE", "CANCELLED"]
    assert 2 <= RETRY_POLICY["maxAttempts"] <= 5  # gRPC takes at most 5
    assert "loadBalancingConfig" not in config and "healthCheckConfig" not in config


def test_round_robin_watches_health() -> None:
    config = service_config(round_robin=True)
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": "tfserve.v1.Translator"}
    assert "healthCheckConfig" not in service_config(round_robin=True, health_service=None)
    assert service_config(retry=False) == {}


def test_channel_targets() -> None:
    assert channel_target("localhost:50051") == "localhost:50051"
    assert channel_target("dns:///tfserve-headless:50051") == "dns:///tfserve-headless:50051"
    assert channel_target(["10.0.0.5:50051"]) == "10.0.0.5:50051"
    assert (channel_target(["10.0.0.5:50051", "10.0.0.6:50052"])
            == "ipv4:10.0.0.5:50051,10.0.0.6:50052")
    assert channel_target(["[::1]:1", "[fe80::1]:2"]) == "ipv6:[::1]:1,[fe80::1]:2"
    for bad, message in ((["server-a:50051", "server-b:50051"], "IP addresses only"),
                         (["10.0.0.5:50051", "[::1]:50051"], "not both"),
                         (["10.0.0.5", "10.0.0.6:1"], "not HOST:PORT"),
                         (["10.0.0.5:0", "10.0.0.6:1"], "not HOST:PORT"),
                         ([], "no server address")):
        with pytest.raises(ValueError, match=message):
            channel_target(bad)


def options(**kwargs: Any) -> dict[str, Any]:
    return dict(_channel_options(1024, **kwargs))


def test_channel_options() -> None:
    default = options()
    assert default["grpc.enable_retries"] == 1
    assert json.loads(default["grpc.service_config"]) == service_config()
    assert options(retry=False)["grpc.enable_retries"] == 0
    assert "grpc.service_config" not in options(retry=False)
    spread = json.loads(options(round_robin=True)["grpc.service_config"])
    assert spread["loadBalancingConfig"] == [{"round_robin": {}}]
    # the caller's own settings win
    own = options(extra=[("grpc.service_config", "{}")], round_robin=True)
    assert own["grpc.service_config"] == "{}"
    named = options(extra=[("grpc.lb_policy_name", "pick_first")], round_robin=True)
    assert "loadBalancingConfig" not in json.loads(named["grpc.service_config"])


def test_clients_take_several_addresses() -> None:
    with Client(["127.0.0.1:1", "127.0.0.1:2"]) as client:
        assert client.target == "ipv4:127.0.0.1:1,127.0.0.1:2"

    async def main() -> str:
        async with AsyncClient(["127.0.0.1:1", "127.0.0.1:2"]) as client:
            return client.target

    assert asyncio.run(main()) == "ipv4:127.0.0.1:1,127.0.0.1:2"


def refused(server: ServerThread) -> float:
    return sum(server.metrics.registry.get_sample_value(
        "tfserve_requests_total", {"rpc": rpc, "code": "UNAVAILABLE"}) or 0.0
        for rpc in ("Translate", "TranslateStream"))


def test_a_draining_server_refusal_is_retried(random_model: Path) -> None:
    """A draining server answers UNAVAILABLE with trailers only, the one answer gRPC
    retries: tfserve's client tries each call RETRY_POLICY["maxAttempts"] times (here, one
    server, every attempt refused), a stream too; without retries, once."""
    attempts = RETRY_POLICY["maxAttempts"]
    with ServerThread(server_args(random_model)) as server:
        async def drain() -> None:
            server.server.core.begin_drain()

        server.run_on_loop(drain)
        with Client(server.target, timeout=60) as client:
            with pytest.raises(ServerError) as error:
                client.translate(["seven"], max_new_tokens=2)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in error.value.details()
            assert refused(server) == attempts
            with pytest.raises(ServerError) as error:
                list(client.translate_stream(["seven"], max_new_tokens=2))
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert refused(server) == 2 * attempts
        with Client(server.target, timeout=60, retry=False) as plain:
            with pytest.raises(ServerError):
                plain.translate(["seven"], max_new_tokens=2)
            assert refused(server) == 2 * attempts + 1


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.INTERNAL])
def test_which_answers_are_retried(code: grpc.StatusCode) -> None:
    """A stand-in server that answers every call with `code` (trailers-only, as a stopping
    server does): the retryable codes are tried maxAttempts times, others once."""
    from tfserve.client import pb2_grpc

    attempts = []

    class Refusing(pb2_grpc.TranslatorServicer):
        async def Translate(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
            attempts.append(code)
            await context.abort(code, "refused")

    async def main() -> grpc.StatusCode:
        server = grpc.aio.server()
        pb2_grpc.add_TranslatorServicer_to_server(Refusing(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}", timeout=60) as client:
                with pytest.raises(ServerError) as error:
                    await client.translate(["seven"])
                return error.value.code()
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == code
    retried = code.name in RETRY_POLICY["retryableStatusCodes"]
    assert len(attempts) == (RETRY_POLICY["maxAttempts"] if retried else 1)
