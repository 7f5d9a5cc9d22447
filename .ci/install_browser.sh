#!/usr/bin/env bash
# Idempotently install Debian's Chromium and its chromedriver for tests/test_browser.py (Selenium drives the system
# browser; nothing is downloaded at test time). Fast no-op when both are installed. Run as root or with sudo.
set -euo pipefail
PKGS=(chromium chromium-driver)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then echo "install_browser.sh: already installed: ${PKGS[*]}"; exit 0; fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else echo "install_browser.sh: must run as root (or with sudo)" >&2; exit 1; fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
${SUDO:+$SUDO -E} apt-get install -y -q --no-install-recommends "${PKGS[@]}"
for b in chromium chromedriver; do command -v "$b" >/dev/null 2>&1 || { echo "install_browser.sh: $b missing after install" >&2; exit 1; }; done
echo "install_browser.sh: done"
