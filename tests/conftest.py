"""Settings every test needs before anything is imported."""

import os

# The runtime forks engine processes with a pre-exec hook; gRPC's fork handlers make such children
# crash while gRPC threads run (codemode.grpc_stubs sets the same default for users).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
