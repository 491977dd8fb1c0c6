"""Async vs sync training throughput on a workload with heavy-tailed response lengths.

Same model, same prompts, same number of trained samples for every mode: the synchronous loop and
each asynchronous mode, run side by side in rounds. In a round every mode runs between two sync
runs (sync, mode A, sync, mode B, ..., sync) and its ratio is taken against the mean of the two
sync runs around it, so a drift in the machine's load between modes does not become a ratio.
Response lengths are heavy-tailed by construction: four data sources whose ``max_new_tokens``
are 8 / 32 / 96 / 256 with weights 0.55 / 0.25 / 0.15 / 0.05, sampled from a randomly
initialised model that rarely emits its end-of-turn token, so most samples run to their
source's limit. The trainer and the engine run
in separate actors with one CPU each (``placement.colocate = false``); every async mode bounds
staleness by ``stale_steps = 1`` and continues unfinished generations under the new weights at
each update (``rollout.partial = true``).

The async modes (``--modes``, see :data:`MODES`):

* ``windowed_fifo``, ``window_gated``: no trained token more than 1 version old (its oldest
  token), nothing dropped;
* ``no_window``: the same bound on the oldest token, enforced by dropping groups (waste);
* ``partial``: partial rollout (``no_window``, ``staleness = "newest"``, ``fill = "trainable"``):
  generations interrupted by an update continue under the new weights and a trajectory is
  trained within 1 version of its last token; its older tokens keep their versions and behaviour
  log-probs (``rollout_logprobs``) for the off-policy correction; nothing is dropped;
* ``partial_ahead``: the same with ``fill = "ahead"`` (new groups start beside generations that
  outlived an update; a little waste for less waiting);
* ``partial_oversample``: the same with ``oversample = 0.25`` (a quarter more groups per step:
  what a filter drops is replaced at once; without filters, as here, the extra groups are waste).

Prints JSON: per mode and round the steady trained samples/s (steps after the first), its ratio
to the sync runs around it (``throughput_vs_sync``: mean, min, max over the rounds), the
trainer's wait share, the largest staleness (oldest token), the waste (``waste_ratio``: tokens
generated and never trained over the tokens of every decided group, run total) and the
length-distribution check: sampled vs trained response lengths (mean, p90, Kolmogorov-Smirnov
distance); ``length_unbiased`` is false when the trained lengths fall short of the sampled ones.
For reference the sync entry carries what overlapping would give, computed from the sync runs' own
phases (rollout; training and weight update) at their sync speed:

* ``any_overlap_vs_sync``: both phases' totals over the larger one, the most any overlap of the
  two can give (2x only when the two totals are equal).
* ``overlapped_phases_vs_sync``: the sync step time over the longer of each step's two phases,
  summed over the steps: every step's two phases side by side.
* ``windowed_bound_vs_sync``: the schedule a strict bound of one version on the oldest token
  allows. Step ``s``'s groups cannot start before the engines serve version ``s - 1`` (the update
  after step ``s - 2``), so step ``s`` starts at ``max(end of step s - 1, update to s - 1 +
  rollout_s)``: what ``windowed_fifo`` and ``window_gated`` reach with both phases at sync speed.

Every async mode also reports ``train_phase_vs_sync``: its mean training phase (``timing/train``)
over that of the sync runs around it; above 1, overlapping slowed training (the actors share the
machine's cores, caches and memory bandwidth), and the engine slows down alike.
The machine's load average is printed beside every round.

    python benchmarks/async_vs_sync.py [--steps 16] [--rounds 3] [--modes windowed_fifo,partial]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

JOB = """
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents", "schedulers"]
[model]
tokenizer = "{tokenizer}"
[model.config]
model_type = "qwen3"
vocab_size = 512
hidden_size = 128
intermediate_size = 256
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 32
max_position_embeddings = 1024
tie_word_embeddings = true
[train]
lr = 1e-5
total_steps = {steps}
mini_batch_size = 32
micro_batch_size = 16
[rollout]
prompts_per_step = 8
samples_per_prompt = 4
max_new_tokens = 256
max_context_length = 1024
weight_transport = "shm"
partial = true
[placement]
colocate = false
[async]
enable = {async_enable}
scheduler = "{scheduler}"
stale_steps = 1
scheduler_args = {scheduler_args}
[run]
seed = 0
save_hf_at_end = false
[[loggers]]
name = "jsonl"
{sources}
"""

MODES: dict[str, tuple[str, str]] = {  # mode -> (scheduler, scheduler_args as TOML)
    "windowed_fifo": ("windowed_fifo", "{}"),
    "window_gated": ("window_gated", "{}"),
    "no_window": ("no_window", "{}"),
    "partial": ("no_window", '{ staleness = "newest", fill = "trainable" }'),
    "partial_ahead": ("no_window", '{ staleness = "newest", fill = "ahead" }'),
    "partial_oversample": ("no_window", '{ staleness = "newest", fill = "trainable", oversample = 0.25 }'),
}
LENGTH_KS_LIMIT = 0.05  # largest sampled vs trained KS distance that counts as unbiased
LENGTH_MEAN_LIMIT = 0.95  # smallest trained / sampled mean response length that counts as unbiased

BOUNDS = ("any_overlap_vs_sync", "overlapped_phases_vs_sync", "windowed_bound_vs_sync")
"""What overlapping would give, from the sync runs' phases (module docstring), in the sync entry."""

