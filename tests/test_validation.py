"""Bad job files and overrides: one line naming the file and key, exit 2, never a traceback.

Each case of the reliability review's list is one parametrized case; a hypothesis test feeds
generated TOML and overrides to ``loongsage validate`` and accepts only exit 0 or 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loongsage_core.cli import main
from loongsage_core.config import load_job

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "configs" / "quickstart" / "model"

BASE = f"""
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents"]
[model]
path = "{MODEL}"
[train]
lr = 1e-5
[[data]]
name = "a"
generator = "arithmetic"
reward = ["exact_match"]
"""


def validate(capsys, job: Path, *overrides: str) -> tuple[int, str]:
    """``loongsage validate`` in this process (the subprocess tests below cover the real CLI)."""
    rc = main(["validate", str(job), *overrides])
    return rc, capsys.readouterr().err


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(BASE)
    return path


def _vlm_model(tmp_path: Path) -> Path:
    """A model directory holding the tiny Qwen2-VL (with the test VLM's tokenizer files)."""
    import shutil

    from loongsage_plugin_torch.modeling import TINY_QWEN2_VL
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoModelForImageTextToText

    conf = dict(TINY_QWEN2_VL)
    out = tmp_path / "vlm"
    config = AutoConfig.for_model(conf.pop("model_type"), **conf)
    config.save_pretrained(str(out))
    save_model(AutoModelForImageTextToText.from_config(config), str(out / "model.safetensors"))
    for f in (Path(__file__).resolve().parent / "data" / "vlm").iterdir():
        shutil.copy(f, out / f.name)
    return out


def _bad_model(tmp_path: Path) -> Path:
    d = tmp_path / "bad_model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3", ')
    return d


def _no_weights(tmp_path: Path) -> Path:
    d = tmp_path / "no_weights"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL / name, d / name)
    return d


def _module(tmp_path: Path, code: str) -> Path:
    path = tmp_path / "user_module.py"
    path.write_text(code)
    return path


# a user's train backend whose spec does not declare supports_lora (every shipped backend does)
NO_LORA_BACKEND = """
from loongsage_hookspecs import TrainBackendSpec, hookimpl


@hookimpl
def loongsage_train_backends():
    yield TrainBackendSpec(name="plain", factory=lambda ctx: None, description="a train backend without LoRA")
"""


# a user's train backend that trains in float32 only (its spec declares model_dtypes)
FP32_BACKEND = """
from loongsage_hookspecs import TrainBackendSpec, hookimpl


@hookimpl
def loongsage_train_backends():
    yield TrainBackendSpec(name="fp32only", factory=lambda ctx: None, model_dtypes=("float32",),
                           description="a train backend that trains in float32 only")
"""


# a user's train backend that checks its own backend_args (its spec declares check_job)
CHECKED_BACKEND = """
from loongsage_hookspecs import TrainBackendSpec, hookimpl


def check_job(job):
    shards = job.train.backend_args.get("shards", 1)
    if job.train.num_workers % shards:
        raise ValueError(f"[train] backend_args.shards = {shards} must divide the {job.train.num_workers} ranks")


@hookimpl
def loongsage_train_backends():
    yield TrainBackendSpec(name="sharded", factory=lambda ctx: None, check_job=check_job,
                           description="a train backend that checks its layout at validation")
"""


MEGATRON = ['plugins.enable=["torch", "rl", "rewards", "loggers", "agents", "megatron"]', "train.backend=megatron"]


