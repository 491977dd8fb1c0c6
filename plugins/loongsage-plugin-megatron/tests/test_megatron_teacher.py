"""The ``megatron`` teacher against the distill plugin's ``torch`` teacher on the same tiny Qwen3
checkpoints (CPU): the same outputs in the same layout, residency, two teachers in one process,
and clear errors for what it does not support."""

from __future__ import annotations

import pytest
import torch

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # fail, never skip: the teacher's tests need the real library
    raise ImportError("megatron-core is not installed: pip install -r requirements-megatron.txt") from exc

from loongsage_plugin_distill.torch_teacher import TorchTeacher
from loongsage_plugin_megatron import plugin
from loongsage_plugin_megatron.teacher import MegatronTeacher

from loongsage_core.config import ConfigError, JobConfig, TeacherConfig
from loongsage_core.controller.teachers import _teacher_builder
from loongsage_hookspecs import Batch, Teacher, TeacherContext, TeacherOutputs

LENGTHS = [11, 3, 7, 10, 1]  # a full row, short rows and one with nothing but position 0


def make_batch(vocab: int = 512, seed: int = 0) -> Batch:
    """Five right-padded rows of ``LENGTHS`` tokens (width 11), plus a tensor teachers ignore."""
    width = max(LENGTHS)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(LENGTHS), width), generator=g)
    attention = (torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return Batch(tensors={"input_ids": ids * attention, "attention_mask": attention,
                          "loss_mask": attention.clone()})


def scored_positions(batch: Batch) -> torch.Tensor:
    """``[B, T]`` bool: positions with a teacher distribution (real tokens after position 0)."""
    real = batch["attention_mask"].bool().clone()
    real[:, 0] = False
    return real


def assert_same_outputs(got: TeacherOutputs, expected: TeacherOutputs, logits_atol: float = 1e-4) -> None:
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=0, atol=1e-5)
    if expected.topk_ids is not None:
        assert torch.equal(got.topk_ids, expected.topk_ids)
        torch.testing.assert_close(got.topk_logprobs, expected.topk_logprobs, rtol=0, atol=1e-5)
    if expected.logits is not None:
        torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=logits_atol)


