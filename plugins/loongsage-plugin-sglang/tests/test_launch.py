"""The SGLang command line built from a job file, its errors, and the server's start-up failure paths."""

from __future__ import annotations

import json
import socket
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from loongsage_plugin_sglang.launch import LaunchConfigError, build_launch_command, engine_args_to_flags
from loongsage_plugin_sglang.process import ManagedProcess, ServerStartError, redact_command
from loongsage_plugin_sglang.router import SGLangRouterProcess
from loongsage_plugin_sglang.server import (
    INSTALL_HINT,
    SGLangNotInstalled,
    SGLangServer,
    sglang_command,
    sglang_flag_error,
)

from loongsage_core.config import load_job
from loongsage_core.rendezvous import retry_on_port_collision
from loongsage_hookspecs import EngineContext


def write_job(tmp_path: Path, engine_args: str = "", model: str = 'path = "models/qwen3-tiny"') -> Path:
    (tmp_path / "models" / "qwen3-tiny").mkdir(parents=True, exist_ok=True)
    job = tmp_path / "job.toml"
    job.write_text(textwrap.dedent(f"""
        [model]
        {model}
        dtype = "bfloat16"

        [rollout]
        engine = "sglang"
        max_context_length = 4096
        {engine_args}

        [run]
        seed = 7
    """))
    return job


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def test_command_from_a_job_file_with_pass_through_args(tmp_path):
    path = write_job(tmp_path)
    path.write_text(path.read_text() + textwrap.dedent("""
        [rollout.engine_args]
        mem_fraction_static = 0.55
        enable_memory_saver = true
        disable_radix_cache = false
        cuda_graph_bs = [1, 2, 4]
        attention-backend = "fa3"
        tp_size = 2
        json_model_override_args = { rope_scaling = { factor = 2.0 } }
        startup_timeout_s = 30
        log_dir = "logs"
    """))
    job = load_job(path)
    argv = sglang_command(job, port=31234, engine_index=3)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert flag_value(argv, "--model-path") == str(tmp_path / "models" / "qwen3-tiny")
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "31234"
    assert flag_value(argv, "--dtype") == "bfloat16"
    assert flag_value(argv, "--context-length") == "4096"
    assert flag_value(argv, "--random-seed") == "10"  # run seed 7 + engine index 3
    assert flag_value(argv, "--tp-size") == "2"
    assert flag_value(argv, "--weight-version") == "0"
    assert flag_value(argv, "--mem-fraction-static") == "0.55"
    assert flag_value(argv, "--attention-backend") == "fa3"
    assert "--enable-memory-saver" in argv
    i = argv.index("--enable-memory-saver")
    assert i == len(argv) - 1 or argv[i + 1].startswith("--")  # a bare flag
    assert "--disable-radix-cache" not in argv  # false leaves the flag out
    i = argv.index("--cuda-graph-bs")
    assert argv[i + 1:i + 4] == ["1", "2", "4"]
    assert json.loads(flag_value(argv, "--json-model-override-args")) == {"rope_scaling": {"factor": 2.0}}
    # launcher options never reach SGLang
    assert not any(a.startswith(("--startup-timeout", "--log-dir", "--env")) for a in argv)
    assert "--tokenizer-path" not in argv


