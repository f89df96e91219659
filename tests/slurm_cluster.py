"""A real one-node Slurm cluster on this machine for the tests: Debian's slurm-wlm and munge (installed by
`make slurm`), `munged` with a key and socket of its own, `slurmctld` and `slurmd` with a config written here (no
cgroups: proctrack/linuxproc, task/none; the node offers more CPUs than it has, as the local Ray does)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")


def missing_tools() -> list[str]:
    return [d for d in DAEMONS if not shutil.which(d) and not Path("/usr/sbin", d).exists()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    def __init__(self, folder: Path, cpus: int = 8):
        self.folder, self.cpus = folder, cpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self) -> "SlurmCluster":
        f = self.folder
        for sub in ("state", "spool", "log", "munge"):
            (f / sub).mkdir(parents=True, exist_ok=True)
        key = f / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.socket = f / "munge" / "munge.sock"
        subprocess.run([_tool("munged"), f"--key-file={key}", f"--socket={self.socket}", "--force",
                        f"--pid-file={f / 'munge' / 'munged.pid'}", f"--log-file={f / 'munge' / 'munged.log'}",
                        f"--seed-file={f / 'munge' / 'seed'}"], check=True, capture_output=True)
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        self.conf.write_text("\n".join([
            "ClusterName=amalia-test", f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.socket}", "SlurmUser=root",
            f"StateSaveLocation={f / 'state'}", f"SlurmdSpoolDir={f / 'spool'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}", f"SlurmdPidFile={f / 'slurmd.pid'}",
            f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={f / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2", "SlurmdParameters=config_overrides",
            "MinJobAge=600", "KillWait=10", "SchedulerParameters=sched_interval=2",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={memory_mb // 2} State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")
        subprocess.run([_tool("slurmctld"), "-i"], env=self.env, check=True, capture_output=True)
        subprocess.run([_tool("slurmd"), "-N", self.node], env=self.env, check=True, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True).stdout
            if out.strip() in ("idle", "mixed", "allocated"):
                return self
            time.sleep(1)
        raise RuntimeError(f"the Slurm node did not come up: {self.log_tail()}")

    def log_tail(self) -> str:
        return "\n".join(p.read_text()[-2000:] for p in sorted((self.folder / "log").glob("*.log")))

    def stop(self) -> None:
        subprocess.run(["scancel", "--full", "--user", "root"], env=self.env, capture_output=True)
        for pidfile in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            path = self.folder / pidfile
            try:
                os.kill(int(path.read_text().split()[0]), signal.SIGTERM)
            except (OSError, ValueError):
                pass
