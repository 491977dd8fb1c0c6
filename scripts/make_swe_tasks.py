"""Build the code-repair tasks of the ``swe`` recipe: ``configs/recipes/swe/tasks.jsonl`` + ``repos/``.

Each repository of ``swe_task_specs.SPECS`` (small, standard library only, one real bug) becomes

* ``repos/<name>.tar.gz``: the buggy repository with its existing tests (a deterministic tarball:
  the same specs write the same bytes), the snapshot the ``local`` sandbox unpacks for the agent;
* one row of ``tasks.jsonl`` in the SWE-bench shape::

    {"instance_id": "loongsage-mini__pager-1", "repo": "loongsage-mini/pager",
     "problem_statement": "...", "sandbox": {"snapshot": "repos/pager.tar.gz"},
     "test_cmd": "python3 -m unittest -v", "FAIL_TO_PASS": [...], "PASS_TO_PASS": [...],
     "test_files": {"tests/test_issue.py": "...", ...}, "patch": "<the reference fix, a diff>",
     "bug": "off-by-one"}

``FAIL_TO_PASS`` and ``PASS_TO_PASS`` are measured, as the SWE-bench harness does: the tests run
on the buggy repository and on the fixed one (with ``test_files`` in place); a test that fails
before and passes after is FAIL_TO_PASS, one that passes both times PASS_TO_PASS. A spec whose
hidden test does not fail before the fix, or whose fix breaks a test, is an error.

Usage::

    python scripts/make_swe_tasks.py                     # writes configs/recipes/swe/
    python scripts/make_swe_tasks.py --out /tmp/swe      # elsewhere
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "plugins" / "loongsage-plugin-rewards"))

from loongsage_plugin_rewards.log_parsers import PASSING, parse_unittest  # noqa: E402
from swe_task_specs import SPECS, Spec  # noqa: E402

TEST_CMD = "python3 -m unittest -v"
OWNER = "loongsage-mini"


def fixed_files(spec: Spec) -> dict[str, str]:
    """The repository's source files with the reference fix applied."""
    files = dict(spec.files)
    for path, old, new in spec.fix:
        count = files[path].count(old)
        if count != 1:
            raise SystemExit(f"{spec.name}: fix text occurs {count} times in {path} (must be once): {old!r}")
        files[path] = files[path].replace(old, new)
    return files


def unified_diff(before: dict[str, str], after: dict[str, str]) -> str:
    """A ``git apply`` / ``patch -p1`` diff from ``before`` to ``after`` (changed files only)."""
    out = []
    for path in sorted(after):
        if before.get(path) == after[path]:
            continue
        out.append(f"diff --git a/{path} b/{path}\n")
        out.extend(difflib.unified_diff(before.get(path, "").splitlines(True), after[path].splitlines(True),
                                        f"a/{path}", f"b/{path}"))
    return "".join(out)


def tarball(files: dict[str, str]) -> bytes:
    """A .tar.gz of ``files`` with fixed times, owners and modes (byte-for-byte reproducible)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({str(Path(p).parents[i]) for p in files for i in range(len(Path(p).parts) - 1)})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for path in sorted(files):
            data = files[path].encode()
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def run_tests(files: dict[str, str]) -> dict[str, str]:
    """Outcome per test id of ``TEST_CMD`` on a checkout of ``files``."""
    with tempfile.TemporaryDirectory(prefix="swe-task-") as tmp:
        for path, content in files.items():
            target = Path(tmp, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        proc = subprocess.run(TEST_CMD.split(), cwd=tmp, capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
        return parse_unittest(proc.stdout + proc.stderr)


def build_row(spec: Spec) -> tuple[dict[str, Any], bytes]:
    """One task row and its repository tarball; F2P/P2P measured by running the tests."""
    fixed = fixed_files(spec)
    tests = {**spec.tests, **spec.hidden_tests}
    before = run_tests({**spec.files, **tests})
    after = run_tests({**fixed, **tests})
    if not after:
        raise SystemExit(f"{spec.name}: no test results from {TEST_CMD!r}")
    broken = sorted(t for t, s in after.items() if s not in PASSING)
    if broken:
        raise SystemExit(f"{spec.name}: tests fail with the reference fix: {broken}")
    f2p = sorted(t for t in after if before.get(t) not in PASSING)
    p2p = sorted(t for t in after if before.get(t) in PASSING)
    if not f2p:
        raise SystemExit(f"{spec.name}: no test fails on the buggy repository")
    if not p2p:
        raise SystemExit(f"{spec.name}: no test passes on the buggy repository (PASS_TO_PASS is empty)")
    row = {
        "instance_id": f"{OWNER}__{spec.name}-1",
        "repo": f"{OWNER}/{spec.name}",
        "problem_statement": spec.problem,
        "sandbox": {"snapshot": f"repos/{spec.name}.tar.gz"},
        "test_cmd": TEST_CMD,
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
        "test_files": tests,
        "patch": unified_diff(spec.files, fixed),
        "bug": spec.bug,
    }
    return row, tarball({**spec.files, **spec.tests})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "configs" / "recipes" / "swe",
                    help="folder for tasks.jsonl and repos/ (default: configs/recipes/swe)")
    args = ap.parse_args()
    names = [s.name for s in SPECS]
    if len(set(names)) != len(names):
        raise SystemExit("two specs share a name")
    (args.out / "repos").mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in SPECS:
        row, tar = build_row(spec)
        (args.out / "repos" / f"{spec.name}.tar.gz").write_bytes(tar)
        rows.append(row)
    with open(args.out / "tasks.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
    print(json.dumps({"tasks": len(rows), "out": str(args.out),
                      "fail_to_pass": sum(len(r["FAIL_TO_PASS"]) for r in rows),
                      "pass_to_pass": sum(len(r["PASS_TO_PASS"]) for r in rows)}))


if __name__ == "__main__":
    main()