def test_seed_and_weight_version_overrides_and_tokenizer_directory(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    job = load_job(write_job(tmp_path, 'engine_args = { random_seed = 99, weight_version = "init" }',
                             model='path = "models/qwen3-tiny"\ntokenizer = "tok/tokenizer.json"'))
    argv = sglang_command(job, port=40000, engine_index=1)
    assert flag_value(argv, "--random-seed") == "99"
    assert flag_value(argv, "--weight-version") == "init"
    assert flag_value(argv, "--tokenizer-path") == str(tok)  # a tokenizer file -> its directory


@pytest.mark.parametrize(("engine_args", "message"), [
    ('engine_args = { port = 1 }', "engine_args.port is set by LoongSage"),
    ('engine_args = { model_path = "x" }', "[model] path"),
    ('engine_args = { context-length = 8 }', "[rollout] max_context_length"),
    ('engine_args = { dtype = "half" }', "[model] dtype"),
    ('engine_args = { tp_size = 0 }', "engine_args.tp_size must be a positive integer"),
    ('engine_args = { tp_size = "2" }', "engine_args.tp_size must be a positive integer"),
    ('engine_args = { random_seed = 1.5 }', "engine_args.random_seed must be an integer"),
    ('engine_args = { cuda_graph_bs = [] }', "engine_args.cuda_graph_bs is an empty list"),
    ('engine_args = { cuda_graph_bs = [1, true] }', "engine_args.cuda_graph_bs[1]"),
    ('engine_args = { cuda_graph_bs = [[1]] }', "engine_args.cuda_graph_bs[0]"),
    ('engine_args = { "bad key" = 1 }', "invalid key 'bad key'"),
    ('engine_args = { when = 1979-05-27 }', "engine_args.when holds a date"),
    ('engine_args = { startup_timeout_s = -1 }', "engine_args.startup_timeout_s must be a positive number"),
    ('engine_args = { env = { A = 1 } }', "engine_args.env must be a table of string values"),
])
def test_bad_engine_args_name_the_key(tmp_path, engine_args, message):
    job = load_job(write_job(tmp_path, engine_args))
    with pytest.raises(LaunchConfigError) as err:
        sglang_command(job, port=30000)
    assert message in str(err.value)
    assert str(tmp_path / "job.toml") in str(err.value)  # the job file is named


def test_inline_model_config_is_refused(tmp_path):
    job = load_job(write_job(tmp_path, model='config = { model_type = "qwen3" }'))
    with pytest.raises(LaunchConfigError, match=r"needs \[model\] path"):
        build_launch_command(job, port=30000)


def test_flags_of_a_plain_mapping():
    assert engine_args_to_flags({"log_level": "warning", "skip_server_warmup": True, "max_running_requests": 8,
                                 "enable_metrics": False, "chunked_prefill_size": None}) == [
        "--log-level", "warning", "--skip-server-warmup", "--max-running-requests", "8"]


def test_start_without_sglang_raises_the_install_hint(tmp_path):
    job = load_job(write_job(tmp_path))
    server = SGLangServer(EngineContext(job=job, components=None, engine_index=0))
    with pytest.raises(SGLangNotInstalled) as err:
        server.start()
    assert INSTALL_HINT in str(err.value) and sys.executable in str(err.value)
    assert server.process is None  # nothing was launched
    server.shutdown()  # harmless after a failed start


STANDIN_SERVER_ARGS = """
class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        for flag in ("--model-path", "--tokenizer-path", "--host", "--dtype", "--weight-version", "--log-level",
                     "--attention-backend"):
            parser.add_argument(flag)
        for flag in ("--port", "--context-length", "--random-seed", "--tp-size"):
            parser.add_argument(flag, type=int)
        parser.add_argument("--mem-fraction-static", type=float)
        parser.add_argument("--grammar-backend", choices=["xgrammar", "outlines", "llguidance", "none"])
        for flag in ("--enable-memory-saver", "--skip-server-warmup", "--disable-cuda-graph"):
            parser.add_argument(flag, action="store_true")
"""


def test_the_installed_sglangs_own_parser_judges_the_flags_before_a_start(tmp_path, monkeypatch):
    # SGLang does not install on this CPU machine: a package with its ServerArgs.add_cli_args entry
    # point (a few of the real release's flags) stands in for it
    pkg = tmp_path / "site" / "sglang" / "srt"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "server_args.py").write_text(STANDIN_SERVER_ARGS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))  # for the probe, a process of its own
    monkeypatch.syspath_prepend(str(tmp_path / "site"))  # for the "is SGLang installed" check here
    good = load_job(write_job(tmp_path, "engine_args = { mem_fraction_static = 0.5 }"), ["placement.offload=false"])
    assert sglang_flag_error(sys.executable, sglang_command(good, port=30000)[3:]) is None
    unknown = load_job(write_job(tmp_path, "engine_args = { enable_flux_capacitor = true }"))
    assert sglang_flag_error(sys.executable, sglang_command(unknown, port=30000)[3:]) == \
        "unrecognized arguments: --enable-flux-capacitor"
    wrong = load_job(write_job(tmp_path, 'engine_args = { mem_fraction_static = "most" }'))
    assert "--mem-fraction-static: invalid float value: 'most'" in sglang_flag_error(
        sys.executable, sglang_command(wrong, port=30000)[3:])
    server = SGLangServer(EngineContext(job=unknown, components=None, engine_index=0, api_key="s3cret"))
    with pytest.raises(LaunchConfigError, match="the installed SGLang refuses the launch command built from "
                                                r"\[model\] / \[rollout\].*--enable-flux-capacitor") as err:
        server.start()
    assert "s3cret" not in str(err.value) and server.process is None  # refused before anything was launched