RATIOS_TO_SYNC = {"steady_samples_per_s": "throughput_vs_sync", "train_s_mean": "train_phase_vs_sync"}
"""Per async mode: a figure of its run (key) over that of the sync runs either side (value)."""

SOURCES = [("short", 8, 0.55), ("medium", 32, 0.25), ("long", 96, 0.15), ("tail", 256, 0.05)]


def job_text(steps: int, mode: str | None) -> str:
    sources = "\n".join(
        f'[[data]]\nname = "{name}"\ngenerator = "arithmetic"\nweight = {w}\n'
        f'generator_args = {{ num_samples = 400, seed = {i} }}\nsampling = {{ max_new_tokens = {n} }}\n'
        for i, (name, n, w) in enumerate(SOURCES))
    scheduler, args = MODES[mode] if mode else ("windowed_fifo", "{}")
    return JOB.format(tokenizer=REPO / "tests" / "data" / "tokenizer", steps=steps,
                      async_enable="true" if mode else "false", scheduler=scheduler, scheduler_args=args,
                      sources=sources)


def length_check(last: dict[str, float]) -> dict[str, float | bool]:
    """Sampled vs trained response lengths from the run totals of the last step's metrics."""
    out: dict[str, float | bool] = {key.removeprefix("rollout/"): last.get(key, 0.0) for key in (
        "rollout/length_sampled_mean", "rollout/length_trained_mean", "rollout/length_sampled_p90",
        "rollout/length_trained_p90", "rollout/length_ks")}
    sampled = float(out["length_sampled_mean"]) or 1.0
    out["length_unbiased"] = (float(out["length_ks"]) <= LENGTH_KS_LIMIT
                              and float(out["length_trained_mean"]) / sampled >= LENGTH_MEAN_LIMIT)
    return out


def run_mode(steps: int, mode: str | None, workdir: Path) -> dict[str, float | bool]:
    from loongsage_core.config import load_job
    from loongsage_core.controller.run import run_job
    from loongsage_core.resolve import resolve_job

    name = mode or "sync"
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{name}.toml"
    path.write_text(job_text(steps, mode))
    start = time.perf_counter()
    history = run_job(resolve_job(load_job(path)), output_dir=str(workdir / name))
    wall = time.perf_counter() - start
    samples = sum(m.get("rollout/num_rows", 0.0) for m in history)
    steady = history[1:] or history  # the first step includes start-up in every mode
    step_time = sum(m["timing/step"] for m in steady) / len(steady)
    wait = sum(m.get("perf/wait_ratio", m.get("timing/rollout", 0.0) / max(m["timing/step"], 1e-9))
               for m in steady) / len(steady)
    out: dict[str, float | bool] = {
        "wall_s": wall, "trained_samples": samples, "samples_per_s": samples / wall,
        "steady_step_s": step_time, "steady_samples_per_s": samples / len(history) / step_time,
        "trainer_wait_ratio": wait,
        "staleness_max": max(m.get("rollout/staleness_max", 0.0) for m in history),
        "staleness_token_mean": sum(m.get("rollout/staleness_token_mean", 0.0) for m in history) / len(history),
        "dropped_groups": history[-1].get("rollout/dropped_stale_total", 0.0)
        + history[-1].get("rollout/dropped_surplus_total", 0.0),
        "aborted_groups": history[-1].get("rollout/aborted_groups_total", 0.0),
        "waste_ratio": history[-1].get("rollout/waste_ratio", 0.0),
        "old_logprob_pass_skipped": sum(m.get("perf/old_logprob_pass_skipped", 0.0) for m in history) / len(history),
    }
    out["train_s_mean"] = sum(m["timing/train"] for m in steady) / len(steady)
    if mode:
        out.update(length_check(history[-1]))
    else:  # what overlapping this run's two phases would give, perfectly and under the window
        rollouts = [m["timing/rollout"] for m in steady]
        rests = [m["timing/step"] - m["timing/rollout"] for m in steady]
        total = sum(m["timing/step"] for m in steady)
        out["any_overlap_vs_sync"] = total / max(sum(rollouts), sum(rests))
        out["overlapped_phases_vs_sync"] = total / sum(max(r, t) for r, t in zip(rollouts, rests))
        out["windowed_bound_vs_sync"] = total / windowed_schedule(rollouts, rests)
    return out


