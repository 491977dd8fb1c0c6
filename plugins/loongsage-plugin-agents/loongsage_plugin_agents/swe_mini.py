"""Generated one-function Python repositories with one bug each, and repair transcripts of them.

The ``swe`` recipe's learning job (configs/recipes/swe/repair.toml) needs many small code-repair
tasks whose fix a tiny policy can learn to find, and a held-out split of repositories it never
saw. :func:`mini_repos` draws them, seeded: each repository is one module ``<noun>.py`` holding
one function ``<verb>_<noun>`` (``noun`` an invented word, so no model knows it; the held-out
split's words are drawn apart and never appear in the training split or in a transcript) with
one bug of a :data:`BUGS` kind, its existing test (passes before and after the fix), the hidden
regression test (fails before, passes after), the issue text (names the file, the function and
the failing call) and two replacements: the right fix and a plausible wrong one (another
operator or value that fails the regression test).

``scripts/make_swe_mini.py`` turns them into SWE-bench-shaped rows with measured
``FAIL_TO_PASS`` / ``PASS_TO_PASS`` and snapshot tarballs. :func:`mini_repair_transcripts` (the
``swe_mini_sft`` data source) writes the warm-start conversations in ``loongsage sft``'s shape:
the issue, a ``view`` of the module (the tool's exact output, :func:`.file_tools.format_view`),
an ``edit`` replacing the buggy fragment (the right fix, or with probability ``1 - p_correct`` the
wrong one), the tool's reply and ``Done.``. A wrong transcript copies the code exactly and only
picks the wrong replacement, which the ``swe_tests`` reward can then select against in RL.
"""

from __future__ import annotations

import json
import random
from typing import Any

import attrs

from loongsage_hookspecs import BuildContext

from .file_tools import apply_edit, format_view
from .python_tools import function_schema, load_function

SPLITS = ("train", "heldout")
DEFAULT_TOOLS = ("loongsage_plugin_agents.file_tools:view", "loongsage_plugin_agents.file_tools:edit")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "tr", "st", "gl")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "or", "an")
VERBS = ("count", "scale", "shift", "take", "keep", "pick", "trim", "bump", "grade", "sort", "mark", "weigh")
SEQUENCES = ("values", "items", "nums", "scores", "sizes", "prices", "points", "marks")
THRESHOLDS = ("limit", "bound", "cap", "level", "edge", "floor")
AMOUNTS = ("step", "extra", "offset", "delta", "n", "count")
ELEMENTS = ("v", "x", "item", "val", "e", "p")
HELDOUT_SEED = 7919
"""The held-out split's words are drawn from this seed; no training repository uses one of them."""
HELDOUT_SIZE = 64
"""How many words the held-out split reserves (at most that many held-out repositories)."""


class MiniRepoError(ValueError):
    """Bad arguments to the generator (the message names the argument)."""


@attrs.frozen
class Bug:
    """One kind of bug: the function's code (``{f}``, ``{xs}``, ``{x}``, ``{t}``, ``{k}``
    placeholders), its right fragment, the buggy one shipped, a plausible wrong fix, the issue
    text, the existing test's body and the regression test's body (``{f}`` calls)."""

    code: str
    right: str
    buggy: str
    wrong: str
    problem: str
    existing_test: str
    hidden_test: str


