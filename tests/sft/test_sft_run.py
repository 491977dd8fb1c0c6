"""``loongsage sft`` end to end on a tiny Qwen3 (real torch train worker, real loggers, one CPU)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from loongsage_core.config import load_job
from loongsage_core.resolve import resolve_sft_job
from loongsage_core.sft.run import SftRun, run_sft

from .conftest import REPO, metrics


def _run(job_path, out, **kw):
    job = load_job(job_path, [f"{k}={v}" for k, v in kw.items()])
    resolved = resolve_sft_job(job)
    return run_sft(resolved.job, resolved.host, str(out))


def test_packed_rows_give_the_same_loss_and_update_as_unpacked(make_job, tmp_path):
    job = make_job(rows=24, sft={"max_steps": 3, "max_seq_len": 128})
    packed = _run(job, tmp_path / "packed", **{"sft.packing": "true"})
    unpacked = _run(job, tmp_path / "unpacked", **{"sft.packing": "false"})
    for p, u in zip(packed, unpacked):
        assert p["sft/rows"] < u["sft/rows"]  # several conversations did share a row
        assert p["sft/tokens"] == u["sft/tokens"]
        assert p["sft/loss"] == pytest.approx(u["sft/loss"], rel=1e-5, abs=1e-6)
        assert p["sft/grad_norm"] == pytest.approx(u["sft/grad_norm"], rel=1e-4)
    # the loss moved (three optimizer steps happened), identically in both layouts
    assert packed[-1]["sft/loss"] < packed[0]["sft/loss"] - 0.1


def test_packed_rows_attend_only_within_each_conversation(make_job, tmp_path):
    """The position ids are what keeps packed conversations apart: without them the same packed
    rows (one causal mask over the whole row) give another loss."""
    job = load_job(make_job(rows=16, sft={"max_seq_len": 128}))
    run = SftRun(job, resolve_sft_job(job).host, tmp_path)
    run.start()
    try:
        from loongsage_core.sft.data import make_batch, pack, step_examples

        examples = step_examples(run.data, 0, 8, seed=0, shuffle=False)
        rows = pack(examples, 128)
        assert len(rows) < len(examples)

        def nll(batch):
            lp = run.worker.forward(batch)["logprobs"]
            return float(-(lp * batch["loss_mask"]).sum() / batch["loss_mask"].sum())

        separate = nll(make_batch([[e] for e in examples], run.pad_id, packed=False))
        packed = nll(make_batch(rows, run.pad_id, packed=True))
        leaky = nll(make_batch(rows, run.pad_id, packed=False))
        assert packed == pytest.approx(separate, rel=1e-5)
        assert abs(leaky - separate) > 1e-3
    finally:
        run.close()


def test_a_short_run_lowers_the_held_back_loss(make_job, tmp_path):
    job = make_job(rows=48, sft={"epochs": 3, "eval_rows": 8, "eval_every": 5})
    history = _run(job, tmp_path / "out")
    evals = [m["sft/eval_loss"] for m in history if "sft/eval_loss" in m]
    assert len(evals) >= 3 and "sft/eval_loss" in history[-1]
    assert evals[-1] < 0.6 * evals[0], evals
    logged = metrics(tmp_path / "out")
    assert [m["step"] for m in logged] == list(range(len(history)))
    assert all("sft/loss" in m for m in logged)


def test_resume_continues_exactly(make_job, tmp_path):
    job = make_job(rows=24, sft={"epochs": 2, "eval_rows": 4, "eval_every": 2},
                   run={"checkpoint_every": 3, "keep_checkpoints": 0, "save_hf_at_end": True})
    full = tmp_path / "full"
    _run(job, full)
    steps = len(metrics(full))
    assert steps == 6
    # the same run killed after its step-3 checkpoint: drop what came later, resume
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "final_hf")
    shutil.rmtree(cut / "checkpoints" / "step_000006")
    _run(job, cut, **{"run.resume": "true"})
    assert metrics(cut) == [{**m, "timing/step": m2["timing/step"]} for m, m2 in zip(metrics(full), metrics(cut))]
    from safetensors.torch import load_file

    a, b = load_file(full / "final_hf" / "model.safetensors"), load_file(cut / "final_hf" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_parquet_and_saved_datasets_render_like_jsonl(make_job, tmp_path):
    import datasets

    from loongsage_core.agentflow import ChatRenderer
    from loongsage_core.hf_models import load_tokenizer
    from loongsage_core.sft.data import load_examples

    job = load_job(make_job(rows=6))
    renderer = ChatRenderer(load_tokenizer(job))
    want = load_examples(job, renderer, None)
    ds = datasets.Dataset.from_json(job.data[0].path)
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "chat.parquet", tmp_path / "saved"):
        job.data[0].path = str(path)
        assert load_examples(job, renderer, None) == want


def cli(*args):
    return subprocess.run([sys.executable, "-m", "loongsage_core", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.slow
def test_cli_trains_and_reports_bad_sft_keys_in_one_line(make_job, tmp_path):
    job = make_job(rows=12, sft={"max_steps": 2, "eval_rows": 2}, run={"save_hf_at_end": True})
    out = cli("sft", str(job), "--output-dir", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    logged = metrics(tmp_path / "out")
    assert len(logged) == 2 and "sft/eval_loss" in logged[-1]
    assert (tmp_path / "out" / "final_hf" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "config.resolved.toml").is_file()

    bad = cli("sft", str(job), "--output-dir", str(tmp_path / "o2"), "sft.epoch=2")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "unknown key 'sft.epoch' (did you mean 'sft.epochs'?)" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1

    job.write_text(job.read_text().replace("[sft]", "[sft]\nloss_on = \"everything\""))
    bad = cli("validate", str(job))
    assert bad.returncode == 2 and "loss_on" in bad.stderr and "'assistant'" in bad.stderr
    job.write_text(job.read_text().replace('loss_on = "everything"', "packing = 1"))
    bad = cli("sft", str(job), "--output-dir", str(tmp_path / "o3"))
    assert bad.returncode == 2 and "sft.packing" in bad.stderr
    job.write_text(job.read_text().replace("packing = 1", "packing = true"))
    bad = cli("validate", str(job), "train.num_workers=2")
    assert bad.returncode == 2 and "train.num_workers = 2" in bad.stderr


def test_validate_knows_sft_jobs_and_run_refuses_them(make_job):
    job = make_job(rows=4)
    ok = cli("validate", str(job))
    assert ok.returncode == 0, ok.stderr
    assert "[sft]" in ok.stdout and f"{job}: OK" in ok.stdout
    refused = cli("run", str(job))
    assert refused.returncode == 2 and "loongsage sft" in refused.stderr


def test_sft_with_lora_trains_only_the_adapter(make_job, tmp_path):
    """``[train] lora``: the backend's PEFT adapter trains, the base weights stay; the merged model
    and the PEFT adapter are exported."""
    from safetensors.torch import load_file

    job_path = make_job(rows=24, sft={"epochs": 2, "eval_rows": 4, "eval_every": 2},
                        train={"lr": 1e-2, "lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}},
                        run={"save_hf_at_end": True})
    job = load_job(job_path)
    run = SftRun(job, resolve_sft_job(job).host, tmp_path / "out")
    run.start()
    try:
        before = {k: v.clone() for k, v in run.worker.model.state_dict().items()}
        history = run.fit()
        after = run.worker.model.state_dict()
    finally:
        run.close()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed), sorted(changed)[:5]
    evals = [m["sft/eval_loss"] for m in history if "sft/eval_loss" in m]
    assert evals[-1] < evals[0]
    assert (tmp_path / "out" / "final_adapter" / "adapter_config.json").is_file()
    merged = load_file(tmp_path / "out" / "final_hf" / "model.safetensors")
    assert not any("lora" in k for k in merged)
    q = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(merged[q + ".weight"], before[q + ".base_layer.weight"])  # the adapter is merged in
