"""A real, throw-away, single-node SLURM cluster *with accounting* for tests.

What it runs (all as root, all in the foreground under ``subprocess.Popen`` so every PID is known):

    munged      private key + socket        (not the system /run/munge one)
    mariadbd    private datadir, --skip-networking, private unix socket
    slurmdbd    accounting_storage/mysql -> that mariadbd
    slurmctld   -D -f <base>/etc/slurm.conf
    slurmd      -D -f <base>/etc/slurm.conf -N localhost

Nothing touches /etc/slurm, /etc/munge, /run/munge or /run/mysqld: config, state, spool and logs live under the
given ``base_dir``; the two unix sockets live in a short ``/tmp/wbslurm-XXXX`` directory (mode 0755, because munged
insists that every directory above its socket is world-executable and unix socket paths are limited to 108 bytes;
pytest's ``/tmp/pytest-of-root`` is 0700). Ports are picked free at start, so a system SLURM on 6817-6819 is no problem.

Usage
-----
Install once (CI does this before pytest)::

    bash .ci/install_slurm.sh

In tests (``tests/conftest.py`` may simply do ``from tests.slurm_cluster import slurm_cluster``)::

    from tests.slurm_cluster import slurm_cluster          # session-scoped pytest fixture

    @pytest.mark.slow
    def test_x(slurm_cluster, tmp_path):
        ex = slurm_cluster.executor(tmp_path / "jobs", ntasks_per_node=2, cpus_per_task=1, timeout_min=30)
        job = ex.submit(fn)                                 # fn: module-level, importable (tests.* / workbench.*)

or by hand::

    with SlurmCluster(base_dir) as cluster:
        subprocess.run(["srun", "-n", "2", "hostname"], env=cluster.env(), check=True)

While the cluster is running, ``start()`` sets ``os.environ["SLURM_CONF"]`` (restored by ``stop()``), so ``sbatch``,
``srun``, ``squeue``, ``sacct``, ``scontrol`` run by submitit (which inherits os.environ) find this cluster. Jobs
inherit the submitter's environment (sbatch ``--export=ALL``), so ``scontrol`` inside a job finds it too.
``cluster.executor(folder, **params)`` returns an explicit ``submitit.SlurmExecutor`` (never AutoExecutor) whose jobs
get ``PYTHONPATH=<repo root>`` so functions defined in ``tests.*`` modules unpickle in the job.

Two nodes on one machine: ``SlurmCluster(base, nodes=2)`` (pytest: the module-scoped ``slurm_two_nodes`` fixture)
runs two ``slurmd -N <name>`` daemons, nodes ``127.0.0.1`` and ``127.0.0.2``, each with its own port, spool, pid and
log file, in one partition; the installed SLURM has no MULTIPLE_SLURMD build, so the nodes differ by name and address
rather than by port alone (:func:`two_node_names` says why). ``srun -N 2`` / ``nodes=2`` jobs then see
``SLURM_JOB_NODELIST=127.0.0.[1-2]``, ``SLURM_NODEID`` 0 and 1, and master address 127.0.0.1.

Fixture semantics: the fixture skips with a reason when SLURM is unavailable (not root / binaries missing) or fails
to start; with ``WORKBENCH_REQUIRE_SLURM=1`` (CI) both are hard failures instead. One cluster per process: a second
fixture/helper in the same session reuses the running cluster.

Teardown and leftovers: ``stop()`` scancels the queue, then kills slurmd, slurmctld, slurmdbd, mariadbd, munged by
their Popen PIDs (SIGTERM, 10 s, SIGKILL), then any slurmstepd/job process of this cluster, and removes pid files and
the socket dir; it is idempotent and runs after a failed start. Every daemon carries ``WORKBENCH_SLURM_HARNESS=
<creator pid>:<id>`` in its environment; ``start()`` first calls ``kill_stale_daemons()``, which kills (by PID) the
daemons and jobs of harness clusters whose creator process is dead (a crashed/SIGKILLed pytest), and leaves
clusters of live processes alone. Nothing else is ever signalled.

Preemption / requeue (verified with submitit 1.5.4 and slurm 22.05.8, tests/test_slurm_cluster.py)
-----------------------------------------------------------------------------------------------
``JobRequeue=1`` is set, SlurmUser is root and jobs run as root, so ``scontrol requeue <jobid>`` works from inside a
job - that is exactly what submitit's signal handler runs. To preempt a running submitit job from a test:

    1. submit a callable with a ``checkpoint()`` method (``submitit.helpers.Checkpointable`` or your own, returning
       ``submitit.helpers.DelayedSubmission(...)`` of the state to resume from) through ``cluster.executor(...)``
       with ``timeout_min > 10`` (see the caveat below);
    2. wait until the function has *started* (e.g. it writes a marker file): submitit installs its USR2 handler
       before calling the function; a USR2 that arrives earlier kills the task (default action) and the job FAILS;
    3. ``job._interrupt()``  (== ``scancel <id> --signal SIGTERM`` then ``scancel <id> --signal USR2``; submitit
       logs "Bypassing signal SIGTERM", then on USR2 rank 0 calls ``checkpoint()``, pickles its result over
       ``<folder>/<id>_submitted.pkl`` and runs ``scontrol requeue <id>``; slurmctld kills the old attempt);
    4. optionally ``cluster.release_requeued(job.job_id)`` (see below), then ``job.result()`` returns the result of
       the second attempt: same job id, ``SLURM_RESTART_COUNT=1`` in the job, ``cluster.requeue_count(id) == 1``,
       sacct state COMPLETED, both attempts' output appended to the same log files.

A job can also requeue itself: ``subprocess.check_call(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]])``;
without a ``checkpoint`` method a *preempted* job is requeued by submitit too and simply reruns the same pickle.

Timing: slurmctld holds a requeued job (Reason=BeginTime) for ``cred_expire + 1`` s (cred_expire=10 here via
``AuthInfo=...,cred_expire=10``; Slurm's default is 120 s), because slurmd revokes the old job credential at
requeue time with one-second resolution. ``cluster.release_requeued(job_id)`` shortens this to ~3 s safely (waits
for the node to finish the old attempt, then 2 s, then ``scontrol update JobId=<id> StartTime=now``). Do NOT just
``StartTime=now`` right after the requeue: a relaunch in the same second as the revocation is refused
("Killing non-startable batch JobId=N: Job credential revoked") and the job ends FAILED.

Caveat (submitit 1.5.4): on USR2 it decides "timed-out" vs "preempted" from the elapsed time versus
``min(0.8 * timeout_min, timeout_min - 10 min)``, so in a job with ``timeout_min <= 10`` *every* USR2 counts as a
time-out (logged "this job is timed-out"): a Checkpointable is still requeued (consuming one of
``max_num_timeout=3``), a plain function is not requeued ("timed-out and not checkpointable"). Use e.g.
``timeout_min=30`` for preemption tests, and ``timeout_min<=10`` + ``job._interrupt(timeout=True)`` to exercise
the time-out path. submitit's ``signal_delay_s`` (``--signal=USR2@N``) is set to 10 s by ``cluster.executor``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import typing as tp
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MARKER_ENV = "WORKBENCH_SLURM_HARNESS"  # in every daemon's environment: "<creator pid>:<its start time>:<uuid>"
REQUIRE_ENV = "WORKBENCH_REQUIRE_SLURM"
CLUSTER_NAME = "local"
NODE_NAME = "localhost"
PARTITION = "debug"
_CONF_HEADER = "# generated by tests/slurm_cluster.py"

_SBIN_CANDIDATES = ("/usr/sbin", "/usr/local/sbin", "/sbin", "/usr/bin", "/usr/local/bin")
_DAEMONS = ("munged", "slurmctld", "slurmd", "slurmdbd")
_CLIENTS = ("sbatch", "srun", "squeue", "sacct", "sacctmgr", "scontrol", "sinfo", "scancel")


class SlurmStartError(RuntimeError):
    pass


def _which(name: str) -> tp.Optional[str]:
    found = shutil.which(name)
    if found:
        return found
    for d in _SBIN_CANDIDATES:
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def _mysqld() -> tp.Optional[str]:
    return _which("mariadbd") or _which("mysqld")


def _mysql_client() -> tp.Optional[str]:
    return _which("mariadb") or _which("mysql")


def _install_db() -> tp.Optional[str]:
    return _which("mariadb-install-db") or _which("mysql_install_db")


def slurm_available() -> tp.Tuple[bool, str]:
    """(True, "") when this process can bring up a cluster: root and every binary present."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "needs root (slurmd/munged/mariadbd run as root here)"
    missing = [b for b in _DAEMONS + _CLIENTS if _which(b) is None]
    if _mysqld() is None:
        missing.append("mariadbd/mysqld")
    if _mysql_client() is None:
        missing.append("mariadb/mysql client")
    if _install_db() is None:
        missing.append("mariadb-install-db/mysql_install_db")
    if missing:
        return False, f"missing binaries: {', '.join(missing)} (run .ci/install_slurm.sh)"
    return True, ""