def windowed_schedule(rollouts: list[float], rests: list[float]) -> float:
    """The length of the steps whose rollout phases take ``rollouts`` and whose training (and
    weight update) phases take ``rests``, run under a bound of one version on the oldest token:
    step ``s``'s groups start when version ``s - 1`` is served (at the end of step ``s - 2``; the
    first step's at once), and step ``s`` trains once they are done and step ``s - 1`` has ended."""
    served = [0.0, 0.0]  # when versions s - 1 and s are served: the ends of steps s - 2 and s - 1
    for rollout, rest in zip(rollouts, rests):
        start = max(served[1], served[0] + rollout)
        served = [served[1], start + rest]
    return served[1]


def summarise(rounds: list[dict[str, dict[str, float | bool]]]) -> dict[str, dict[str, object]]:
    """Per mode: ``throughput_vs_sync`` (each round's ratio to the sync runs around the mode) as
    mean, min, max and standard deviation over the rounds, and the waste and length checks."""
    out: dict[str, dict[str, object]] = {}
    for mode in rounds[0]:
        ratios = [float(r[mode]["throughput_vs_sync"]) for r in rounds]
        waste = [float(r[mode]["waste_ratio"]) for r in rounds]
        out[mode] = {
            "throughput_vs_sync": {"mean": statistics.fmean(ratios), "min": min(ratios), "max": max(ratios),
                                   "stdev": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
                                   "rounds": ratios},
            "waste_ratio": {"mean": statistics.fmean(waste), "max": max(waste)},
            "steady_samples_per_s": statistics.fmean(float(r[mode]["steady_samples_per_s"]) for r in rounds),
            "staleness_max": max(float(r[mode]["staleness_max"]) for r in rounds),
            "dropped_groups": sum(float(r[mode]["dropped_groups"]) for r in rounds),
            "length_unbiased": all(bool(r[mode].get("length_unbiased", True)) for r in rounds),
            "length_ks_max": max(float(r[mode].get("length_ks", 0.0)) for r in rounds),
        }
        if mode == "sync":
            for bound in BOUNDS:
                out[mode][bound] = statistics.fmean(float(r[mode][bound]) for r in rounds)
        else:
            out[mode]["train_phase_vs_sync"] = statistics.fmean(float(r[mode]["train_phase_vs_sync"]) for r in rounds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="windowed_fifo,window_gated,no_window,partial",
                        help=f"comma-separated, from {', '.join(MODES)}")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown mode(s) {unknown}; choose from {sorted(MODES)}")
    import ray

    from loongsage_core.controller.placement import start_local_cluster

    start_local_cluster(num_cpus=2, object_store_mb=128)  # the cluster (and worker priority) a run gets
    rounds: list[dict[str, dict[str, float | bool]]] = []
    loads: list[dict[str, list[float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            work = Path(tmp) / f"round{i}"
            work.mkdir()
            before = list(os.getloadavg())
            syncs = [run_mode(args.steps, None, work / "s0")]
            results: dict[str, dict[str, float | bool]] = {}
            for j, mode in enumerate(modes):
                results[mode] = run_mode(args.steps, mode, work)
                syncs.append(run_mode(args.steps, None, work / f"s{j + 1}"))
                for key, ratio in RATIOS_TO_SYNC.items():
                    around = (float(syncs[-2][key]) + float(syncs[-1][key])) / 2  # the sync runs either side
                    results[mode][ratio] = float(results[mode][key]) / around
            rates = [float(x["steady_samples_per_s"]) for x in syncs]
            results["sync"] = {"steady_samples_per_s": statistics.fmean(rates), "throughput_vs_sync": 1.0,
                               **{bound: statistics.fmean(float(x[bound]) for x in syncs) for bound in BOUNDS},
                               "spread_of_sync_runs": (max(rates) - min(rates)) / statistics.fmean(rates),
                               "waste_ratio": 0.0, "staleness_max": 0.0, "dropped_groups": 0.0}
            rounds.append(results)
            loads.append({"before": before, "after": list(os.getloadavg())})
    print(json.dumps({"benchmark": "async_vs_sync", "steps": args.steps, "rounds": args.rounds,
                      "summary": summarise(rounds), "load_average": loads, "per_round": rounds}, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
