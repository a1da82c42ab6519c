"""A throw-away Slurm cluster on 127.0.0.1 for tests/test_slurm.py: munged, slurmctld and one slurmd per node.

Everything lives in one temporary directory (config, munge key and socket, state, spool, logs). Node names
(`fsdpn1`...) go into /etc/hosts because job scripts resolve them (MASTER_ADDR); the file is restored byte
for byte on stop. Each slurmd is started with `-N <name>` and its own port (Debian builds Slurm with
multiple-slurmd support). Each node has fake GPUs for GRES: character devices with the NVIDIA major number
195, which slurmd only stats, so the sbatch headers' `--gpus-per-node` is scheduled as on a GPU cluster.
Every daemon runs in the foreground (-D / -F) as our child and is stopped by its PID.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "srun")
HOSTS = Path("/etc/hosts")
GPUS_PER_NODE = 8  # what the sbatch headers ask for (--gpus-per-node=8)


def missing_tools() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d) is None]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(what: str, ok, timeout: float, interval: float = 0.2, log: Path | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = ok()
        if value:
            return value
        time.sleep(interval)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{tail}")


class Cluster:
    def __init__(self, root: Path, nodes: int = 3, cpus: int = 2):
        self.root, self.cpus = root, cpus
        self.nodes = [f"fsdpn{i}" for i in range(1, nodes + 1)]
        self.procs: dict[str, subprocess.Popen] = {}
        self.hosts_before: bytes | None = None
        self.conf = root / "slurm.conf"
        # without the test-process tag (conftest.py): the daemons outlive each test, the jobs they run do not
        self.env = {k: v for k, v in os.environ.items() if k != "FSDP_RECIPES_TEST_PROCESS"}
        self.env["SLURM_CONF"] = str(self.conf)

    # -- start -------------------------------------------------------------------------------------------
    def start(self) -> "Cluster":
        try:
            self._write_hosts()
            self._start_munge()
            self._write_config()
            self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)], self.root / "slurmctld.log")
            wait_for("slurmctld", lambda: self.scontrol("ping").returncode == 0, 30, log=self.root / "slurmctld.log")
            for node in self.nodes:
                self._daemon(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)], self.root / f"slurmd.{node}.log")
            wait_for("all nodes idle", self._all_idle, 60, log=self.root / "slurmctld.log")
            return self
        except BaseException:
            self.stop()
            raise

    def _write_hosts(self):
        self.hosts_before = HOSTS.read_bytes()
        # written in place (not renamed): /etc/hosts is often a bind mount in containers
        HOSTS.write_bytes(self.hosts_before + f"\n127.0.0.1 {' '.join(self.nodes)}  # tests/slurm_cluster.py\n".encode())

    def _start_munge(self):
        mdir = self.root / "munge"
        mdir.mkdir(mode=0o700)
        key = mdir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = mdir / "munge.socket"
        log = self.root / "munged.log"
        self._daemon("munged", ["munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                                f"--pid-file={mdir / 'munged.pid'}", f"--seed-file={mdir / 'munged.seed'}",
                                f"--log-file={log}"], log)
        wait_for("munged socket", self.munge_socket.exists, 15, log=log)

    def _write_config(self):
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        devs = self.root / "dev"
        devs.mkdir()
        for i in range(GPUS_PER_NODE):
            os.mknod(devs / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))  # S_IFCHR, major 195 = NVIDIA
        (self.root / "state").mkdir()
        lines = [
            "ClusterName=fsdptest", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={ctld_port}",
            "SlurmUser=root", "SlurmdUser=root",
            # cred_expire: a requeued job may not start before it has passed (default 120 s)
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root}/spool.%n", f"SlurmdPidFile={self.root}/slurmd.%n.pid",
            f"SlurmctldPidFile={self.root}/slurmctld.pid",
            f"SlurmctldLogFile={self.root}/slurmctld.log", f"SlurmdLogFile={self.root}/slurmd.%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            # no cgroups on a test host: track processes by parent PID, bind nothing
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/builtin",
            # then it waits for the next full scheduling pass (default every 60 s)
            "SchedulerParameters=sched_interval=1",
            "MpiDefault=none", "ReturnToService=2", "SlurmdParameters=config_overrides",
            "GresTypes=gpu", "JobRequeue=1", "KillWait=5", "MinJobAge=600", "InactiveLimit=0",
            "SlurmdTimeout=60", "MessageTimeout=20",
        ]
        for node, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname=localhost Port={port} CPUs={self.cpus} "
                         f"RealMemory=1000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        # gres.conf sits next to slurm.conf; AutoDetect=off: the devices are fakes, there is no NVML
        (self.root / "gres.conf").write_text(
            f"AutoDetect=off\nName=gpu File={devs}/nvidia[0-{GPUS_PER_NODE - 1}]\n")

    def _daemon(self, name: str, cmd: list[str], log: Path):
        out = open(self.root / f"{name}.stdout", "w")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        out.close()
        time.sleep(0.1)
        if self.procs[name].poll() is not None:
            raise RuntimeError(f"{name} exited at once: {(self.root / f'{name}.stdout').read_text()[-2000:]}")

    def _all_idle(self) -> bool:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    # -- use ---------------------------------------------------------------------------------------------
    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=30)

    def sbatch(self, script: Path, *opts: str, cwd: Path, env: dict) -> int:
        res = subprocess.run(["sbatch", "--parsable", *opts, str(script)], cwd=cwd,
                             env={**env, "SLURM_CONF": str(self.conf)}, capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return int(res.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, NumNodes, ...)."""
        out = self.scontrol("show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, timeout: float, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                             "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")) -> dict:
        """Poll until the job is in one of `states` (sbatch --wait backs off for tens of seconds)."""
        last: dict = {}

        def done():
            last.update(self.job(job_id))
            return dict(last) if last.get("JobState") in states else None

        try:
            return wait_for(f"job {job_id}", done, timeout, interval=0.5)
        except TimeoutError as err:
            raise TimeoutError(f"{err}: still {last.get('JobState')} (reason {last.get('Reason')})") from None

    def _cancel_all(self):
        """Cancel what a failed test left running, so that no job step outlives the cluster."""
        def queue() -> list[str]:
            res = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True, timeout=30)
            return res.stdout.split() if res.returncode == 0 else []

        jobs = queue()
        if jobs:
            subprocess.run(["scancel", "--full", *jobs], env=self.env, capture_output=True, timeout=30)
            try:
                wait_for("cancelled jobs to end", lambda: not queue(), 60, interval=0.5)
            except TimeoutError:
                pass  # the daemons are stopped anyway; slurmd's stop ends its steps

    # -- stop --------------------------------------------------------------------------------------------
    def stop(self):
        if "slurmctld" in self.procs:
            self._cancel_all()
        # slurmd first (they kill their job steps), then the controller, then munge
        order = [n for n in self.nodes if n in self.procs] + [n for n in ("slurmctld", "munged") if n in self.procs]
        for name in order:
            proc = self.procs.pop(name)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        if self.hosts_before is not None:
            HOSTS.write_bytes(self.hosts_before)
            self.hosts_before = None
