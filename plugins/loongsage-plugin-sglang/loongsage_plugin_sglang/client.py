"""SGLang-specific control calls (weight updates, memory release) over SGLang's native HTTP API.

:class:`loongsage_core.engine_client.EngineClient` covers what every LoongSage engine serves
(``/generate``, abort, pause, ...). This module adds the SGLang server's own control endpoints,
with SGLang's request field names:

* ``POST /update_weights_from_disk``: ``model_path``, ``load_format``, ``weight_version``,
  ``flush_cache``, ``abort_all_requests``;
* ``POST /init_weights_update_group``: ``master_address``, ``master_port``, ``rank_offset``,
  ``world_size``, ``group_name``, ``backend``; ``POST /destroy_weights_update_group``: ``group_name``;
* ``POST /update_weights_from_distributed``: ``names``, ``dtypes``, ``shapes``, ``group_name``,
  ``weight_version``, ``flush_cache``, ``abort_all_requests``, ``load_format``;
* ``POST /update_weights_from_tensor``: ``serialized_named_tensors``, ``load_format``,
  ``flush_cache``, ``weight_version``, ``abort_all_requests``;
* ``POST /release_memory_occupation`` / ``/resume_memory_occupation``: ``tags`` (``"weights"``,
  ``"kv_cache"``; none means all), for colocated trainer and engine;
* ``POST /pause_generation`` (``mode``) / ``/continue_generation``; ``POST /flush_cache``;
* the weight version: ``GET /get_weight_version``, falling back to ``/weight_version`` and to
  ``/model_info`` / ``/get_model_info`` (newer SGLang releases moved it there).

SGLang answers ``{"success": ..., "message": ...}`` to weight updates; an HTTP error or
``success: false`` raises :class:`SGLangRequestError`. Weight versions are sent as strings, the
type SGLang declares.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import httpx

from loongsage_core.backend_api.serving import engine_headers

DEFAULT_GROUP = "weight_update_group"
"""SGLang's default weight-update group name."""


class SGLangRequestError(RuntimeError):
    """An SGLang control call failed; the message names the server, the endpoint and SGLang's reason."""

    def __init__(self, base_url: str, path: str, message: str, status_code: int | None = None) -> None:
        super().__init__(f"SGLang server {base_url} {path} failed"
                         + (f" with HTTP {status_code}" if status_code is not None else "") + f": {message}")
        self.base_url = base_url
        self.path = path
        self.message = message
        self.status_code = status_code


def _version(value: int | str | None) -> str | None:
    return None if value is None else str(value)


def _body(**fields: Any) -> dict[str, Any]:
    """A request body without the fields left at ``None`` (SGLang then uses its defaults)."""
    return {k: v for k, v in fields.items() if v is not None}


def update_weights_from_disk_body(model_path: str, *, load_format: str | None = None,
                                  weight_version: int | str | None = None, flush_cache: bool = True,
                                  abort_all_requests: bool = False) -> dict[str, Any]:
    """``UpdateWeightFromDiskReqInput`` as JSON: the host's engine client's body, which the
    embedded engine's ``/update_weights_from_disk`` reads too."""
    from loongsage_core.backend_api.engines import EngineClient

    return EngineClient.update_weights_from_disk_body(model_path, load_format=load_format,
                                                      weight_version=weight_version, flush_cache=flush_cache,
                                                      abort_all_requests=abort_all_requests)


def load_lora_adapter_body(lora_name: str, lora_path: str, *, pinned: bool | None = None) -> dict[str, Any]:
    """``LoadLoRAAdapterReqInput`` as JSON: load the PEFT adapter directory ``lora_path`` as ``lora_name``."""
    return _body(lora_name=lora_name, lora_path=str(lora_path), pinned=pinned)


