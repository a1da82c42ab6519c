#!/usr/bin/env bash
# Install Slurm (controller, node daemon, client tools) and munge from Debian, for tests/test_slurm.py.
# Idempotent and quiet: a no-op when the commands are already there. Needs root (CI runs as root).
# Installing does not leave daemons running: the test starts its own throw-away cluster and stops it by PID.
# --if-possible (make test): where it cannot install (not root, no apt-get), say which tests will skip and the
# command that adds them, and exit 0.
set -euo pipefail
if_possible=0
[ "${1:-}" = "--if-possible" ] && if_possible=1

need=()
for cmd in slurmctld slurmd sbatch munged; do
  command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd")
done
if [ "${#need[@]}" -eq 0 ]; then
  exit 0
fi
if [ "$if_possible" -eq 1 ] && { [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; }; then
  echo "[test] no Slurm here (missing ${need[*]}): the tests of tests/test_slurm.py will skip. To run them: sudo $0"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "error: missing ${need[*]}; installing Slurm needs root. Fix: sudo $0" >&2
  exit 2
fi
echo "install_slurm: installing Slurm and munge from Debian for tests/test_slurm.py (apt-get; once)"
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d exit 101 stops the package scripts from starting munge/slurm services in a container or CI
# machine: the test runs its own daemons. Removed again only if we created it.
created_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  created_policy=1
fi
trap '[ "$created_policy" -eq 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
echo "install_slurm: installed slurm $(dpkg-query -W -f='${Version}' slurmctld), munge $(dpkg-query -W -f='${Version}' munge)"
