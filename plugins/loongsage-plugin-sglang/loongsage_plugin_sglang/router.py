"""``sglang-router`` in front of several engines: one URL that load-balances ``/generate``.

:class:`SGLangRouterProcess` runs ``python -m sglang_router.launch_router --worker-urls URL...
--host 127.0.0.1 --port PORT --policy POLICY`` (flag names of sglang-router's launcher) as a
subprocess in its own process group, waits until the router answers ``/health`` and returns its
URL; :meth:`SGLangRouterProcess.shutdown` terminates it. While it runs,
:meth:`~SGLangRouterProcess.add_engine` and :meth:`~SGLangRouterProcess.remove_engine` change its
workers through sglang-router's worker API (``POST /workers``, ``DELETE /workers/{id}``, listed
by ``GET /workers``), e.g. when the run replaced an engine that died. The workers may be SGLang servers or
LoongSage's embedded engines (both serve SGLang's native API). Install the router with
``pip install 'loongsage-plugin-sglang[router]'``; it runs on CPU.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from loongsage_core.backend_api.distributed import free_port, retry_on_port_collision

from .process import ManagedProcess, ServerStartError, secret_args

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
"""Routing policies of sglang-router usable with plain worker URLs."""

ROUTER_INSTALL_HINT = "pip install 'loongsage-plugin-sglang[router]'"

WORKER_API_TIMEOUT_S = 30.0
WORKER_POLL_S = 0.2


def router_command(worker_urls: Sequence[str], *, host: str, port: int, policy: str = "cache_aware",
                   extra_args: Mapping[str, Any] | None = None, python: str | None = None) -> list[str]:
    """The ``sglang_router.launch_router`` argv; ``extra_args`` keys become ``--kebab-case`` flags."""
    from .launch import engine_args_to_flags

    if not worker_urls:
        raise ValueError("sglang router: at least one worker URL is needed")
    for url in worker_urls:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"sglang router: worker URL {url!r} is not an http(s) URL")
    if policy not in POLICIES:
        raise ValueError(f"sglang router: unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    argv = [python or sys.executable, "-m", "sglang_router.launch_router",
            "--worker-urls", *[u.rstrip("/") for u in worker_urls],
            "--host", host, "--port", str(int(port)), "--policy", policy]
    return argv + engine_args_to_flags(dict(extra_args or {}), "<sglang router>")


class SGLangRouterProcess:
    """A running sglang-router in front of ``worker_urls``.

    ``policy``: ``"cache_aware"`` (prefix-affinity with load balance) or ``"round_robin"`` (or
    ``"random"``, ``"power_of_two"``); ``extra_args``: more launcher flags (``{"log_level": "warn"}``);
    ``startup_timeout_s``: limit for ``/health``; ``log_path``: the router's log file;
    ``api_key``: the run secret the router sends to the workers (``--api-key``; default: the one set
    in this process, see ``loongsage_core.security``).
    """

    def __init__(self, worker_urls: Sequence[str], policy: str = "cache_aware", *, host: str = "127.0.0.1",
                 port: int = 0, extra_args: Mapping[str, Any] | None = None, startup_timeout_s: float = 120.0,
                 log_path: str | None = None, python: str | None = None, api_key: str | None = None) -> None:
        from loongsage_core.backend_api.serving import check_listen_address, process_secret

        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.policy = policy
        self.host = host
        self.secret = api_key or process_secret()
        check_listen_address(host, self.secret, "sglang router")  # beyond loopback only with the secret
        self.fixed_port = bool(port)
        """A port given is used as is; otherwise a free one, another if it is taken before the router binds it."""
        self.port = int(port) or free_port(host)
        self.python = python or sys.executable
        self.extra_args = dict(extra_args or {})
        self.command = self._command(self.port)
        self.startup_timeout_s = float(startup_timeout_s)
        self.log_path = Path(log_path) if log_path \
            else Path(tempfile.mkdtemp(prefix="loongsage-router-")) / "router.log"
        self.process: ManagedProcess | None = None
        self.base_url: str | None = None

    def start(self) -> str:
        """Launch the router, wait for ``/health`` and until it lists every engine; returns
        ``http://HOST:PORT``."""
        if self.base_url is not None:
            return self.base_url
        if Path(self.python).resolve() == Path(sys.executable).resolve() \
                and importlib.util.find_spec("sglang_router") is None:
            raise ServerStartError(f"sglang-router is not installed for {self.python}; install it with: "
                                   f"{ROUTER_INSTALL_HINT}")
        if self.fixed_port:
            self.base_url = self._launch(self.port)
        else:  # the router binds its port itself, later: start it again on another port if that one was taken
            self.base_url = retry_on_port_collision(self._launch, host=self.host, first_port=self.port,
                                                    where="sglang router")
        # /health answers before the router has health-checked and listed every worker: wait for
        # them, so the run's first requests spread over all engines and the worker list is whole
        wanted = set(self.worker_urls)
        try:
            self._wait_until(lambda urls: wanted <= set(urls), "listing every engine", self.startup_timeout_s)
        except RuntimeError as exc:
            self.shutdown()
            raise ServerStartError(str(exc)) from None
        return self.base_url

    def _command(self, port: int) -> list[str]:
        """The launch command line for ``port`` (with the run secret as ``--api-key`` when there is one)."""
        extra = dict(self.extra_args)
        # its metrics exporter listens on 0.0.0.0:29000 by default: loopback (the router's host) and
        # a free port instead, so it is not open to the network and two runs on one machine can start
        extra.setdefault("prometheus_host", self.host)
        if "prometheus_port" not in extra:
            extra["prometheus_port"] = free_port()  # retried on a collision, as the main port
        command = router_command(self.worker_urls, host=self.host, port=port, policy=self.policy,
                                 extra_args=extra, python=self.python)
        return command + (secret_args("--api-key", secret=self.secret) if self.secret else [])

    def _launch(self, port: int) -> str:
        """Run the router on ``port`` and wait for ``/health`` (stopped again if it never answers)."""
        if port != self.port:
            self.port = port
            self.command = self._command(port)
        self.process = ManagedProcess(self.command, name="sglang router", log_path=self.log_path)
        return self.process.launch(f"http://{self.host}:{port}", ("/health",), timeout_s=self.startup_timeout_s)

    # -- workers (sglang-router's worker API: GET/POST /workers, DELETE /workers/{id}) -----------
    def _api(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        if self.base_url is None:
            raise RuntimeError("sglang router: not started")
        headers = {"Authorization": f"Bearer {self.secret}"} if self.secret else {}
        resp = httpx.request(method, self.base_url + path, headers=headers, timeout=WORKER_API_TIMEOUT_S,
                             trust_env=False, **kwargs)
        if resp.status_code >= 400:
            raise RuntimeError(f"sglang router: {method} {path} answered HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    def workers(self) -> list[dict[str, Any]]:
        """The router's workers as it lists them (``url``, ``id``, ``is_healthy``, ...)."""
        return list(self._api("GET", "/workers").get("workers", []))

    def worker_urls_now(self) -> list[str]:
        """The URLs the router routes to now."""
        return [str(w["url"]).rstrip("/") for w in self.workers()]

    def _wait_until(self, done: Any, what: str, timeout_s: float) -> None:
        """Poll the worker list until ``done(urls)``: the router applies changes in the background."""
        deadline = time.monotonic() + timeout_s
        while not done(self.worker_urls_now()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"sglang router: {what} did not happen within {timeout_s:g}s "
                                   f"(workers now: {self.worker_urls_now()}; log: {self.log_path})")
            time.sleep(WORKER_POLL_S)

    def add_engine(self, url: str, timeout_s: float = 120.0) -> None:
        """Route to one more engine (``POST /workers``); returns once the router lists it (it
        lists only a worker that passed its health check)."""
        url = url.rstrip("/")
        if url not in self.worker_urls_now():
            self._api("POST", "/workers", json={"url": url})
            self._wait_until(lambda urls: url in urls, f"adding worker {url}", timeout_s)
        if url not in self.worker_urls:
            self.worker_urls.append(url)

    def remove_engine(self, url: str, timeout_s: float = 60.0) -> None:
        """Stop routing to an engine (``DELETE /workers/{id}``; nothing when it is not listed)."""
        url = url.rstrip("/")
        for worker in self.workers():
            if str(worker["url"]).rstrip("/") == url:
                self._api("DELETE", f"/workers/{worker['id']}")
        self._wait_until(lambda urls: url not in urls, f"removing worker {url}", timeout_s)
        if url in self.worker_urls:
            self.worker_urls.remove(url)

    def shutdown(self) -> None:
        """Terminate the router (idempotent)."""
        if self.process is not None:
            self.process.stop()
        self.base_url = None

    def __enter__(self) -> "SGLangRouterProcess":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