BUGS: dict[str, Bug] = {
    "comparison": Bug(
        code='def {f}({xs}, {t}):\n    """Count the values above {t}."""\n    n = 0\n    for {x} in {xs}:\n'
             '        if {x} > {t}:\n            n += 1\n    return n\n',
        right="{x} > {t}", buggy="{x} >= {t}", wrong="{x} < {t}",
        problem="`{f}({xs}, {t})` in {mod}.py counts values equal to {t} too: `{f}([1, 5, 9, 12], 5)` "
                "returns 3, expected 2.",
        existing_test="self.assertEqual({f}([], 3), 0)", hidden_test="self.assertEqual({f}([1, 5, 9, 12], 5), 2)"),
    "arithmetic": Bug(
        code='def {f}({xs}, {k}):\n    """Add {k} to every value."""\n    return [{x} + {k} for {x} in {xs}]\n',
        right="{x} + {k}", buggy="{x} - {k}", wrong="{x} * {k}",
        problem="`{f}({xs}, {k})` in {mod}.py subtracts {k} instead of adding it: `{f}([1, 2], 3)` returns "
                "[-2, -1], expected [4, 5].",
        existing_test="self.assertEqual({f}([], 2), [])", hidden_test="self.assertEqual({f}([1, 2], 3), [4, 5])"),
    "off_by_one": Bug(
        code='def {f}({xs}, {k}):\n    """The first {k} values."""\n    return {xs}[:{k}]\n',
        right="{xs}[:{k}]", buggy="{xs}[:{k} - 1]", wrong="{xs}[:{k} + 1]",
        problem="`{f}({xs}, {k})` in {mod}.py returns one value too few: `{f}([4, 5, 6], 2)` returns [4], "
                "expected [4, 5].",
        existing_test="self.assertEqual({f}([], 3), [])", hidden_test="self.assertEqual({f}([4, 5, 6], 2), [4, 5])"),
    "wrong_default": Bug(
        code='def {f}({x}, {k}=1):\n    """{x} times {k}."""\n    return {x} * {k}\n',
        right="{k}=1", buggy="{k}=0", wrong="{k}=2",
        problem="`{f}({x})` in {mod}.py returns 0: by default {k} should be 1, so `{f}(7)` returns 7.",
        existing_test="self.assertEqual({f}(2, 3), 6)", hidden_test="self.assertEqual({f}(7), 7)"),
    "flipped_comparison": Bug(
        code='def {f}({xs}, {t}):\n    """The values below {t}."""\n    return [{x} for {x} in {xs} if {x} < {t}]\n',
        right="{x} < {t}", buggy="{x} > {t}", wrong="{x} <= {t}",
        problem="`{f}({xs}, {t})` in {mod}.py keeps the values above {t}, not below: `{f}([1, 5, 9], 5)` "
                "returns [9], expected [1].",
        existing_test="self.assertEqual({f}([], 1), [])", hidden_test="self.assertEqual({f}([1, 5, 9], 5), [1])"),
}
"""The kinds of bug, by name; each repository has one."""


@attrs.frozen
class MiniRepo:
    """One generated repository: ``files`` (buggy source and the existing tests), ``hidden_tests``
    (the regression test the grader adds), ``path`` (the module with the bug), ``buggy`` / ``fix``
    / ``wrong_fix`` (the fragment shipped, its right and a wrong replacement), ``problem`` (the issue)."""

    name: str
    bug: str
    problem: str
    path: str
    files: dict[str, str]
    hidden_tests: dict[str, str]
    buggy: str
    fix: str
    wrong_fix: str

    def fixed_files(self, replacement: str | None = None) -> dict[str, str]:
        """The files with the buggy fragment replaced (by the right fix unless ``replacement``)."""
        new, reply = apply_edit(self.path, self.files[self.path], self.buggy, replacement or self.fix)
        if new is None:
            raise MiniRepoError(f"{self.name}: {reply}")
        return {**self.files, self.path: new}


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.choice((2, 2, 3))))


def heldout_words(num: int) -> list[str]:
    """The first ``num`` distinct words of the held-out split (the same for every seed)."""
    rng, out = random.Random(HELDOUT_SEED), list[str]()
    while len(out) < num:
        word = _word(rng)
        if word not in out:
            out.append(word)
    return out


def _unittest(module: str, name: str, cls: str, method: str, body: str) -> str:
    return (f"import unittest\n\nfrom {module} import {name}\n\n\nclass {cls}(unittest.TestCase):\n"
            f"    def {method}(self):\n        {body}\n\n\nif __name__ == \"__main__\":\n    unittest.main()\n")


def _repo(noun: str, rng: random.Random, kinds: list[str]) -> MiniRepo:
    kind = rng.choice(kinds)
    bug = BUGS[kind]
    names = {"f": f"{rng.choice(VERBS)}_{noun}", "xs": rng.choice(SEQUENCES), "t": rng.choice(THRESHOLDS),
             "k": rng.choice(AMOUNTS), "x": rng.choice(ELEMENTS), "mod": noun}
    path = f"{noun}.py"
    source = bug.code.format(**names).replace(bug.right.format(**names), bug.buggy.format(**names))
    files = {path: source, "tests/__init__.py": "",
             f"tests/test_{noun}.py": _unittest(noun, names["f"], "TestBasics", "test_basics",
                                                bug.existing_test.format(**names))}
    hidden = {"tests/test_issue.py": _unittest(noun, names["f"], "TestIssue", "test_issue",
                                               bug.hidden_test.format(**names))}
    return MiniRepo(name=noun, bug=kind, problem=bug.problem.format(**names), path=path, files=files,
                    hidden_tests=hidden, buggy=bug.buggy.format(**names), fix=bug.right.format(**names),
                    wrong_fix=bug.wrong.format(**names))


