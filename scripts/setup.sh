#!/usr/bin/env bash
# Set up a virtual environment in .venv with every LoongSage package (editable) and the test tools.
# Needs only Python 3.10+ and pip with access to the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.11 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi
# the local sandbox isolates agent commands with bubblewrap (read-only root, no network)
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) >/dev/null \
    || echo "warning: could not install bubblewrap; the local sandbox will enforce less" >&2
fi
# the run viewer's browser tests drive Debian's chromium through its chromedriver (Selenium)
if ! { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) >/dev/null \
    || echo "warning: could not install chromium; the run viewer's browser tests will fail" >&2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
# Megatron-Core backend: megatron-bridge declares GPU-only packages it does not need here
PYTHON=.venv/bin/python bash scripts/install_megatron.sh
# tinker-cookbook, whose recipes run against `loongsage tinker-serve` (the plugin's cookbook test): its
# imports pinned, then the cookbook without its declared tml-renderers>=0.4.1 (`pip check` reports that
# one pin only; its recipes run with tml-renderers 0.2.1)
.venv/bin/python -m pip install -q --disable-pip-version-check -r plugins/loongsage-plugin-tinker/requirements-cookbook.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps tinker-cookbook==0.6.1 tml-renderers==0.2.1
# the black-box agent CLIs (agents `codex`, `claude_code`, `opencode`), pinned, into .tools/npm
bash scripts/install_agent_clis.sh || echo "warning: could not install the agent CLIs; see scripts/install_agent_clis.sh" >&2
echo "LoongSage installed in .venv ($(.venv/bin/python --version))"
