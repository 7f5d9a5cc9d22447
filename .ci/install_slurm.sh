#!/usr/bin/env bash
# Idempotently install SLURM with accounting (Debian/Ubuntu, run as root): the packages serve the one-node test
# cluster and the two-node one alike (two slurmd -N daemons named 127.0.0.1 and 127.0.0.2: no MULTIPLE_SLURMD build
# and no network namespaces needed, see tests/slurm_cluster.py two_node_names).
# Fast no-op when every package is already installed. Used by CI before pytest;
# tests/slurm_cluster.py brings the daemons up and down itself.
set -euo pipefail

PKGS=(slurm-wlm munge slurmdbd mariadb-server)

missing=()
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "install_slurm.sh: already installed: ${PKGS[*]}"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "install_slurm.sh: must run as root (or with sudo)" >&2; exit 1
    fi
fi

echo "install_slurm.sh: installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Do not let package postinst scripts start services (no systemd here / in CI containers).
policy_created=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod +x /usr/sbin/policy-rc.d
    policy_created=1
fi
cleanup() { if [ "$policy_created" -eq 1 ]; then $SUDO rm -f /usr/sbin/policy-rc.d; fi; }
trap cleanup EXIT

$SUDO apt-get update -q
${SUDO:+$SUDO -E} apt-get install -y -q --no-install-recommends "${PKGS[@]}"

for b in slurmctld slurmd slurmdbd munged sbatch srun sacct sacctmgr mariadbd mariadb-install-db; do
    command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || { echo "install_slurm.sh: $b missing after install" >&2; exit 1; }
done
echo "install_slurm.sh: done"
