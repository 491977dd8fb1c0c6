"""Job-file loading: strict schema, clear errors, typed overrides, round trip."""

from __future__ import annotations

import sys

import pytest

from loongsage_core.config import ConfigError, apply_override, dump_job_toml, load_job, structure_job

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GOOD = """
[plugins]
enable = ["rl"]
[train]
lr = 3e-5
total_steps = 7
[async]
enable = true
stale_steps = 2
[[data]]
name = "math"
path = "math.jsonl"
reward = "exact_match"
weight = 0.7
[[data]]
name = "tools"
generator = "arithmetic"
reward = ["exact_match", "format"]
weight = 0.3
"""


def write(tmp_path, text, name="job.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_good_file_structures_with_defaults(tmp_path):
    job = load_job(write(tmp_path, GOOD))
    assert job.train.lr == 3e-5 and job.train.total_steps == 7
    assert job.async_.enable and job.async_.stale_steps == 2
    assert [d.name for d in job.data] == ["math", "tools"]
    assert job.data[0].reward == ["exact_match"]  # a single name becomes a list
    assert job.rollout.samples_per_prompt == 4  # default
    assert job.resolve_path("math.jsonl") == str((tmp_path / "math.jsonl").resolve())


@pytest.mark.parametrize("text, expected", [
    ("[train]\nlrr = 1.0\n", "unknown key 'train.lrr' (did you mean 'train.lr'?)"),
    ("[trian]\nlr = 1.0\n", "unknown key 'trian' (did you mean 'train'?)"),
    ("[[data]]\nnmae = 'x'\n", "unknown key 'data[0].nmae' (did you mean 'data[0].name'?)"),
    ("[train]\nlr = 'fast'\n", "expected float, got str 'fast' at key 'train.lr'"),
    ("[train]\ntotal_steps = 2.5\n", "expected int, got float 2.5 at key 'train.total_steps'"),
    ("[async]\nenable = 1\n", "expected bool, got int 1 at key 'async.enable'"),
    ("[[loggers]]\nargs = {}\n", "required key is missing at key 'loggers[0].name'"),
    ("[model]\ndtype = 'int4'\n", "'dtype' must be in"),
    ("[train\nlr = 1\n", "malformed TOML"),
])
def test_bad_files_name_file_and_key(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_job(path)
    assert str(err.value).startswith(str(path) + ": ")
    assert expected in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="job file not found"):
        load_job(tmp_path / "nope.toml")


def test_overrides_are_typed_by_the_schema(tmp_path):
    job = load_job(write(tmp_path, GOOD), ["train.lr=1e-4", "train.total_steps=3", "data.1.weight=0.5",
                                           "model.path=123", "algorithm.advantage_args.norm_std=false",
                                           "async.enable=false", "data[0].reward=[\"a\", \"b\"]"])
    assert job.train.lr == 1e-4 and job.train.total_steps == 3
    assert job.data[1].weight == 0.5
    assert job.model.path == "123"  # a str field keeps the raw text, even when it looks like a number
    assert job.algorithm.advantage_args == {"norm_std": False}
    assert job.async_.enable is False
    assert job.data[0].reward == ["a", "b"]


def test_bad_overrides(tmp_path):
    path = write(tmp_path, GOOD)
    with pytest.raises(ConfigError, match="override 'trian.lr=1': unknown key 'trian' \\(did you mean 'train'\\?\\)"):
        load_job(path, ["trian.lr=1"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_job(path, ["train.lr"])
    with pytest.raises(ConfigError, match="expected int, got str 'many' at key 'train.total_steps'"):
        load_job(path, ["train.total_steps=many"])


def test_resolved_toml_round_trips(tmp_path):
    job = load_job(write(tmp_path, GOOD))
    text = dump_job_toml(job)
    again = structure_job(tomllib.loads(text), "again.toml")
    assert dump_job_toml(again) == text
    assert "[async]" in text


def test_apply_override_creates_list_entries():
    raw: dict = {}
    apply_override(raw, "data.0.name=x")
    apply_override(raw, "loggers.0.name=jsonl")
    assert raw == {"data": [{"name": "x"}], "loggers": [{"name": "jsonl"}]}


LORA = GOOD.replace("[async]", "[train.lora]\nrank = 4\nalpha = 8\ntarget_modules = \"all-linear\"\n[async]", 1)


def test_lora_table_structures_and_round_trips(tmp_path):
    job = load_job(write(tmp_path, LORA))
    lora = job.train.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules, lora.all_linear) == (4, 8.0, 0.0,
                                                                                          ["all-linear"], True)
    assert load_job(write(tmp_path, GOOD)).train.lora is None
    again = structure_job(tomllib.loads(dump_job_toml(job)))
    assert again.train.lora == lora
    named = load_job(write(tmp_path, LORA), ['train.lora.target_modules=["q_proj", "v_proj"]'])
    assert named.train.lora.target_modules == ["q_proj", "v_proj"] and not named.train.lora.all_linear


@pytest.mark.parametrize("override, expected", [
    ("train.lora.rank=0", "must be an integer >= 1, got 0 at key 'train.lora.rank'"),
    ("train.lora.dropout=1.0", "< 1, got 1.0 at key 'train.lora.dropout'"),
    ("train.lora.alpha=0", "> 0, got 0.0 at key 'train.lora.alpha'"),
    ("train.lora.target_modules=[]", "non-empty list of module names, got [] at key 'train.lora.target_modules'"),
    ('train.lora.target_modules=["all-linear", "q_proj"]', "\"all-linear\" stands alone"),
    ("train.lora.rnk=3", "did you mean 'train.lora.rank'"),
])
def test_bad_lora_settings_name_the_key(tmp_path, override, expected):
    with pytest.raises(ConfigError) as err:
        load_job(write(tmp_path, LORA), [override])
    assert expected in str(err.value) and "job.toml" in str(err.value)
