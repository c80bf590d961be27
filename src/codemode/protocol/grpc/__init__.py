"""The gRPC carriage ``codex.code_mode.v1``: its interface, messages and domain conversions. No I/O.

* ``codex/code_mode/v1.proto`` — the interface definition (package data), as the specification
  pins it;
* :mod:`~codemode.protocol.grpc.v1_pb2` — its generated messages (needs the ``grpc`` extra: the
  ``protobuf`` runtime); the service bindings, which import ``grpc``, are
  :mod:`codemode.grpc_stubs.v1_pb2_grpc`;
* :mod:`~codemode.protocol.grpc.conversions` — domain values ⇄ messages;
* :mod:`~codemode.protocol.grpc.identifiers` — the identifier rules;
* :mod:`~codemode.protocol.grpc.texts` — every exact text of this carriage, by meaning;
* :mod:`~codemode.protocol.grpc.constants` — its limits and names.

This package imports nothing itself, so ``texts``, ``identifiers`` and ``constants`` work without
the extra.
"""
