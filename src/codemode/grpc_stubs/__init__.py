"""The generated gRPC service bindings of ``codex.code_mode.v1.CodeModeHost`` (needs the ``grpc`` extra).

``v1_pb2_grpc`` holds ``CodeModeHostStub`` (client side, sync and ``grpc.aio`` channels alike),
``CodeModeHostServicer`` and ``add_CodeModeHostServicer_to_server`` (host side). It is generated
by ``scripts/generate_grpc.py`` and never edited by hand; its messages live in
:mod:`codemode.protocol.grpc.v1_pb2`. It is kept out of ``codemode.protocol`` because it imports
``grpc``, an I/O library, and ``protocol/`` does no I/O (docs/decisions/0009-grpc-interface.md).
"""

import os

# The runtime forks engine processes with a pre-exec hook; gRPC's fork handlers make such
# children crash while gRPC threads run. Off unless the environment says otherwise (it only takes
# effect before ``grpc`` is first imported, which importing this package before it ensures).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
