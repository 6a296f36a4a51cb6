"""The sandbox's inside: run as a script (`python -I -S confine.py STATUS_FD MARKER_FD`) by sandbox.py, standard
library only, nothing of nanoqwen. It reads its configuration (the plan, the program, the secret marker) from
stdin, then stdin becomes /dev/null. Three processes:

- the supervisor (the process sandbox.py started) enters a new PID namespace (through a new user namespace
  when not root), forks the init, enforces the wall clock on it, and writes its end on STATUS_FD;
- the init (PID 1 of that namespace) enters new mount, network and IPC namespaces, builds a root of its
  own (a tmpfs holding the read-only interpreter and libraries, /dev/null and friends, its own /proc and a
  size-limited tmpfs /work), pivots into it, drops every privilege, reports what applied on STATUS_FD,
  forks the program and reaps. When it exits the kernel kills everything left in its PID namespace;
- the program runs the untrusted code, then the harness's check; only if that returns does it write the
  secret on MARKER_FD and exit 0.
Each step that the OS refuses is recorded in the report, and the run goes on without it; dropping root is
never skipped."""

import ctypes
import json
import os
import resource
import select
import signal
import sys
import time
import traceback

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x1000, 0x4000, 0x40000
ATTR_RDONLY, ATTR_NOSUID, ATTR_NODEV, ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8  # MOUNT_ATTR_*
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_MOUNT_SETATTR = 442  # the same on every architecture
PR_SET_DUMPABLE, PR_CAPBSET_READ, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 4, 23, 24, 38, 47


def check(rc):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def unshare(flags):  # os.unshare exists from Python 3.12 only
    check(libc.unshare(flags))


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)))


def set_attr(path, attr, recursive):
    """mount_setattr(2): add ``attr`` to the mount at ``path`` (and the mounts below it if ``recursive``)."""
    args = (ctypes.c_uint64 * 4)(attr, 0, 0, 0)  # attr_set, attr_clr, propagation, userns_fd
    check(libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(-100), path.encode(),  # AT_FDCWD
                       ctypes.c_uint(0x8000 if recursive else 0), args, ctypes.c_size_t(32)))  # AT_RECURSIVE


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


# --- the init: a root of its own ---------------------------------------------------------------------------

