"""Container health check: exit 0 when the server's gRPC health service answers SERVING.

    python /opt/tfserve/healthcheck.py [--port N] [--service NAME] [--timeout S]

The image's HEALTHCHECK runs this inside the container. It asks `grpc.health.v1.Health/Check`
on the local server, the same service Kubernetes' native gRPC probes ask. The port is
--port, else $TFSERVE_PORT, else 50051; the service is --service, else `tfserve.v1.Translator`
(NOT_SERVING once a drain has begun). With $TFSERVE_TLS_CERT set it connects over TLS,
trusting $TFSERVE_HEALTHCHECK_CA, else that certificate itself (fine for a self-signed one),
and checks the name $TFSERVE_HEALTHCHECK_HOST, else `localhost`, against it. Health checks
are exempt from --auth-token.

Exit codes: 0 SERVING, 1 anything else (NOT_SERVING, unreachable, timeout).
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEFAULT_SERVICE = "tfserve.v1.Translator"


def local_address(host: str) -> str:
    """Where to reach a server that listens on `host` from inside its container."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="healthcheck.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("TFSERVE_PORT") or 50051))
    parser.add_argument("--service", default=DEFAULT_SERVICE,
                        help="health service name ('' is the server as a whole)")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    if args.port == 0:
        print("unhealthy: TFSERVE_PORT=0 (an ephemeral port) cannot be checked; "
              "pass --port", file=sys.stderr)
        return 1
    target = f"{local_address(os.environ.get('TFSERVE_HOST', ''))}:{args.port}"
    cert = os.environ.get("TFSERVE_TLS_CERT")
    if cert:
        with open(os.environ.get("TFSERVE_HEALTHCHECK_CA") or cert, "rb") as handle:
            credentials = grpc.ssl_channel_credentials(root_certificates=handle.read())
        name = os.environ.get("TFSERVE_HEALTHCHECK_HOST", "localhost")
        channel = grpc.secure_channel(target, credentials,
                                      options=[("grpc.ssl_target_name_override", name)])
    else:
        channel = grpc.insecure_channel(target)
    try:
        with channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    except grpc.RpcError as exc:
        print(f"unhealthy: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(f"{target} {args.service or '(server)'}: {status}")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
