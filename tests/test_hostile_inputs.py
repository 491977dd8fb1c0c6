"""Bad input is refused by ``loongsage validate`` as well as by ``loongsage run``, before Ray
starts: a corpus of hostile job files, data files and overrides, each run through both commands
as a user would (the CLI, in a subprocess). Every case must end with exit status 2 and one
line on standard error that names the file or key at fault, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest


def jsonl(*rows: object) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


GOOD = jsonl({"prompt": "1+1=", "label": "2"}, {"prompt": "2+2=", "label": "4"})


class Case(NamedTuple):
    name: str
    files: dict[str, bytes]
    overrides: tuple[str, ...]
    error: str  # a phrase the one-line error must contain


CASES = [
    Case("missing data file", {}, ("data.0.path=absent.jsonl",), "absent.jsonl' does not exist"),
    Case("empty data file", {"data.jsonl": b""}, (), "the data source is empty"),
    Case("blank data file", {"data.jsonl": b"\n  \n\n"}, (), "the data source is empty"),
    Case("missing prompt field", {"data.jsonl": jsonl({"question": "1+1=", "label": "2"})}, (),
         "data.jsonl:1: prompt field 'prompt' is missing"),
    Case("prompt field missing on a later line", {"data.jsonl": GOOD + jsonl({"label": "3"})}, (),
         "data.jsonl:3: prompt field 'prompt' is missing"),
    Case("fake parquet file", {"data.parquet": b"this is not parquet\n"}, ("data.0.path=data.parquet",),
         "cannot read parquet file"),
    Case("empty parquet-named file", {"data.parquet": b""}, ("data.0.path=data.parquet",),
         "cannot read parquet file"),
    Case("lone surrogate in a prompt", {"data.jsonl": GOOD + b'{"prompt": "x \\ud800 y", "label": "1"}\n'}, (),
         "data.jsonl:3: prompt field 'prompt' holds a lone UTF-16 surrogate '\\ud800'"),
    Case("lone surrogate in a chat message", {"data.jsonl": b'{"prompt": [{"role": "user", "content": "\\udfff"}]}\n'},
         (), "data.jsonl:1: prompt field 'prompt' holds a lone UTF-16 surrogate '\\udfff'"),
    Case("empty prompt", {"data.jsonl": GOOD + jsonl({"prompt": "", "label": "1"})}, (),
         "data.jsonl:3: prompt field 'prompt' is empty"),
    Case("blank prompt", {"data.jsonl": jsonl({"prompt": " \n\t", "label": "1"})}, (),
         "data.jsonl:1: prompt field 'prompt' is empty"),
    Case("null prompt", {"data.jsonl": jsonl({"prompt": None})}, (), "prompt field 'prompt' is null"),
    Case("prompt of a wrong type", {"data.jsonl": jsonl({"prompt": 7})}, (), "must be a string or a non-empty list"),
    Case("invalid JSON line", {"data.jsonl": GOOD + b'{"prompt": "x",\n'}, (), "data.jsonl:3: invalid JSON"),
    Case("non-UTF-8 data", {"data.jsonl": b'{"prompt": "\xff\xfe"}\n'}, (), "data.jsonl:1: not UTF-8 text"),
    Case("a line over the size limit", {"data.jsonl": GOOD + jsonl({"prompt": "x" * 5000})},
         ("data.0.max_line_bytes=4096",), "data.jsonl:3: the line is longer than max_line_bytes (4096 bytes)"),
    Case("empty model.path", {"data.jsonl": GOOD}, ("model.path=",), "model.path is empty"),
    Case("model.path that does not exist", {"data.jsonl": GOOD}, ("model.path=no_model",), "does not exist"),
    Case("no training step", {"data.jsonl": GOOD}, ("train.total_steps=0",), "train.total_steps"),
    Case("group advantage with one sample", {"data.jsonl": GOOD}, ("rollout.samples_per_prompt=1",),
         "rollout.samples_per_prompt = 1"),
    Case("rloo with one sample", {"data.jsonl": GOOD}, ("rollout.samples_per_prompt=1", "algorithm.advantage=rloo"),
         "rollout.samples_per_prompt = 1"),
    Case("a component argument of the wrong type", {"data.jsonl": GOOD}, ("algorithm.advantage_args.norm_std=maybe",),
         "algorithm.advantage_args.norm_std: expected bool"),
    Case("data directory that is no dataset", {"sub/readme.txt": b"hi"}, ("data.0.path=sub",),
         "is a directory but not a dataset"),
]


def write_case(tiny_job, case: Case, where: Path) -> Path:
    """The tiny job, reading its prompts from ``data.jsonl``, with ``case``'s files beside it."""
    where.mkdir(parents=True)
    job = tiny_job.write(where)
    job.write_text(job.read_text().replace('generator = "arithmetic"\ngenerator_args = { num_samples = 16 }',
                                           'path = "data.jsonl"'))
    for name, content in case.files.items():
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_bytes(content)
    return where / "job.toml"


