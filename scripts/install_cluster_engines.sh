#!/usr/bin/env bash
# The cluster engines the test suite starts for real (tests/test_slurm.py, tests/test_mpi.py):
# SLURM with munge and Open MPI, Debian's packages (SLURM 22.05 and Open MPI 4.1 on Debian 12).
# As root it installs what is missing; otherwise it says what to install, and those tests
# skip with the same line (unless REQUIRE_CLUSTER_ENGINES=1, as in CI).
set -euo pipefail
missing=()
for pair in slurmctld:slurmctld slurmd:slurmd srun:slurm-client munged:munge mpirun:openmpi-bin; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "note: the SLURM and MPI tests need ${missing[*]} (Debian packages, installed as root)" >&2
fi