def mini_repos(split: str = "train", num: int = 64, seed: int = 0, kinds: list[str] | None = None) -> list[MiniRepo]:
    """``num`` repositories of ``split`` (``"train"``: words drawn from ``seed``, none of the held-out
    split's; ``"heldout"``: the held-out words, bugs drawn from ``seed``), each a distinct module name."""
    if split not in SPLITS:
        raise MiniRepoError(f"swe_mini: 'split' must be one of {SPLITS}, got {split!r}")
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise MiniRepoError(f"swe_mini: 'num' must be an integer >= 1, got {num!r}")
    chosen = list(kinds) if kinds is not None else list(BUGS)
    unknown = sorted(set(chosen) - set(BUGS))
    if unknown or not chosen:
        raise MiniRepoError(f"swe_mini: 'kinds' must name bugs of {sorted(BUGS)}, got {chosen!r}")
    rng = random.Random(f"swe-mini-{split}-{seed}")
    held = heldout_words(HELDOUT_SIZE)
    if split == "heldout":
        if num > HELDOUT_SIZE:
            raise MiniRepoError(f"swe_mini: the held-out split has {HELDOUT_SIZE} repositories, asked for {num}")
        return [_repo(word, rng, chosen) for word in held[:num]]
    out: list[MiniRepo] = []
    seen: set[str] = set()
    while len(out) < num:
        word = _word(rng)
        if word in seen or word in held:
            continue
        seen.add(word)
        out.append(_repo(word, rng, chosen))
    return out


def _call(n: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def mini_repair_transcripts(
    ctx: BuildContext | None = None,
    /,
    *,
    seed: int = 0,
    num_samples: int = 1000,
    p_correct: float = 1.0,
    kinds: list[str] | None = None,
    tools: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Repair transcripts of ``num_samples`` training-split repositories (see the module docstring).

    Args:
        ctx: the host's context (unused).
        seed: the repositories and the right/wrong draws.
        num_samples: how many transcripts (one repository each).
        p_correct: share of transcripts whose edit is the right fix; the rest make the bug's wrong fix.
        kinds: the bug kinds drawn (default: all of :data:`BUGS`).
        tools: the tool import paths offered (their schemas fill the ``tools`` column); they must
            include tools named ``view`` and ``edit``.

    Returns:
        Rows ``{"messages", "tools", "metadata": {"behaviour", "bug", "repo"}}``.
    """
    if isinstance(p_correct, bool) or not isinstance(p_correct, (int, float)) or not 0.0 <= p_correct <= 1.0:
        raise MiniRepoError(f"swe_mini_sft: 'p_correct' must be a number in [0, 1], got {p_correct!r}")
    paths = list(tools) if tools is not None else list(DEFAULT_TOOLS)
    schemas = [function_schema(load_function(p)) for p in paths]
    if not {"view", "edit"} <= {s["function"]["name"] for s in schemas}:
        raise MiniRepoError(f"swe_mini_sft: 'tools' must include tools named view and edit, got {paths}")
    rng = random.Random(f"swe-mini-sft-{seed}")
    out = []
    for repo in mini_repos("train", num_samples, seed=seed, kinds=kinds):
        right = rng.random() < p_correct
        replacement = repo.fix if right else repo.wrong_fix
        _, reply = apply_edit(repo.path, repo.files[repo.path], repo.buggy, replacement)
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": repo.problem},
            _call(1, "view", {"path": repo.path}),
            {"role": "tool", "tool_call_id": "call_1", "content": format_view(repo.path, repo.files[repo.path])},
            _call(2, "edit", {"path": repo.path, "old_text": repo.buggy, "new_text": replacement}),
            {"role": "tool", "tool_call_id": "call_2", "content": reply},
            {"role": "assistant", "content": "Done."},
        ]
        out.append({"messages": messages, "tools": schemas,
                    "metadata": {"behaviour": "correct" if right else "wrong_fix", "bug": repo.bug,
                                 "repo": repo.name}})
    return out
