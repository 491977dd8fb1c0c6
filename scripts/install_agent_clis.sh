#!/usr/bin/env bash
# Install the black-box agent CLIs that the agents `codex`, `claude_code` and `opencode` run, at
# pinned versions, into the project-local folder .tools/npm (binaries in .tools/npm/node_modules/.bin,
# where the agents look first). Installs nodejs/npm from apt where npm is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
CODEX_VERSION="0.171.0"
CLAUDE_CODE_VERSION="2.1.332"
OPENCODE_VERSION="1.18.33"
PREFIX="${LOONGSAGE_TOOLS_DIR:-.tools}/npm"
if ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm) >/dev/null
  else
    echo "error: npm is missing; install nodejs and npm (apt-get install nodejs npm), then rerun $0" >&2
    exit 1
  fi
fi
mkdir -p "$PREFIX"
npm install --prefix "$PREFIX" --no-audit --no-fund --loglevel=error --no-save \
  "@openai/codex@$CODEX_VERSION" \
  "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" \
  "opencode-ai@$OPENCODE_VERSION"
echo "agent CLIs installed in $PREFIX/node_modules/.bin: codex $CODEX_VERSION, claude $CLAUDE_CODE_VERSION, opencode $OPENCODE_VERSION"
