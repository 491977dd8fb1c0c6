"""Multi-source data: loading (JSONL, parquet, save_to_disk), field mapping, and exact mixing per
step, per mini-batch and per data-parallel rank."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from loongsage_core.config import ConfigError, DataConfig, JobConfig, RolloutConfig
from loongsage_core.controller.batching import shard_rows
from loongsage_core.controller.data import (
    DataMixer,
    integer_weights,
    interleave_by_source,
    quota_sequence,
    round_shares,
)
from loongsage_core.data_sources import load_rows

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def job_with(tmp_path: Path, sources: list[DataConfig], prompts_per_step: int = 7) -> JobConfig:
    job = JobConfig(data=sources, rollout=RolloutConfig(prompts_per_step=prompts_per_step))
    job.source_path = str(tmp_path / "job.toml")
    return job


def within_quota(count: int, share: Fraction) -> bool:
    return math.floor(share) <= count <= math.ceil(share)


def make_sources(tmp_path: Path, weights: dict[str, float], rows: int = 5) -> list[DataConfig]:
    out = []
    for name, w in weights.items():
        write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": f"{name} {i}", "label": i} for i in range(rows)])
        out.append(DataConfig(name=name, path=f"{name}.jsonl", weight=w))
    return out


# --------------------------------------------------------------------------------------------
# per step
# --------------------------------------------------------------------------------------------


def test_step_counts_follow_the_running_quota_over_many_steps(tmp_path):
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    mixer = DataMixer(job_with(tmp_path, make_sources(tmp_path, weights)), None)
    exact = {k: Fraction(str(v)) for k, v in weights.items()}
    drawn: Counter[str] = Counter()
    per_step = []
    for step in range(1, 61):
        prompts = mixer.next_prompts(7)
        counts = Counter(p.source for p in prompts)
        per_step.append(counts)
        assert len(prompts) == 7
        drawn.update(counts)
        for name, w in exact.items():  # cumulative: floor or ceil of the exact share, after every step
            assert within_quota(drawn[name], w * 7 * step), (step, name, drawn)
        if step % 10 == 0:  # 70 prompts: shares are whole, so the counts are exactly them
            assert dict(drawn) == {"a": 35 * step // 10, "b": 21 * step // 10, "c": 14 * step // 10}
    # 3.5 / 2.1 / 1.4 a step: never further than one prompt from the step's share
    for counts in per_step:
        for name, w in exact.items():
            assert abs(counts[name] - w * 7) < 2


def test_many_small_sources_keep_their_quota(tmp_path):
    # seven light sources and a heavy one, drawn one to twenty prompts at a time (refills after
    # filtering draw fewer): the counts always add up and no source leaves its quota
    weights = [3, 1, 1, 3, 3, 1, 3, 51]
    ints = integer_weights([float(w) for w in weights])
    rng = random.Random(7)
    counts = [0] * len(weights)
    total = 0
    for _ in range(300):
        n = rng.choice([1, 1, 2, 3, 6, rng.randint(1, 20)])
        seq = quota_sequence(ints, counts, n)
        total += n
        assert len(seq) == n and sum(counts) == total
        for i, w in enumerate(weights):
            assert within_quota(counts[i], Fraction(w * total, sum(weights))), (i, counts, total)


def test_decimal_weights_are_read_as_written():
    assert integer_weights([0.5, 0.3, 0.2]) == [5, 3, 2]
    assert integer_weights([1e-05, 2]) == [1, 200000]
    with pytest.raises(ValueError, match="weight 1"):
        integer_weights([1.0, float("nan")])


def test_resumed_mixer_draws_what_an_uninterrupted_one_draws(tmp_path):
    sources = make_sources(tmp_path, {"a": 0.5, "b": 0.3, "c": 0.2}, rows=4)
    straight = DataMixer(job_with(tmp_path, sources), None)
    first = [p.prompt_id for _ in range(9) for p in straight.next_prompts(7)]
    resumed = DataMixer(job_with(tmp_path, sources), None)
    head = [p.prompt_id for _ in range(4) for p in resumed.next_prompts(7)]
    state = json.loads(json.dumps(resumed.state_dict()))  # what a checkpoint stores
    again = DataMixer(job_with(tmp_path, sources), None)
    again.load_state_dict(state)
    tail = [p.prompt_id for _ in range(5) for p in again.next_prompts(7)]
    assert head + tail == first


# --------------------------------------------------------------------------------------------
# per mini-batch and per rank
# --------------------------------------------------------------------------------------------


def cut(order: list[int], mini_batch_size: int, world_size: int) -> list[list[list[int]]]:
    """The rows of each rank of each mini-batch, cut as the learner cuts them."""
    out = []
    for start in range(0, len(order), mini_batch_size):
        mini = order[start:start + mini_batch_size]
        out.append([[mini[i] for i in shard] for shard in shard_rows(len(mini), world_size)])
    return out


def check_interleaving(sources: list[str], mini_batch_size: int, world_size: int, seed: object) -> None:
    order = interleave_by_source(sources, mini_batch_size, world_size, seed=seed)
    assert sorted(order) == list(range(len(sources)))
    step_counts = Counter(sources)
    n = len(sources)
    names = sorted(step_counts)
    per_source_total: Counter[str] = Counter()
    for shards in cut(order, mini_batch_size, world_size):
        rows = [r for shard in shards for r in shard]
        mini_counts = Counter(sources[r] for r in rows)
        per_source_total.update(mini_counts)
        for s in names:
            assert within_quota(mini_counts[s], Fraction(len(rows) * step_counts[s], n)), (s, mini_counts)
        rank_total: Counter[str] = Counter()
        for shard in shards:
            shard_counts = Counter(sources[r] for r in shard)
            rank_total.update(shard_counts)
            for s in names:
                share = Fraction(len(shard) * mini_counts[s], len(rows))
                assert within_quota(shard_counts[s], share), (s, shard_counts, mini_counts)
        assert rank_total == mini_counts
    assert per_source_total == step_counts


def test_every_mini_batch_and_rank_carries_each_sources_share_over_many_steps(tmp_path):
    """0.5 / 0.3 / 0.2 with 7 prompts a step and 4 samples each; filters drop whole groups."""
    mixer = DataMixer(job_with(tmp_path, make_sources(tmp_path, {"a": 0.5, "b": 0.3, "c": 0.2})), None)
    rng = random.Random(0)
    for step in range(40):
        prompts = mixer.next_prompts(7)
        kept = [p for p in prompts if rng.random() > 0.15] or prompts
        rows = [p.source for p in kept for _ in range(4)]
        rng.shuffle(rows)
        for mini_batch_size, world_size in ((8, 3), (6, 2), (28, 4), (5, 1), (3, 4)):
            check_interleaving(rows, mini_batch_size, world_size, seed=f"0:{step}:minibatch")


def test_even_shares_give_identical_mini_batches_and_ranks():
    # 16 / 8 / 4 rows in mini-batches of 7 rows over 1 rank, then 14 rows over 2 ranks of 7
    rows = ["a"] * 16 + ["b"] * 8 + ["c"] * 4
    random.Random(1).shuffle(rows)
    for mini_batch_size, world_size in ((7, 1), (14, 2)):
        order = interleave_by_source(rows, mini_batch_size, world_size, seed=3)
        for shards in cut(order, mini_batch_size, world_size):
            for shard in shards:
                assert Counter(rows[r] for r in shard) == {"a": 4, "b": 2, "c": 1}


def test_interleaving_is_seeded_and_mixes_inside_a_shard():
    rows = ["a"] * 10 + ["b"] * 10
    one = interleave_by_source(rows, 20, 1, seed="x")
    assert one == interleave_by_source(rows, 20, 1, seed="x")
    assert one != interleave_by_source(rows, 20, 1, seed="y")
    labels = [rows[r] for r in one]
    assert labels == ["a", "b"] * 10  # equal shares alternate, so any micro-batch split is mixed too
    with pytest.raises(ValueError, match="mini_batch_size"):
        interleave_by_source(rows, 0, 1)


def test_round_shares_meets_every_margin_for_uneven_blocks():
    rng = random.Random(5)
    for _ in range(300):
        totals = [rng.randint(0, 15) for _ in range(rng.randint(1, 6))]
        n = sum(totals)
        cuts = sorted(rng.randint(0, n) for _ in range(rng.randint(0, 6)))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
        counts = round_shares(totals, sizes)
        assert [sum(row) for row in counts] == sizes
        assert [sum(col) for col in zip(*counts)] == totals
        for k, row in enumerate(counts):
            for s, c in enumerate(row):
                assert within_quota(c, Fraction(sizes[k] * totals[s], n) if n else Fraction(0))


# --------------------------------------------------------------------------------------------
# loading and field mapping
# --------------------------------------------------------------------------------------------


def test_saved_dataset_directories_load_with_their_split(tmp_path):
    import datasets

    rows = [{"question": f"q{i}", "answer": str(i), "info": {"level": i}} for i in range(3)]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "both"))

    def source(path: str, split: str | None = None) -> JobConfig:
        return job_with(tmp_path, [DataConfig(name="d", path=path, split=split, prompt_key="question",
                                              label_key="answer", metadata_key="info")])

    loaded = load_rows(source("single"), 0, None)
    assert loaded == [{"prompt": f"q{i}", "label": str(i), "metadata": {"level": i}} for i in range(3)]
    assert [r["prompt"] for r in load_rows(source("both", "test"), 0, None)] == ["q0"]
    with pytest.raises(ConfigError, match=r"data\[0\] \('d'\)\.split: .*both holds the splits \['train', 'test'\]"):
        load_rows(source("both"), 0, None)
    with pytest.raises(ConfigError, match="no split 'dev'"):
        load_rows(source("both", "dev"), 0, None)
    with pytest.raises(ConfigError, match="single dataset, not a DatasetDict"):
        load_rows(source("single", "train"), 0, None)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ConfigError, match="not a dataset saved with save_to_disk"):
        load_rows(source("plain"), 0, None)


def test_parquet_rows_and_default_field_mapping(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "p0", "label": 1, "metadata": {"k": "v"}, "extra": 5}]),
                   tmp_path / "d.parquet")
    job = job_with(tmp_path, [DataConfig(name="d", path="d.parquet")])
    assert load_rows(job, 0, None) == [{"prompt": "p0", "label": 1, "metadata": {"k": "v", "extra": 5}}]


def test_field_mapping_errors_name_the_file_and_row(tmp_path):
    good = {"prompt": "fine", "label": 1}
    write_jsonl(tmp_path / "a.jsonl", [good, good, {"question": "no prompt here"}])
    job = job_with(tmp_path, [DataConfig(name="a", path="a.jsonl")])
    with pytest.raises(ConfigError, match=r"a\.jsonl:3: prompt field 'prompt' is missing .*fields: question"):
        load_rows(job, 0, None)

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "ok"}, {"prompt": "ok"}, {"prompt": None}]),
                   tmp_path / "b.parquet")
    job = job_with(tmp_path, [DataConfig(name="b", path="b.parquet")])
    with pytest.raises(ConfigError, match=r"b\.parquet row 2: prompt field 'prompt' is null"):
        load_rows(job, 0, None)

    write_jsonl(tmp_path / "c.jsonl", [{"prompt": 42}])
    job = job_with(tmp_path, [DataConfig(name="c", path="c.jsonl")])
    with pytest.raises(ConfigError, match=r"c\.jsonl:1: field 'prompt' must be a string or .*got int 42"):
        load_rows(job, 0, None)

    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x", "meta": {"a": 1}}, {"prompt": "y", "meta": [1, 2]}])
    job = job_with(tmp_path, [DataConfig(name="d", path="d.jsonl", metadata_key="meta")])
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: metadata field 'meta' must be an object, got list"):
        load_rows(job, 0, None)

    write_jsonl(tmp_path / "e.jsonl", [{"prompt": "x"}])
    job = job_with(tmp_path, [DataConfig(name="e", path="e.jsonl", metadata_key="meta")])
    with pytest.raises(ConfigError, match=r"e\.jsonl:1: metadata field 'meta' is missing"):
        load_rows(job, 0, None)

    job = job_with(tmp_path, [DataConfig(name="e", path="e.jsonl", split="train")])
    with pytest.raises(ConfigError, match=r"data\[0\] \('e'\)\.split: only a saved DatasetDict"):
        load_rows(job, 0, None)


def test_custom_keys_and_chat_prompts_map_through(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    write_jsonl(tmp_path / "m.jsonl", [{"msgs": messages, "gold": "4", "metadata": {"id": 7}, "topic": "math"}])
    job = job_with(tmp_path, [DataConfig(name="m", path="m.jsonl", prompt_key="msgs", label_key="gold")])
    assert load_rows(job, 0, None) == [{"prompt": messages, "label": "4", "metadata": {"id": 7, "topic": "math"}}]
