"""docs/reference/job-schema.md is what scripts/gen_schema_docs.py writes from the job schema today,
and every job-file key carries the docstring it is documented by."""

from __future__ import annotations

import importlib.util
import sys
import typing
from pathlib import Path
from types import ModuleType

import attrs
import pytest

from loongsage_core.config import JobConfig, structure_job

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "docs" / "reference" / "job-schema.md"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_schema_docs", REPO / "scripts" / "gen_schema_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # attrs and typing resolve the module's names through sys.modules
    spec.loader.exec_module(module)
    return module


GEN = load_generator()


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    return GEN


def test_the_committed_reference_is_what_the_script_writes(gen):
    assert REFERENCE.read_text(encoding="utf-8") == gen.render(), (
        "docs/reference/job-schema.md is out of date: run .venv/bin/python scripts/gen_schema_docs.py")


def test_check_fails_on_a_stale_file_and_passes_on_a_fresh_one(gen, tmp_path, capsys):
    out = tmp_path / "job-schema.md"
    assert gen.main(["--output", str(out)]) == 0
    assert gen.main(["--check", "--output", str(out)]) == 0
    out.write_text(out.read_text().replace("| `lr` |", "| `learning_rate` |"))
    assert gen.main(["--check", "--output", str(out)]) == 1
    assert "out of date" in capsys.readouterr().err


def schema_classes() -> list[type]:
    seen: list[type] = [JobConfig]
    for cls in seen:
        hints = typing.get_type_hints(cls)
        for f in attrs.fields(cls):
            sub = GEN.attrs_class_in(hints[f.name])
            if sub is not None and sub not in seen:
                seen.append(sub)
    return seen


@pytest.mark.parametrize("cls", schema_classes(), ids=lambda c: c.__name__)
def test_every_job_file_key_has_a_docstring(gen, cls):
    docs = gen.field_docs(cls)
    missing = [f.name for f in gen.job_fields(cls) if not docs.get(f.name)]
    assert not missing, f"{cls.__name__}: keys without a docstring (one on the line after the field): {missing}"


def test_a_key_without_a_docstring_is_named(gen):
    @attrs.define
    class Demo:
        documented: int = 1
        """Has one."""
        bare: str = "x"

    with pytest.raises(gen.MissingDoc, match=r"Demo\.bare \(demo\.bare\)"):
        gen.table_section("demo", Demo, False)


def test_every_table_and_key_of_a_loaded_job_is_in_the_reference():
    """Walk a job as the loader builds it (every table present) and find each key in its table's section."""
    text = REFERENCE.read_text(encoding="utf-8")
    job = structure_job({"data": [{"name": "d"}], "teachers": [{"name": "t"}], "train": {"lora": {}}, "sft": {}})
    sections = {s.split("`", 1)[0]: s for s in text.split("\n## `")[1:]}

    def walk(obj, heading):
        assert heading in sections, f"no section for {heading}"
        for f in attrs.fields(type(obj)):
            if f.metadata.get("internal"):
                continue
            key = "async" if f.name == "async_" else f.name
            value = getattr(obj, f.name)
            if attrs.has(type(value)):
                walk(value, f"[{heading.strip('[]')}.{key}]" if heading != "[]" else f"[{key}]")
            elif isinstance(value, list) and value and attrs.has(type(value[0])):
                walk(value[0], f"[[{key}]]")
            if heading != "[]":
                assert f"| `{key}` |" in sections[heading], f"{heading} {key} missing from the reference"

    sections["[]"] = ""
    walk(job, "[]")


def test_defaults_in_the_reference_are_the_schema_defaults(gen):
    """A few defaults read back from the reference's rows equal what an empty job file loads as."""
    job = structure_job({})
    text = REFERENCE.read_text(encoding="utf-8")
    for section, key, value in (("[train]", "lr", job.train.lr), ("[rollout]", "samples_per_prompt",
                                                                     job.rollout.samples_per_prompt),
                                ("[async]", "scheduler", job.async_.scheduler), ("[run]", "keep_checkpoints",
                                                                                 job.run.keep_checkpoints)):
        part = text.split(f"## `{section}`", 1)[1].split("\n## ", 1)[0]
        row = next(line for line in part.splitlines() if line.startswith(f"| `{key}` |"))
        assert row.split(" | ")[2] == f"`{gen.toml_value(value)}`", row