def init_weights_update_group_body(master_address: str, master_port: int, rank_offset: int, world_size: int, *,
                                   group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> dict[str, Any]:
    """``InitWeightsUpdateGroupReqInput`` as JSON."""
    return {"master_address": str(master_address), "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def update_weights_from_distributed_body(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                                         *, group_name: str = DEFAULT_GROUP, weight_version: int | str | None = None,
                                         flush_cache: bool = True, abort_all_requests: bool = False,
                                         load_format: str | None = None) -> dict[str, Any]:
    """``UpdateWeightsFromDistributedReqInput`` as JSON (the three lists in broadcast order)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"update_weights_from_distributed: {len(names)} names, {len(dtypes)} dtypes and "
                         f"{len(shapes)} shapes; they must have one entry per tensor")
    return _body(names=list(names), dtypes=list(dtypes), shapes=[[int(d) for d in s] for s in shapes],
                 group_name=group_name, weight_version=_version(weight_version), flush_cache=flush_cache,
                 abort_all_requests=abort_all_requests, load_format=load_format)


class SGLangClient:
    """Synchronous client of one SGLang server's control endpoints."""

    def __init__(self, base_url: str, *, timeout: float | None = 600.0, api_key: str | None = None) -> None:
        """``api_key``: the run secret (default: the one set in this process, see ``loongsage_core.security``)."""
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout, trust_env=False,
                                    headers=engine_headers(api_key))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "SGLangClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------------
    def request(self, method: str, path: str, json: Any = None, *, check_success: bool = True,
                timeout: float | None | str = "default") -> Any:
        """Send one request; raise :class:`SGLangRequestError` on an HTTP error or ``success: false``."""
        kw: dict[str, Any] = {} if timeout == "default" else {"timeout": timeout}
        try:
            resp = self._client.request(method, path, json=json, **kw)
        except httpx.HTTPError as exc:
            raise SGLangRequestError(self.base_url, path, f"{type(exc).__name__}: {exc}") from exc
        body: Any
        try:
            body = resp.json() if resp.content else {}
        except ValueError:
            body = {"message": resp.text}
        if resp.status_code >= 400:
            message = body.get("message") or body.get("detail") or body.get("error") if isinstance(body, Mapping) \
                else None
            raise SGLangRequestError(self.base_url, path, str(message or resp.text or resp.reason_phrase),
                                     resp.status_code)
        if check_success and isinstance(body, Mapping) and body.get("success") is False:
            raise SGLangRequestError(self.base_url, path, str(body.get("message") or body))
        return body

    # -- weights -------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, *, load_format: str | None = None,
                                 weight_version: int | str | None = None, flush_cache: bool = True,
                                 abort_all_requests: bool = False) -> dict[str, Any]:
        """Reload the weights from a Hugging Face directory the server can read."""
        return self.request("POST", "/update_weights_from_disk", update_weights_from_disk_body(
            model_path, load_format=load_format, weight_version=weight_version, flush_cache=flush_cache,
            abort_all_requests=abort_all_requests), timeout=None)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load the PEFT adapter directory ``lora_path`` (readable by the server) as ``lora_name``."""
        return self.request("POST", "/load_lora_adapter", load_lora_adapter_body(lora_name, lora_path), timeout=None)

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload the adapter ``lora_name`` (requests naming it are refused until it is loaded again)."""
        return self.request("POST", "/unload_lora_adapter", {"lora_name": lora_name}, timeout=None)

    def update_weight_version(self, version: int | str, *, abort_all_requests: bool = False) -> dict[str, Any]:
        """Set the version the server reports and tags its tokens with (``UpdateWeightVersionReqInput``)."""
        return self.request("POST", "/update_weight_version",
                            {"new_version": str(version), "abort_all_requests": abort_all_requests})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int, *,
                                  group_name: str = DEFAULT_GROUP, backend: str = "nccl",
                                  timeout: float | None = None) -> dict[str, Any]:
        """Make the server's ranks join a process group with the trainer (blocks until all joined)."""
        return self.request("POST", "/init_weights_update_group", init_weights_update_group_body(
            master_address, master_port, rank_offset, world_size, group_name=group_name, backend=backend),
            timeout=timeout)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
        return self.request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], *, group_name: str = DEFAULT_GROUP,
                                        weight_version: int | str | None = None, flush_cache: bool = True,
                                        abort_all_requests: bool = False, load_format: str | None = None,
                                        timeout: float | None = None) -> dict[str, Any]:
        """Announce the tensors the trainer broadcasts next; returns once the server loaded them."""
        return self.request("POST", "/update_weights_from_distributed", update_weights_from_distributed_body(
            names, dtypes, shapes, group_name=group_name, weight_version=weight_version, flush_cache=flush_cache,
            abort_all_requests=abort_all_requests, load_format=load_format), timeout=timeout)

    def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str], *, load_format: str | None = None,
                                   weight_version: int | str | None = None, flush_cache: bool = True,
                                   abort_all_requests: bool = False) -> dict[str, Any]:
        """Load tensors serialized by the caller (one base64 entry per tensor-parallel rank)."""
        return self.request("POST", "/update_weights_from_tensor", _body(
            serialized_named_tensors=list(serialized_named_tensors), load_format=load_format,
            weight_version=_version(weight_version), flush_cache=flush_cache, abort_all_requests=abort_all_requests),
            timeout=None)

    # -- memory (colocated runs) ---------------------------------------------------------------
    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """Free the GPU memory of ``tags`` (``"weights"``, ``"kv_cache"``; all when ``None``)."""
        return self.request("POST", "/release_memory_occupation", _body(tags=list(tags) if tags else None))

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> Any:
        """Take back the memory released by :meth:`release_memory_occupation`."""
        return self.request("POST", "/resume_memory_occupation", _body(tags=list(tags) if tags else None))

    # -- scheduling ----------------------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> Any:
        """``mode``: ``"abort"``, ``"retract"`` or ``"in_place"``."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause_generation: mode must be 'abort', 'retract' or 'in_place', got {mode!r}")
        return self.request("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> Any:
        return self.request("POST", "/continue_generation", {})

    def flush_cache(self) -> Any:
        return self.request("POST", "/flush_cache", check_success=False)

    # -- info ----------------------------------------------------------------------------------
    def get_weight_version(self) -> str | None:
        """The server's weight version (a string, as SGLang reports it)."""
        last: SGLangRequestError | None = None
        for path in ("/get_weight_version", "/weight_version", "/model_info", "/get_model_info"):
            try:
                body = self.request("GET", path, check_success=False)
            except SGLangRequestError as exc:
                if exc.status_code not in (404, 405):
                    raise
                last = exc
                continue
            if isinstance(body, Mapping) and "weight_version" in body:
                value = body["weight_version"]
                return None if value is None else str(value)
        raise SGLangRequestError(self.base_url, "/get_weight_version",
                                 f"no endpoint reports the weight version ({last.message if last else 'no answer'})")

    def server_info(self) -> dict[str, Any]:
        for path in ("/get_server_info", "/server_info"):
            try:
                return self.request("GET", path, check_success=False)
            except SGLangRequestError as exc:
                if exc.status_code not in (404, 405):
                    raise
        raise SGLangRequestError(self.base_url, "/get_server_info", "not served")