def build_root(cfg, applied):
    """Mount the new root on cfg["root"] (an empty directory of the host) and pivot into it."""
    root, uid = cfg["root"], cfg["uid"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    for step in cfg["plan"]:
        kind, path = step[0], root + step[1]
        if kind == "dir":
            os.makedirs(path, exist_ok=True)
        elif kind == "link":
            os.symlink(step[2], path)
        else:  # "bind" (read-only) or "dev" (a device node, writable): the host's path onto the same path here
            os.makedirs(path if os.path.isdir(step[1]) else os.path.dirname(path), exist_ok=True)
            if not os.path.isdir(step[1]):
                open(path, "w").close()
            mount(step[1], path, None, MS_BIND | MS_REC)
            set_attr(path, ATTR_NOSUID | ATTR_NOEXEC if kind == "dev" else ATTR_RDONLY | ATTR_NOSUID | ATTR_NODEV,
                     recursive=True)
    os.mkdir(root + "/proc")
    try:  # in its new PID namespace, /proc shows only its own processes; in the host's, none is mounted
        if not applied["processes"].startswith("own"):
            raise OSError(0, "no PID namespace of its own")
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        applied["proc"] = "its own processes only (own PID namespace)"
    except OSError as e:  # e.g. a user namespace under a masked /proc: then no /proc at all
        applied["proc"] = "none (%s)" % e.strerror
    os.mkdir(root + "/work")
    mount("tmpfs", root + "/work", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
          "size=%dk,nr_inodes=%d,mode=0700,uid=%d,gid=%d" % (cfg["disk_mb"] << 10, cfg["disk_mb"] << 6, uid, uid))
    set_attr(root, ATTR_RDONLY, recursive=False)  # the skeleton itself; /work stays writable
    os.chdir(root)
    check(libc.syscall(ctypes.c_long(SYS_PIVOT_ROOT[os.uname().machine]), b".", b"."))
    check(libc.umount2(b".", 2))  # MNT_DETACH: the host's tree is gone from this namespace
    os.chdir("/work")
    applied["filesystem"] = ("own root: read-only interpreter and libraries, its directory /work "
                             "(tmpfs of %d MiB: the disk limit)" % cfg["disk_mb"])


def drop_privileges(cfg, applied):
    """No capability in any set (bounding and ambient included), no_new_privs (setuid bits do nothing), and for
    root a uid of its own (that owns no file and no other process, so RLIMIT_NPROC counts this sandbox)."""
    for cap in range(cfg["cap_last"] + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # refused without CAP_SETPCAP: read back below
    bounding = sum(libc.prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1 for cap in range(cfg["cap_last"] + 1))
    libc.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    who = "the caller's uid"
    if os.getuid() == 0:
        who = "a uid of its own"
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    check(libc.capset(header, (ctypes.c_uint32 * 6)()))  # effective, permitted, inheritable: all empty
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the program (same uid) cannot ptrace the init or open its fds
    applied["user"] = who + ", no capabilities (bounding set %s), no_new_privs" % (
        "empty" if not bounding else "of %d kept: no CAP_SETPCAP to drop them" % bounding)


# Memory that RLIMIT_AS does not count, and the way back to capabilities: refused with EPERM (clone3 with
# ENOSYS, so that the C library falls back to clone, whose flags the filter can read).
SECCOMP_ARCH = {"x86_64": (0xC000003E, {"memfd_create": 319, "shmget": 29, "msgget": 68, "unshare": 272},
                           56, 435),
                "aarch64": (0xC00000B7, {"memfd_create": 279, "shmget": 194, "msgget": 186, "unshare": 97},
                            220, 435)}


def install_seccomp(applied):
    """A seccomp filter (needs no_new_privs): memfd_create (files in memory beside the tmpfs), SysV shared
    memory and message queues (kept after every process detaches), unshare and clone(CLONE_NEWUSER) (a user
    namespace of its own would give it capabilities there, enough to mount a tmpfs of any size)."""
    machine = os.uname().machine
    if machine not in SECCOMP_ARCH:
        applied["syscalls"] = "all (no seccomp filter for %s)" % machine
        return
    arch, denied, clone, clone3 = SECCOMP_ARCH[machine]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    EPERM, ENOSYS, ALLOW, KILL = 0x50000 | 1, 0x50000 | 38, 0x7FFF0000, 0x80000000
    code = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, KILL), (LD, 0, 0, 0),
            (JGE, 0, 1, 0x40000000), (RET, 0, 0, EPERM)]  # x32 syscall numbers on x86_64
    for nr in denied.values():
        code += [(JEQ, 0, 1, nr), (RET, 0, 0, EPERM)]
    code += [(JEQ, 0, 1, clone3), (RET, 0, 0, ENOSYS), (JEQ, 1, 0, clone), (RET, 0, 0, ALLOW),
             (LD, 0, 0, 16), (JSET, 0, 1, CLONE_NEWUSER), (RET, 0, 0, EPERM), (RET, 0, 0, ALLOW)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(code))(*[Filter(*insn) for insn in code])
    check(libc.prctl(22, 2, ctypes.byref(Program(len(code), filters)), 0, 0))  # PR_SET_SECCOMP, MODE_FILTER
    applied["syscalls"] = "refused: " + ", ".join(sorted(denied)) + ", clone(CLONE_NEWUSER)"


def set_limits(cfg, applied):
    limits = dict(cfg["rlimits"])
    if applied["processes"].startswith("shared"):
        # no namespace and no uid of its own: RLIMIT_NPROC counts every task of the caller's uid, so the limit
        # is what runs now plus the sandbox's own allowance
        running = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) == os.getpid():
                continue  # the init is part of the allowance
            try:
                with open("/proc/%s/status" % pid) as f:
                    status = dict(line.split(":", 1) for line in f if ":" in line)
                running += int(status["Threads"]) if int(status["Uid"].split()[0]) == os.getuid() else 0
            except (OSError, KeyError, ValueError):
                pass
        limits["RLIMIT_NPROC"] += running
    for name, value in limits.items():  # soft = hard, but CPU: the soft limit sends SIGXCPU, the hard one SIGKILL
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
    applied["memory"] = "RLIMIT_AS %d MiB x %d processes" % (limits["RLIMIT_AS"] >> 20, cfg["rlimits"]["RLIMIT_NPROC"])