# (overrides built from tmp_path, text expected in the one error line)
CASES = {
    "override into a scalar": (lambda t: ["train.lr.x=1"],
                               "override 'train.lr.x=1': 'train.lr' is a float, not a table"),
    "corrupt config.json": (lambda t: [f"model.path={_bad_model(t)}"], "config.json' is not valid JSON"),
    "model without weights": (lambda t: [f"model.path={_no_weights(t)}"], "has no weight files"),
    "data weight nan": (lambda t: ["data.0.weight=nan"], "got nan at key 'data[0].weight'"),
    "data weight inf": (lambda t: ["data.0.weight=inf"], "got inf at key 'data[0].weight'"),
    "negative lr": (lambda t: ["train.lr=-1e-5"], "must be a finite number > 0, got -1e-05 at key 'train.lr'"),
    "nan lr": (lambda t: ["train.lr=nan"], "got nan at key 'train.lr'"),
    "inf lr": (lambda t: ["train.lr=inf"], "got inf at key 'train.lr'"),
    "negative total_steps": (lambda t: ["train.total_steps=-3"], "got -3 at key 'train.total_steps'"),
    "negative warm-up": (lambda t: ["train.lr_warmup_steps=-1"], "got -1 at key 'train.lr_warmup_steps'"),
    "one beta": (lambda t: ["train.betas=[0.9]"], "must be two numbers in [0, 1)"),
    "zero engines": (lambda t: ["rollout.num_engines=0"],
                     "must be an integer >= 1, got 0 at key 'rollout.num_engines'"),
    "max_new_tokens -1": (lambda t: ["rollout.max_new_tokens=-1"], "key 'rollout.max_new_tokens'"),
    "temperature -1": (lambda t: ["rollout.temperature=-1"], "key 'rollout.temperature'"),
    "top_p 0": (lambda t: ["rollout.top_p=0"], "must be a finite number > 0 and <= 1, got 0.0 at key 'rollout.top_p'"),
    "top_k 0": (lambda t: ["rollout.top_k=0"], "must be an integer >= 1 (or -1), got 0 at key 'rollout.top_k'"),
    "20-digit seed": (lambda t: ["run.seed=12345678901234567890"], "at key 'run.seed'"),
    "source sampling top_p 0": (lambda t: ["data.0.sampling={top_p=0}"], "data[0].sampling.top_p: must be"),
    "ppo_epochs 0": (lambda t: ["train.ppo_epochs=0"], "at key 'train.ppo_epochs'"),
    "micro above mini": (lambda t: ["train.micro_batch_size=64"], "train.micro_batch_size (64) must not exceed"),
    "generator of the wrong type": (lambda t: ["data.0={generator=5}"],
                                    "expected str, got int 5 at key 'data[0].generator'"),
    "advantage_args of the wrong type": (lambda t: ["algorithm.advantage_args=5"],
                                         "expected a table, got int 5 at key 'algorithm.advantage_args'"),
    "module raising on import": (lambda t: [f'plugins.modules=["{_module(t, "raise RuntimeError(1)")}"]'],
                                 "user_module.py' failed: RuntimeError"),
    "module exiting on import": (lambda t: [f'plugins.modules=["{_module(t, "import sys; sys.exit(3)")}"]'],
                                 "user_module.py' failed: the module called sys.exit(3)"),
    "colocated engines above trainers": (lambda t: ["rollout.num_engines=2"], "needs rollout.num_engines (2) <="),
    "inprocess between actors": (lambda t: ["placement.colocate=false", "rollout.weight_transport=inprocess"],
                                 "rollout.weight_transport = 'inprocess' hands weights over inside one process"),
    "megatron with a reference refresh": (lambda t: ['plugins.enable=["torch", "rl", "rewards", "loggers", "agents", '
                                                     '"megatron"]', "train.backend=megatron", "algorithm.kl=k3",
                                                     "algorithm.kl_coef=0.1", "algorithm.ref_update_every=5"],
                                          "'megatron' does not declare the LoadsWeights capability"),
    "megatron's distributed optimizer without a trainer GPU": (
        lambda t: [*MEGATRON, "train.backend_args={use_distributed_optimizer=true}"],
        "backend_args.use_distributed_optimizer = true cannot run here: Megatron-Core's DistributedOptimizer "
        "needs CUDA"),
    "megatron tp above the ranks": (lambda t: [*MEGATRON, "train.backend_args={tp=2}"],
                                    "train.backend = 'megatron': [train] backend_args: 1 ranks are not divisible "
                                    "by tp * pp = 2"),
    "megatron pp not splitting the layers": (lambda t: [*MEGATRON, "train.num_workers=2", "train.backend_args={pp=2}"],
                                             "backend_args.pp = 2: the model's 3 layers do not split evenly"),
    "megatron virtual stages without a pipeline": (lambda t: [*MEGATRON, "train.backend_args={vpp=2}"],
                                                   "backend_args.vpp = 2 needs pp > 1"),
    "megatron context parallelism on the CPU": (lambda t: [*MEGATRON, "train.num_workers=2",
                                                           "train.backend_args={cp=2}"],
                                                "backend_args.cp = 2 cannot run: Megatron-Core computes "
                                                "context-parallel attention only in Transformer Engine's"),
    "megatron full recomputation without a method": (
        lambda t: [*MEGATRON, "train.backend_args={recompute_granularity='full'}"],
        "backend_args.recompute_granularity = 'full' needs recompute_method"),
    "auto's flat weight_transport_args": (lambda t: ["rollout.weight_transport_args={bucket_bytes=4096}"],
                                          "rollout.weight_transport_args.bucket_bytes: 'auto' takes one table per "
                                          "transport it may choose, and 'bucket_bytes' is none of them; choose "
                                          "from: broadcast, inprocess, shm"),
    "auto's table for a transport that is not a table": (lambda t: ["rollout.weight_transport_args={shm=4}"],
                                                         "rollout.weight_transport_args.shm: expected a table"),
    "megatron with a vision-language model": (lambda t: [*MEGATRON, f"model.path={_vlm_model(t)}"],
                                              "is a vision-language model (model_type 'qwen2_vl'); the megatron "
                                              "backend trains text models only"),
    "megatron backend_args key misspelt": (lambda t: [*MEGATRON, "train.backend_args={tpp=2}"],
                                           "[train] backend_args: unknown keys ['tpp'] for the megatron backend"),
    "router replay on a dense model": (lambda t: ["algorithm.router_replay=true"],
                                       "algorithm.router_replay = true, but the policy"),
    "a dtype the backend does not train in": (lambda t: ["train.backend=fp32only", "model.dtype=bfloat16",
                                                         f'plugins.modules=["{_module(t, FP32_BACKEND)}"]'],
                                              "model.dtype = 'bfloat16': train.backend = 'fp32only' trains in "
                                              "'float32' only"),
    "a layout the backend's check_job refuses": (lambda t: ["train.backend=sharded", "train.num_workers=3",
                                                           "train.backend_args={shards=2}",
                                                           f'plugins.modules=["{_module(t, CHECKED_BACKEND)}"]'],
                                                 "train.backend = 'sharded': [train] backend_args.shards = 2 must "
                                                 "divide the 3 ranks"),
    "torch backend_args key misspelt": (lambda t: ["train.backend_args={devcie='cpu'}"],
                                        "train.backend = 'torch': [train] backend_args"),
    "torch backend_args value out of its choices": (lambda t: ["train.backend_args={dist_backend='mpi'}"],
                                                    "[train] backend_args: 'dist_backend' must be in ('auto', "
                                                    "'gloo', 'nccl') (got 'mpi')"),
    "torch backend_args flag that is not a boolean": (lambda t: ["train.backend_args={share_prompts=3}"],
                                                      "[train] backend_args: expected bool, got int 3 at key "
                                                      "'share_prompts'"),
    "torch on CUDA without a trainer GPU": (lambda t: ["train.backend_args={device='cuda'}"],
                                            "backend_args.device = 'cuda', but [placement] trainer_gpus = 0"),
    "torch on a device torch cannot parse": (lambda t: ["train.backend_args={device='gpu0'}"],
                                             "backend_args.device = 'gpu0' is not a torch device"),
    "lora rank 0": (lambda t: ["train.lora={rank=0}"], "must be an integer >= 1, got 0 at key 'train.lora.rank'"),
    "lora with a reference refresh": (lambda t: ["train.lora={rank=4}", "algorithm.kl=k3", "algorithm.kl_coef=0.1",
                                                 "algorithm.ref_update_every=5"],
                                      "algorithm.ref_update_every = 5 with train.lora"),
    "lora on a backend without it": (lambda t: ["train.lora={rank=4}", "train.backend=plain",
                                                f'plugins.modules=["{_module(t, NO_LORA_BACKEND)}"]'],
                                     "train.lora: train.backend = 'plain' does not support LoRA adapters"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_value_is_one_line_naming_the_key(capsys, tmp_path, job, case):
    make_overrides, expected = CASES[case]
    rc, err = validate(capsys, job, *make_overrides(tmp_path))
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"loongsage: error: {job}: ") or lines[0].startswith("loongsage: error: "), lines[0]
    assert str(job) in lines[0] and expected in lines[0], lines[0]


def test_a_backends_device_checks_read_the_jobs_placement_not_this_machine(capsys, job):
    """A GPU job validates on a machine without a GPU (a login node): the backends' ``check_job``
    reads ``[placement] trainer_gpus``, and the same settings are refused without it."""
    gpus = ["placement.trainer_gpus=1", "placement.engine_gpus=1"]
    for overrides in ([*MEGATRON, "train.backend_args={use_distributed_optimizer=true}"],
                      ["train.backend_args={device='cuda:0'}"]):
        rc, err = validate(capsys, job, *overrides, *gpus)
        assert rc == 0, err
        rc, err = validate(capsys, job, *overrides)
        assert rc == 2 and ("trainer_gpus = 0" in err or "needs CUDA" in err), err


def test_non_utf8_job_file(capsys, tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(BASE.encode() + "# caf\u00e9\n".encode("latin-1"))
    rc, err = validate(capsys, path)
    assert rc == 2
    assert f"{path}: not UTF-8 text" in err


def test_non_utf8_data_file(capsys, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"prompt": "1+1", "label": "2"}\n{"prompt": "caf\xe9"}\n')
    path = tmp_path / "job.toml"
    path.write_text(BASE.replace('generator = "arithmetic"', f'path = "{data}"'))
    rc, err = validate(capsys, path)
    assert rc == 2
    assert f"data[0] ('a'): {data}:2: not UTF-8 text" in err


def test_data_file_nested_too_deep(capsys, tmp_path):
    """A row whose metadata nests 100k levels deep is an error naming the file and line (the parser
    would otherwise run out of recursion)."""
    data = tmp_path / "rows.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    data.write_text('{"prompt": "1+1", "label": "2"}\n{"prompt": "x", "metadata": ' + deep + "}\n")
    path = tmp_path / "job.toml"
    path.write_text(BASE.replace('generator = "arithmetic"', f'path = "{data}"'))
    rc, err = validate(capsys, path)
    assert rc == 2 and "Traceback" not in err
    assert f"data[0] ('a'): {data}:2: the JSON nests deeper than 64 levels" in err


def test_table_override_merges_into_the_table(job):
    loaded = load_job(job, ["train={total_steps=3}", "train={mini_batch_size=8, micro_batch_size=2}"])
    assert loaded.train.lr == 1e-5  # from the file: the override did not replace [train]
    assert (loaded.train.total_steps, loaded.train.mini_batch_size, loaded.train.micro_batch_size) == (3, 8, 2)
    nested = load_job(job, ["algorithm.advantage_args={norm_std=false}", "algorithm={advantage_args={eps=1e-3}}"])
    assert nested.algorithm.advantage_args == {"norm_std": False, "eps": 1e-3}


def test_good_job_still_validates(capsys, job):
    rc, err = validate(capsys, job, "train.lr=3e-4", "rollout.top_k=20", "run.seed=2147483647")
    assert rc == 0, err


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loongsage_core", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_cli_run_reports_user_module_exit_and_bad_values(tmp_path, job):
    """The real CLI, ``run`` included: nothing starts, one line, exit 2."""
    module = _module(tmp_path, "import sys\nsys.exit(3)\n")
    for args in (["validate", str(job), f'plugins.modules=["{module}"]'],
                 ["run", str(job), "rollout.num_engines=0", "--output-dir", str(tmp_path / "out")],
                 ["run", str(job), "train.lr=inf", "--output-dir", str(tmp_path / "out")]):
        out = _cli(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "out").exists()  # refused before the run directory was touched


@pytest.mark.slow
def test_unwritable_output_dir_is_one_line(tmp_path, job):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = _cli("run", str(job), "--output-dir", str(blocker / "run"))
    assert out.returncode == 2, out.stderr
    assert f"--output-dir: cannot write to run directory '{blocker / 'run'}'" in out.stderr
    assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------------------------
# Fuzzing: generated job files and overrides give exit 0 or 2, never a traceback
# --------------------------------------------------------------------------------------------

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEYS = ["train.lr", "train.total_steps", "train.betas", "train.mini_batch_size", "train.micro_batch_size",
        "train.ppo_epochs", "train.lr_warmup_steps", "train.min_lr_ratio", "train.grad_clip", "train.max_bad_steps",
        "rollout.num_engines", "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.max_new_tokens",
        "rollout.max_context_length", "rollout.samples_per_prompt", "run.seed", "model.seed", "model.path",
        "data.0.weight", "data.0.generator", "data.0.sampling", "data.0.reward", "algorithm.advantage_args",
        "algorithm.kl_coef", "placement.colocate", "train", "rollout", "data", "data.1.name", "train.lr.x",
        "algorithm.advantage_args.norm_std.x", "async.stale_steps", "run.keep_checkpoints", "nonsense.key",
        "data.x", "loggers.0.args"]


def _toml_literal(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    return json.dumps(value)


scalars = st.one_of(st.integers(min_value=-2**70, max_value=2**70), st.floats(), st.booleans(),
                    st.text(alphabet="abcxyz_ -.", max_size=6))
toml_values = st.one_of(
    scalars.map(_toml_literal),
    st.sampled_from(["[0.9]", "[]", "{}", "{lr=1}", "{top_p=0}", "[1, 2]", '"arithmetic"', "{norm_std=false}",
                     "[[1]]", "x=1", "=", "", "{a={b=1}}"]),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=st.lists(st.tuples(st.sampled_from(KEYS), toml_values), max_size=4))
@example(overrides=[("data.0.reward", '""')])  # an empty component name (found by a hunt)
def test_fuzzed_overrides_exit_0_or_2(capsys, job, overrides):
    items = [f"{k}={v}" for k, v in overrides]
    rc, err = validate(capsys, job, *items)
    assert rc in (0, 2), (items, err)
    if rc == 2:
        assert len(err.strip().splitlines()) == 1, (items, err)
    _COUNTS[rc] = _COUNTS.get(rc, 0) + 1


_COUNTS: dict[int, int] = {}

section_text = st.lists(st.tuples(st.sampled_from(KEYS), toml_values), max_size=6).map(
    lambda kvs: "\n".join(f"{k} = {v}" for k, v in kvs))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=section_text, header=st.sampled_from(["", "[train]", "[rollout]", "[[data]]", "[run]", "[x]"]))
def test_fuzzed_job_files_exit_0_or_2(capsys, tmp_path, extra, header):
    path = tmp_path / "fuzz.toml"
    path.write_text(BASE + "\n" + header + "\n" + extra + "\n")
    rc, err = validate(capsys, path)
    assert rc in (0, 2), (path.read_text(), err)
    _COUNTS[rc] = _COUNTS.get(rc, 0) + 1


def test_fuzz_counts_printed():
    """Print how the fuzzed inputs were answered (pytest -s shows it)."""
    print(f"fuzzed validate calls: exit 0 x{_COUNTS.get(0, 0)}, exit 2 x{_COUNTS.get(2, 0)}")
    assert set(_COUNTS) <= {0, 2}
