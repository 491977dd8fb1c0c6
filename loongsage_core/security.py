"""The run secret: who may call the control endpoints of a run's router and engines.

A run (``loongsage run`` / ``loongsage serve``) generates one secret at start
(:func:`new_secret`), writes it to a ``0600`` file in the run directory
(:func:`write_secret_file`) and hands it to the AgentFlow router and to every engine it launches.
Requests prove they hold it with ``Authorization: Bearer <secret>`` (or ``x-api-key: <secret>``,
the header Anthropic clients send), the scheme SGLang's ``--api-key`` / ``--admin-api-key`` use,
so one header works for the embedded engine, SGLang servers and ``sglang-router`` alike.

Agents never receive the secret: each trajectory gets a key of its own,
:func:`trajectory_key` = HMAC(secret, "trajectory_id/attempt"), which the router accepts only on
that trajectory's and attempt's endpoint. The key is derived, not stored, so the router, the
controller and an admin client holding the secret agree on it without a round trip, and a retried
trajectory (``attempt + 1``) gets a new key.

Inside a model actor the secret is held by this module (:func:`set_process_secret`), so weight
transports and engine clients built there send it without every factory growing an argument. It
is never put in an environment variable: agents' subprocesses inherit the driver's environment.

A server that listens beyond loopback (an engine on a multi-node Ray cluster listens on its node's
address) must be started with the secret: :func:`check_listen_address` refuses it otherwise.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import secrets
from pathlib import Path
from typing import Mapping

SECRET_FILE = "run_secret"
"""Name of the file in the run directory that holds the run secret (mode ``0600``)."""

OPEN_PATHS = ("/health", "/health_generate")
"""Paths every server of a run answers without the secret (liveness probes)."""

_process_secret: str | None = None


def new_secret() -> str:
    """A fresh, unguessable run secret (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def write_secret_file(run_dir: str | os.PathLike[str], secret: str) -> Path:
    """Write ``secret`` to ``run_dir/run_secret``, readable and writable by the owner only.

    The file is created with mode ``0600`` (never world-readable, not even for an instant) and
    replaced atomically, so a reader sees the old or the new secret, never a partial one.
    """
    directory = Path(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SECRET_FILE
    tmp = directory / f".{SECRET_FILE}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secret + "\n").encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_secret_file(path: str | os.PathLike[str]) -> str:
    """The secret stored at ``path`` (a run directory or the secret file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / SECRET_FILE
    try:
        text = p.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the run secret from {p}: {exc}") from None
    if not text:
        raise ValueError(f"the run secret file {p} is empty")
    return text


def trajectory_key(secret: str, trajectory_id: str, attempt: int) -> str:
    """The API key of one trajectory attempt: opens ``/{trajectory_id}/{attempt}/...`` and nothing else."""
    mac = hmac.new(secret.encode(), f"trajectory:{trajectory_id}/{int(attempt)}".encode(), hashlib.sha256)
    return "lsk-" + base64.urlsafe_b64encode(mac.digest()).decode("ascii").rstrip("=")


def presented_token(headers: Mapping[str, str]) -> str | None:
    """The credential a request carries: ``Authorization: Bearer X`` or ``x-api-key: X``."""
    auth = headers.get("Authorization") or headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key") or headers.get("X-Api-Key")
    return key.strip() if key and key.strip() else None


def token_matches(presented: str | None, expected: str | None) -> bool:
    """Constant-time comparison; ``False`` when either side is missing."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


def auth_headers(secret: str | None) -> dict[str, str]:
    """The header that carries ``secret`` (empty when there is none)."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def set_process_secret(secret: str | None) -> None:
    """Remember the run secret in this process (a model actor) for :func:`engine_headers`."""
    global _process_secret
    _process_secret = secret


def process_secret() -> str | None:
    """The run secret set in this process, if any."""
    return _process_secret


def engine_headers(secret: str | None = None) -> dict[str, str]:
    """Headers for a request to a run's engine: ``secret``, else this process's run secret."""
    return auth_headers(secret or _process_secret)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a host name) only reaches this machine: ``localhost`` or an
    address in ``127.0.0.0/8`` / ``::1``. ``0.0.0.0`` and every other address are not loopback."""
    name = str(host).strip().strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a host name other than localhost may resolve to any interface
        return False


def check_listen_address(host: str, secret: str | None, where: str) -> None:
    """Refuse to serve on ``host`` beyond loopback without the run secret: there, any machine that
    reaches the address could otherwise update weights, pause or abort. ``where`` names the server."""
    if not secret and not is_loopback(host):
        raise ValueError(f"{where}: refusing to listen on {host} (beyond loopback) without the run secret; "
                         "start it with the run secret (EngineContext.api_key) or on 127.0.0.1")
