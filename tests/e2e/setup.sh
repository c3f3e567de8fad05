#!/usr/bin/env bash
# Installs what the VS Code end-to-end suite needs, cached under
# ${OPENCOMPOSER_E2E_CACHE:-~/.cache/opencomposer/e2e}: Debian's chromium, libkrb5-dev
# (code-server's kerberos module builds from source), code-server 4.100.3 (newer ones
# need node 24) and puppeteer-core. A second run with the cache in place does nothing.
set -euo pipefail
CACHE="${OPENCOMPOSER_E2E_CACHE:-$HOME/.cache/opencomposer/e2e}"
CS_VERSION=4.100.3
PPT_VERSION=24.43.1
mkdir -p "$CACHE"

missing=""
command -v chromium >/dev/null || missing="$missing chromium"
command -v rg >/dev/null || missing="$missing ripgrep"
dpkg -s libkrb5-dev >/dev/null 2>&1 || missing="$missing libkrb5-dev"
command -v node >/dev/null || missing="$missing nodejs"
command -v npm >/dev/null || missing="$missing npm"
command -v make >/dev/null || missing="$missing build-essential"
command -v python3 >/dev/null || missing="$missing python3"
if [ -n "$missing" ]; then
  echo "e2e: installing Debian packages:$missing"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

# @vscode/ripgrep 1.15.11 downloads rg from GitHub in its post-install; seed its cache
# with Debian's rg so no download is tried.
TMPD="$(node -e 'process.stdout.write(require("os").tmpdir())')"
RGC="$TMPD/vscode-ripgrep-cache-1.15.11"
RGT="$RGC/ripgrep-v13.0.0-10-x86_64-unknown-linux-musl.tar.gz"
if [ ! -s "$RGT" ]; then
  mkdir -p "$RGC"
  tmp="$(mktemp -d)"; cp "$(command -v rg)" "$tmp/rg"
  tar -czf "$RGT" -C "$tmp" rg; rm -rf "$tmp"
fi

if [ ! -x "$CACHE/node_modules/.bin/code-server" ] || \
   ! grep -q "\"version\": \"$CS_VERSION\"" "$CACHE/node_modules/code-server/package.json" 2>/dev/null; then
  echo "e2e: npm install code-server@$CS_VERSION puppeteer-core@$PPT_VERSION into $CACHE (several minutes)"
  cd "$CACHE"
  [ -f package.json ] || echo '{"name":"opencomposer-e2e","private":true}' > package.json
  npm_config_yes=true npm install --no-audit --no-fund --unsafe-perm=true \
    "code-server@$CS_VERSION" "puppeteer-core@$PPT_VERSION"
elif [ ! -d "$CACHE/node_modules/puppeteer-core" ]; then
  cd "$CACHE" && npm install --no-audit --no-fund "puppeteer-core@$PPT_VERSION"
fi
echo "e2e: ready ($CACHE)"