NO_RAY = """
import sys


class NoRay:
    \"\"\"Refuses to import Ray: these inputs must be refused before the run gets that far.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("ray was imported: the bad input was not refused before the run started Ray")
        return None


sys.meta_path.insert(0, NoRay())
from loongsage_core.cli import main

sys.exit(main(sys.argv[1:]))
"""


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The ``loongsage`` command in a subprocess whose Python cannot import Ray."""
    return subprocess.run([sys.executable, "-c", NO_RAY, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_the_good_job_of_the_corpus_validates(tiny_job, tmp_path):
    job = write_case(tiny_job, Case("good", {"data.jsonl": GOOD}, (), ""), tmp_path / "good")
    done = cli("validate", str(job), cwd=job.parent)
    assert done.returncode == 0, done.stderr


def test_every_hostile_input_is_refused_by_validate_and_by_run_in_one_line(tiny_job, tmp_path):
    def both(i_case: tuple[int, Case]) -> list[str]:
        i, case = i_case
        job = write_case(tiny_job, case, tmp_path / f"case{i}")
        problems = []
        for command in (("validate", str(job)), ("run", str(job), "--output-dir", str(job.parent / "out"))):
            done = cli(*command, *case.overrides, cwd=job.parent)
            lines = done.stderr.strip().splitlines()
            ok = (done.returncode == 2 and len(lines) == 1 and lines[0].startswith("loongsage: error: ")
                  and case.error in lines[0] and "Traceback" not in done.stderr)
            if not ok:
                problems.append(f"{case.name} / {command[0]}: exit {done.returncode}: {done.stderr.strip()[-600:]}")
        return problems

    with ThreadPoolExecutor(max_workers=4) as pool:
        problems = [p for found in pool.map(both, enumerate(CASES)) for p in found]
    assert not problems, "\n".join(problems)


WARNED = [
    (("rollout.temperature=0",), "rollout.temperature = 0 (greedy) with algorithm.advantage = 'grpo'"),
    (("data.0.sampling={temperature=0}", "algorithm.advantage=rloo"),
     "data[0].sampling.temperature = 0 (greedy) with algorithm.advantage = 'rloo'"),
    (("train.mini_batch_size=3", "train.micro_batch_size=1"),
     "train.mini_batch_size = 3 does not divide the 8 trajectories of a step"),
    (("train.mini_batch_size=16",), "train.mini_batch_size = 16 is more than the 8 trajectories of a step"),
]


def test_misfit_settings_are_warned_of_in_one_line_each_and_validate(tiny_job, tmp_path):
    job = write_case(tiny_job, Case("good", {"data.jsonl": GOOD}, (), ""), tmp_path / "good")
    for overrides, warning in WARNED:
        done = cli("validate", str(job), *overrides, cwd=job.parent)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 0 and len(lines) == 1 and lines[0].startswith("warning: "), done.stderr
        assert warning in lines[0], lines[0]
    # greedy sampling warns only for an estimator that compares a group's samples
    done = cli("validate", str(job), "rollout.temperature=0", "algorithm.advantage=reinforce_pp", cwd=job.parent)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_a_line_over_the_limit_is_refused_having_held_no_more_than_the_limit(tmp_path):
    import tracemalloc

    from loongsage_core.config import ConfigError
    from loongsage_core.data_sources import read_jsonl_file

    path = tmp_path / "big.jsonl"
    with path.open("wb") as fh:  # a 32 MiB line (no newline in sight) after a good one
        fh.write(GOOD)
        fh.write(b'{"prompt": "' + b"x" * (32 << 20))
    limit = 1 << 20
    tracemalloc.start()
    try:
        rows = read_jsonl_file(path, "data[0]", limit)
        assert next(rows)[0].endswith("big.jsonl:1")
        with pytest.raises(ConfigError, match=r"big\.jsonl:3: the line is longer than max_line_bytes \(1048576 "):
            list(rows)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * limit, peak
    # a line of exactly the limit (newline excluded) is read
    exact = tmp_path / "exact.jsonl"
    line = json.dumps({"prompt": "y" * 100}).encode()
    exact.write_bytes(line + b"\n" + line)
    assert len(list(read_jsonl_file(exact, "data[0]", len(line)))) == 2
    with pytest.raises(ConfigError, match="exact.jsonl:1: the line is longer"):
        list(read_jsonl_file(exact, "data[0]", len(line) - 1))
