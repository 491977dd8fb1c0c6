"""Held-out accuracy of a ``vision_count`` run per question and per right answer, from its rollout records.

The recipe's held-out files are label-balanced (each answer is right on a quarter of the pictures),
so a policy that only shifts its answer prior scores 0.25 however it shifts; this table shows, at
every evaluation, how often each right answer was sampled (pass@1 per label) and how the policy's
answers are spread (``answered``), which tells reading the picture from favouring one answer.

    python scripts/vision_count_labels.py runs/vision_count
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

from loongsage_core.records.reader import read_rollouts, rollout_steps


def label_table(run_dir: str) -> str:
    """A Markdown table: one row per evaluation step and held-out source."""
    lines = ["| step | source | pass@1 | pass@1 per right answer | answered |", "|---|---|---|---|---|"]
    for step in rollout_steps(run_dir):
        by_source: dict[str, list[dict]] = defaultdict(list)
        for record in read_rollouts(run_dir, step):
            if record.get("eval"):
                by_source[record["source"].removeprefix("eval:")].append(record)
        for source, records in sorted(by_source.items()):
            right: dict[str, list[float]] = defaultdict(list)
            for r in records:
                right[str(r["label"])].append(float(r["reward"]["score"]))
            answered = Counter((r["response_text"] or "").strip() for r in records)
            total = sum(s for scores in right.values() for s in scores) / len(records)
            per_label = ", ".join(f"{lab} {sum(s) / len(s):.2f}" for lab, s in sorted(right.items()))
            spread = ", ".join(f"{a or '(none)'} {n}" for a, n in sorted(answered.items()))
            lines.append(f"| {step} | {source} | {total:.3f} | {per_label} | {spread} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run's --output-dir")
    print(label_table(parser.parse_args(argv).run_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
