#!/usr/bin/env bash
# promtool, Prometheus's rule checker, from Debian's prometheus package, for tests/test_gates.py (`promtool check
# rules` and `promtool test rules` on monitoring/alerts.yaml). Only the one static binary is unpacked (dpkg -x) into
# the venv's bin, which `make test` puts on PATH: no daemon, no service, no root needed where apt's lists exist.
# Idempotent and quiet: a no-op when promtool is already there.
# --if-possible (make test): where it cannot (no apt-get, no lists and not root), say which test will skip and exit 0.
set -euo pipefail
if_possible=0
[ "${1:-}" = "--if-possible" ] && if_possible=1
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=${VENV:-.venv}/bin

if command -v promtool >/dev/null 2>&1 || [ -x "$BIN/promtool" ]; then
  exit 0
fi
cannot() {
  if [ "$if_possible" -eq 1 ]; then
    echo "[test] no promtool here ($1): the promtool test of tests/test_gates.py will skip. To run it: $0"
    exit 0
  fi
  echo "error: cannot install promtool: $1. Fix: run $0 as root on a Debian machine, or put promtool on PATH" >&2
  exit 2
}
command -v apt-get >/dev/null 2>&1 || cannot "no apt-get"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1); then
  [ "$(id -u)" -eq 0 ] || cannot "apt has no package lists and this is not root"
  apt-get update -qq || cannot "apt-get update failed (no network?)"
  (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1) || cannot "apt-get download prometheus failed"
fi
dpkg -x "$tmp"/prometheus_*.deb "$tmp/x"
mkdir -p "$BIN"
cp "$tmp/x/usr/bin/promtool" "$BIN/promtool"
echo "install_promtool: $("$BIN/promtool" --version 2>&1 | head -1) -> $BIN/promtool"
