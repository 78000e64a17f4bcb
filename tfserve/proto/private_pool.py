"""The descriptor pool of the Open Inference Protocol's generated messages
(tfserve.proto.inference, from proto/inference/grpc_service.proto).

tritonclient and kserve register the protocol's `inference.*` messages in protobuf's default
pool; a second registration of those names there would fail whichever module imports last.
The build (tfserve/proto/build.py) makes tfserve's generated modules register them here
instead, so that a server and either client live in one process. Messages of this pool
serialize, parse and serve over gRPC as any others.
"""

from __future__ import annotations

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
