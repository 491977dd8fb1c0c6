"""A real run (controller -> router -> embedded engine -> trainer) whose agent asks for structured
output: every turn is decoded under a JSON-schema grammar, the rollout records keep the grammar
spans, and the trainer replays them, so its log-probs are those of the distribution the engine
sampled. ``train/is_approx_k3_kl`` therefore stays at the fp32 level of a free run; scoring the
same tokens without the grammar puts it near 3 on this model (the test of the engine's log-probs in
``tests/agentflow/test_constrained_decoding.py`` measures that gap)."""

from __future__ import annotations

import json

from loongsage_core.config import load_job
from loongsage_core.controller.run import run_job
from loongsage_core.records.reader import read_rollouts, rollout_steps
from loongsage_core.resolve import resolve_job

from .conftest import TINY_JOB, TOKENIZER_DIR

AGENT = ('agent = "single_turn"\nagent_args = { request_args = { response_format = { type = "json_schema", '
         'json_schema = { name = "answer", schema = { type = "object", properties = { n = { enum = [1, 2, 3] } }, '
         'required = ["n"] } } } } }\n')


def test_constrained_turns_train_with_the_engines_distribution(ray_cluster, tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(TINY_JOB.format(tokenizer=TOKENIZER_DIR).replace('reward = ["exact_match"]',
                                                                     'reward = ["exact_match"]\n' + AGENT))
    out = tmp_path / "run"
    overrides = ["train.total_steps=2", "rollout.max_new_tokens=16", "run.checkpoint_every=0"]
    run_job(resolve_job(load_job(path, overrides)), output_dir=str(out))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "train/is_approx_k3_kl" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/failed_ratio"] == 0.0
        assert m["train/is_approx_k3_kl"] < 1e-6
    records = [rec for step in rollout_steps(out) for rec in read_rollouts(out, step)]
    assert records
    answers = 0
    for rec in records:
        for seg in rec["segments"]:
            spans = seg.get("constraints") or []
            assert [[c["start"], c["end"]] for c in spans] == seg["turns"]  # every turn was constrained
        text = rec["response_text"]
        if rec.get("finish_reason") == "stop":
            assert json.loads(text)["n"] in (1, 2, 3)
            answers += 1
    assert answers > 0
