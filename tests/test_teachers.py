"""TeacherGroup: two tiny saved teachers, per-source routing, residency and the controller hooks."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from loongsage_core.algorithms import LossPipeline, LossPipelineError, StepAlgorithm
from loongsage_core.algorithms.distill import distill_setup, uses_reference_model
from loongsage_core.algorithms.pipeline import TEACHER_MASK_KEY
from loongsage_core.config import AlgorithmConfig, ConfigError, DataConfig, JobConfig, PlacementConfig, TeacherConfig
from loongsage_core.controller.teacher_actor import Teachers
from loongsage_core.controller.teachers import TeacherGroup
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import AggregationNorm, Batch

TOKENIZER_DIR = Path(__file__).resolve().parent / "data" / "tokenizer"
TEXTS = ["What is 2 + 3?", "def add(a, b): return a + b", "Tell me a story about a cat.",
         "Solve x * 4 = 12 for x.", "print('hello world')", "hi"]
SOURCES = ["math", "code", "chat", "math", "code", "chat"]


def _tiny_model(seed: int):
    from loongsage_plugin_torch.modeling import TINY_QWEN3
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = dict(TINY_QWEN3)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(conf.pop("model_type"), **conf))


@pytest.fixture(scope="module")
def teacher_dirs(tmp_path_factory) -> dict[str, Path]:
    dirs = {}
    for name, seed in (("big", 1), ("coder", 2)):
        path = tmp_path_factory.mktemp(name)
        _tiny_model(seed).save_pretrained(path)
        dirs[name] = path
    return dirs


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.create(enable=["distill", "rl"])


@pytest.fixture(scope="module")
def batch() -> Batch:
    """Six rows (prompt + a few 'generated' tokens) from three sources, right-padded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    seqs = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    width = max(len(s) for s in seqs) + 3
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    att = torch.zeros_like(ids)
    loss = torch.zeros(len(seqs), width)
    g = torch.Generator().manual_seed(0)
    for i, s in enumerate(seqs):
        tail = torch.randint(0, 512, (3,), generator=g).tolist()
        row = s + tail
        ids[i, :len(row)] = torch.tensor(row)
        att[i, :len(row)] = 1
        loss[i, len(s):len(row)] = 1
    old = torch.randn(len(seqs), width, generator=g).clamp(max=0) * loss
    return Batch(tensors={"input_ids": ids, "attention_mask": att, "loss_mask": loss, "old_logprobs": old},
                 meta={"source": list(SOURCES)})


def make_job(dirs: dict[str, Path], *, kl: str = "opd_k3", distill_kl: str | None = None,
             max_resident: int = 1, offload: str = "cpu", **alg: object) -> JobConfig:
    teachers = [TeacherConfig(name=n, path=str(p), args={"device": "cpu", "micro_batch_size": 4})
                for n, p in dirs.items()]
    data = [DataConfig(name="math", path="m.jsonl", teacher="big"),
            DataConfig(name="code", path="c.jsonl", teacher="coder"),
            DataConfig(name="chat", path="h.jsonl")]
    algorithm = AlgorithmConfig(kl=kl, kl_coef=1.0, distill_kl=distill_kl, **alg)  # type: ignore[arg-type]
    return JobConfig(teachers=teachers, data=data, algorithm=algorithm,
                     placement=PlacementConfig(max_resident_teachers=max_resident, teacher_offload=offload))