def test_a_server_that_exits_reports_its_log_tail(tmp_path):
    proc = ManagedProcess([sys.executable, "-c", "import sys; print('loading weights failed: no such file'); "
                           "sys.exit(3)"], name="test server", log_path=tmp_path / "s.log")
    proc.start()
    with socket.socket() as closed:  # bound, never listening: nothing can answer at this address
        closed.bind(("127.0.0.1", 0))
        with pytest.raises(ServerStartError) as err:
            proc.wait_healthy(f"http://127.0.0.1:{closed.getsockname()[1]}", timeout_s=30)
    text = str(err.value)
    assert "exited with status 3" in text and "loading weights failed: no such file" in text
    assert str(tmp_path / "s.log") in text


def test_health_wait_timeout_and_group_shutdown(tmp_path):
    # a real HTTP server whose child process shares its process group
    code = ("import subprocess, sys, http.server\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "open(sys.argv[1], 'w').write(str(child.pid))\n"
            "http.server.test(HandlerClass=http.server.SimpleHTTPRequestHandler, port=int(sys.argv[2]), "
            "bind='127.0.0.1')\n")
    pid_file = tmp_path / "child.pid"

    def launch(port: int) -> tuple[ManagedProcess, int]:
        proc = ManagedProcess([sys.executable, "-c", code, str(pid_file), str(port)], name="http server",
                              log_path=tmp_path / f"h{port}.log", cwd=str(tmp_path))
        # the first path never answers, the second does: waiting falls through to it
        proc.launch(f"http://127.0.0.1:{port}", ("/no-such-path", "/"), timeout_s=60)
        return proc, port

    proc, port = retry_on_port_collision(launch, where="http server")  # the child binds the port itself
    try:
        with pytest.raises(ServerStartError, match="did not answer /no-such-path"):
            proc.wait_healthy(f"http://127.0.0.1:{port}", ("/no-such-path",), timeout_s=3)
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
        child = int(pid_file.read_text())
    finally:
        proc.stop(grace_s=5)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        state = Path(f"/proc/{child}/stat").read_text().split()[2] if Path(f"/proc/{child}/stat").exists() else "X"
        if state == "Z":
            break
        time.sleep(0.05)
    alive = Path(f"/proc/{child}/stat").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z"
    assert not alive, "the server's child survived shutdown"
    assert not proc.running()


def test_memory_saver_follows_colocated_offload(tmp_path):
    colocated = load_job(write_job(tmp_path))  # placement.colocate and placement.offload default to true
    assert "--enable-memory-saver" in sglang_command(colocated, port=30000)
    for overrides in (["placement.colocate=false"], ["placement.offload=false"]):
        assert "--enable-memory-saver" not in sglang_command(load_job(write_job(tmp_path), overrides), port=30000)
    kept = load_job(write_job(tmp_path, "engine_args = { enable_memory_saver = true }"))
    assert sglang_command(kept, port=30000).count("--enable-memory-saver") == 1
    refused = load_job(write_job(tmp_path, "engine_args = { enable_memory_saver = false }"))
    with pytest.raises(LaunchConfigError, match="placement.offload = false"):
        sglang_command(refused, port=30000)


def test_fp32_lm_head_reaches_sglang(tmp_path):
    assert "--enable-fp32-lm-head" not in sglang_command(load_job(write_job(tmp_path)), port=30000)
    fp32 = load_job(write_job(tmp_path), ["model.fp32_lm_head=true"])
    assert sglang_command(fp32, port=30000).count("--enable-fp32-lm-head") == 1
    refused = load_job(write_job(tmp_path, "engine_args = { enable_fp32_lm_head = false }"),
                       ["model.fp32_lm_head=true"])
    with pytest.raises(LaunchConfigError, match="set model.fp32_lm_head = false"):
        sglang_command(refused, port=30000)


def test_router_replay_launches_sglang_able_to_return_routed_experts(tmp_path):
    plain = load_job(write_job(tmp_path))
    assert "--enable-return-routed-experts" not in sglang_command(plain, port=30000)
    replay = load_job(write_job(tmp_path), ["algorithm.router_replay=true"])
    assert sglang_command(replay, port=30000).count("--enable-return-routed-experts") == 1
    refused = load_job(write_job(tmp_path, "engine_args = { enable_return_routed_experts = false }"),
                       ["algorithm.router_replay=true"])
    with pytest.raises(LaunchConfigError, match="enable_return_routed_experts = False, but \\[algorithm\\] "
                                                "router_replay = true"):
        sglang_command(refused, port=30000)


