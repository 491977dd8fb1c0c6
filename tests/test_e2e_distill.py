"""On-policy distillation end to end: a tiny student learns from two teachers, one per data source."""

from __future__ import annotations

from pathlib import Path

from loongsage_core.config import load_job
from loongsage_core.controller.run import run_job
from loongsage_core.resolve import resolve_job

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "configs" / "quickstart" / "model"


def make_second_teacher(path: Path) -> None:
    """Another teacher of the same vocabulary: the quickstart model with its output layer perturbed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(QUICKSTART)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(QUICKSTART).save_pretrained(path)


def test_student_distills_from_two_teachers(ray_cluster, tmp_path):
    make_second_teacher(tmp_path / "teacher_b")
    job_path = tmp_path / "job.toml"
    job_path.write_text(f"""
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents", "distill"]
[model]
tokenizer = "{REPO / 'tests' / 'data' / 'tokenizer'}"
[model.config]
model_type = "qwen3"
vocab_size = 512
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 1
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16
max_position_embeddings = 256
tie_word_embeddings = true
[train]
lr = 2e-2
total_steps = 10
mini_batch_size = 32
micro_batch_size = 16
[rollout]
prompts_per_step = 4
samples_per_prompt = 4
max_new_tokens = 6
weight_transport = "inprocess"
[algorithm]
distill_kl = "opd_full_kl"
distill_coef = 1.0
[run]
save_hf_at_end = false
[[teachers]]
name = "a"
path = "{QUICKSTART}"
[[teachers]]
name = "b"
path = "{tmp_path / 'teacher_b'}"
[[data]]
name = "add"
generator = "arithmetic"
generator_args = {{ num_samples = 50, ops = "+" }}
teacher = "a"
[[data]]
name = "sub"
generator = "arithmetic"
generator_args = {{ num_samples = 50, ops = "-" }}
teacher = "b"
[[loggers]]
name = "jsonl"
""")
    history = run_job(resolve_job(load_job(job_path)), output_dir=str(tmp_path / "run"))
    kl = [m["train/opd_kl"] for m in history]
    assert all(f"train_per_teacher/{t}/opd_kl" in history[-1] for t in ("a", "b"))
    assert all(m["rollout_per_source/add/count"] == m["rollout_per_source/sub/count"] == 8.0 for m in history)
    # the student moves towards its teachers: the KL of the last steps is well below the first steps'
    assert sum(kl[-2:]) / 2 < 0.8 * sum(kl[:2]) / 2, kl