# --------------------------------------------------------------------------- process helpers


def _pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie (PID 1 in some sandboxes never reaps)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError, OSError):
        return False
    state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
    return state not in ("Z", "X")


def _proc_environ(pid: int) -> tp.Dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def _start_time(pid: int) -> str:
    """The process start time (clock ticks since boot, /proc/<pid>/stat field 22): (pid, start) is unique."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _creator_alive(marker: str) -> bool:
    parts = marker.split(":")
    if len(parts) < 3 or not parts[0].isdigit():
        return False
    pid = int(parts[0])
    return _pid_alive(pid) and _start_time(pid) == parts[1]


def _ancestors() -> tp.Set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _scan() -> tp.Tuple[tp.Dict[int, str], tp.Dict[int, str]]:
    """(marked daemons: pid -> marker, job processes: pid -> their SLURM_CONF), live processes only.

    Daemons (and the slurmstepds slurmd forks) carry MARKER_ENV, which only this harness sets; job processes
    carry SLURM_JOB_ID plus the SLURM_CONF of the cluster that ran them. This process and its ancestors are skipped.
    """
    daemons, jobs = {}, {}
    skip = _ancestors()
    parents: tp.Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        if pid in skip:
            continue
        env = _proc_environ(pid)
        if not env or not _pid_alive(pid):
            continue
        if env.get(MARKER_ENV):
            daemons[pid] = env[MARKER_ENV]
        elif "SLURM_JOB_ID" in env and env.get("SLURM_CONF"):
            jobs[pid] = env["SLURM_CONF"]

    def our_descendant(pid: int) -> bool:  # e.g. pytest itself runs inside an outer SLURM job
        seen = 0
        while pid > 1 and seen < 512:
            pid = parents.get(pid, 0)
            if pid == os.getpid():
                return True
            seen += 1
        return False

    jobs = {pid: conf for pid, conf in jobs.items() if not our_descendant(pid)}
    return daemons, jobs


def _is_harness_conf(path: str) -> bool:
    """True if path is (or was: deleted temp dir) a slurm.conf written by this harness."""
    if not path.endswith("/etc/slurm.conf"):
        return False
    try:
        with open(path) as f:
            return f.readline().startswith(_CONF_HEADER)
    except FileNotFoundError:
        return True  # its temp dir is gone: the cluster cannot be running any more
    except OSError:
        return False


def _kill_pids(pids: tp.Iterable[int], timeout: float = 10.0, popens: tp.Optional[tp.Dict[int, subprocess.Popen]] = None) -> None:
    """SIGTERM, wait up to timeout, SIGKILL the rest, wait. Reaps our own children."""
    pids = [p for p in set(pids) if p > 1 and p != os.getpid()]
    popens = popens or {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for sig_round in (0, 1):
        while True:
            for p in popens.values():
                p.poll()
            alive = [p for p in pids if _pid_alive(p)]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not alive:
            break
        if sig_round == 0:
            for pid in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
    for p in popens.values():
        with contextlib.suppress(Exception):
            p.wait(timeout=1)


def kill_stale_daemons() -> tp.List[int]:
    """Kill daemons (and their jobs) left by an earlier harness whose creating process is gone.

    A crashed or SIGKILLed test session leaves munged/mariadbd/slurm* running; they are recognised by MARKER_ENV
    ("<creator pid>:<id>") in /proc/<pid>/environ, so nothing else is touched. Clusters whose creator is still
    alive (another pytest process, or a cluster of this process that is running) are left alone. Returns the PIDs.
    """
    daemons, jobs = _scan()
    stale, live_confs = [], set()
    for pid, marker in daemons.items():
        if marker.split(":", 1)[0] == str(os.getpid()):
            is_live = marker in _RUNNING  # a cluster of this process: live while started and not stopped
        else:
            is_live = _creator_alive(marker)  # another (pytest) process's cluster, if that process still runs
        if is_live:
            live_confs.add(_proc_environ(pid).get("SLURM_CONF", ""))
        else:
            stale.append(pid)
    stale_envs = [_proc_environ(pid) for pid in stale]
    stale += [pid for pid, conf in jobs.items() if conf not in live_confs and _is_harness_conf(conf)]
    if stale:
        _kill_pids(stale)
    # their pid files and private socket directory
    for env in stale_envs:
        conf = env.get("SLURM_CONF", "")
        if conf and conf not in live_confs and _is_harness_conf(conf):
            run_dir = Path(conf).parent.parent / "run"
            for pidfile in run_dir.glob("*.pid") if run_dir.is_dir() else []:
                with contextlib.suppress(OSError):
                    pidfile.unlink()
        sock = env.get("MYSQL_UNIX_PORT", "")
        if sock and Path(sock).parent.name.startswith("wbslurm-") and str(Path(sock).parent.parent) == "/tmp":
            shutil.rmtree(Path(sock).parent, ignore_errors=True)
    return stale


_RUNNING: tp.Dict[str, "SlurmCluster"] = {}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _free_ports(n: int) -> tp.List[int]:
    ports: tp.List[int] = []
    while len(ports) < n:
        p = _free_port()
        if p not in ports and p > 1024:
            ports.append(p)
    return ports


def _mem_mb() -> int:
    total_kb = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total_kb = int(line.split()[1])
                break
    total_mb = total_kb // 1024
    margin = max(512, total_mb // 10)
    return max(256, total_mb - margin)


def _node_topology() -> str:
    """CPUs/Boards/Sockets/Cores/Threads as slurmd sees them (avoids a drained node on a mismatch)."""
    cpus = os.cpu_count() or 1
    fallback = f"CPUs={cpus}"
    slurmd = _which("slurmd")
    if not slurmd:
        return fallback
    try:
        out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return fallback
    fields = {}
    for tok in out.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            fields[k] = v
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    if all(k in fields for k in keys) and fields["CPUs"].isdigit():
        return " ".join(f"{k}={fields[k]}" for k in keys)
    return fallback


def two_node_names() -> tp.List[str]:
    """Two node names for two slurmd daemons on this one machine: ``127.0.0.1`` and ``127.0.0.2``.

    The SLURM here (Debian's 22.05.8) is built without MULTIPLE_SLURMD: two ``NodeName`` lines with the same
    NodeHostName are refused ("fatal: Duplicated NodeHostName"), and ``localhost`` counts as this machine's hostname.
    Each node is therefore named by its own loopback address (all of 127.0.0.0/8 is this machine's loopback), with
    NodeHostname = NodeAddr = that name and a port of its own; each slurmd is started as ``slurmd -N <name>``. No
    network namespaces are needed, nothing in /etc is touched, and the job's nodelist (``127.0.0.[1-2]``) names hosts
    that every process can reach without a resolver: the first one is the rendezvous (MASTER_ADDR) address.
    """
    return ["127.0.0.1", "127.0.0.2"]


# --------------------------------------------------------------------------- the cluster


class SlurmCluster:
    """A SLURM cluster with accounting under ``base_dir``: one node, or with ``nodes=2`` two slurmd daemons on this
    machine (each node declares the whole machine's CPUs, so the two oversubscribe it); see the module docstring."""

    def __init__(
        self, base_dir: tp.Union[str, Path], *, start_timeout: float = 60.0, debug: str = "info", cred_expire: int = 10,
        nodes: int = 1,
    ) -> None:
        self.base = Path(base_dir).resolve()
        self.cred_expire = cred_expire
        self.start_timeout = start_timeout
        self.debug = debug
        self.marker = f"{os.getpid()}:{_start_time(os.getpid())}:{uuid.uuid4().hex[:12]}"
        self.etc = self.base / "etc"
        self.logs = self.base / "log"
        self.state = self.base / "state"
        self.spool = self.base / "spool"
        self.run = self.base / "run"
        self.mysql_data = self.base / "mysql"
        self.munge_dir = self.base / "munge"
        self.conf = self.etc / "slurm.conf"
        self.sock_dir: tp.Optional[Path] = None
        self.ports: tp.Dict[str, int] = {}
        self.cluster_name = CLUSTER_NAME
        self.node_name = NODE_NAME
        self.node_names = [NODE_NAME] if nodes == 1 else two_node_names() if nodes == 2 else []
        if not self.node_names:
            raise ValueError(f"nodes={nodes}: this harness makes 1 or 2 nodes (see two_node_names)")
        self.partition = PARTITION
        self.procs: tp.Dict[str, subprocess.Popen] = {}
        self.timings: tp.Dict[str, float] = {}
        self._saved_env: tp.Dict[str, tp.Optional[str]] = {}
        self._started = False
        self._db_pass = uuid.uuid4().hex

    # ------------------------------------------------------------------ public API

    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc: tp.Any) -> None:
        self.stop()

    @property
    def munge_socket(self) -> Path:
        assert self.sock_dir is not None
        return self.sock_dir / "munge.sock"

    @property
    def mysql_socket(self) -> Path:
        assert self.sock_dir is not None
        return self.sock_dir / "mysqld.sock"

    def env(self, base: tp.Optional[tp.Mapping[str, str]] = None) -> tp.Dict[str, str]:
        """An environment for SLURM client commands (and, via sbatch's --export=ALL, for jobs)."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def start(self) -> "SlurmCluster":
        if self._started:
            return self
        ok, reason = slurm_available()
        if not ok:
            raise SlurmStartError(reason)
        t0 = time.monotonic()
        _RUNNING[self.marker] = self  # before kill_stale_daemons so our own (none yet) are safe
        try:
            killed = kill_stale_daemons()
            if killed:
                self.timings["killed_stale"] = float(len(killed))
            self._prepare_dirs()
            self._write_configs()
            self._step("munged", self._start_munged)
            self._step("mariadb", self._start_mariadb)
            self._step("slurmdbd", self._start_slurmdbd)
            self._step("slurmctld", self._start_slurmctld)
            self._step("slurmd", self._start_slurmd)
            self._save_pids()
            self._saved_env = {"SLURM_CONF": os.environ.get("SLURM_CONF")}
            os.environ["SLURM_CONF"] = str(self.conf)
            self._started = True
        except BaseException as e:
            logs = self.log_tail()
            self.stop()
            if isinstance(e, SlurmStartError):
                raise SlurmStartError(f"{e}\n--- daemon logs ---\n{logs}") from None
            raise
        self.timings["total"] = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Cancel jobs, then kill every daemon by PID (SIGTERM, then SIGKILL). Safe after a failed/partial start."""
        if "slurmctld" in self.procs and self._alive("slurmctld"):
            with contextlib.suppress(Exception):
                self._drain_jobs(timeout=15.0)
        for name in (*self._slurmd_procs(), "slurmctld", "slurmdbd", "mariadbd", "munged"):
            p = self.procs.get(name)
            if p is not None:
                _kill_pids([p.pid], timeout=10.0, popens={p.pid: p})
        # anything else: slurmstepds (they inherit slurmd's marker) and job processes of this cluster
        daemons, jobs = _scan()
        leftovers = [pid for pid, m in daemons.items() if m == self.marker]
        leftovers += [pid for pid, conf in jobs.items() if conf == str(self.conf)]
        if leftovers:
            _kill_pids(leftovers)
        for pidfile in self.run.glob("*.pid") if self.run.exists() else []:
            with contextlib.suppress(OSError):
                pidfile.unlink()
        if self.sock_dir is not None:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved_env = {}
        self.procs = {}
        self._started = False
        _RUNNING.pop(self.marker, None)

    def pids(self) -> tp.Dict[str, int]:
        return {name: p.pid for name, p in self.procs.items()}

    def run_cmd(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster; returns the CompletedProcess (text)."""
        r = subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise subprocess.CalledProcessError(r.returncode, args, r.stdout, r.stderr)
        return r

    def executor(self, folder: tp.Union[str, Path], **params: tp.Any):
        """An explicit ``submitit.SlurmExecutor`` for this cluster (never AutoExecutor).

        Jobs get PYTHONPATH=<repo root> so functions from ``tests.*``/``workbench.*`` unpickle by reference.
        Defaults: partition=debug, time=60 (minutes; ``timeout_min`` is accepted as an alias), signal_delay_s=10;
        any ``params`` override them. Keep time > 10 min if a test interrupts the job: submitit 1.5.4 counts any
        USR2 in a job with time <= 10 min as a *timeout* (see the module docstring).
        """
        import submitit  # local import: the module must import without submitit installed

        ex = submitit.SlurmExecutor(folder=str(folder))
        setup = [f'export PYTHONPATH="{REPO_ROOT}${{PYTHONPATH:+:$PYTHONPATH}}"']
        setup += list(params.pop("setup", []) or [])
        defaults: tp.Dict[str, tp.Any] = dict(partition=self.partition, time=60, signal_delay_s=10)
        if "timeout_min" in params:  # AutoExecutor-style names
            params["time"] = params.pop("timeout_min")
        if "tasks_per_node" in params:
            params["ntasks_per_node"] = params.pop("tasks_per_node")
        defaults.update(params)
        ex.update_parameters(setup=setup, **defaults)
        return ex

    def job_state(self, job_id: str) -> str:
        """State from squeue if the job is in the queue, else from sacct ('' if unknown)."""
        r = self.run_cmd("squeue", "-h", "-j", str(job_id), "-o", "%T", check=False)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0]
        r = self.run_cmd("sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State", check=False)
        lines = [ln for ln in r.stdout.split() if ln]
        return lines[-1] if lines else ""

    def wait_state(self, job_id: str, states: tp.Union[str, tp.Iterable[str]], timeout: float = 60.0) -> str:
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            last = self.job_state(job_id)
            if last.split()[0:1] and last.split()[0] in wanted:
                return last
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} not in {sorted(wanted)} after {timeout}s (last state {last!r})")

    def release_requeued(self, job_id: str, timeout: float = 60.0) -> None:
        """Skip most of the BeginTime hold (cred_expire + 1 s) that slurmctld puts on a requeued job.

        The hold exists because slurmd revokes the old job credential at requeue time (second resolution): a
        relaunch within the same second is refused ("Job credential revoked") and the job ends FAILED. So: wait
        until the job is PENDING again and the node has finished terminating the old attempt (revocation done),
        wait 2 s more, then ``scontrol update JobId=<id> StartTime=now``. Saves ~8 s per requeue.
        """
        self.wait_state(job_id, "PENDING", timeout=timeout)
        deadline = time.monotonic() + timeout

        def node_completing() -> bool:
            r = self.run_cmd("sinfo", "-h", "-N", "-n", ",".join(self.node_names), "-o", "%T", check=False, timeout=10)
            return r.returncode != 0 or "completing" in r.stdout.lower()

        while node_completing() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)
        if self.job_state(job_id).split()[:1] == ["PENDING"]:
            self.run_cmd("scontrol", "update", f"JobId={job_id}", "StartTime=now")

    def requeue_count(self, job_id: str) -> int:
        """Number of times slurmctld requeued the job (scontrol's Restarts=, 0 once it left memory)."""
        r = self.run_cmd("scontrol", "show", "job", str(job_id), check=False)
        for tok in r.stdout.split():
            if tok.startswith("Restarts="):
                return int(tok.split("=", 1)[1])
        return 0

    def log_tail(self, n: int = 15) -> str:
        parts = []
        for f in sorted(self.logs.glob("*.log")) if self.logs.exists() else []:
            with contextlib.suppress(OSError):
                lines = f.read_text(errors="replace").splitlines()[-n:]
                parts.append(f"== {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    # ------------------------------------------------------------------ internals

    def _step(self, name: str, fn: tp.Callable[[], None]) -> None:
        t = time.monotonic()
        fn()
        self.timings[name] = round(time.monotonic() - t, 2)

    def _alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def _prepare_dirs(self) -> None:
        for d in (self.etc, self.logs, self.state, self.spool, self.run, self.munge_dir):
            d.mkdir(parents=True, exist_ok=True)
        # munged refuses group/world-writable key/log/seed directories
        for d in (self.munge_dir, self.state, self.spool, self.etc):
            os.chmod(d, 0o700)
        self.sock_dir = Path(tempfile.mkdtemp(prefix="wbslurm-", dir="/tmp"))
        os.chmod(self.sock_dir, 0o755)  # munged: every dir above its socket must be world-executable
        names = ("slurmctld", "slurmd", "slurmdbd", *(f"slurmd:{n}" for n in self.node_names[1:]))
        self.ports = dict(zip(names, _free_ports(len(names))))

    def _daemon_env(self) -> tp.Dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env["MYSQL_UNIX_PORT"] = str(self.mysql_socket)  # slurmdbd's libmariadb finds our socket through this
        env[MARKER_ENV] = self.marker
        return env

    def _write_configs(self) -> None:
        auth_info = f"socket={self.munge_socket}"
        # cred_expire (default 120 s) is also how long a requeued job is held (BeginTime) before it may restart.
        ctl_auth_info = f"{auth_info},cred_expire={self.cred_expire}"
        # Two nodes: each slurmd has its own port, spool, pid and log file (%n: the node name slurmd -N was given).
        suffix = "" if len(self.node_names) == 1 else ".%n"
        node_lines = "\n".join(
            f"NodeName={n} NodeAddr={n} NodeHostname={n}"
            + (f" Port={self.ports['slurmd:' + n]}" if i else (f" Port={self.ports['slurmd']}" if len(self.node_names) > 1 else ""))
            + f" {_node_topology()} RealMemory={_mem_mb()} State=UNKNOWN"
            for i, n in enumerate(self.node_names))
        if len(self.node_names) == 1:  # the one-node cluster's line, unchanged
            node_lines = f"NodeName={self.node_name} NodeAddr=127.0.0.1 {_node_topology()} RealMemory={_mem_mb()} State=UNKNOWN"
        slurm_conf = f"""{_CONF_HEADER}
ClusterName={self.cluster_name}
SlurmctldHost={self.node_name}(127.0.0.1)
SlurmctldPort={self.ports['slurmctld']}
SlurmdPort={self.ports['slurmd']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo={ctl_auth_info}
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation={self.state}
SlurmdSpoolDir={self.spool}/slurmd{suffix}
SlurmctldPidFile={self.run}/slurmctld.pid
SlurmdPidFile={self.run}/slurmd{suffix}.pid
SlurmctldLogFile={self.logs}/slurmctld.log
SlurmdLogFile={self.logs}/slurmd{suffix}.log
SlurmctldDebug={self.debug}
SlurmdDebug={self.debug}
PlugStackConfig={self.etc}/plugstack.conf
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=0,batch_sched_delay=0
JobRequeue=1
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
MessageTimeout=10
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={self.ports['slurmdbd']}
AccountingStoragePass={self.munge_socket}
JobCompType=jobcomp/none
{node_lines}
PartitionName={self.partition} Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
        self.conf.write_text(slurm_conf)
        (self.etc / "plugstack.conf").write_text("")
        dbd = self.etc / "slurmdbd.conf"  # slurmdbd reads it from dirname($SLURM_CONF)
        dbd.write_text(
            f"""AuthType=auth/munge
AuthInfo={auth_info}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={self.ports['slurmdbd']}
SlurmUser=root
DebugLevel={self.debug}
LogFile={self.logs}/slurmdbd.log
PidFile={self.run}/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass={self._db_pass}
"""
        )
        os.chmod(dbd, 0o600)

    def _spawn(self, name: str, argv: tp.List[str], log: str) -> subprocess.Popen:
        out = open(self.logs / log, "ab")
        try:
            p = subprocess.Popen(
                argv, env=self._daemon_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=str(self.base),
            )
        finally:
            out.close()
        self.procs[name] = p
        return p

    def _wait(self, what: str, cond: tp.Callable[[], bool], daemons: tp.Sequence[str], timeout: tp.Optional[float] = None) -> None:
        deadline = time.monotonic() + (timeout or self.start_timeout)
        delay = 0.05
        while True:
            if cond():
                return
            for d in daemons:
                if not self._alive(d):
                    rc = self.procs[d].returncode if d in self.procs else None
                    raise SlurmStartError(f"{d} exited (rc={rc}) while waiting for {what}")
            if time.monotonic() > deadline:
                raise SlurmStartError(f"timed out waiting for {what}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _start_munged(self) -> None:
        key = self.munge_dir / "munge.key"
        if not key.exists():  # a private random key (munge accepts 32..1024 bytes); no mungekey version issues
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(128))
        os.chown(key, 0, 0)
        os.chmod(key, 0o600)
        self._spawn(
            "munged",
            [_which("munged"), "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--log-file={self.logs}/munged.log", f"--pid-file={self.run}/munged.pid",
             f"--seed-file={self.munge_dir}/munged.seed", "--num-threads=4"],
            "munged.out.log",
        )
        self._wait("munge socket", self.munge_socket.exists, ["munged"])

    def _mysql(self, sql: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [_mysql_client(), "--no-defaults", f"--socket={self.mysql_socket}", "-u", "root", "-e", sql],
            capture_output=True, text=True, check=check, timeout=30,
        )

    def _start_mariadb(self) -> None:
        common = [f"--datadir={self.mysql_data}", "--innodb-log-file-size=8M", "--innodb-buffer-pool-size=64M"]
        if not (self.mysql_data / "mysql").exists():
            r = subprocess.run(
                [_install_db(), "--no-defaults", "--user=root",
                 "--auth-root-authentication-method=socket", "--skip-test-db", *common],
                capture_output=True, text=True, timeout=120,
            )
            (self.logs / "mariadb-install.log").write_text(r.stdout + r.stderr)
            if r.returncode != 0:
                raise SlurmStartError(f"mariadb-install-db failed (rc={r.returncode}): {r.stderr[-2000:]}")
        self._spawn(
            "mariadbd",
            [_mysqld(), "--no-defaults", "--user=root", *common, "--skip-networking", f"--socket={self.mysql_socket}",
             f"--pid-file={self.run}/mariadbd.pid", f"--log-error={self.logs}/mariadbd.log", "--skip-log-bin",
             "--innodb-lock-wait-timeout=900", "--max-connections=200"],
            "mariadbd.out.log",
        )
        self._wait("mariadbd", lambda: self._mysql("SELECT 1", check=False).returncode == 0, ["mariadbd"])
        self._mysql(
            f"CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '{self._db_pass}';"
            f"ALTER USER 'slurm'@'localhost' IDENTIFIED BY '{self._db_pass}';"
            "CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
            "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"
        )

    def _start_slurmdbd(self) -> None:
        self._spawn("slurmdbd", [_which("slurmdbd"), "-D"], "slurmdbd.out.log")
        self._wait("slurmdbd port", lambda: _port_open(self.ports["slurmdbd"]), ["slurmdbd", "mariadbd"])

        def cluster_added() -> bool:
            r = self.run_cmd("sacctmgr", "-i", "add", "cluster", self.cluster_name, check=False, timeout=20)
            text = r.stdout + r.stderr
            if r.returncode == 0 or "already exists" in text or "Nothing new added" in text:
                return True
            return False

        self._wait("slurmdbd + sacctmgr add cluster", cluster_added, ["slurmdbd", "mariadbd"])

    def _start_slurmctld(self) -> None:
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out.log")
        self._wait("slurmctld", lambda: self.run_cmd("scontrol", "ping", check=False, timeout=10).stdout.count("UP") > 0,
                   ["slurmctld"])

    def _slurmd_procs(self) -> tp.List[str]:
        """The names under which each node's slurmd is kept in ``procs``: "slurmd" for the first node, then
        "slurmd:<node name>" for a second one."""
        return ["slurmd"] + [f"slurmd:{n}" for n in self.node_names[1:]]

    def _start_slurmd(self) -> None:
        for proc, node in zip(self._slurmd_procs(), self.node_names):
            log = "slurmd.out.log" if proc == "slurmd" else f"slurmd.{node}.out.log"
            self._spawn(proc, [_which("slurmd"), "-D", "-f", str(self.conf), "-N", node], log)

        def idle() -> bool:
            r = self.run_cmd("sinfo", "-h", "-N", "-n", ",".join(self.node_names), "-o", "%t", check=False, timeout=10)
            states = [s.rstrip("*") for s in r.stdout.split()]
            return r.returncode == 0 and len(states) == len(self.node_names) and set(states) == {"idle"}

        self._wait("every node idle in sinfo", idle, [*self._slurmd_procs(), "slurmctld"])

    def _save_pids(self) -> None:
        (self.run / "pids.json").write_text(json.dumps({"marker": self.marker, "pids": self.pids()}, indent=1))

    def _drain_jobs(self, timeout: float) -> None:
        r = self.run_cmd("squeue", "-h", "-o", "%i", check=False, timeout=10)
        ids = r.stdout.split()
        if not ids:
            return
        self.run_cmd("scancel", *ids, check=False, timeout=10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.run_cmd("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split():
                return
            time.sleep(0.2)


# --------------------------------------------------------------------------- pytest integration

_SHARED: tp.Optional[SlurmCluster] = None


def slurm_cluster_fixture(tmp_path_factory) -> tp.Iterator[SlurmCluster]:
    """Generator for a session-scoped pytest fixture: yields a running SlurmCluster.

    Fails when SLURM is unavailable or does not start (where it is missing and not required, the SLURM tests are
    skipped at collection instead: tests/conftest.py). Reuses a cluster already started by this process (one cluster per session).
    """
    import pytest

    global _SHARED

    def unavailable(reason: str) -> None:
        # Reached only where SLURM is installed or required: without it (and WORKBENCH_REQUIRE_SLURM unset) the SLURM
        # tests carry a skipif mark from collection (tests/conftest.py, SLURM_SKIP) and never ask for this fixture.
        pytest.fail(f"SLURM required or installed but unavailable: {reason}", pytrace=False)

    if _SHARED is not None and _SHARED._started:
        yield _SHARED
        return
    ok, reason = slurm_available()
    if not ok:
        unavailable(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmStartError as e:
        unavailable(f"cluster failed to start: {e}")
    _SHARED = cluster
    try:
        yield cluster
    finally:
        _SHARED = None
        cluster.stop()


def slurm_two_nodes_fixture(tmp_path_factory) -> tp.Iterator[SlurmCluster]:
    """Generator for a module-scoped pytest fixture: a running two-node cluster (``SlurmCluster(nodes=2)``: two slurmd
    daemons on this machine, nodes ``127.0.0.1`` and ``127.0.0.2``, see :func:`two_node_names`), started and stopped
    like the one-node cluster. While it runs, ``SLURM_CONF`` names it (a one-node session cluster that is also up gets
    ``SLURM_CONF`` back when this one stops); fails, like the one-node fixture, when SLURM is there but does not start."""
    import pytest

    ok, reason = slurm_available()
    if not ok:
        pytest.fail(f"SLURM required or installed but unavailable: {reason}", pytrace=False)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm2n"), nodes=2)
    try:
        cluster.start()
    except SlurmStartError as e:
        pytest.fail(f"SLURM required or installed but unavailable: two-node cluster failed to start: {e}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()


SLURM_FIXTURES = ("slurm_cluster", "slurm_two_nodes")  # a test that asks for one of these needs a real SLURM


def _make_fixture():
    import pytest

    @pytest.fixture(scope="session", name="slurm_cluster")
    def slurm_cluster(tmp_path_factory):
        yield from slurm_cluster_fixture(tmp_path_factory)

    return slurm_cluster


def _make_two_node_fixture():
    import pytest

    @pytest.fixture(scope="module", name="slurm_two_nodes")
    def slurm_two_nodes(tmp_path_factory):
        yield from slurm_two_nodes_fixture(tmp_path_factory)

    return slurm_two_nodes


try:
    slurm_cluster = _make_fixture()
    slurm_two_nodes = _make_two_node_fixture()
except ImportError:  # pragma: no cover - importable without pytest (e.g. for manual use)
    pass