def init(cfg, status_fd, marker_fd):
    applied = {"processes": cfg.pop("pid_namespace")}
    try:
        unshare(CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
        applied["network"] = "none (own network namespace: no interface up, no abstract socket of the host)"
    except OSError as e:
        applied["network"] = "host (unshare refused: %s)" % e.strerror
    try:
        unshare(CLONE_NEWNS)
        build_root(cfg, applied)
    except OSError as e:  # run where it is, in the host's directory: no disk limit, the host's files visible
        applied["filesystem"] = "host (own root refused: %s)" % e.strerror
        applied.setdefault("proc", "the host's (no root of its own)")
        os.chdir(cfg["root"])
        os.chown(".", cfg["uid"], cfg["uid"])
    with open("program.py", "w", encoding="utf-8") as f:  # for the traceback's source lines
        f.write(cfg["program"])
    os.chown("program.py", cfg["uid"], cfg["uid"])
    drop_privileges(cfg, applied)
    install_seccomp(applied)
    set_limits(cfg, applied)
    os.write(status_fd, (json.dumps({"applied": applied}) + "\n").encode())
    program = os.fork()
    if program == 0:
        os.close(status_fd)  # the program never speaks for the harness
        run_program(cfg, marker_fd)
    os.close(marker_fd)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as PID 1 it then ignores the program's SIGINT
    while True:  # as PID 1, reap every orphan until the program itself ends
        pid, status = os.wait()
        if pid == program:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)  # a signal as the shell reports it


def run_program(cfg, marker_fd):
    """The untrusted code, then the check, in one namespace; the secret only after the check has returned."""
    # bound before the program runs: it may replace builtins and module attributes (builtins.eval included)
    write, exit_now, flush, evaluate, print_exc = os.write, os._exit, sys.stderr.flush, eval, traceback.print_exc
    secret = cfg.pop("secret").encode()
    namespace = {"__name__": "__main__"}
    try:
        checker = compile(cfg.pop("check") or "None", "<check>", "eval")
        exec(compile(cfg.pop("program"), os.path.abspath("program.py"), "exec"), namespace)
        evaluate(checker, namespace)
    except BaseException:  # SystemExit included: leaving early is not passing
        try:
            print_exc()
            flush()
        finally:
            exit_now(1)
    try:
        flush()
    except BaseException:
        pass  # its stderr is its own: a closed one does not fail a solution
    try:
        write(marker_fd, secret)
    finally:
        exit_now(0)


# --- the supervisor --------------------------------------------------------------------------------------

def supervise(cfg, status_fd, marker_fd):
    with open("/proc/sys/kernel/cap_last_cap") as f:  # read here: the init may have no /proc
        cfg["cap_last"] = int(f.read())
    if os.getuid() == 0:
        flags = CLONE_NEWPID
    else:  # a user namespace mapping only the caller's own ids: caps inside it, none over the host
        cfg["uid"] = os.getuid()
        flags = CLONE_NEWUSER | CLONE_NEWPID
    gid = os.getgid()
    try:
        unshare(flags)
        if flags & CLONE_NEWUSER:
            write_file("/proc/self/setgroups", "deny")
            write_file("/proc/self/uid_map", "%d %d 1" % (cfg["uid"], cfg["uid"]))
            write_file("/proc/self/gid_map", "%d %d 1" % (gid, gid))
        cfg["pid_namespace"] = "own PID namespace (all killed when it ends)"
    except OSError as e:
        cfg["pid_namespace"] = "shared with the host (unshare refused: %s)" % e.strerror
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # after the maps: no process of its uid may open its fds or memory
    deadline = cfg["deadline"]
    child = os.fork()
    if child == 0:
        try:
            os.setpgid(0, 0)
            init(cfg, status_fd, marker_fd)
        except BaseException as e:
            try:
                os.write(status_fd, (json.dumps({"error": "%s: %s" % (type(e).__name__, e)}) + "\n").encode())
                traceback.print_exc()
            finally:
                os._exit(125)
        os._exit(125)  # never reached: the init and the program end with os._exit
    os.close(marker_fd)
    pidfd = os.pidfd_open(child)
    timeout = not select.select([pidfd], [], [], max(deadline - time.monotonic(), 0))[0]
    for kill in (os.kill, os.killpg):  # PID 1 of a namespace takes the namespace with it; else its group
        try:
            kill(child, signal.SIGKILL)  # not reaped yet: the pid and the group id are still the init's
        except ProcessLookupError:
            pass
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    os.write(status_fd, (json.dumps({"exit": code, "timeout": timeout}) + "\n").encode())


def main():
    status_fd, marker_fd = int(sys.argv[1]), int(sys.argv[2])
    cfg = json.loads(sys.stdin.buffer.read())
    null = os.open(os.devnull, os.O_RDONLY)  # not closed: a closed fd 0 would be the program's first open
    os.dup2(null, 0)
    os.close(null)
    supervise(cfg, status_fd, marker_fd)


if __name__ == "__main__":
    main()
