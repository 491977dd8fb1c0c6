"""The ``loongsage`` command line: ``run``, ``eval``, ``sft``, ``validate``, ``plugins``, ``recipes``,
``serve``, ``view``, and the commands installed plugins add (:data:`COMMANDS_GROUP`).

Imports stay lazy so ``loongsage --help`` answers instantly; bad input is reported as one line
naming the file and key at fault, with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

EXIT_USAGE = 2
EXIT_RUN_FAILED = 1

COMMANDS_GROUP = "loongsage.commands"
"""Entry-point group of the subcommands plugins add. Each entry point names an object with ``help``
(one line), ``add_arguments(parser)`` and ``run(args, load) -> int``, where ``load(job, overrides)``
returns the job file (a path or recipe name) loaded, with its plugin host: ``(job, host)``. The
object's module is imported whenever the parser is built, so it must import nothing heavy."""


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="TOML job file, or a recipe name (`loongsage recipes` lists them)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override a job-file value by dotted key, e.g. train.lr=1e-5 data.0.weight=0.5")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loongsage", description="LoongSage: RL post-training for agentic LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="train: run a job file")
    _add_job_args(p)
    p.add_argument("--output-dir", help="where metrics.jsonl, checkpoints/ and config.resolved.toml go "
                                        "(default: the job's run.output_dir)")
    p.add_argument("--overwrite", action="store_true",
                   help="start fresh in a directory that holds a run: the old run is moved to <dir>.old-<time>")

    p = sub.add_parser("eval", help="the job's [eval] on a checkpoint or a model directory: a table and JSON")
    _add_job_args(p)
    p.add_argument("--checkpoint", metavar="latest|final|DIR",
                   help="what to evaluate: the run's newest checkpoint, its final_hf/, a checkpoint directory "
                        "(checkpoints/step_N) or a Hugging Face model directory (default: the job's [model])")
    p.add_argument("--run-dir", help="the run directory latest and final refer to (default: the job's run.output_dir)")
    p.add_argument("--step", type=int, help="the step a model directory stands for (its sampling seeds; default 0, "
                                            "train.total_steps for final)")
    p.add_argument("--output", default="eval_results.json", help="where the JSON goes (default: %(default)s)")

    p = sub.add_parser("sft", help="supervised fine-tuning on chat data: a job file with an [sft] table")
    _add_job_args(p)
    p.add_argument("--output-dir", help="where metrics.jsonl, checkpoints/ and final_hf/ go "
                                        "(default: the job's run.output_dir)")
    p.add_argument("--overwrite", action="store_true",
                   help="start fresh in a directory that holds a run: the old run is moved to <dir>.old-<time>")

    p = sub.add_parser("validate", help="load a job file and its plugins, resolve every component, print the result")
    _add_job_args(p)
    p.add_argument("--json", action="store_true", help="print the resolved job as JSON")

    p = sub.add_parser("plugins", help="list installed plugins and the components they provide")
    p.add_argument("--json", action="store_true", help="machine-readable listing (stable interface)")

    p = sub.add_parser("recipes", help="list the named job files (recipes) that run/validate accept by name")
    p.add_argument("--json", action="store_true", help="machine-readable listing (stable interface)")

    p = sub.add_parser("serve", help="start rollout engines and the AgentFlow router without training")
    _add_job_args(p)
    p.add_argument("--port", type=int, default=0, help="router port (default: any free port)")
    p.add_argument("--output-dir", help="where the run secret file goes (default: a new private temporary "
                                        "directory)")

    p = sub.add_parser("view", help="a local web page over run directories: metrics, trajectories, tokens")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="run directories (several are overlaid)")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any free port)")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")
    for name, command in plugin_commands().items():
        p = sub.add_parser(name, help=command.help)
        command.add_arguments(p)
        p.set_defaults(plugin_command=command)
    return parser


def plugin_commands() -> dict[str, Any]:
    """The subcommands of installed plugins (:data:`COMMANDS_GROUP`), by name; a built-in name wins."""
    from importlib.metadata import entry_points

    builtin = {"run", "eval", "sft", "validate", "plugins", "recipes", "serve", "view"}
    return {ep.name: ep.load() for ep in entry_points(group=COMMANDS_GROUP) if ep.name not in builtin}


