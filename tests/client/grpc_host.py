"""``codemode host --listen grpc://127.0.0.1:0`` that lets clients ping every ``SECONDS`` (the CLI
host permits one ping every 10 s), so keepalive tests finish in seconds.

Run as ``python -m tests.client.grpc_host SECONDS`` with the repository root on the path; the
URL is the first line of stdout; it serves until it is killed.
"""

from __future__ import annotations

import asyncio
import sys

from codemode.host.grpc import GrpcHostOptions, serve_grpc
from codemode.runtime import LocalSessionProvider


async def main(min_client_ping_interval: float) -> None:
    options = GrpcHostOptions(min_client_ping_interval=min_client_ping_interval)
    async with LocalSessionProvider() as provider:
        await serve_grpc(
            provider,
            "grpc://127.0.0.1:0",
            stop=asyncio.Event(),
            options=options,
            ready=lambda url: print(url, flush=True),
        )


if __name__ == "__main__":
    asyncio.run(main(float(sys.argv[1])))
