#!/usr/bin/env bash
# Installs what test_vscode_browser.py needs from the npm registry alone: code-server (VS Code in the browser),
# @sparticuz/chromium (a headless Chromium shipped inside the package, unpacked on first use), puppeteer-core (drives
# that browser) and vsce (packages the extension).
#
# code-server's own postinstall cannot run on a machine that reaches only package registries: it downloads ripgrep
# from GitHub and builds kerberos, which needs libkrb5-dev. This script does the rest of that postinstall by hand:
# VS Code's server dependencies (from code-server's shrinkwrap) and the native modules the server and the extension
# host load, built from source with node-gyp against the installed Node's headers. Without ripgrep, VS Code's text
# search is unavailable; without kerberos, so is Kerberos proxy authentication: the test needs neither.
# code-server 4.100.3 is the newest release that runs on Node 20.
set -euo pipefail
cd "$(dirname "$0")"
export npm_config_yes=true  # node-pty's postinstall runs `npx node-gyp`
quiet=(--no-audit --no-fund --loglevel=error)
npm ci --ignore-scripts "${quiet[@]}"
npm_config_build_from_source=true npm rebuild argon2 "${quiet[@]}"
cd node_modules/code-server/lib/vscode
npm install --omit=dev --ignore-scripts "${quiet[@]}"  # its shrinkwrap is not in sync for `npm ci`
npm rebuild @vscode/spdlog node-pty native-watchdog @vscode/deviceid "${quiet[@]}"
ln -sfn node_modules node_modules.asar  # what code-server's postinstall does: VS Code looks there for its modules
