"""The README's code blocks work as written, and the README and docs/ link only to what exists.

Every fenced block of README.md carries a marker comment on the line before it that says how it
is tested (docs/dev/contributing.md, "Docs that are tested"):

* ``<!-- test: run -->``: a bash block, run with bash from the repository root, with two
  documented substitutions: a leading ``bash scripts/setup.sh &&`` is dropped (the tests run
  inside the environment setup.sh made) and paths under ``runs/`` go to a temporary directory
  that all of the README's run blocks share, in order;
* ``<!-- test: run KEY=VALUE ... -->``: the same, with those overrides added to each
  ``loongsage run`` / ``loongsage sft`` command (the quickstart runs 2 steps instead of 60);
* ``<!-- test: validate -->``: a TOML block that is a whole job file, saved in a directory that
  stands in for the repository root (its ``configs/`` links to the real one) and checked with
  ``loongsage validate``;
* ``<!-- test: exec -->``: a Python block, executed;
* ``<!-- test: skip (reason) -->``: not run, for the reason given.

A block without a marker, or with a marker that does not fit its language, fails the test.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CI_TEST_COMMAND = "bash scripts/setup.sh && .venv/bin/python -m pytest -q"

MARKER = re.compile(r"<!--\s*test:\s*(?P<kind>[a-z]+)(?P<rest>.*?)\s*-->")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
LANGUAGES = {"run": {"bash"}, "validate": {"toml"}, "exec": {"python"}, "skip": None}


class Block(NamedTuple):
    """One fenced block: its language, text, 1-based line, and marker (kind and argument)."""

    lang: str
    text: str
    line: int
    kind: str
    arg: str


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of ``path`` with the marker on the nearest non-blank line before it."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.fullmatch(before.strip())
        found.append(Block(fence["lang"], "\n".join(lines[i + 1:end]), i + 1,
                           marker["kind"] if marker else "", marker["rest"].strip() if marker else ""))
        i = end + 1
    return found


def test_every_readme_block_has_a_marker_that_fits_its_language():
    problems = []
    for b in blocks():
        where = f"README.md:{b.line} ({b.lang or 'no language'})"
        if b.kind not in LANGUAGES:
            problems.append(f"{where}: no `<!-- test: run|validate|exec|skip (reason) -->` marker on the line before")
        elif LANGUAGES[b.kind] is not None and b.lang not in LANGUAGES[b.kind]:
            problems.append(f"{where}: `test: {b.kind}` is for {', '.join(sorted(LANGUAGES[b.kind]))} blocks")
        elif b.kind == "skip" and not re.fullmatch(r"\(.+\)", b.arg):
            problems.append(f"{where}: `test: skip` needs a reason in parentheses")
        elif b.kind == "run" and any("=" not in a for a in shlex.split(b.arg)):
            problems.append(f"{where}: `test: run` takes KEY=VALUE overrides only, got {b.arg!r}")
        elif b.kind in ("validate", "exec") and b.arg:
            problems.append(f"{where}: `test: {b.kind}` takes no argument, got {b.arg!r}")
    assert not problems, "\n".join(problems)


def test_the_marker_check_finds_an_unmarked_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```bash\necho hi\n```\n\n<!-- test: skip (why) -->\n```text\ndiagram\n```\n")
    assert [(b.kind, b.arg) for b in blocks(page)] == [("", ""), ("skip", "(why)")]


def test_the_readme_shows_the_test_command_that_ci_runs():
    """The README's test block is exactly CI's command, and .ci/run runs that command: setup, then
    pytest with no other arguments (an environment variable before it is allowed)."""
    assert any(CI_TEST_COMMAND in b.text.splitlines() for b in blocks()), f"README lacks `{CI_TEST_COMMAND}`"
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    setup = ci.index("bash scripts/setup.sh")
    pytest_lines = [line for line in ci if "-m pytest" in line]
    assert len(pytest_lines) == 1, pytest_lines
    command = re.sub(r"^(\w+=\S+\s+)*", "", pytest_lines[0]).split(" || ")[0]
    assert command == ".venv/bin/python -m pytest -q", command
    assert ci.index(pytest_lines[0]) > setup


def test_the_recipe_table_lists_every_recipe(monkeypatch):
    from loongsage_core.recipes import CONFIG_PATH_ENV, list_recipes

    monkeypatch.delenv(CONFIG_PATH_ENV, raising=False)
    monkeypatch.chdir(REPO)
    names = [r.name.removeprefix("recipes/") for r in list_recipes() if r.name.startswith("recipes/")]
    assert names, "no recipes found"
    table = README.read_text(encoding="utf-8").split("## Recipes", 1)[1].split("\n## ", 1)[0]
    missing = [n for n in names if f"| `{n}` |" not in table]
    assert not missing, f"recipes without a row in the README's recipe table: {missing}"


def test_readme_job_files_validate(tmp_path, capsys):
    from loongsage_core.cli import main

    (tmp_path / "configs").symlink_to(REPO / "configs")
    for b in [b for b in blocks() if b.kind == "validate"]:
        job = tmp_path / f"job_line{b.line}.toml"
        job.write_text(b.text + "\n", encoding="utf-8")
        assert main(["validate", str(job)]) == 0, f"README.md:{b.line}: {capsys.readouterr().err}"
        assert "[model]" in capsys.readouterr().out, f"README.md:{b.line}: validate printed no resolved job"


def test_readme_python_blocks_run():
    """Each Python block runs, and the specs its hook implementations provide are built."""
    for b in [b for b in blocks() if b.kind == "exec"]:
        namespace: dict = {"__name__": "readme_block"}
        exec(compile(b.text, f"README.md:{b.line}", "exec"), namespace)  # noqa: S102
        for value in list(namespace.values()):
            if callable(value) and hasattr(value, "loongsage_impl"):  # an @hookimpl provider hook
                specs = list(value())
                assert specs and all(s.name for s in specs), f"README.md:{b.line}: {value.__name__} provides nothing"


def shell_script(block: Block, runs: Path) -> str:
    """The block as the test runs it: the substitutions of the module docstring applied."""
    script = re.sub(r"^bash scripts/setup\.sh && ", "", block.text, flags=re.M)
    script = re.sub(r"(?<![\w/.])runs/", f"{runs}/", script)
    overrides = " ".join(shlex.quote(a) for a in shlex.split(block.arg))
    if overrides:
        script = re.sub(r"(loongsage (?:run|sft) \S+)", lambda m: f"{m.group(1)} {overrides}", script)
    return script


def test_the_substitutions(tmp_path):
    block = Block("bash", "bash scripts/setup.sh && .venv/bin/loongsage run configs/q.toml --output-dir runs/q\n"
                  "ls runs/q ./runs/x", 1, "run", "train.total_steps=2")
    assert shell_script(block, tmp_path / "r").splitlines() == [
        f".venv/bin/loongsage run configs/q.toml train.total_steps=2 --output-dir {tmp_path}/r/q",
        f"ls {tmp_path}/r/q ./runs/x"]


def test_readme_commands_run(slow_fixture, tmp_path):
    """Every `run` block in order (the quickstart trains, its metrics are plotted), then what they
    leave behind: the metrics of the steps the overrides asked for and the plot."""
    runs = tmp_path / "runs"
    runs.mkdir()
    ran = [b for b in blocks() if b.kind == "run"]
    assert ran, "the README has no run block"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    for b in ran:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", shell_script(b, runs)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"README.md:{b.line} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-3000:]}"
    metrics = [json.loads(line) for line in (runs / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    steps = [b.arg for b in ran if "total_steps=" in b.arg]
    trained = [m for m in metrics if "train/loss" in m]  # the quickstart's [eval] adds a row after the last step
    assert steps and len(trained) == int(re.search(r"total_steps=(\d+)", steps[0])[1])
    assert (runs / "quickstart" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# Links
# --------------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def doc_pages() -> list[Path]:
    """The README, docs/, and the package and recipe READMEs."""
    return [README, *sorted((REPO / "docs").rglob("*.md")), REPO / "hookspecs" / "README.md",
            *sorted(REPO.glob("plugins/*/README.md")), *sorted(REPO.glob("configs/recipes/*/README.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m[1]) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, flags=re.M)}


def test_the_slug_of_a_heading():
    assert slug("## `loongsage_schedulers` — scheduler".lstrip("# ")) == "loongsage_schedulers--scheduler"
    assert slug("Seeing what the policy did: rollout records and `loongsage view`") == \
        "seeing-what-the-policy-did-rollout-records-and-loongsage-view"


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files_and_headings_that_exist(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(REPO):
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_name_no_file_outside_the_repository(page):
    text = page.read_text(encoding="utf-8")
    assert "DESIGN.md" not in text, "DESIGN.md is not part of the repository"
    assert "../shared" not in text


def test_the_readme_is_a_front_door():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250, "README.md grew past 250 lines: move " \
        "material into docs/"


def test_readme_toml_is_toml():
    for b in blocks():
        if b.lang == "toml":
            tomllib.loads(b.text)