def load_job_and_host(job: str, overrides: Sequence[str] = ()) -> tuple[Any, Any]:
    """A plugin command's job file (a path or a recipe name), loaded, and the plugin host of its
    ``[plugins]`` table."""
    from .config import load_job
    from .plugins import PluginHost
    from .recipes import find_job

    loaded = load_job(find_job(job), list(overrides))
    return loaded, PluginHost.from_job(loaded)


def _load(args: argparse.Namespace) -> Any:
    """The job file resolved: as a supervised job when it has an ``[sft]`` table (or for ``sft``)."""
    from .config import SftConfig, load_job
    from .recipes import find_job
    from .resolve import resolve_job, resolve_sft_job

    job = load_job(find_job(args.job), args.overrides)
    if args.command == "sft" and job.sft is None:
        job.sft = SftConfig()
    if job.sft is not None:
        if args.command in ("run", "serve", "eval"):
            from .config import ConfigError

            raise ConfigError(f"{job.source_path}: this job has an [sft] table: train it with "
                              f"`loongsage sft {args.job}` (or remove [sft] for an RL run)")
        return resolve_sft_job(job)
    return resolve_job(job)


def cmd_validate(args: argparse.Namespace) -> int:
    from .config import dump_job_toml, job_to_dict

    resolved = _load(args)
    if args.json:
        print(json.dumps({"job": job_to_dict(resolved.job), "components": resolved.summary()}, indent=2))
    else:
        print(dump_job_toml(resolved.job))
        print("# components")
        for key, (kind, name, plugin) in resolved.components.items():
            print(f"# {key:32s} {kind:18s} {name:20s} ({plugin})")
        print(f"{args.job}: OK")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from .plugins import PluginHost

    host = PluginHost.create()
    listing = host.describe()
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    for plugin in listing["plugins"]:
        print(f"{plugin['name']} {plugin['version']}")
        for kind, names in plugin["components"].items():
            print(f"  {kind:18s} {', '.join(names)}")
    for name, reason in host.skipped.items():
        print(f"{name} (skipped: {reason})")
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    from .recipes import list_recipes

    recipes = list_recipes()
    if args.json:
        print(json.dumps({"recipes": [r.to_dict() for r in recipes]}, indent=2))
        return 0
    width = max((len(r.name) for r in recipes), default=0)
    for r in recipes:
        print(f"{r.name:{width}s}  {r.description}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    resolved = _load(args)  # a broken job file fails before torch and Ray are imported
    from .controller.run import run_job

    run_job(resolved, output_dir=args.output_dir, overwrite=args.overwrite)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    resolved = _load(args)  # a broken job file fails before torch and Ray are imported
    from pathlib import Path

    from .controller.eval_job import evaluate_job, format_table, write_result

    result = evaluate_job(resolved, checkpoint=args.checkpoint, run_dir=args.run_dir, step=args.step)
    write_result(result, Path(args.output))
    print(format_table(result))
    print(f"wrote {args.output}")
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    resolved = _load(args)  # a broken job file fails before torch and Ray are imported
    from .sft.run import run_sft

    run_sft(resolved.job, resolved.host, output_dir=args.output_dir, overwrite=args.overwrite)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    resolved = _load(args)  # a broken job file fails before torch and Ray are imported
    from .controller.serve import serve_job

    serve_job(resolved, port=args.port, output_dir=args.output_dir)
    return 0


def cmd_view(args: argparse.Namespace) -> int:
    from .viewer import serve

    try:
        serve(args.dirs, port=args.port, open_browser=args.open)
    except OSError as exc:  # the port is taken, or not ours to bind
        print(f"loongsage: error: view: cannot listen on 127.0.0.1:{args.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return EXIT_USAGE
    return 0


COMMANDS = {"run": cmd_run, "eval": cmd_eval, "sft": cmd_sft, "validate": cmd_validate, "plugins": cmd_plugins,
            "recipes": cmd_recipes, "serve": cmd_serve, "view": cmd_view}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow options (``run job.toml --output-dir d train.lr=1e-5``)
    if extra:
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    from .errors import USER_ERRORS, RunError

    try:
        command = getattr(args, "plugin_command", None)
        if command is not None:
            return int(command.run(args, load_job_and_host))
        return COMMANDS[args.command](args)
    except USER_ERRORS as exc:
        print(f"loongsage: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunError as exc:
        print(f"loongsage: error: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except KeyboardInterrupt:
        print("loongsage: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
