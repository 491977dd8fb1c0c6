"""Unmodified ``tinker-cookbook`` recipes train on ``loongsage tinker-serve``: the supervised
``sl_basic`` and the RL ``math_rl`` (its generated arithmetic problems).

The cookbook is installed by ``scripts/setup.sh`` (``requirements-cookbook.txt``, then the cookbook
itself without its declared dependencies). Its recipe looks the model up by a registry name: the chat
renderer from the cookbook's model table and the tokenizer with ``AutoTokenizer.from_pretrained(name)``,
which reads a local directory of that relative path first. So the tiny model is served as
``Qwen/Qwen3-8B`` and the recipe runs from a directory holding it under that path, offline.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.slow

KEY = "tml-cookbook-test-key"
REGISTRY_NAME = "Qwen/Qwen3-8B"
STEPS = 3


@pytest.fixture(scope="module")
def workdir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory where ``Qwen/Qwen3-8B`` is the tiny model (a relative path the recipe's tokenizer reads)."""
    root = tmp_path_factory.mktemp("cookbook")
    (root / "Qwen").mkdir()
    (root / REGISTRY_NAME).symlink_to(tiny_model_dir, target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def served(workdir: Path, tmp_path_factory: pytest.TempPathFactory, tinker_serve: Any) -> Iterator[tuple[str, Path]]:
    """``loongsage tinker-serve`` serving the tiny model as ``Qwen/Qwen3-8B``: (base URL, state directory)."""
    state = tmp_path_factory.mktemp("cookbook_state")
    with tinker_serve(KEY, f"{REGISTRY_NAME}={REGISTRY_NAME}", state, cwd=workdir) as exports:
        assert exports["TINKER_API_KEY"] == KEY
        yield exports["TINKER_BASE_URL"], state


def test_sl_basic_runs_unmodified_against_the_service(served: tuple[str, Path], workdir: Path,
                                                     tiny_model_dir: Path) -> None:
    import tinker_cookbook
    from safetensors.torch import load_file

    base_url, state = served
    assert base_url.startswith("http://127.0.0.1:")
    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    log_path = workdir / "runs" / "sl_basic"
    command = [sys.executable, "-m", "tinker_cookbook.recipes.sl_basic", f"model_name={REGISTRY_NAME}",
               f"base_url={base_url}", f"log_path={log_path}", f"max_steps={STEPS}", "eval_every=0",
               "save_every=0", "lora_rank=8", "learning_rate=1e-3",
               "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
               f"dataset_builder.file_path={conversations}",
               f"dataset_builder.common_config.model_name_for_tokenizer={REGISTRY_NAME}",
               "dataset_builder.common_config.renderer_name=qwen3",
               "dataset_builder.common_config.max_length=128", "dataset_builder.common_config.batch_size=4"]
    env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("TINKER_BASE_URL", None)
    out = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]

    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["train_mean_nll"] for row in rows if "train_mean_nll" in row}
    assert sorted(losses) == list(range(STEPS)), rows
    assert all(math.isfinite(loss) and loss > 0 for loss in losses.values()), losses
    # the recipe's final checkpoints: state (resumable) and sampler weights, as the service saved them
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    final = checkpoints[-1]
    assert final["name"] == "final" and final["state_path"].startswith("tinker://")
    assert final["sampler_path"].startswith("tinker://")
    sampler_files = list(state.glob("*/sampler_weights/final/model.safetensors"))
    assert len(sampler_files) == 1, sorted(str(p) for p in state.rglob("*"))
    assert list(state.glob("*/weights/final/trainer/trainer_state.pt"))
    # the steps trained the LoRA adapters: the saved sampler weights (adapters merged) moved every
    # linear projection of the base model and nothing else
    base, trained = load_file(tiny_model_dir / "model.safetensors"), load_file(sampler_files[0])
    assert set(trained) == set(base)
    moved = {name for name in base if not bool((trained[name] == base[name]).all())}
    assert moved == {name for name in base if name.endswith("_proj.weight")}, sorted(moved)


def test_math_rl_runs_unmodified_against_the_service(served: tuple[str, Path], workdir: Path) -> None:
    """The cookbook's RL recipe on its generated arithmetic problems (no download): sampling,
    rewards, ``importance_sampling`` steps and, with ``compute_post_kl``, the sampler's
    ``compute_logprobs`` of the trained tokens. Its ``optim/kl_sample_train_v2`` (the sampling
    engine's log-probs against the trainer's on the same tokens) is rounding-small: the engine
    samples the weights the trainer trains."""
    base_url, _ = served
    log_path = workdir / "runs" / "math_rl"
    command = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={REGISTRY_NAME}",
               f"base_url={base_url}", f"log_path={log_path}", "env=arithmetic", "loss_fn=importance_sampling",
               f"max_steps={STEPS}", "groups_per_batch=4", "group_size=4", "lora_rank=8", "renderer_name=qwen3",
               "eval_every=0", "save_every=0", "compute_post_kl=True", "behavior_if_log_dir_exists=delete"]
    env = {**os.environ, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("TINKER_BASE_URL", None)
    out = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "optim/kl_sample_train_v2" in row]
    assert [row["step"] for row in trained] == list(range(STEPS)), rows
    for row in trained:
        assert abs(row["optim/kl_sample_train_v2"]) < 1e-6, row
        assert math.isfinite(row["kl_pre_post_v2"]) and math.isfinite(row["env/all/reward/total"]), row