def reference_logprobs(path: Path, batch: Batch, rows: list[int]) -> torch.Tensor:
    """Aligned sampled-token log-probs of ``rows`` computed directly with the saved model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    out = torch.zeros(len(rows), batch["input_ids"].shape[1])
    with torch.no_grad():
        for j, r in enumerate(rows):
            n = int(batch["attention_mask"][r].sum())
            ids = batch["input_ids"][r, :n]
            logq = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].double(), -1)
            out[j, 1:n] = logq.gather(-1, ids[1:, None])[:, 0].float()
    return out


def test_rows_are_routed_by_source_to_their_own_teacher(teacher_dirs, host, batch):
    group = TeacherGroup.from_job(make_job(teacher_dirs), host)
    assert group is not None
    out = group.forward(batch)
    assert set(out) == {"ref_logprobs", TEACHER_MASK_KEY}
    math_rows, code_rows, chat_rows = [0, 3], [1, 4], [2, 5]
    big = reference_logprobs(teacher_dirs["big"], batch, math_rows)
    coder = reference_logprobs(teacher_dirs["coder"], batch, code_rows)
    torch.testing.assert_close(out["ref_logprobs"][math_rows], big, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["ref_logprobs"][code_rows], coder, atol=1e-5, rtol=1e-5)
    # the two teachers really differ, so the match above is the routing and not a coincidence
    other = reference_logprobs(teacher_dirs["coder"], batch, math_rows)
    assert (other - big).abs().max() > 1e-2
    # rows without a teacher: zeros and a zero mask row; rows with one: a mask row of ones
    assert torch.equal(out["ref_logprobs"][chat_rows], torch.zeros(2, batch["input_ids"].shape[1]))
    mask = out[TEACHER_MASK_KEY]
    assert mask.shape == batch["input_ids"].shape
    assert torch.equal(mask[:, 0], torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0]))
    assert bool((mask == mask[:, :1]).all())


def test_topk_and_logits_levels_fill_the_vocabulary_tensors(teacher_dirs, host, batch):
    group = TeacherGroup.from_job(make_job(teacher_dirs, distill_kl="opd_topk_kl", distill_topk=5), host)
    assert group is not None and group.setup.separate and group.setup.topk == 5
    out = group.forward(batch)
    assert set(out) == {"teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs", TEACHER_MASK_KEY}
    assert out["teacher_topk_ids"].shape == (*batch["input_ids"].shape, 5)
    logits = group.forward(batch, requires="logits")["teacher_logits"]
    assert logits.shape == (*batch["input_ids"].shape, 512)
    row, n = 1, int(batch["attention_mask"][1].sum())
    logq = torch.log_softmax(logits[row, 1:n].double(), -1)
    top = logq.topk(5, -1)
    torch.testing.assert_close(out["teacher_topk_logprobs"][row, 1:n].double(), top.values, atol=1e-5, rtol=1e-5)
    assert torch.equal(out["teacher_topk_ids"][row, 1:n], top.indices)
    picked = logq.gather(-1, batch["input_ids"][row, 1:n, None])[:, 0]
    torch.testing.assert_close(out["teacher_logprobs"][row, 1:n].double(), picked, atol=1e-5, rtol=1e-5)
    assert not bool(logits[[2, 5]].any())  # chat rows get nothing


def test_at_most_max_resident_teachers_stay_loaded(teacher_dirs, host, batch):
    group = TeacherGroup.from_job(make_job(teacher_dirs, max_resident=1), host)
    assert group is not None
    group.forward(batch)
    assert len(group.resident) == 1 and group.loads == 2
    group.forward(batch)  # the resident teacher runs first, so only the other one is loaded again
    assert len(group.resident) == 1 and group.loads == 3
    assert all(t.builds == 1 for t in group.teachers.values())  # "cpu" offload keeps the objects

    both = TeacherGroup.from_job(make_job(teacher_dirs, max_resident=2), host)
    assert both is not None
    both.forward(batch)
    both.forward(batch)
    assert set(both.resident) == {"big", "coder"} and both.loads == 2


def test_release_offload_drops_the_teacher_and_rebuilds_it_on_next_use(teacher_dirs, host, batch):
    group = TeacherGroup.from_job(make_job(teacher_dirs, max_resident=0, offload="release"), host)
    assert group is not None
    first = group.forward(batch)["ref_logprobs"]
    assert group.resident == () and all(t.teacher is None for t in group.teachers.values())
    second = group.forward(batch)["ref_logprobs"]
    assert all(t.builds == 2 for t in group.teachers.values())
    torch.testing.assert_close(first, second)


def test_a_teacher_no_source_uses_is_never_built(teacher_dirs, host, batch):
    job = make_job(teacher_dirs)
    job.data[1].teacher = None  # "code" rows are no longer distilled
    group = TeacherGroup.from_job(job, host)
    assert group is not None
    out = group.forward(batch)
    assert group.teachers["coder"].builds == 0
    assert torch.equal(out[TEACHER_MASK_KEY][:, 0], torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0]))


def test_apply_teachers_stores_tensors_and_reports_metrics(teacher_dirs, host, batch):
    job = make_job(teacher_dirs)
    teachers = Teachers.local(job, host)  # the teacher actor's code, in this process
    assert teachers is not None
    work = Batch(tensors=dict(batch.tensors), meta=dict(batch.meta))
    metrics = teachers.apply(work)
    assert "ref_logprobs" in work and TEACHER_MASK_KEY in work
    mask = (work["loss_mask"] * work[TEACHER_MASK_KEY]) > 0
    expected = float((work["old_logprobs"] - work["ref_logprobs"])[mask].mean())
    assert metrics["train/opd_kl"] == pytest.approx(expected, rel=1e-5)
    assert metrics["train/teacher_row_ratio"] == pytest.approx(4 / 6)
    assert metrics["timing/teacher"] > 0 and metrics["perf/teacher_loads"] == 2.0
    for name, rows in (("big", [0, 3]), ("coder", [1, 4])):
        m = work["loss_mask"][rows] > 0
        want = float((work["old_logprobs"][rows] - work["ref_logprobs"][rows])[m].mean())
        assert metrics[f"train_per_teacher/{name}/opd_kl"] == pytest.approx(want, rel=1e-5)
    assert teachers.apply(Batch(tensors={k: v[:0] for k, v in batch.tensors.items()}, meta={"source": []})) == {}
    teachers.close()
    assert all(t.teacher is None for t in teachers.actor.obj.group.teachers.values())
    no_source_distils = attrs.evolve(job, data=[DataConfig(name="chat", path="h.jsonl")])
    assert Teachers.local(no_source_distils, host) is None


def test_reward_penalty_is_masked_to_distilled_tokens(teacher_dirs, host, batch):
    job = make_job(teacher_dirs, kl="opd_pg", kl_in_reward=True)
    job.algorithm.kl_coef = 0.5
    teachers = Teachers.local(job, host)
    assert teachers is not None
    work = Batch(tensors=dict(batch.tensors), meta=dict(batch.meta))
    teachers.apply(work)
    penalty, metrics = StepAlgorithm.from_job(job, host, distill=teachers.setup).token_penalties(work)
    mask = work["loss_mask"] * work[TEACHER_MASK_KEY]
    torch.testing.assert_close(penalty, -0.5 * (work["old_logprobs"] - work["ref_logprobs"]) * mask)
    assert not bool(penalty[[2, 5]].any())
    assert "train/reward_distill" in metrics and "train/reward_kl" not in metrics  # the teachers feed kl
    in_loss = make_job(teacher_dirs)
    assert StepAlgorithm.from_job(in_loss, host, distill=distill_setup(in_loss, host)).token_penalties(work)[0] is None


def make_setup(dirs, host):
    return distill_setup(make_job(dirs), host)


def test_setup_errors_name_the_key(teacher_dirs, host):
    with pytest.raises(ConfigError, match="no distillation term"):
        distill_setup(make_job(teacher_dirs, kl=None), host)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="algorithm.distill_kl = 'opd_topk_kl' requires 'topk'"):
        distill_setup(make_job(teacher_dirs, distill_kl="opd_topk_kl", distill_in_reward=True), host)
    with pytest.raises(ConfigError, match="k = 32 .*distill_topk = 20"):
        distill_setup(make_job(teacher_dirs, distill_kl="opd_topk_kl", distill_kl_args={"k": 32}), host)
    with pytest.raises(ConfigError, match="k = 8 .*distill_topk = 4"):
        distill_setup(make_job(teacher_dirs, distill_kl="opd_mix_topk", distill_topk=4,
                               distill_kl_args={"gkd_args": {"k": 8}}), host)
    job = make_job(teacher_dirs)
    job.teachers[0].args["no_such_arg"] = 1
    group = TeacherGroup.from_job(job, host)
    assert group is not None
    rows = Batch(tensors={"input_ids": torch.ones(1, 4, dtype=torch.long)}, meta={"source": ["math"]})
    with pytest.raises(ConfigError, match=r"teachers\[0\]\.args"):
        group.forward(rows)


def test_who_needs_the_reference_model(teacher_dirs, host):
    assert not uses_reference_model(make_job(teacher_dirs), host)  # the teachers feed [algorithm] kl
    assert uses_reference_model(make_job(teacher_dirs, kl="k3", distill_kl="opd_k3"), host)
    plain = JobConfig(data=[DataConfig(name="x", path="x.jsonl")], algorithm=AlgorithmConfig(kl="k3", kl_coef=0.1))
    assert uses_reference_model(plain, host) and TeacherGroup.from_job(plain, host) is None


def test_a_batch_without_teacher_rows_runs_no_teacher(teacher_dirs, host, batch):
    group = TeacherGroup.from_job(make_job(teacher_dirs, distill_kl="opd_full_kl"), host)
    assert group is not None
    chat = batch.select([2, 5])
    out = group.forward(chat)
    assert group.loads == 0 and not bool(out[TEACHER_MASK_KEY].any())
    assert out["teacher_logits"].shape == (2, chat["input_ids"].shape[1], 0)
    assert not bool(out["teacher_logprobs"].any())


# --------------------------------------------------------------------------------------------
# the loss pipeline consuming the teacher tensors
# --------------------------------------------------------------------------------------------


def pipeline_micro(prefix="ref_", teacher_rows=(1.0, 0.0), extra=None):
    """A two-row micro-batch (next-token student logits, aligned teacher logits) whose rows have a
    teacher as ``teacher_rows`` says; the teacher tensors are named ``<prefix>*``."""
    g = torch.Generator().manual_seed(0)
    rows, width, vocab = 2, 6, 7
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.float32)
    student = torch.randn(rows, width - 1, vocab, generator=g).requires_grad_(True)
    teacher = torch.randn(rows, width, vocab, generator=g)
    log_s = torch.nn.functional.pad(torch.log_softmax(student, -1), (0, 0, 1, 0))
    logp = log_s.gather(-1, ids[..., None])[..., 0]
    ref = torch.log_softmax(teacher, -1).gather(-1, ids[..., None])[..., 0]
    tmask = torch.tensor(teacher_rows)[:, None].expand(rows, width).contiguous()
    ref = ref * tmask  # rows without a teacher hold zeros, as the teacher pass leaves them
    t = {"input_ids": ids, "loss_mask": mask, "advantages": torch.zeros(rows, width),
         "rollout_logprobs": logp.detach(), prefix + "logprobs": ref, prefix + "logits": teacher * tmask[..., None],
         "teacher_mask": tmask}
    t.update(extra or {})
    return Batch(tensors=t), logp, student, log_s, torch.log_softmax(teacher, -1), mask, tmask


def norm_of(mask):
    return AggregationNorm(num_tokens=float(mask.sum()), num_sequences=2.0, max_response_length=4.0)


def test_teacher_fed_kl_only_counts_teacher_rows(host):
    b, logp, student, log_s, log_q, mask, tmask = pipeline_micro()
    job = JobConfig(algorithm=AlgorithmConfig(kl="opd_full_kl", kl_coef=1.0))
    pipe = LossPipeline.from_job(job, host)
    loss, metrics = pipe.loss(b, logp, None, norm_of(mask), logits=student)
    kl = (log_s.exp() * (log_s - log_q)).sum(-1)
    torch.testing.assert_close(loss, (kl * mask * tmask).sum() / mask.sum())
    assert not bool(metrics["kl"][1].any())


def test_separate_distill_term_beside_a_reference_kl(host):
    extra = {"ref_logprobs": torch.zeros(2, 6)}
    b, logp, student, log_s, log_q, mask, tmask = pipeline_micro(prefix="teacher_", extra=extra)
    b.tensors["ref_logprobs"] = logp.detach() - 0.1  # reference KL k1 = 0.1 per token
    job = JobConfig(algorithm=AlgorithmConfig(kl="k1", kl_coef=2.0, distill_kl="opd_full_kl", distill_coef=0.5))
    pipe = LossPipeline.from_job(job, host)
    assert pipe.needs_logits
    loss, metrics = pipe.loss(b, logp, None, norm_of(mask), logits=student)
    kl = (log_s.exp() * (log_s - log_q)).sum(-1)
    want = 2.0 * 0.1 + 0.5 * (kl * mask * tmask).sum() / mask.sum()
    torch.testing.assert_close(loss, want)
    assert "distill_loss" in metrics and "kl_loss" in metrics


def test_micro_batch_without_teacher_rows_skips_the_term(host):
    b, logp, student, *_ = pipeline_micro(prefix="teacher_", teacher_rows=(0.0, 0.0))
    b.tensors["teacher_logits"] = torch.zeros(2, 6, 0)  # vocabulary unknown: no teacher ran
    job = JobConfig(algorithm=AlgorithmConfig(distill_kl="opd_full_kl", distill_coef=1.0))
    loss, metrics = LossPipeline.from_job(job, host).loss(b, logp, None, norm_of(b["loss_mask"]), logits=student)
    assert float(metrics["distill_loss"]) == 0.0 and float(loss.detach()) == 0.0


def test_distill_kl_without_teacher_mask_is_an_error(host):
    b, logp, student, *_ = pipeline_micro(prefix="teacher_")
    del b.tensors["teacher_mask"]
    job = JobConfig(algorithm=AlgorithmConfig(distill_kl="opd_k3"))
    with pytest.raises(LossPipelineError, match="teacher_mask"):
        LossPipeline.from_job(job, host).loss(b, logp, None, norm_of(b["loss_mask"]), logits=student)


def test_teachers_run_in_an_actor_of_their_own(teacher_dirs, host, batch, ray_cluster):
    """On a Ray cluster the teachers live in the teacher actor, not in the controller's process,
    and score exactly as in-process teachers do."""
    import os

    job = make_job(teacher_dirs)
    remote = Teachers.create(job, host)
    assert remote is not None
    try:
        assert ray_cluster.get(remote.actor.ready.remote())["pid"] != os.getpid()
        work = Batch(tensors=dict(batch.tensors), meta=dict(batch.meta))
        metrics = remote.apply(work, ray_cluster.put(batch))  # the rows as the policy group shipped them
    finally:
        remote.close()
    here = Batch(tensors=dict(batch.tensors), meta=dict(batch.meta))
    local = Teachers.local(job, host)
    assert local is not None
    expected = local.apply(here)
    local.close()
    for key in ("ref_logprobs", TEACHER_MASK_KEY):
        torch.testing.assert_close(work[key], here[key])
    assert metrics["train/opd_kl"] == pytest.approx(expected["train/opd_kl"], rel=1e-6)
    assert metrics["perf/teacher_builds"] == 2.0 and metrics["perf/teachers_resident"] == 1.0
