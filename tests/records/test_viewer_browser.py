"""The run viewer in a real headless browser (Debian's chromium + chromium-driver, driven by Selenium).

The page is loaded from a viewer serving a run made in this test session; the test reads what a
person would see: the overview curves drawn by uPlot, a step's trajectory table, a trajectory with
its tokens coloured by loss mask and advantage, and no error in the browser console. A screenshot
of each page is saved under the test's tmp directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loongsage_core.records import read_rollouts, rollout_steps
from loongsage_core.viewer import ViewerServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser(slow_fixture):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail("chromium and chromium-driver are needed (scripts/setup.sh installs them with apt)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--no-proxy-server"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def wait_for(driver, script: str, timeout: float = 30.0):
    """Poll a JavaScript expression until it is truthy; returns its value."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(lambda d: d.execute_script(f"return {script}"))


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]


@pytest.fixture
def served(recorded_run, browser):
    servers: list[ViewerServer] = []

    def serve(*dirs: Path) -> str:
        server = ViewerServer([str(d) for d in dirs])
        servers.append(server)
        return server.start()

    yield serve
    # leave the page before its server stops: a page still open would poll the stopped server, and
    # the browser (shared by the module's tests) would log that as an error of the next test
    browser.get("about:blank")
    browser.get_log("browser")
    for s in servers:
        s.stop()


def test_overview_draws_the_curves_of_overlaid_runs(browser, served, recorded_run, tmp_path):
    run = recorded_run["dir"]
    url = served(run, run)  # the same run twice stands for two runs overlaid
    browser.get(url)
    wait_for(browser, "document.querySelectorAll('#charts .uplot').length >= 4")
    titles = browser.execute_script(
        "return [...document.querySelectorAll('#charts .chart')].filter(c => c.querySelector('.uplot'))"
        ".map(c => c.dataset.title)")
    for wanted in ("Reward (mean)", "Train-inference gap: train/is_approx_k3_kl", "Response length (mean tokens)",
                   "Timing per phase (s)"):
        assert wanted in titles
    # each curve has one series per run, with the run's values at steps 0 and 1
    legend = browser.execute_script(
        "return [...document.querySelector('[data-title=\"Reward (mean)\"] .u-legend').querySelectorAll('.u-label')]"
        ".map(e => e.textContent)")
    name = f"{run.parent.name}/{run.name}"  # the same directory name twice: told apart by the parent
    assert legend == ["step", f"{name} reward_mean", f"{name} reward_mean"]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert wait_for(browser, "document.querySelectorAll('#charts canvas').length") >= 4
    timing_series = browser.execute_script(
        "return [...document.querySelector('[data-title=\"Timing per phase (s)\"] .u-legend')"
        ".querySelectorAll('.u-label')].map(e => e.textContent)")
    assert any("rollout" in s for s in timing_series) and any("train" in s for s in timing_series)
    assert "2/2 steps" in browser.find_element("id", "runs").text and len(metrics) == 2
    assert "all runs finished" in wait_for(browser, "document.getElementById('live').textContent")
    browser.save_screenshot(str(tmp_path / "overview.png"))
    assert (tmp_path / "overview.png").stat().st_size > 10_000
    assert console_errors(browser) == []


def test_step_table_filters_and_a_trajectory_shows_coloured_tokens(browser, served, recorded_run, tmp_path):
    run = recorded_run["dir"]
    records = read_rollouts(run, 1)
    url = served(run)
    browser.get(url + "#/step/0/1")
    wait_for(browser, "document.querySelectorAll('#traj-table tbody tr').length === 9")
    # filter by status: the failed ones are the flaky source's, as in the records
    browser.execute_script("const s = document.getElementById('step-status'); s.value = 'failed';"
                           "s.dispatchEvent(new Event('change'))")
    failed = [r["index"] for r in records if r["status"] == "failed"]
    rows = wait_for(browser, "[...document.querySelectorAll('#traj-table tbody tr')].map(r => +r.dataset.index)")
    assert sorted(rows) == sorted(failed) and failed
    browser.execute_script("const s = document.getElementById('step-status'); s.value = '';"
                           "s.dispatchEvent(new Event('change'));"
                           "const o = document.getElementById('step-sort'); o.value = '-reward';"
                           "o.dispatchEvent(new Event('change'))")
    shown = browser.execute_script("return [...document.querySelectorAll('#traj-table tbody tr')]"
                                   ".map(r => +r.dataset.index)")
    by_reward = sorted(records, key=lambda r: (-(r["reward"]["score"] if r["reward"] else float("-inf")), r["index"]))
    assert shown == [r["index"] for r in by_reward]  # ties keep the sample order
    browser.save_screenshot(str(tmp_path / "step.png"))

    # a tool-agent trajectory: its tokens coloured by loss mask, then by advantage
    tool = next(r for r in records if r["source"] == "tools" and r["trained"])
    browser.find_element("css selector", f"#traj-table tbody tr[data-index='{tool['index']}']").click()
    wait_for(browser, "document.querySelectorAll('#traj-tokens .tok').length > 0")
    spans = browser.execute_script(
        "return [...document.querySelectorAll('#traj-tokens .tok')].map(s => [s.classList.contains('m1'),"
        " s.style.backgroundColor])")
    mask = [m for seg in tool["segments"] for m in seg["loss_mask"]]
    assert len(spans) == len(mask)
    assert [int(m) for m, _ in spans] == mask
    assert all((bg != "") == bool(m) for m, bg in spans)  # trained tokens coloured, the others not
    assert {bg for m, bg in spans if m} == {"rgba(46, 160, 67, 0.3)"}
    text = browser.find_element("id", "traj-turns").text
    assert "tool call add" in text and text.count("output (sandbox / tool)") == 2
    assert "3" in browser.find_element("css selector", "#traj-turns .tool-output").text
    browser.save_screenshot(str(tmp_path / "trajectory.png"))
    assert (tmp_path / "trajectory.png").stat().st_size > 10_000

    # colour by advantage: green where it is positive, red where negative (a trajectory that has both
    # signs or at least one non-zero advantage)
    moved = next(r for r in records if r["trained"] and any(a for s in r["segments"] for a in s.get("advantages", [])))
    browser.get(url + f"#/traj/0/1/{moved['index']}")
    wait_for(browser, f"document.querySelector('#traj-head') && "
                      f"document.querySelector('#traj-head').textContent.includes('{moved['id']}')")
    for part in ("traj-nav", "traj-reward"):  # optional parts left out, not written as "null"
        assert "null" not in browser.find_element("id", part).text
    browser.execute_script("const s = document.getElementById('traj-colour'); s.value = 'advantage';"
                           "s.dispatchEvent(new Event('change'))")
    adv = [a for seg in moved["segments"] for a, m in zip(seg.get("advantages") or [0.0] * len(seg["tokens"]),
                                                         seg["loss_mask"]) if m]
    colours = browser.execute_script("return [...document.querySelectorAll('#traj-tokens .tok.m1')]"
                                     ".map(s => s.style.backgroundColor)")
    assert len(colours) == len(adv)
    for c, a in zip(colours, adv):
        assert c.startswith("rgba(46, 160, 67" if a > 0 else "rgba(215, 58, 73" if a < 0 else "rgba(140, 150, 165")
    browser.execute_script("const s = document.getElementById('traj-colour'); s.value = 'gap';"
                           "s.dispatchEvent(new Event('change'))")
    gaps = browser.execute_script("return [...document.querySelectorAll('#traj-tokens .tok.m1')]"
                                  ".map(s => s.style.backgroundColor)")
    assert len(gaps) == len(adv) and all(g.startswith("rgba(255, 140, 0") for g in gaps)
    browser.save_screenshot(str(tmp_path / "advantage.png"))
    assert console_errors(browser) == []


