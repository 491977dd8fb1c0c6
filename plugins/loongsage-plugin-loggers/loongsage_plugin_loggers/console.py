"""The ``console`` logger: a live progress bar over the run's steps with the key metrics.

On a terminal it draws a rich progress bar (steps done / total, elapsed and remaining time, and
the chosen metrics) that updates in place. When the output is not a terminal (a log file, CI) it
prints one plain line per step instead (``step 3/50  reward=0.3125  loss=0.0412  1.8s``).

Steps are numbered from 0: after ``log(step, ...)`` the bar shows ``step + 1`` steps done.

With ``show_samples = N`` it also prints, every N steps, one trajectory drawn from the step's
rollout records (the host hands them over through :meth:`ConsoleLogger.log_trajectories`): its
source, agent, status, reward with the reason, the prompt, and each turn's answer and tool calls.
"""

from __future__ import annotations

import fnmatch
import random
import sys
import time
from typing import IO, TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover - typing only
    from loongsage_hookspecs import LoggerContext

DEFAULT_KEYS: tuple[str, ...] = (
    "rollout/reward_mean",
    "rollout/reward",
    "train/loss",
    "train/pg_loss",
    "train/grad_norm",
    "train/is_approx_k3_kl",
    "rollout/response_length_mean",
    "sft/loss",
    "sft/eval_loss",
    "sft/grad_norm",
    "sft/lr",
    "timing/step",
)
"""Metrics shown when ``keys`` is not given (those present in a step, in this order)."""

MAX_DEFAULT_KEYS = 4


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _short(key: str) -> str:
    return key.rsplit("/", 1)[-1]


