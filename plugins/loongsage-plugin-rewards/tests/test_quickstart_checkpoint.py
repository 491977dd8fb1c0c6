"""The shipped quickstart checkpoint (configs/quickstart/model) against this plugin's task and reward.

It must load as a Hugging Face directory, answer in the task's format, be only partly right when
sampled at temperature 1, and a plain GRPO loop must raise its reward (the reason it is shipped).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch  # the checkpoint test runs the model (the 'test' extra names torch and transformers)
import transformers

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "configs" / "quickstart" / "model"
SCRIPT = ROOT / "scripts" / "make_quickstart_model.py"


@pytest.fixture(scope="module")
def quickstart():
    spec = importlib.util.spec_from_file_location("make_quickstart_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _load():
    tok = transformers.AutoTokenizer.from_pretrained(str(MODEL))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL))
    return model, tok


def test_checkpoint_is_small_and_uses_the_test_tokenizer():
    size = sum(p.stat().st_size for p in MODEL.iterdir())
    assert size < 4 * 2**20
    tok = transformers.AutoTokenizer.from_pretrained(str(MODEL))
    ref = transformers.AutoTokenizer.from_pretrained(str(ROOT / "tests" / "data" / "tokenizer"))
    assert tok.get_vocab() == ref.get_vocab() and tok.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "What is 3 + 5?"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_sampled_accuracy_is_partial(quickstart, one_thread):
    model, tok = _load()
    stats = quickstart.evaluate(model, tok, quickstart.task_questions(), samples=2, max_new_tokens=8, seed=11)
    assert 0.1 <= stats["sampled_accuracy"] <= 0.45, stats
    assert stats["well_formed"] >= 0.85, stats


@pytest.mark.slow
def test_plain_grpo_raises_the_reward(quickstart, one_thread):
    model, tok = _load()
    history = quickstart.grpo_check(model, tok, quickstart.task_questions(), steps=30, prompts_per_step=8,
                                    samples_per_prompt=8, lr=3e-4, temperature=1.0, max_new_tokens=8, seed=5)
    first, last = sum(history[:8]) / 8, sum(history[-8:]) / 8
    assert last >= first + 0.15, history
