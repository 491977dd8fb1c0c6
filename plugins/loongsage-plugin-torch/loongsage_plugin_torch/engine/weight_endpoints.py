"""The weight endpoints of the embedded engine: versions, tensor updates and broadcast groups.

:class:`WeightEndpointsMixin` answers what the trainer side sends between rollouts:
``/get_weight_version``, ``/get_weights_by_name``, ``/update_weight_version``, ``/update_weights_from_tensor``,
``/update_weights_from_disk`` and the
broadcast group's ``/init_weights_update_group``, ``/update_weights_from_distributed`` and
``/destroy_weights_update_group`` (see ``transport.broadcast``). Kept apart from generation in
:mod:`.server`, which mixes it into :class:`~.server.EngineServer` and routes the paths to it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable

from aiohttp import web

from .control_protocol import (
    parse_destroy_weights_group,
    parse_init_weights_group,
    parse_update_distributed,
    parse_update_from_disk,
    parse_update_version,
    parse_update_weights,
    parse_weights_by_name,
)
from .http_common import EngineEndpoints, read_json_body
from .request_checks import InvalidRequest
from .weights import safetensors_dir_tensors


class WeightEndpointsMixin(EngineEndpoints):
    """The weight handlers of :class:`~.server.EngineServer`."""

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.engine.scheduler.version)})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's ``/get_weights_by_name``: the first ``truncate_size`` values of a parameter
        (flattened, as float32 numbers: exact for the engine's float32 and bfloat16 weights), so a
        weight update can be checked from outside the engine."""
        name, size = parse_weights_by_name(await read_json_body(request))
        runner = self.engine.runner

        def read() -> list[float]:
            tensor = runner.named_tensors().get(name)
            if tensor is None:
                raise InvalidRequest(f"no parameter named {name!r} in the engine's model", "name")
            return tensor.detach().reshape(-1)[:size].float().tolist()

        return web.json_response(await self._run(read))

    async def update_weight_version(self, request: web.Request) -> web.Response:
        version, abort_all = parse_update_version(await read_json_body(request))
        sched = self.engine.scheduler

        def apply() -> None:
            if abort_all:
                sched.abort(None, True, "aborted by update_weight_version")
            sched.set_version(version)

        await self._run(apply)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": str(version)})

    async def _load_between_steps(self, named: Callable[[], Iterable[tuple[str, Any]]], update: Any,
                                  path: str) -> web.Response:
        """Copy the tensors ``named()`` gives into the model between two engine steps (after
        aborting everything with ``update.abort_all_requests``), set ``update.weight_version``,
        flush the prefix cache with ``update.flush_cache``; SGLang's answer."""
        sched = self.engine.scheduler

        def apply() -> int:
            if update.abort_all_requests:
                sched.abort(None, True, f"aborted by {path}")
            count = sched.load_weights(named(), update.weight_version)
            if update.flush_cache:
                sched.flush_cache()
            return count

        count = await self._run(apply)
        version = sched.version
        return web.json_response({"success": True, "message": f"Updated {count} tensors. "
                                  f"Weight version updated to {version}.", "weight_version": str(version)})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        update = parse_update_weights(await read_json_body(request))
        named = self.engine.named_tensors_from(update.load_format, update.payload)
        return await self._load_between_steps(lambda: named, update, "update_weights_from_tensor")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        """SGLang's ``/update_weights_from_disk``: the model's weights from a Hugging Face directory
        on this machine (the same architecture), copied in place between two engine steps."""
        update = parse_update_from_disk(await read_json_body(request))
        return await self._load_between_steps(
            lambda: safetensors_dir_tensors(update.model_path, self.engine.runner.named_tensors()), update,
            "update_weights_from_disk")

    # -- broadcast groups (the trainer is rank 0; see transport.broadcast) ----------------------
    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        join = parse_init_weights_group(await read_json_body(request))
        groups = self.engine.weight_groups
        try:  # the rendezvous blocks until every member joined: off the event loop
            await asyncio.get_running_loop().run_in_executor(None, lambda: groups.join(
                join.master_address, join.master_port, join.rank_offset, join.world_size,
                group_name=join.group_name, backend=join.backend))
        except ValueError as exc:
            raise InvalidRequest(str(exc), "group_name") from None
        return web.json_response({"success": True, "message": f"Joined weight update group {join.group_name!r} "
                                  f"as rank {join.rank_offset} of {join.world_size}."})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        update = parse_update_distributed(await read_json_body(request))
        groups = self.engine.weight_groups
        sched = self.engine.scheduler
        name = update.payload["group_name"]

        def apply(named: list[Any]) -> int:
            if update.abort_all_requests:
                sched.abort(None, True, "aborted by update_weights_from_distributed")
            # without a weight_version the version stays (SGLang's rule); buckets before the last carry none
            count = sched.load_weights(named, sched.version if update.weight_version is None
                                       else update.weight_version)
            if update.flush_cache:
                sched.flush_cache()
            return count

        def receive_and_load() -> int:
            try:
                lock = groups.lock(name)
            except KeyError as exc:
                raise InvalidRequest(str(exc.args[0]), "group_name") from None
            with lock:  # the received views stay valid until the engine has copied them
                named = list(groups.receive(update.payload))
                return sched.call(lambda: apply(named)).result()

        count = await asyncio.get_running_loop().run_in_executor(None, receive_and_load)
        version = sched.version
        return web.json_response({"success": True, "message": f"Updated {count} tensors. "
                                  f"Weight version is {version}.", "weight_version": str(version)})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        name = parse_destroy_weights_group(await read_json_body(request))
        left = await asyncio.get_running_loop().run_in_executor(None, self.engine.weight_groups.leave, name)
        if not left:
            raise InvalidRequest(f"no weight update group {name!r} on this engine", "group_name")
        return web.json_response({"success": True, "message": f"Left weight update group {name!r}."})
