"""Per-role custom Ray resources (``placement.trainer_resources`` / ``engine_resources`` /
``teacher_resources``): how a job pins trainers, engines and its teachers to nodes of a multi-node
cluster. Schema, reservation arithmetic, and the
placement-group bundles that carry them; the two-node run is ``test_two_nodes.py``."""

from __future__ import annotations

import sys

import pytest

from loongsage_core.config import ConfigError, dump_job_toml, load_job, structure_job
from loongsage_core.controller.placement import check_resources, create_placement_group, required_resources

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

JOB = """
[train]
num_workers = 2
[rollout]
num_engines = 3
[placement]
colocate = false
trainer_cpus = 1
engine_cpus = 0.5
trainer_resources = { train_node = 1 }
engine_resources = { engine_node = 0.5, fast_disk = 1 }
"""


def job(tmp_path, text=JOB, overrides=()):
    path = tmp_path / "job.toml"
    path.write_text(text)
    return load_job(path, list(overrides))


def test_role_resources_are_read_and_round_trip(tmp_path):
    j = job(tmp_path)
    assert j.placement.trainer_resources == {"train_node": 1}
    assert j.placement.engine_resources == {"engine_node": 0.5, "fast_disk": 1}
    again = structure_job(tomllib.loads(dump_job_toml(j)), "again.toml")
    assert again.placement.engine_resources == {"engine_node": 0.5, "fast_disk": 1}
    assert job(tmp_path, "").placement.trainer_resources == {}


@pytest.mark.parametrize("text, words", [
    ("[placement]\ntrainer_resources = { CPU = 1 }\n",
     "must not name 'CPU' (use the *_cpus keys), got {'CPU': 1.0} at key 'placement.trainer_resources'"),
    ("[placement]\nengine_resources = { n = -1 }\n",
     "must map resource names to finite numbers >= 0, got 'n' = -1.0 at key 'placement.engine_resources'"),
    ("[placement]\nengine_resources = { n = 'a' }\n", "at key 'placement.engine_resources"),
    ("[placement]\nengine_resource = { n = 1 }\n", "did you mean 'placement.engine_resources'"),
])
def test_bad_role_resources_name_the_key(tmp_path, text, words):
    with pytest.raises(ConfigError) as err:
        job(tmp_path, text)
    assert words in str(err.value) and str(tmp_path / "job.toml") in str(err.value)


def test_required_resources_add_the_custom_ones_per_actor(tmp_path):
    assert required_resources(job(tmp_path)) == {"CPU": 2 * 1 + 3 * 0.5, "GPU": 0.0, "train_node": 2.0,
                                                 "engine_node": 1.5, "fast_disk": 3.0}
    # colocated: one actor per trainer rank, which reserves the trainer's resources only
    colocated = job(tmp_path, overrides=["placement.colocate=true", "rollout.num_engines=2"])
    assert required_resources(colocated) == {"CPU": 2.0, "GPU": 0.0, "train_node": 2.0}


def test_a_missing_custom_resource_fails_fast_naming_the_keys(tmp_path, ray_cluster):
    with pytest.raises(ConfigError) as err:
        check_resources(job(tmp_path))
    message = str(err.value)
    assert "need 2 train_node but the Ray cluster has 0" in message
    assert "placement.trainer_resources / engine_resources / teacher_resources" in message


def test_bundles_carry_each_roles_resources(tmp_path, ray_cluster):
    from ray.util.placement_group import remove_placement_group

    pg = create_placement_group(job(tmp_path))
    try:
        assert pg.bundle_specs == [{"CPU": 1.0, "train_node": 1.0}] * 2 + [
            {"CPU": 0.5, "engine_node": 0.5, "fast_disk": 1.0}] * 3
    finally:
        remove_placement_group(pg)


def test_critic_ranks_get_bundles_after_the_other_actors(tmp_path, ray_cluster):
    from ray.util.placement_group import remove_placement_group

    critic = job(tmp_path, overrides=["critic.num_workers=2", "critic.cpus=0.25"])
    pg = create_placement_group(critic, with_critic=True)
    try:
        assert pg.bundle_specs[5:] == [{"CPU": 0.25}] * 2
        assert len(pg.bundle_specs) == 7
    finally:
        remove_placement_group(pg)


DISTILLING = JOB + """teacher_cpus = 0.75
teacher_resources = { big_memory = 1 }
[[teachers]]
name = "big"
path = "teacher"
[[data]]
name = "math"
path = "math.jsonl"
teacher = "big"
"""


def test_a_distilling_job_reserves_the_teacher_actor(tmp_path):
    need = required_resources(job(tmp_path, DISTILLING))
    assert need["CPU"] == 2 * 1 + 3 * 0.5 + 0.75 and need["big_memory"] == 1.0
    # teachers listed but no source distils: no teacher actor, nothing reserved for it
    idle = job(tmp_path, DISTILLING.replace('teacher = "big"', ""))
    assert required_resources(idle)["CPU"] == 2 * 1 + 3 * 0.5 and "big_memory" not in required_resources(idle)


def test_the_teacher_actor_gets_the_last_bundle(tmp_path, ray_cluster):
    from ray.util.placement_group import remove_placement_group

    distilling = job(tmp_path, DISTILLING, overrides=["critic.num_workers=2", "critic.cpus=0.25"])
    pg = create_placement_group(distilling, with_critic=True)
    try:
        assert pg.bundle_specs[5:] == [{"CPU": 0.25}] * 2 + [{"CPU": 0.75, "big_memory": 1.0}]
    finally:
        remove_placement_group(pg)
