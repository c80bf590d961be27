"""Hosts: serve any session provider (normally the embedded runtime) to remote clients."""

from codemode.host.v1 import HostOptions, serve_v1_connection

__all__ = ["HostOptions", "serve_v1_connection"]