def test_the_run_secret_becomes_api_key_and_admin_api_key_and_is_masked_in_logs(tmp_path):
    import argparse

    # a URL-safe token starts with "-" one time in 64: passed as "--api-key VALUE" the servers'
    # argument parsers took it for an option and exited with status 2
    secret = "-s3cret"
    job = load_job(write_job(tmp_path))
    server = SGLangServer(EngineContext(job=job, components=None, engine_index=0, api_key=secret))
    argv = server.command
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key")
    parser.add_argument("--admin-api-key")
    parsed, _ = parser.parse_known_args(argv)
    assert parsed.api_key == secret and parsed.admin_api_key == secret
    assert secret not in " ".join(redact_command(argv)) and "--api-key=***" in redact_command(argv)
    assert "s3cret" not in " ".join(redact_command(["srv", "--api-key", "s3cret"]))  # the spaced form too
    assert not any(a.startswith("--api-key") for a in SGLangServer(EngineContext(job=job, components=None)).command)
    router = SGLangRouterProcess(["http://127.0.0.1:1"], api_key=secret)
    assert parser.parse_known_args(router.command)[0].api_key == secret
    proc = ManagedProcess([sys.executable, "-c", "import sys; sys.exit(2)", "--api-key", "s3cret"], name="t",
                          log_path=tmp_path / "t.log")
    proc.start()
    with socket.socket() as closed, pytest.raises(ServerStartError) as err:  # bound, never listening
        closed.bind(("127.0.0.1", 0))
        proc.wait_healthy(f"http://127.0.0.1:{closed.getsockname()[1]}", timeout_s=30)
    assert "s3cret" not in str(err.value) and "s3cret" not in (tmp_path / "t.log").read_text()


def test_server_and_router_listen_on_the_address_given_and_beyond_loopback_only_with_the_secret(tmp_path):
    job = load_job(write_job(tmp_path))
    server = SGLangServer(EngineContext(job=job, components=None, engine_index=3, host="192.0.2.7", port=31999,
                                        api_key="s3cret"))
    assert server.command[server.command.index("--host") + 1] == "192.0.2.7"
    with pytest.raises(ValueError, match="^sglang server \\(engine 3\\): refusing to listen on 192.0.2.7 "
                                         "\\(beyond loopback\\) without the run secret"):
        SGLangServer(EngineContext(job=job, components=None, engine_index=3, host="192.0.2.7"))
    router = SGLangRouterProcess(["http://192.0.2.7:1"], host="192.0.2.7", port=31998, api_key="s3cret")
    assert router.command[router.command.index("--host") + 1] == "192.0.2.7"
    with pytest.raises(ValueError, match="^sglang router: refusing to listen on 0.0.0.0"):
        SGLangRouterProcess(["http://192.0.2.7:1"], host="0.0.0.0", port=31998)


@pytest.mark.parametrize("key", ["api_key", "admin-api-key"])
def test_engine_args_cannot_set_the_api_keys(tmp_path, key):
    job = load_job(write_job(tmp_path, engine_args=f'engine_args = {{ "{key}" = "mine" }}'))
    with pytest.raises(LaunchConfigError, match="run secret"):
        build_launch_command(job, port=30000)


def test_lora_runs_launch_with_lora_enabled_and_a_weights_backup(tmp_path):
    plain = sglang_command(load_job(write_job(tmp_path)), port=30000)
    assert "--enable-lora" not in plain and "--enable-weights-cpu-backup" not in plain
    job = load_job(write_job(tmp_path), ["train.lora={rank=16, target_modules=[\"q_proj\", \"v_proj\"]}"])
    argv = sglang_command(job, port=30000)
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "16"
    assert argv[argv.index("--lora-target-modules") + 1: argv.index("--lora-target-modules") + 3] == ["q_proj",
                                                                                                     "v_proj"]
    # colocated with offload: only the adapter comes back after training, so the base weights are kept
    assert "--enable-weights-cpu-backup" in argv
    apart = sglang_command(load_job(write_job(tmp_path), ["train.lora={rank=4}", "placement.colocate=false"]),
                           port=30000)
    assert "--enable-weights-cpu-backup" not in apart
    assert apart[apart.index("--lora-target-modules") + 1] == "all"  # "all-linear" is SGLang's "all"


def test_sglang_decodes_constrained_turns_with_llguidance_unless_told_otherwise(tmp_path):
    """The router's forced tool calls are Lark grammars in llguidance's syntax, and the trainer
    replays llguidance's masks: SGLang is launched with the same grammar backend by default."""
    argv = sglang_command(load_job(write_job(tmp_path)), port=30000)
    assert argv[argv.index("--grammar-backend") + 1] == "llguidance"
    argv = sglang_command(load_job(write_job(tmp_path, 'engine_args = { grammar_backend = "xgrammar" }')), port=30000)
    assert argv[argv.index("--grammar-backend") + 1] == "xgrammar" and argv.count("--grammar-backend") == 1
