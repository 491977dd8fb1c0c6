"""Job files by name: lookup, listing, did-you-mean, overrides on a named recipe, search order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongsage_core.cli import main
from loongsage_core.config import ConfigError
from loongsage_core.recipes import describe, find_job, list_recipes

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _outside_the_checkout(tmp_path, monkeypatch):
    """Run from a directory without ./configs, so only the shipped configs (and the env) count."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LOONGSAGE_CONFIG_PATH", raising=False)


def test_a_short_name_finds_the_recipe_and_a_long_name_any_config():
    assert find_job("grpo") == REPO / "configs" / "recipes" / "grpo.toml"
    assert find_job("recipes/dapo") == REPO / "configs" / "recipes" / "dapo.toml"
    assert find_job("quickstart/grpo") == REPO / "configs" / "quickstart" / "grpo.toml"
    assert find_job("rloo") == REPO / "configs" / "recipes" / "rloo.toml"


def test_a_path_wins_over_a_name(tmp_path):
    own = tmp_path / "grpo"
    own.write_text("[plugins]\n")
    assert find_job("grpo").resolve() == own


def test_unknown_name_suggests_the_closest(capsys):
    with pytest.raises(ConfigError, match=r"gpro: no job file or recipe.*did you mean.*'recipes/grpo'"):
        find_job("gpro")
    assert main(["validate", "gpro"]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_missing_toml_path_is_not_treated_as_a_name():
    with pytest.raises(ConfigError, match="missing.toml: job file not found"):
        find_job("missing.toml")


def test_validate_by_name_applies_overrides(capsys):
    assert main(["validate", "dapo", "train.lr=0.125", "--json"]) == 0
    job = json.loads(capsys.readouterr().out)["job"]
    assert job["train"]["lr"] == 0.125
    assert job["algorithm"]["filters"]  # dapo's dynamic sampling came from the named file


def test_listing_is_json_with_names_descriptions_and_paths(capsys):
    assert main(["recipes", "--json"]) == 0
    listed = {r["name"]: r for r in json.loads(capsys.readouterr().out)["recipes"]}
    # a file named like its folder (recipes/x/x.toml) is listed under the folder's name
    shipped = {(p.parent if p.stem == p.parent.name else p.with_suffix("")).relative_to(REPO / "configs").as_posix()
               for p in (REPO / "configs").rglob("*.toml")}
    assert set(listed) == shipped
    assert {"recipes/math_dapo", "recipes/mopd"} <= shipped
    assert listed["recipes/grpo"]["description"].startswith("GRPO (DeepSeekMath)")
    assert listed["recipes/dr_grpo"]["description"].startswith("Dr. GRPO")  # no cut at "Dr."
    assert Path(listed["recipes/grpo"]["path"]).is_file()


def test_config_path_env_comes_first_and_a_folder_names_its_recipe(tmp_path, monkeypatch):
    extra = tmp_path / "mine"
    (extra / "recipes" / "grpo").mkdir(parents=True)
    (extra / "recipes" / "grpo" / "grpo.toml").write_text("# My GRPO variant. More text.\n[plugins]\n")
    monkeypatch.setenv("LOONGSAGE_CONFIG_PATH", str(extra))
    assert find_job("grpo") == extra / "recipes" / "grpo" / "grpo.toml"
    mine = {r.name: r for r in list_recipes()}["recipes/grpo"]
    assert mine.description == "My GRPO variant."


def test_description_is_the_first_sentence_of_the_opening_comment(tmp_path):
    job = tmp_path / "j.toml"
    job.write_text("# One line that goes\n# on here. Second sentence.\n#   loongsage run j.toml\n[train]\n")
    assert describe(job) == "One line that goes on here."
    job.write_text("[train]\n# not an opening comment\n")
    assert describe(job) == ""
