"""How this plugin's transports rank an engine for ``auto``: by node id (Ray's node id inside a Ray
cluster, so two Ray nodes on one machine count as two), device and the formats the engine accepts.
Every receiver kind with every shipped transport: ``tests/test_weight_transport_auto.py``; the
two-node run that sees ``broadcast`` chosen end to end: ``tests/multinode/test_two_nodes.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loongsage_core.weight_group import NODE_ID_ENV, node_id

BOTH = ["direct", "shm", "broadcast"]


def torch_candidates() -> dict:
    """This plugin's transports that rank engines for ``auto``, from the real plugin host."""
    from loongsage_core.plugins import PluginHost

    return {name: spec for name, spec in PluginHost.create(["torch"]).components("weight_transport").items()
            if spec.auto_rank is not None}


def _target(info, in_process=False):
    from loongsage_hookspecs import WeightTarget

    return WeightTarget(url=None if in_process else "http://e:1", server_info=info, trainer_node="ray:a",
                        in_process=in_process)


@pytest.mark.parametrize("info, path", [
    ({"node_id": "ray:a", "device": "cpu", "weight_load_formats": BOTH}, "shm"),
    ({"node_id": "ray:b", "device": "cpu", "weight_load_formats": BOTH}, "broadcast"),  # another node
    ({"node_id": "ray:a", "device": "cuda:0", "weight_load_formats": BOTH}, "broadcast"),  # on an accelerator
    ({"node_id": "ray:a", "device": "cpu", "weight_load_formats": ["broadcast"]}, "broadcast"),  # no shm receiver
    ({"device": "cpu", "weight_load_formats": BOTH}, "broadcast"),  # an engine that does not say its node
])
def test_choice_by_node_device_and_formats(info, path):
    """This plugin's three transports, as a run with only this plugin has them."""
    from loongsage_plugin_torch.transport.auto import choose_transport

    candidates = torch_candidates()
    assert sorted(candidates) == ["broadcast", "inprocess", "shm"]
    assert choose_transport(_target(info), candidates) == path
    assert choose_transport(_target({}, in_process=True), candidates) == "inprocess"


def test_an_engine_without_shm_or_broadcast_is_an_error_naming_it():
    from loongsage_plugin_torch.transport.auto import choose_transport
    from loongsage_plugin_torch.transport.shm import WeightTransferError

    with pytest.raises(WeightTransferError, match="no active transport reaches engine http://e:1"):
        choose_transport(_target({"node_id": "ray:a", "weight_load_formats": ["disk"]}), torch_candidates())


def _ids() -> tuple[str, str]:
    import ray

    return node_id(), ray.get_runtime_context().get_node_id()


def test_in_ray_the_node_id_is_rays_and_the_environment_overrides_it(ray_local, monkeypatch):
    ray = ray_local
    ours, ray_node = ray.get(ray.remote(_ids).remote())
    assert ours == f"ray:{ray_node}"
    assert node_id() == f"ray:{ray.get_runtime_context().get_node_id()}" == ours  # the driver, same node
    monkeypatch.setenv(NODE_ID_ENV, "node-b")
    assert node_id() == "node-b"


def test_outside_ray_the_node_id_is_the_machines():
    code = "import socket; from loongsage_core.weight_group import node_id; print(node_id(), socket.gethostname())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout.split()
    ours, host = out
    assert ours.startswith(f"{host}:") and len(ours) > len(host) + 1  # host name and boot id
