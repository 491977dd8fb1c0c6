"""Helpers several of the sglang plugin's tests share (importable by name: ``conftest.py`` puts
this folder on ``sys.path``; test modules cannot import ``conftest`` itself, whose name other
test folders share)."""

from __future__ import annotations


def assert_engine_scores_like(url: str, model) -> None:
    """The engine's greedy tokens carry the log-probs ``model`` gives them (its weights are ``model``'s)."""
    import httpx
    import torch

    prompt = [5, 9, 17, 33]
    out = httpx.post(url + "/generate", json={"input_ids": prompt, "return_logprob": True,
                                              "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
                     trust_env=False, timeout=60).json()
    engine_lp = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
    tokens = torch.tensor([prompt + out["output_ids"]])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float().log_softmax(-1)
    trainer_lp = logits[0, len(prompt) - 1:-1].gather(-1, tokens[0, len(prompt):, None])[:, 0]
    torch.testing.assert_close(engine_lp, trainer_lp, rtol=0, atol=1e-4)
