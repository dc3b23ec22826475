"""The cluster engines the tests start for real: a one-node SLURM of this machine (munge,
slurmctld, slurmd; its configuration, state, logs and sockets in a temporary folder, its
daemons stopped by pid) and Open MPI's mpirun. Where they are not installed the tests
that need them skip with one line naming the install command, unless
REQUIRE_CLUSTER_ENGINES is set (CI sets it: .ci/run installs them)."""

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from largebatch_jax.launch import free_port
from tests.runs import ROOT, env

INSTALL = "bash scripts/install_cluster_engines.sh (as root)"


def cpu_devices(count: int) -> dict[str, str]:
    """The environment of a process with `count` CPU devices and gloo collectives."""
    return {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
    }


# 2 processes x 2 CPU devices: the real-engine runs (a run of 2 x 4 takes about 15% more
# time here, more gloo ranks on 2 cores; exact mode gives every layout the same bits).
TWO_BY_TWO = cpu_devices(2)
# What SLURM itself prints about a job step (not the program's lines).
SLURM_LINE = re.compile(r"^(srun: |slurmstepd(-\S+)?: )")


def need(*commands: str) -> None:
    """Skip (or fail, under REQUIRE_CLUSTER_ENGINES) unless `commands` are installed and
    this is root (slurmd starts the tasks; munged and slurmctld run as root here)."""
    missing = [c for c in commands if shutil.which(c) is None]
    why = ""
    if missing:
        why = f"{', '.join(missing)} not installed: {INSTALL}"
    elif os.geteuid() != 0:
        why = "the SLURM and MPI tests start their daemons as root"
    if why and os.environ.get("REQUIRE_CLUSTER_ENGINES"):
        pytest.fail(f"REQUIRE_CLUSTER_ENGINES is set but {why}")
    if why:
        pytest.skip(why)


CONF = """\
ClusterName=tests
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/socket,cred_expire=5
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
FirstJobId={first_job}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
{gres_types}
NodeName=localhost NodeAddr=127.0.0.1 CPUs=16 {gres} State=UNKNOWN
PartitionName=tests Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Slurm:
    """A one-node SLURM cluster of this machine with 16 CPUs (more than the cores, so that
    steps run side by side) and, where device nodes can be made, 8 GPUs: character
    devices that no driver backs, so that SLURM's own GPU binding (CUDA_VISIBLE_DEVICES,
    SLURM_*GPUS*) is what the tasks see. Its own ports, munge socket and job ids: a
    system SLURM or another test session on the machine is left alone."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.gpus = 0

    def start(self) -> None:
        for sub in ("munge", "state", "spool", "log", "dev"):
            (self.root / sub).mkdir()
        self.root.chmod(0o755)
        (self.root / "munge").chmod(0o755)  # munged wants its socket's folder searchable
        keys = self.root / "munge-key"
        keys.mkdir(mode=0o700)
        (keys / "key").write_bytes(os.urandom(1024))
        (keys / "key").chmod(0o400)
        munge = self.root / "munge"
        self._daemon(
            "munged",
            "--force",  # as root, in a folder of its own
            f"--socket={munge}/socket",
            f"--key-file={keys}/key",
            f"--log-file={munge}/log",
            f"--pid-file={munge}/pid",
            f"--seed-file={munge}/seed",
        )
        self.gpus = self._make_gpus(8)
        gres = f"Name=gpu File={self.root}/dev/nvidia[0-{self.gpus - 1}]"
        (self.root / "gres.conf").write_text(f"NodeName=localhost {gres}\n" if self.gpus else "")
        self.conf.write_text(
            CONF.format(
                root=self.root,
                ctld_port=free_port(),
                d_port=free_port(),
                first_job=int.from_bytes(os.urandom(2), "big") % 50000 + 1000,
                gres_types="GresTypes=gpu" if self.gpus else "",
                gres=f"Gres=gpu:{self.gpus}" if self.gpus else "",
            )
        )
        self._daemon("slurmctld", "-f", str(self.conf))
        self._daemon("slurmd", "-f", str(self.conf), "-N", "localhost")
        deadline = time.time() + 20
        while time.time() < deadline:
            state = self.run(["sinfo", "-h", "-o", "%T"], check=False).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.1)
        logs = "".join(p.read_text()[-2000:] for p in (self.root / "log").glob("*.log"))
        raise AssertionError(f"the test SLURM did not come up (node {state!r}): {logs}")

    def _make_gpus(self, count: int) -> int:
        try:
            for i in range(count):
                os.mknod(self.root / "dev" / f"nvidia{i}", 0o600 | 0o020000, os.makedev(195, i))
        except OSError:  # no CAP_MKNOD (a container): a cluster without GPUs
            return 0
        return count

    def _daemon(self, *command: str) -> None:
        """Start a daemon (it forks and returns); what it prints goes to log/start.txt, not
        to a pipe that its forked half would hold open."""
        with open(self.root / "log" / "start.txt", "a") as log:
            started = subprocess.run(
                command, env=self.env(), stdout=log, stderr=log, timeout=60, check=False
            )
        if started.returncode != 0:
            text = (self.root / "log" / "start.txt").read_text()[-2000:]
            raise AssertionError(f"{command[0]} did not start: {text}")

    def stop(self) -> None:
        """Cancel every job, then stop slurmd, slurmctld and munged by their pid files."""
        self.run(["scancel", "--full", "--user=root"], check=False)
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munge/pid"):
            path = self.root / pid_file
            if path.exists():
                stop_process(int(path.read_text().split()[0]))

    def env(self, **extra: str | None) -> dict:
        return env(SLURM_CONF=str(self.conf), **extra)

    def run(self, args, timeout: float = 300, check: bool = True, **extra):
        out = subprocess.run(
            args, cwd=ROOT, env=self.env(**extra), capture_output=True, text=True, timeout=timeout
        )
        if check and out.returncode != 0 and args[0] not in ("srun", "sbatch"):
            raise AssertionError(f"{args}: {out.stderr[-2000:]}")
        return out

    def start_step(self, args, **extra) -> subprocess.Popen:
        return subprocess.Popen(
            args,
            cwd=ROOT,
            env=self.env(**extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: str, done, what: str, timeout: float = 240) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            job = self.job(job_id)
            if done(job):
                return job
            time.sleep(0.2)
        raise AssertionError(f"job {job_id}: no {what} within {timeout} s: {self.job(job_id)}")


def stop_process(pid: int, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if it still runs after `timeout` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + timeout
        while time.time() < deadline and alive(pid):
            time.sleep(0.05)
        if not alive(pid):
            return


def alive(pid: int) -> bool:
    """Running and not a zombie (a daemon's exit status waits for whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def task_pid(workdir: Path, rank: int) -> int:
    """The pid of the task of rank `rank` (SLURM_PROCID) that runs main.py on `workdir`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = f"--workdir={workdir}".encode() in cmdline and b"main.py" in cmdline
        if ours and f"SLURM_PROCID={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no task {rank} runs main.py on {workdir}")


def program_lines(text: str) -> list[str]:
    """The lines of a job step's output that are not SLURM's own."""
    return [x for x in text.splitlines() if not SLURM_LINE.match(x)]
