"""The ``torch`` teacher backend on a tiny transformers model saved to a local directory."""

from __future__ import annotations

import pytest
import torch
from loongsage_plugin_distill import TeacherManager, TorchTeacher, plugin, terms
from loongsage_plugin_distill.torch_teacher import TeacherLoadError

from loongsage_hookspecs import Batch, KLInputs, TeacherContext

TINY = {"model_type": "qwen3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 128, "tie_word_embeddings": True, "rope_theta": 10000.0}


def tiny_model(seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = dict(TINY)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(conf.pop("model_type"), **conf))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher")
    tiny_model(seed=1).save_pretrained(path)
    return path


def make_batch(rows: int = 5, width: int = 9, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (rows, width), generator=g)
    lengths = torch.tensor([width, 3, 6, width - 1, 2][:rows])
    att = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return Batch(tensors={"input_ids": ids * att, "attention_mask": att})


def reference_rows(model, batch: Batch) -> list[torch.Tensor]:
    """Per row, without padding: float64 log-softmax of the model's logits, aligned (entry t -> token t)."""
    out = []
    with torch.no_grad():
        for ids, att in zip(batch["input_ids"], batch["attention_mask"]):
            n = int(att.sum())
            logits = model(input_ids=ids[:n].unsqueeze(0)).logits[0].double()
            out.append(torch.log_softmax(logits[:-1], -1))  # row t scores token t + 1
    return out


def test_spec_factory_loads_a_local_directory_and_scores_tokens(teacher_dir):
    spec = {s.name: s for s in plugin.loongsage_teachers()}["torch"]
    teacher = spec.factory(TeacherContext(name="big", path=str(teacher_dir)), micro_batch_size=2)
    assert isinstance(teacher, TorchTeacher) and not teacher.loaded
    batch = make_batch()
    out = teacher.forward(batch, topk=4, return_logits=True)
    ref = reference_rows(teacher.model, batch)
    vocab = TINY["vocab_size"]
    assert out.logprobs.shape == (5, 9) and out.topk_ids.shape == (5, 9, 4) and out.logits.shape == (5, 9, vocab)
    for row, log_q in enumerate(ref):
        n = log_q.shape[0] + 1
        ids = batch["input_ids"][row, 1:n]
        torch.testing.assert_close(out.logprobs[row, 1:n].double(), log_q.gather(-1, ids[:, None])[:, 0],
                                   atol=1e-5, rtol=1e-5)
        values, index = log_q.topk(4, -1)
        torch.testing.assert_close(out.topk_logprobs[row, 1:n].double(), values, atol=1e-5, rtol=1e-5)
        assert torch.equal(out.topk_ids[row, 1:n], index)
        torch.testing.assert_close(torch.log_softmax(out.logits[row, 1:n].double(), -1), log_q, atol=1e-5, rtol=1e-5)
        # position 0 and padding hold zeros
        assert out.logprobs[row, 0] == 0 and bool((out.logprobs[row, n:] == 0).all())
        assert bool((out.topk_ids[row, n:] == 0).all()) and bool((out.logits[row, n:] == 0).all())


def test_micro_batch_size_does_not_change_results(teacher_dir):
    batch = make_batch()
    one = TorchTeacher(str(teacher_dir), micro_batch_size=1).forward(batch, topk=3)
    all_rows = TorchTeacher(str(teacher_dir), micro_batch_size=8).forward(batch, topk=3)
    torch.testing.assert_close(one.logprobs, all_rows.logprobs, atol=1e-5, rtol=1e-5)
    assert torch.equal(one.topk_ids, all_rows.topk_ids)


def test_teacher_topk_over_whole_vocab_gives_full_kl_against_a_student(teacher_dir):
    """Teacher outputs feed the distillation terms: top-k with k = V equals the full-vocab KL."""
    teacher = TorchTeacher(str(teacher_dir))
    student = tiny_model(seed=7)
    batch = make_batch()
    vocab = TINY["vocab_size"]
    out = teacher.forward(batch, topk=vocab, return_logits=True)
    ids, att = batch["input_ids"], batch["attention_mask"]
    logits = student(input_ids=ids, attention_mask=att).logits[:, :-1]  # next-token layout
    log_s = torch.nn.functional.pad(torch.log_softmax(logits, -1), (0, 0, 1, 0))
    mask = att.clone()
    mask[:, :2] = 0  # the "prompt"
    x = KLInputs(logprobs=log_s.gather(-1, ids[..., None])[..., 0], ref_logprobs=out.logprobs, response_mask=mask,
                 logits=logits, ref_logits=out.logits, ref_topk_ids=out.topk_ids, ref_topk_logprobs=out.topk_logprobs)
    full = terms.full_kl(x, direction="forward")
    topk = terms.topk_kl(x, direction="forward")
    torch.testing.assert_close(topk, full, atol=1e-5, rtol=1e-4)
    assert float(full.detach().sum()) > 0
    topk.sum().backward()
    assert student.model.embed_tokens.weight.grad is not None


def test_manager_with_two_torch_teachers_and_offload(teacher_dir):
    first = TorchTeacher(str(teacher_dir), device="cpu")
    second = TorchTeacher(config=TINY, seed=5, device="cpu")
    manager = TeacherManager({"first": first, "second": second}, {"x": "first", "y": "second"}, max_resident=1)
    batch = make_batch()
    batch.meta["source"] = ["y", "x", "y", "x", "x"]
    out = manager.forward(batch)
    assert manager.resident == ("first",) and first.loaded and not second.loaded  # ran second, then first
    for row, teacher in enumerate([second, first, second, first, first]):
        alone = teacher.forward(batch.select([row]))
        torch.testing.assert_close(out.logprobs[row], alone.logprobs[0], atol=1e-5, rtol=1e-5)


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(TeacherLoadError, match="no config.json"):
        TorchTeacher(str(tmp_path))
    with pytest.raises(TeacherLoadError, match="set 'path'"):
        TorchTeacher()
    with pytest.raises(TeacherLoadError, match="dtype"):
        TorchTeacher(config=TINY, dtype="float8")
    with pytest.raises(ValueError, match="micro_batch_size"):
        TorchTeacher(config=TINY, micro_batch_size=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_and_offload_move_the_model(teacher_dir):
    teacher = TorchTeacher(str(teacher_dir), device="cuda", dtype="bfloat16")
    assert teacher.model_device.type == "cpu"
    teacher.load()
    assert teacher.model_device.type == "cuda"
    out = teacher.forward(make_batch(), topk=2)
    assert out.logprobs.device.type == "cpu" and bool(torch.isfinite(out.logprobs).all())
    teacher.offload()
    assert teacher.model_device.type == "cpu"
