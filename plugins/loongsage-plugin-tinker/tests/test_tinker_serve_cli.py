"""``loongsage tinker-serve`` as a user starts it: a subprocess printing the variables the SDK reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.slow

KEY = "tml-a-key-chosen-by-the-user"


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           tinker_serve: Any) -> Iterator[dict[str, str]]:
    with tinker_serve(KEY, f"tiny={tiny_model_dir}", tmp_path_factory.mktemp("cli_state")) as exports:
        assert set(exports) == {"TINKER_BASE_URL", "TINKER_API_KEY"}, exports
        yield exports


def test_the_printed_variables_reach_the_service(served: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import tinker

    assert served["TINKER_API_KEY"] == KEY
    assert served["TINKER_BASE_URL"].startswith("http://127.0.0.1:")
    for name, value in served.items():
        monkeypatch.setenv(name, value)
    models = tinker.ServiceClient().get_server_capabilities().supported_models
    assert [m.model_name for m in models] == ["tiny"]


def test_a_wrong_api_key_is_refused(served: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    response = httpx.post(f"{served['TINKER_BASE_URL']}/api/v1/create_session", headers={"X-API-Key": "tml-wrong"},
                          json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"})
    assert response.status_code == 401 and "API key" in response.json()["detail"]
    ok = httpx.get(f"{served['TINKER_BASE_URL']}/api/v1/no_such_endpoint", headers={"X-API-Key": KEY})
    assert ok.status_code == 404 and "/api/v1/no_such_endpoint is not supported" in ok.json()["detail"]


def test_a_missing_model_directory_is_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "loongsage_core", "tinker-serve", "--model", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"loongsage: error: --model {tmp_path / 'nope'}: "
                                               f"{tmp_path / 'nope'} is not a Hugging Face model directory "
                                               "(no config.json)"]




def test_the_job_files_model_is_served_beside_the_command_lines(tiny_model_dir: Path, tmp_path: Path) -> None:
    from loongsage_plugin_tinker.serve import served_models

    from loongsage_core.cli import load_job_and_host

    job_file = tmp_path / "serve.toml"
    job_file.write_text(f'[plugins]\nenable = ["torch", "tinker"]\n[model]\npath = "{tiny_model_dir}"\n')
    job, _ = load_job_and_host(str(job_file))
    models = served_models(job, [f"alias={tiny_model_dir}"])
    assert models == {str(tiny_model_dir.resolve()): str(tiny_model_dir.resolve()),
                      "alias": str(tiny_model_dir.resolve())}