@pytest.fixture(scope="module", autouse=True)
def restore_process_group():
    """Leave torch.distributed as this module found it: teachers start a world of one where there is
    none and never end it (other teachers of the process share it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    before = dist.is_initialized()
    yield
    if not before and dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def teacher(hf_dir, host) -> MegatronTeacher:
    """Built through the plugin's ``loongsage_teachers`` hook, as the host builds a ``[[teachers]]``
    entry with ``backend = "megatron"``."""
    spec = host.get("teacher", "megatron")
    assert spec.factory is {s.name: s for s in plugin.loongsage_teachers()}["megatron"].factory
    return spec.factory(TeacherContext(name="big", path=str(hf_dir)), micro_batch_size=2)


@pytest.fixture(scope="module")
def torch_teacher(hf_dir) -> TorchTeacher:
    return TorchTeacher(hf_dir, micro_batch_size=3)


def test_outputs_equal_the_torch_teacher(teacher, torch_teacher):
    assert isinstance(teacher, MegatronTeacher) and isinstance(teacher, Teacher)
    assert not teacher.loaded and teacher.model_device == torch.device("cpu")
    batch = make_batch()
    got = teacher.forward(batch, topk=5, return_logits=True)
    expected = torch_teacher.forward(batch, topk=5, return_logits=True)
    assert got.logprobs.shape == (5, 11) and got.logprobs.dtype == torch.float32
    assert got.topk_ids.shape == (5, 11, 5) and got.topk_ids.dtype == torch.long
    assert got.logits.shape == (5, 11, 512) and got.logits.dtype == torch.float32
    assert {t.device for t in (got.logprobs, got.topk_ids, got.topk_logprobs, got.logits)} == {torch.device("cpu")}
    assert_same_outputs(got, expected)

    scored = scored_positions(batch)
    assert bool((got.logprobs[scored] < 0).all())  # real log-probs wherever a token was scored
    assert bool((got.topk_logprobs[scored].diff(dim=-1) <= 0).all())  # largest first
    # Position 0 and padding hold zeros in every field.
    for field in (got.logprobs, got.topk_ids, got.topk_logprobs, got.logits):
        assert bool((field[~scored] == 0).all())

    # Log-probs only: nothing else is computed, the log-probs are the same.
    plain = teacher(batch)
    assert plain.topk_ids is None and plain.topk_logprobs is None and plain.logits is None
    assert torch.equal(plain.logprobs, got.logprobs)
    # Without attention_mask every position is a real token.
    unmasked = Batch(tensors={"input_ids": batch["input_ids"][:2]})
    assert_same_outputs(teacher.forward(unmasked, topk=2), torch_teacher.forward(unmasked, topk=2))


def test_offload_and_load_keep_cpu_outputs(teacher):
    batch = make_batch(seed=1)
    before = teacher.forward(batch, topk=3)
    teacher.load()
    assert teacher.loaded and teacher.model_device == torch.device("cpu")
    during = teacher.forward(batch, topk=3)
    teacher.offload()
    assert not teacher.loaded and teacher.model_device == torch.device("cpu")
    after = teacher.forward(batch, topk=3)
    for out in (during, after):
        assert torch.equal(out.logprobs, before.logprobs) and torch.equal(out.topk_ids, before.topk_ids)
        assert torch.equal(out.topk_logprobs, before.topk_logprobs)


def test_two_teachers_in_one_process(teacher, torch_teacher, tiny_qwen3_writer, tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state

    # Another model (other weights, vocabulary and width), built while the first teacher exists.
    other = tiny_qwen3_writer(str(tmp_path), seed=1, vocab_size=384, hidden_size=32, intermediate_size=64,
                              head_dim=8)
    rng = torch.get_rng_state()
    groups = (dist.group.WORLD, parallel_state.get_tensor_model_parallel_group(),
              parallel_state.get_data_parallel_group())
    second = MegatronTeacher(other, micro_batch_size=5, logits_dtype="bfloat16")
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's random stream is untouched
    # The process group and Megatron's parallel state the first teacher set up are used, not replaced.
    assert dist.get_world_size() == 1
    now = (dist.group.WORLD, parallel_state.get_tensor_model_parallel_group(), parallel_state.get_data_parallel_group())
    assert all(a is b for a, b in zip(now, groups))

    batch = make_batch(vocab=384, seed=2)
    got = second.forward(batch, topk=3, return_logits=True)
    expected = TorchTeacher(other).forward(batch, topk=3, return_logits=True)
    assert got.logits.shape == (5, 11, 384) and got.logits.dtype == torch.bfloat16
    assert_same_outputs(got, TeacherOutputs(logprobs=expected.logprobs, topk_ids=expected.topk_ids,
                                            topk_logprobs=expected.topk_logprobs))
    # bfloat16 keeps 8 significant bits: within half a unit in the last place of the float32 logits.
    torch.testing.assert_close(got.logits.float(), expected.logits, rtol=2**-8, atol=1e-5)

    # The first teacher still scores with its own model, and the two differ.
    first = teacher.forward(batch, topk=3)
    assert_same_outputs(first, torch_teacher.forward(batch, topk=3))
    assert float((first.logprobs - got.logprobs).abs().max()) > 0.1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_teacher_scores_in_16_bit_close_to_float32(teacher, hf_dir, dtype):
    """``dtype``: the weights and the compute are 16-bit (Megatron-Core's Float16Module), the
    outputs float32 and within 16-bit rounding of the float32 teacher's."""
    half = MegatronTeacher(hf_dir, dtype=dtype, micro_batch_size=2)
    weights = {p.dtype for module in half.worker.modules for p in module.parameters()}
    assert weights == {getattr(torch, dtype)}
    batch = make_batch(seed=4)
    got, full = half.forward(batch, topk=3, return_logits=True), teacher.forward(batch, topk=3, return_logits=True)
    assert got.logprobs.dtype == got.topk_logprobs.dtype == torch.float32
    scored = scored_positions(batch)
    gap = (got.logprobs - full.logprobs)[scored].abs()
    assert float(gap.max()) > 1e-5  # 16-bit arithmetic, not the float32 model
    assert float(gap.mean()) < 2e-2 and float(gap.max()) < 1e-1
    assert bool((got.logprobs[~scored] == 0).all())
    agree = (got.topk_ids[..., 0] == full.topk_ids[..., 0])[scored].float().mean()
    assert float(agree) > 0.9  # the same best token almost everywhere


def test_bad_arguments_raise_clear_errors(teacher, hf_dir, host, tmp_path):
    for key, kind in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert")):
        with pytest.raises(ValueError, match=rf"megatron teacher: {key} = 2: .*its {kind}-parallel size must be 1"):
            MegatronTeacher(hf_dir, **{key: 2})
    with pytest.raises(ValueError, match=r"dtype must be one of \['float32', 'bfloat16', 'float16'\], got 'int8'"):
        MegatronTeacher(hf_dir, dtype="int8")
    with pytest.raises(ValueError, match="set 'path'"):
        MegatronTeacher()
    with pytest.raises(ValueError, match="no config.json in model directory"):
        MegatronTeacher(str(tmp_path))
    with pytest.raises(ValueError, match="micro_batch_size must be an integer >= 1, got 0"):
        MegatronTeacher(hf_dir, micro_batch_size=0)
    with pytest.raises(ValueError, match="logits_dtype must be one of"):
        MegatronTeacher(hf_dir, logits_dtype="int8")
    with pytest.raises(ValueError, match="offload_device must be 'cpu'"):
        MegatronTeacher(hf_dir, offload_device="meta")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="device = 'cpu' on a machine with CUDA"):
            MegatronTeacher(hf_dir, device="cpu")
    else:
        with pytest.raises(ValueError, match="device = 'cuda' but CUDA is not available"):
            MegatronTeacher(hf_dir, device="cuda")

    # Through the host, as a [[teachers]] table: the error names the table.
    def build(**args):
        job = JobConfig(teachers=[TeacherConfig(name="big", path=hf_dir, backend="megatron", args=args)])
        return _teacher_builder(job, host, 0)()

    with pytest.raises(ConfigError, match=r"teachers\[0\]\.args: megatron teacher: pp = 2"):
        build(pp=2)
    with pytest.raises(ConfigError, match=r"teachers\[0\]\.args: .*'config'"):
        build(config={"model_type": "qwen3"})

    # Bad batches and top-k sizes.
    batch = make_batch()
    with pytest.raises(KeyError, match="no 'input_ids'"):
        teacher.forward(Batch(tensors={"attention_mask": batch["attention_mask"]}))
    with pytest.raises(ValueError, match="topk must be an integer >= 0, got -1"):
        teacher.forward(batch, topk=-1)
    with pytest.raises(ValueError, match="topk=513 exceeds the vocabulary size 512"):
        teacher.forward(batch, topk=513)
    with pytest.raises(ValueError, match="differ in shape"):
        teacher.forward(Batch(tensors={"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"][:2]}))
    left_padded = batch["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="right-padded"):
        teacher.forward(Batch(tensors={"input_ids": batch["input_ids"], "attention_mask": left_padded}))