class ConsoleLogger:
    """Shows progress and chosen metrics on the console.

    Args:
        ctx: the logger's context; ``ctx.total_steps`` is the run's step count, the bar's end
            (0: unknown, the bar has no end and plain lines show no total). ``output_dir`` is
            unused.
        keys: metric names to show; shell-style patterns such as ``"rollout/*"`` match several.
            Default: those of :data:`DEFAULT_KEYS` present in the step (at most four), else the
            first four metric names in sorted order.
        live: ``True`` forces the live bar, ``False`` plain lines; default: live on a terminal.
        every: in plain mode, print every ``every``-th step (and always the last one).
        stream: ``"stdout"`` or ``"stderr"``.
        console: a ``rich.console.Console`` to draw on (for embedding and tests); overrides ``stream``.
        show_samples: every this many steps, print one sampled trajectory of the step (0: never).
        sample_chars: texts of a printed trajectory are cut to this many characters.
    """

    def __init__(self, ctx: "LoggerContext", *, keys: Sequence[str] | str | None = None, live: bool | None = None,
                 every: int = 1, stream: str = "stdout", console: Any = None, show_samples: int = 0,
                 sample_chars: int = 300) -> None:
        total_steps = ctx.total_steps
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(f"console logger: 'total_steps' must be a non-negative integer, got {total_steps!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"console logger: 'every' must be a positive integer, got {every!r}")
        for name, value in (("show_samples", show_samples), ("sample_chars", sample_chars)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"console logger: {name!r} must be a non-negative integer, got {value!r}")
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"console logger: 'stream' must be 'stdout' or 'stderr', got {stream!r}")
        self.total_steps: int | None = total_steps or None
        self.keys = [keys] if isinstance(keys, str) else (list(keys) if keys is not None else None)
        self.every = every
        self.show_samples = show_samples
        self.sample_chars = max(20, sample_chars)
        self._stream: IO[str] = sys.stdout if stream == "stdout" else sys.stderr
        self._console = console
        self._live = live
        self._progress: Any = None
        self._task: Any = None
        self._last_time: float | None = None
        self._closed = False

    # -------------------------------------------------------------- helpers

    def _get_console(self) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self._stream)
        return self._console

    @property
    def live(self) -> bool:
        """Whether the live bar is used (resolved on first use)."""
        if self._live is None:
            self._live = bool(self._get_console().is_terminal)
        return self._live

    def select(self, metrics: Mapping[str, Any]) -> list[str]:
        """The metric names shown for ``metrics``, in display order."""
        names = [k for k in metrics if k != "step"]
        if self.keys is None:
            chosen = [k for k in DEFAULT_KEYS if k in metrics][:MAX_DEFAULT_KEYS]
            # a held-out evaluation's headline, per source ([eval]: eval/<source>/pass@1)
            chosen += sorted(k for k in names if k.startswith("eval/") and k.endswith("/pass@1"))
            return chosen or sorted(names)[:MAX_DEFAULT_KEYS]
        chosen = []
        for key in self.keys:
            matches = sorted(fnmatch.filter(names, key)) if any(c in key for c in "*?[") else (
                [key] if key in metrics else [])
            chosen += [m for m in matches if m not in chosen]
        return chosen

    def format_metrics(self, metrics: Mapping[str, Any]) -> str:
        """``name=value`` pairs of the shown metrics (names without their ``ns/`` prefix when unique)."""
        chosen = self.select(metrics)
        shorts = [_short(k) for k in chosen]
        labels = [s if shorts.count(s) == 1 else k for k, s in zip(chosen, shorts)]
        return "  ".join(f"{label}={_fmt(metrics[k])}" for label, k in zip(labels, chosen))

    def _start_progress(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"),
            console=self._get_console(), transient=False, refresh_per_second=4,
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=self.total_steps, metrics="")

    # -------------------------------------------------------------- protocol

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._closed:
            raise RuntimeError("console logger: log() after close()")
        now = time.perf_counter()
        done = int(step) + 1
        text = self.format_metrics(metrics)
        if all(k.startswith("eval/") or k == "step" for k in metrics):  # the evaluation after the last step
            self._get_console().print(f"eval after step {int(step)}  {text}", markup=False, highlight=False,
                                      soft_wrap=True)
            return
        if self.live:
            if self._progress is None:
                self._start_progress()
            self._progress.update(self._task, completed=done, metrics=text)
        else:
            last = self.total_steps is not None and done >= self.total_steps
            if done % self.every == 0 or last or self.every == 1:
                total = f"/{self.total_steps}" if self.total_steps is not None else ""
                took = f"  {now - self._last_time:.1f}s" if self._last_time is not None else ""
                self._get_console().print(f"step {done}{total}  {text}{took}", markup=False, highlight=False,
                                          soft_wrap=True)
        self._last_time = now

    @property
    def wants_trajectories(self) -> bool:
        """Whether the host should hand this logger rollout records (only with ``show_samples``)."""
        return self.show_samples > 0

    def log_trajectories(self, step: int, records: Sequence[Mapping[str, Any]]) -> None:
        """Print one of ``step``'s trajectory records every ``show_samples`` steps (seeded by the step)."""
        if not self.show_samples or not records or (int(step) + 1) % self.show_samples:
            return
        record = random.Random(int(step)).choice(list(records))
        self._get_console().print(self.format_sample(record), markup=False, highlight=False, soft_wrap=True)

    def format_sample(self, record: Mapping[str, Any]) -> str:
        """A trajectory record as a few lines of text (docs/reference/records.md describes the fields)."""
        reward = record.get("reward") or {}
        score = reward.get("score")
        why = reward.get("reason") or reward.get("error") or ""
        head = (f"── sample of step {record.get('step')}: {record.get('source')} / {record.get('agent')} "
                f"#{record.get('index')}  {record.get('status')}  reward={_fmt(score) if score is not None else '-'}"
                + (f" ({self._cut(why)})" if why else ""))
        lines = [head, f"  prompt: {self._cut(_prompt_text(record.get('prompt')))}"]
        for k, turn in enumerate(record.get("turns") or []):
            lines.append(f"  turn {k}: {self._cut(turn.get('response_text') or '')}")
            for call in turn.get("tool_calls") or []:
                lines.append(f"    tool {call.get('name')}({self._cut(str(call.get('arguments') or ''))}) -> "
                             f"{self._cut(str(call.get('output')))}")
        if not record.get("turns"):
            lines.append(f"  response: {self._cut(record.get('response_text') or '')}")
        if record.get("error"):
            lines.append(f"  error: {self._cut(record['error'])}")
        return "\n".join(lines)

    def _cut(self, text: str) -> str:
        text = " ".join(str(text).split())  # one line per field
        return text if len(text) <= self.sample_chars else text[: self.sample_chars] + "..."

    def close(self) -> None:
        if self._progress is not None:
            self._progress.refresh()
            self._progress.stop()
            self._progress = None
        self._closed = True


def _prompt_text(prompt: Any) -> str:
    """A data row's prompt as text: a string, or the last user message of a chat prompt."""
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]) if users else str(prompt)
    return "" if prompt is None else str(prompt)
