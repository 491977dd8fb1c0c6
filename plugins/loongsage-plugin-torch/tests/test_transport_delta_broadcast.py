"""Delta sync over ``broadcast`` (Gloo) into an embedded engine in a Ray actor, and its healing.

The trainer side is this process (a ``broadcast`` sender with ``delta = true``); the engine is a
real embedded engine in another process. A delta rebuilt wrong on the engine (the sender's record
of what the engine holds is damaged) is refused after the broadcast, so the group stays in step,
and the version is sent again in full over the same group.
"""

from __future__ import annotations

from typing import Any

import torch

from loongsage_hookspecs import WeightTransportContext


class EngineHost:
    """An embedded engine (float32, the torch plugin's receivers) in an actor."""

    def __init__(self) -> None:
        from loongsage_plugin_torch.engine import create_engine
        from loongsage_plugin_torch.modeling import TINY_QWEN3

        from loongsage_core.config import JobConfig, ModelConfig
        from loongsage_core.plugins import PluginHost
        from loongsage_hookspecs import EngineContext

        job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3)))
        self.engine = create_engine(EngineContext(job=job, components=PluginHost.create(["torch"])))
        self.url = self.engine.start()

    def base_url(self) -> str:
        return self.url

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().clone() for n, t in self.engine.model.named_parameters()}

    def version(self) -> int:
        return int(self.engine.weight_version)

    def shutdown(self) -> None:
        self.engine.shutdown()


def test_broadcast_delta_is_exact_and_a_mismatch_is_healed_over_the_group(ray_local):
    from loongsage_plugin_torch.transport import broadcast_sender

    ray = ray_local
    engine: Any = ray.remote(EngineHost).remote()
    sender = broadcast_sender(WeightTransportContext(role="sender"), bucket_bytes=1 << 16, backend="gloo",
                              init_timeout_s=60, delta=True, full_every=0)
    try:
        url = ray.get(engine.base_url.remote())
        master = {n: t.float() for n, t in ray.get(engine.weights.remote()).items()}
        torch.manual_seed(0)
        history = []
        for version in range(1, 5):
            for t in master.values():
                t.add_(torch.randn_like(t).sign() * 1e-6)
            if version == 3:  # the sender's record of the engine's bytes goes bad
                sender.delta.last_sent["model.norm.weight"][0][0] ^= 0x04
            metrics = sender.send(iter(master.items()), version, [url])
            history.append((metrics["perf/weight_sync_full"], metrics["perf/weight_sync_fallbacks"]))
            got = ray.get(engine.weights.remote())
            assert all(torch.equal(got[n], t) for n, t in master.items()), version
            assert ray.get(engine.version.remote()) == version
            if version == 2:
                assert 0.0 < metrics["perf/weight_sync_delta_ratio"] < 1.0
        assert history == [(1.0, 0.0), (0.0, 0.0), (1.0, 1.0), (0.0, 0.0)]
    finally:
        sender.close()
        ray.get(engine.shutdown.remote())
        ray.kill(engine)
