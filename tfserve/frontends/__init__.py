"""The front ends: each converts one wire format into the serving core's plain values and back,
and nothing else (the checks, the calls' bookkeeping and each RPC's steps are the core's,
tfserve.serving).

    front_end    FrontEnd, the steps a server process runs on each of its front ends, and
                 Shared, what they share (the core, readiness, the bearer token's check)
    messages     the tfserve.v1 messages <-> the core's plain values, and their JSON mapping
    grpc_api     tfserve.v1.Translator over gRPC: the servicer, GrpcCall, Status -> gRPC code
    grpc_server  the gRPC front end: grpc.aio server, TLS, auth, health, reflection
    http_api     HTTP/JSON: the routes, HttpCall, server-sent events, probes, the
                 playground page (static/)
    http_errors  Status -> HTTP status, the JSON error body, aiohttp's own errors in it
    http_server  the HTTP front end: the aiohttp listener, TLS, connection limits
    openapi      GET /openapi.json from the route table and the proto
    oip_*        the Open Inference Protocol: its tensors <-> the core's plain values
                 (oip_tensors), its REST routes on the HTTP front end (oip_rest) and its
                 gRPC service on the gRPC one (oip_grpc)

A new front end on a listener of its own is a module here with a factory (`Shared` -> its
FrontEnd) and one entry in tfserve.server.translator_server's FRONT_ENDS; a new protocol on
an existing listener adds its routes or service there, as the Open Inference Protocol does.
"""

from tfserve.frontends.front_end import FrontEnd, FrontEndFactory, Readiness, Shared

__all__ = ["FrontEnd", "FrontEndFactory", "Readiness", "Shared"]
