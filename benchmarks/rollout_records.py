#!/usr/bin/env python3
"""What rollout records cost the training loop, and what they cost off it. Prints JSON.

A synthetic step (``--groups`` x ``--samples`` trajectories of ``--prompt-tokens`` prompt and
``--response-tokens`` generated tokens, with the padded training batch of build_batch plus old
log-probs and advantages) is handed to :class:`RolloutRecorder` ``--steps`` times:

* ``add_ms``: the time ``add()`` blocks the loop (it only queues references);
* ``write_ms``: the writer thread's time per step (records built, gzip-compressed, renamed);
* ``file_kib``: the compressed size of one step's records.

``loop_share`` = add_ms / write_ms: the part of the work the loop itself pays.

    python benchmarks/rollout_records.py --groups 8 --samples 8 --response-tokens 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_step(tokenizer, step: int, groups: int, samples: int, prompt_tokens: int, response_tokens: int):
    import random

    import torch

    from loongsage_core.controller.batching import build_batch
    from loongsage_hookspecs import Reward, Segment, Trajectory, TrajectoryGroup, TrajectoryStatus

    rng = random.Random(step)
    vocab = len(tokenizer)
    out = []
    for g in range(groups):
        group = TrajectoryGroup(group_id=f"{step}:{g}", prompt_id=f"p{g}", source="bench")
        prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        for j in range(samples):
            seg = Segment()
            seg.append(prompt, generated=False)
            seg.append([rng.randrange(vocab) for _ in range(response_tokens)], generated=True,
                       logprobs=[-rng.random() for _ in range(response_tokens)], weight_version=step)
            group.trajectories.append(Trajectory(
                id=f"{step}:{g}:{j}", prompt_id=f"p{g}", group_id=group.group_id, source="bench", prompt="x",
                segments=[seg], status=TrajectoryStatus.COMPLETED, reward=Reward(score=float(j % 2))))
        out.append(group)
    batch = build_batch(out)
    batch.tensors["old_logprobs"] = batch["rollout_logprobs"] + 1e-6
    batch.tensors["advantages"] = torch.randn(batch["loss_mask"].shape) * batch["loss_mask"]
    return out, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--response-tokens", type=int, default=512)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from loongsage_core.records.writer import RolloutRecorder

    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "tests" / "data" / "tokenizer"))
    steps = [make_step(tokenizer, s, args.groups, args.samples, args.prompt_tokens, args.response_tokens)
             for s in range(args.steps)]
    with tempfile.TemporaryDirectory() as tmp:
        recorder = RolloutRecorder(tmp, tokenizer)
        add_ms, write_ms, sizes = [], [], []
        for s, (groups, batch) in enumerate(steps):
            t0 = time.perf_counter()
            recorder.add(s, groups, batch, policy_version=s)
            t1 = time.perf_counter()
            recorder.flush()
            t2 = time.perf_counter()
            add_ms.append((t1 - t0) * 1e3)
            write_ms.append((t2 - t1) * 1e3)
            sizes.append((Path(tmp) / "rollouts" / f"step_{s:06d}.jsonl.gz").stat().st_size / 1024)
        recorder.close()
    add, write = statistics.median(add_ms), statistics.median(write_ms)
    print(json.dumps({
        "trajectories_per_step": args.groups * args.samples,
        "tokens_per_trajectory": args.prompt_tokens + args.response_tokens,
        "add_ms": round(add, 3), "write_ms": round(write, 1), "file_kib": round(statistics.median(sizes), 1),
        "loop_share": round(add / write, 5),
    }, indent=2))


if __name__ == "__main__":
    main()
