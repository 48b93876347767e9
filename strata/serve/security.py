"""Start-up checks of who may reach the server: the API key and the bound address.

A key-less server on a public address, or an empty key that silently turns
authentication off, are mistakes worth one clear line before serving.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = {"localhost", "ip6-localhost", "ip6-loopback"}


def api_key_problem(key: str | None) -> str | None:
    """Why `key` cannot be used, or None: an empty key would mean "no authentication"."""
    if key is not None and not key.strip():
        return ("the API key is empty (--api-key '' or an empty STRATA_API_KEY): give a key, "
                "or unset STRATA_API_KEY and drop --api-key to serve without one")
    return None


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    name = host.strip().strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to a public address


def bind_warning(host: str, key: str | None) -> str | None:
    """The one-line warning for a public bind without a key, or None."""
    if key is None and not is_loopback(host):
        return (f"serving on {host} without --api-key: anyone who can reach this address can use "
                "the model (set --api-key or STRATA_API_KEY, or bind 127.0.0.1)")
    return None