def test_a_truncated_records_file_and_a_run_still_being_written(browser, served, recorded_run, tmp_path):
    src = recorded_run["dir"]
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(src / "config.resolved.toml", live)
    lines = (src / "metrics.jsonl").read_text().splitlines()
    (live / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:40])  # step 1's line half written
    (live / "rollouts").mkdir()
    data = (src / "rollouts" / "step_000000.jsonl.gz").read_bytes()
    (live / "rollouts" / "step_000000.jsonl.gz").write_bytes(data[: len(data) * 2 // 3])
    url = served(live)
    browser.get(url + "#/step/0/0")
    problem = wait_for(browser, "!document.getElementById('step-problem').hidden && "
                                "document.getElementById('step-problem').textContent")
    assert "step_000000.jsonl.gz: truncated after" in problem
    shown = len(browser.find_elements("css selector", "#traj-table tbody tr"))
    assert 0 < shown < 9
    assert "1/2 steps" in browser.find_element("id", "runs").text
    assert "live" in browser.find_element("id", "runs").text

    # the run goes on: step 1 is written whole, with its records; the page follows
    (live / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n")
    shutil.copy(src / "rollouts" / "step_000001.jsonl.gz", live / "rollouts")
    wait_for(browser, "document.getElementById('runs').textContent.includes('2/2 steps')", timeout=20)
    wait_for(browser, "[...document.querySelectorAll('#step-step option')].some(o => o.value === '1')")
    browser.get(url + "#/overview")
    wait_for(browser, "document.querySelectorAll('#charts .uplot').length >= 4")
    browser.save_screenshot(str(tmp_path / "live.png"))
    assert console_errors(browser) == []
    assert rollout_steps(live) == [0, 1]


def test_view_refuses_what_is_not_a_run(tmp_path):
    import subprocess
    import sys

    (tmp_path / "empty").mkdir()
    for target, message in ((tmp_path / "empty", "not a LoongSage run directory"),
                            (tmp_path / "missing", "no such directory")):
        done = subprocess.run([sys.executable, "-m", "loongsage_core", "view", str(target)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2
        assert done.stderr.strip() == f"loongsage: error: {target}: {message}" + (
            " (no metrics.jsonl, rollouts/ or config.resolved.toml)" if "not a" in message else "")


def test_a_trajectory_tree_shows_where_each_segment_forked(browser, tree_run, tmp_path):
    run = tree_run["dir"]
    record = read_rollouts(run, 0)[0]
    segs = record["segments"]
    server = ViewerServer([str(run)])
    url = server.start()
    try:
        browser.get(url + f"#/traj/0/0/{record['index']}")
        wait_for(browser, "document.querySelectorAll('#traj-tokens .segment').length === 3")
        shown = browser.execute_script(
            "return [...document.querySelectorAll('#traj-tokens .segment')].map(s => [s.querySelector('.seg-head')"
            ".textContent, getComputedStyle(s).marginLeft, s.querySelectorAll('.tok.shared').length])")
        head, indent, shared = zip(*shown)
        assert head[0].startswith("segment 0 · ") and "forked" not in head[0]
        for s in (1, 2):
            assert head[s].startswith(f"segment {s} · forked from segment 0 at token {segs[s]['fork_at']} "
                                      "(request does not repeat the recorded conversation) · ")
        assert indent == ("0px", "24px", "24px")  # the forked segments one level under their parent
        assert shared == (0, segs[1]["fork_at"], segs[2]["fork_at"])  # their shared tokens are marked
        browser.save_screenshot(str(tmp_path / "tree.png"))
        assert console_errors(browser) == []
    finally:
        browser.get("about:blank")
        browser.get_log("browser")
        server.stop()
