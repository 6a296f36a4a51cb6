"""The execution sandbox (nanoqwen/eval/sandbox.py) on hostile and ordinary programs, each run through its own
API: every escape attempt fails (host files, other processes, privileges, sockets, disk, memory, the report
channel, early exits), the limits hold, a correct solution still passes and a wrong one fails, and nothing
the program started survives it. A test skips only where the OS refused the feature it checks, and says
which (the run's own report names what applied)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from nanoqwen.eval import sandbox
from nanoqwen.eval.confine import SECCOMP_ARCH

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

LIMITS = sandbox.Limits(timeout_s=3.0)
CLONE_NR = SECCOMP_ARCH.get(os.uname().machine, (None, None, -1))[2]  # -1: no filter here, the test skips
SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = "def check(candidate):\n    assert candidate(2, 3) == 5\n"


def live_sandbox_processes() -> list[int]:
    """Live (non-zombie: a zombie's cmdline is empty) processes running this checkout's confine.py."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if sandbox.CONFINE.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def run(program: str, tmp_path, limits=LIMITS, check="") -> sandbox.Outcome:
    roots = tmp_path / "roots"
    roots.mkdir(exist_ok=True)
    out = sandbox.run(program, limits, check, tmp_root=str(roots))
    assert live_sandbox_processes() == [], "a sandboxed process outlived its run"
    assert os.listdir(roots) == [], "the sandbox's mount point was not removed"
    return out


@pytest.fixture(scope="module")
def applied(tmp_path_factory) -> dict:
    out = sandbox.run("pass\n", LIMITS, tmp_root=str(tmp_path_factory.mktemp("probe")))
    assert out.status == "pass", out.detail
    return out.applied


def require(applied: dict, key: str, prefix: str) -> None:
    assert key in applied, applied  # the run got as far as its report
    if not applied[key].startswith(prefix):
        pytest.skip(f"the OS refused it here: {key}: {applied.get(key)}")


def test_correct_passes_wrong_fails(tmp_path):
    assert run(SOLUTION + TESTS, tmp_path, check="check(add)").status == "pass"
    out = run("def add(a, b):\n    return a - b\n" + TESTS, tmp_path, check="check(add)")
    assert (out.status, out.detail) == ("fail", "AssertionError")
    assert run("def f(:\n", tmp_path).detail.startswith("SyntaxError")
    assert run("x = 1 + 1\nassert x == 2\n", tmp_path).status == "pass"  # no check: running to the end passes


@pytest.mark.parametrize("exit_early", [
    "import os\nos._exit(0)\n",                                               # before the tests exist
    "import sys\nsys.exit(0)\n",
    "def add(a, b):\n    import os\n    os._exit(0)\n",                        # inside check
    "def add(a, b):\n    raise SystemExit(0)\n",
    "def add(a, b):\n    import threading, os\n    threading.Thread(target=os._exit, args=(0,)).start()\n"
    "    import time\n    time.sleep(5)\n",
])
def test_early_exit_fails(tmp_path, exit_early):
    """Exit status 0 without the check having returned: no marker, so a failure."""
    out = run(exit_early + "\n" + TESTS, tmp_path, check="check(add)")
    assert out.status == "fail", out


def test_replacing_the_harness_functions_does_not_skip_the_check(tmp_path):
    """A wrong solution that replaces eval, exec, os._exit, os.write and traceback.print_exc before the harness
    runs its check: the harness bound its own before the program ran, so the check still runs and fails."""
    program = ("def add(a, b):\n    return a - b\n" + TESTS +
               "import builtins, os, traceback\n"
               "builtins.eval = builtins.exec = lambda *a, **k: None\n"
               "os._exit = os.write = traceback.print_exc = lambda *a, **k: None\n")
    out = run(program, tmp_path, check="check(add)")
    assert (out.status, out.detail) == ("fail", "AssertionError"), out


def test_forged_report_fails(tmp_path, applied):
    """The program tries to seek and rewrite its stderr, writes a fake report line and fake markers to every
    fd it has, then exits 0: nothing it wrote counts, and the report of what applied is the sandbox's."""
    program = ("import os, sys\n"
               "seekable = []\n"
               "for fd in map(int, os.listdir('/proc/self/fd')):\n"
               "    try:\n"
               "        os.lseek(fd, 0, os.SEEK_SET)\n"
               "        seekable.append(os.readlink(f'/proc/self/fd/{fd}'))\n"
               "    except OSError:\n"
               "        pass\n"
               "fake = b'sandbox: {\"user\": \"forged\"}\\n{\"applied\": {}, \"exit\": 0, \"timeout\": false}\\n' + 32 * b'0'\n"
               "for fd in range(1, 64):\n"
               "    try:\n"
               "        os.write(fd, fake)\n"
               "    except OSError:\n"
               "        pass\n"
               "sys.stderr.write(f'seekable: {seekable}\\n')\n"
               "sys.stderr.flush()\n"
               "os._exit(0)\n")
    out = run(program, tmp_path)
    assert out.status == "fail" and out.applied == applied, out
    out = run(program.replace("os._exit(0)", "raise SystemExit(f'seekable: {seekable}')"), tmp_path)
    assert out.detail == "SystemExit: seekable: ['/dev/null', '/dev/null']", out  # stdin and stdout only


def test_fresh_working_directory_empty_stdin_isolated_interpreter(tmp_path, applied):
    require(applied, "filesystem", "own root")
    program = ("import os, sys\n"
               "assert os.getcwd() == '/work' and sorted(os.listdir('.')) == ['program.py'], os.listdir('.')\n"
               "assert sys.stdin.read() == ''\n"
               "assert sys.flags.isolated == 1 and sys.flags.no_site == 1\n"
               "assert set(os.environ) == {'PATH', 'HOME', 'TMPDIR', 'LC_ALL'}, sorted(os.environ)\n"
               "open('scratch.txt', 'w').write('its own directory is writable')\n"
               "import json, decimal, sqlite3, ssl, subprocess  # extension modules and their libraries load\n"
               "assert subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True).stdout == b'42\\n'\n")
    out = run(program, tmp_path)
    assert out.status == "pass", out.detail


def test_host_files_are_out_of_reach(tmp_path, applied):
    """/etc/shadow, the host's /root, the checkout (this test file) and the host's /tmp do not exist inside; its
    root holds only the mount plan's paths, /proc and /work; writing beside /work fails."""
    require(applied, "filesystem", "own root")
    for path in ("/etc/shadow", __file__, os.getcwd(), "/tmp", "/run", str(tmp_path)):
        out = run(f"print(open({path!r}).read() if __import__('os').path.isfile({path!r}) else "
                  f"__import__('os').listdir({path!r}))\n", tmp_path)
        assert out.status == "fail" and out.detail.startswith("FileNotFoundError"), (path, out.detail)
    plan_paths = {step[1] for step in sandbox.mount_plan()}
    host_only = set(os.listdir("/root") if os.access("/root", os.R_OK) else ())
    host_only -= {p.split("/")[2] for p in plan_paths if p.startswith("/root/")}
    if host_only:  # the host's /root has entries the plan does not name: none may be listed
        out = run(f"import os\nassert set(os.listdir('/root')) & {host_only!r}, 'nothing'\n", tmp_path)
        assert (out.status, out.detail) == ("fail", "AssertionError: nothing"), out
    allowed = {p.split("/")[1] for p in plan_paths} | {"proc", "work"}
    out = run(f"import os\nextra = set(os.listdir('/')) - {allowed!r}\nassert not extra, extra\n"
              "assert os.listdir('/etc') in ([], ['ld.so.cache']), os.listdir('/etc')\n", tmp_path)
    assert out.status == "pass", out.detail
    out = run("open('/escape.txt', 'w')\n", tmp_path)
    assert out.status == "fail" and "Read-only file system" in out.detail, out.detail
    binds = [step[1] for step in sandbox.mount_plan() if step[0] == "bind"]
    out = run(f"import os\nfor path in {binds!r}:\n    assert os.statvfs(path).f_flag & os.ST_RDONLY, path\n", tmp_path)
    assert out.status == "pass", out.detail  # the interpreter and its libraries: read-only mounts


def test_other_processes_are_invisible(tmp_path, applied):
    """A host process with a secret in its command line (a server's API key): neither its /proc entry nor any
    /proc/*/cmdline inside shows it, and the sandbox sees only its own few processes."""
    require(applied, "proc", "its own")
    key = "sk-nanoqwen-test-" + os.urandom(8).hex()
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", key])
    try:
        out = run(f"print(open('/proc/{server.pid}/cmdline').read())\n", tmp_path)
        assert out.status == "fail" and out.detail.startswith("FileNotFoundError"), out.detail
        out = run("import os\n"
                  "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
                  f"found = [p for p in pids if {key!r}.encode() in open(f'/proc/{{p}}/cmdline', 'rb').read()]\n"
                  "assert found, f'not found in {sorted(pids, key=int)}'\n", tmp_path)
        assert (out.status, out.detail) == ("fail", "AssertionError: not found in ['1', '2']"), out
    finally:
        server.kill()
        server.wait()


def test_no_privileges(tmp_path, applied):
    """No capability in any set, no_new_privs, not root, every mount nosuid; becoming root or raising a
    capability fails."""
    require(applied, "user", "a uid of its own" if os.getuid() == 0 else "the caller's")
    require(applied, "proc", "its own")
    program = ("import os\n"
               "status = dict(line.split(':\\t', 1) for line in open('/proc/self/status').read().splitlines())\n"
               "for cap in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb'):\n"
               "    assert status[cap] == '0000000000000000', (cap, status[cap])\n"
               "assert status['NoNewPrivs'] == '1' and os.getuid() != 0 and os.geteuid() != 0\n"
               "for line in open('/proc/self/mountinfo'):\n"
               "    assert 'nosuid' in line.split(' - ')[0], line\n")
    assert run(program, tmp_path).status == "pass"
    out = run("import os\nos.setuid(0)\n", tmp_path)
    assert out.status == "fail" and out.detail.startswith("PermissionError"), out.detail
    raise_cap = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 "header = (ctypes.c_uint32 * 2)(0x20080522, 0)\n"
                 "data = (ctypes.c_uint32 * 6)(1 << 21, 1 << 21, 0, 0, 0, 0)  # CAP_SYS_ADMIN\n"
                 "assert libc.capset(header, data) == 0, 'capset refused: errno %d' % ctypes.get_errno()\n")
    out = run(raise_cap, tmp_path)
    assert (out.status, out.detail) == ("fail", "AssertionError: capset refused: errno 1"), out


def test_setuid_binaries_do_not_run_privileged(tmp_path, applied):
    """A setuid file it can reach would run unprivileged: each one lies on a nosuid mount (and no_new_privs,
    checked above, would void the bit anyway)."""
    require(applied, "filesystem", "own root")
    program = ("import os, stat\n"
               "found = []\n"
               "def walk(path):\n"
               "    for entry in os.scandir(path):\n"
               "        if entry.is_dir(follow_symlinks=False):\n"
               "            walk(entry.path)\n"
               "        elif entry.stat(follow_symlinks=False).st_mode & (stat.S_ISUID | stat.S_ISGID):\n"
               "            found.append(entry.path)\n"
               "for top in os.listdir('/'):\n"
               "    if top != 'proc':\n"
               "        walk('/' + top)\n"
               "usable = [f for f in found if not os.statvfs(f).f_flag & os.ST_NOSUID]\n"
               "assert usable, f'none usable of {len(found)}'\n")
    out = run(program, tmp_path, sandbox.Limits(timeout_s=60.0))  # the whole visible tree: slow on a loaded 2-core CI machine (10 s timed out)
    assert out.status == "fail" and out.detail.startswith("AssertionError: none usable of"), out


def test_host_sockets_are_unreachable(tmp_path, applied):
    """A Unix socket at a host path, an abstract Unix socket and a TCP port on the host's loopback, all
    listening: none can be reached."""
    require(applied, "network", "none")
    require(applied, "filesystem", "own root")
    name = "nanoqwen-test-" + os.urandom(6).hex()
    with socket.socket(socket.AF_UNIX) as by_path, socket.socket(socket.AF_UNIX) as abstract, socket.socket() as tcp:
        by_path.bind(str(tmp_path / "server.sock"))
        abstract.bind("\0" + name)
        tcp.bind(("127.0.0.1", 0))
        for s in (by_path, abstract, tcp):
            s.listen()
        attacks = {f"socket.socket(socket.AF_UNIX).connect({str(tmp_path / 'server.sock')!r})": "FileNotFoundError",
                   f"socket.socket(socket.AF_UNIX).connect('\\0{name}')": "ConnectionRefusedError",
                   f"socket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), timeout=2)": "OSError"}
        for attack, error in attacks.items():
            out = run(f"import socket\n{attack}\n", tmp_path)
            assert out.status == "fail" and out.detail.startswith(error), (attack, out.detail)


@pytest.mark.parametrize("attack, error", [
    ("import os\nos.memfd_create('ram')\n", "PermissionError"),  # a file in memory, beside the tmpfs
    ("assert libc.shmget(0, 1 << 20, 0o1600) >= 0, errno()\n", "AssertionError: 1"),  # SysV shared memory
    ("assert libc.msgget(0, 0o1600) >= 0, errno()\n", "AssertionError: 1"),  # SysV message queue
    ("assert libc.unshare(0x10000000) == 0, errno()\n", "AssertionError: 1"),  # CLONE_NEWUSER: caps again
    (f"assert libc.syscall({CLONE_NR}, 0x10000000 | 17, 0, 0, 0, 0) >= 0, errno()\n",  # clone(NEWUSER|SIGCHLD)
     "AssertionError: 1"),
])
def test_memory_beside_the_address_space_and_new_user_namespaces_are_refused(tmp_path, applied, attack, error):
    """What RLIMIT_AS does not count (memfd, SysV shm and message queues, a tmpfs mounted in a user namespace of
    its own) is refused by the seccomp filter with EPERM."""
    require(applied, "syscalls", "refused")
    prelude = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nerrno = ctypes.get_errno\n"
    out = run(prelude + attack, tmp_path)
    assert out.status == "fail" and out.detail.startswith(error), out.detail


def test_disk_limit_is_total(tmp_path, applied):
    """Many files, each small, together past the tmpfs size: the write fails with ENOSPC."""
    require(applied, "filesystem", "own root")
    program = (f"chunk = b'x' * (1 << 20)\n"
               f"for i in range({2 * LIMITS.disk_mb}):\n"
               f"    open(f'part{{i}}', 'wb').write(chunk)\n")
    out = run(program, tmp_path)
    assert out.status == "fail" and "No space left on device" in out.detail, out.detail


def test_memory_limit_is_total_across_processes(tmp_path):
    """As many processes as it may start each allocate all they can in 8 MiB blocks (anonymous maps: address
    space, which is what the limit bounds, without the time to touch every page): together they stay under
    memory_mb, whatever the host has."""
    limits = sandbox.Limits(timeout_s=10.0)
    program = ("import mmap, os\n"
               "def grab():\n"
               "    blocks = []\n"
               "    try:\n"
               "        while True:\n"
               "            blocks.append(mmap.mmap(-1, 8 << 20))\n"
               "    except OSError:\n"
               "        return len(blocks) * 8\n"
               "r, w = os.pipe()\n"
               "kids = 0\n"
               "try:\n"
               f"    for _ in range({limits.processes}):\n"
               "        if os.fork() == 0:\n"
               "            os.write(w, b'%d\\n' % grab())\n"
               "            os._exit(0)\n"
               "        kids += 1\n"
               "except OSError:\n"
               "    pass\n"
               "os.close(w)\n"
               "total = grab()\n"
               "total += sum(map(int, os.fdopen(r).read().split()))\n"
               f"assert total > {limits.memory_mb}, f'{{total}} MiB in {{kids + 1}} processes'\n")
    out = run(program, tmp_path, limits)
    m = re.fullmatch(r"AssertionError: (\d+) MiB in (\d+) processes", out.detail)
    assert out.status == "fail" and m, out
    assert 0 < int(m[1]) < limits.memory_mb and int(m[2]) == limits.processes - 1  # the init is the 16th


def test_infinite_loop_times_out_on_the_wall_clock(tmp_path):
    """Ended by the supervisor's deadline, not by the harness's backstop (which reports no status): the run's
    own clock (from the supervisor's start, after the one-time mount plan) reads at least the limit."""
    out = run("while True:\n    pass\n", tmp_path)
    assert out.status == "timeout" and "wall time" in out.detail, out
    assert LIMITS.timeout_s <= out.seconds < LIMITS.timeout_s + sandbox.GRACE_S


def test_cpu_limit_counts_cpu_seconds():
    limits = sandbox.Limits(timeout_s=2.5)
    assert limits.rlimits()["RLIMIT_CPU"] == 4  # whole seconds, a second above the wall limit


def test_cpu_limit_ends_a_program_with_sigxcpu(tmp_path):
    """The soft CPU limit, which the program may only lower, ends it with SIGXCPU (a soft limit equal to
    the hard one would be a SIGKILL, indistinguishable from any other kill): reported as a timeout."""
    program = ("import resource\n"
               "resource.setrlimit(resource.RLIMIT_CPU, (1, resource.getrlimit(resource.RLIMIT_CPU)[1]))\n"
               "while True:\n    pass\n")
    limits = sandbox.Limits(timeout_s=60.0)  # room for one CPU second on a busy machine; SIGXCPU ends it long before
    out = run(program, tmp_path, limits)
    assert out.status == "timeout" and out.detail.startswith("CPU time limit"), out
    assert out.seconds < limits.timeout_s


def test_fork_bomb_is_contained(tmp_path):
    """Forks that swallow their own failures and spin: RLIMIT_NPROC caps them, the end of the init ends them."""
    out = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", tmp_path)
    assert out.status == "timeout"  # run() asserts that no process of it is left


def test_process_limit_holds_and_children_are_killed(tmp_path):
    """The program may start at most LIMITS.processes - 2 children (the init and itself count); they all
    sleep long after it exits, and run() checks none of them survives."""
    program = ("import os, time\n"
               "started = 0\n"
               "try:\n"
               "    for _ in range(100):\n"
               "        if os.fork() == 0:\n"
               "            time.sleep(60)\n"
               "            os._exit(0)\n"
               "        started += 1\n"
               "except OSError:\n"
               "    pass\n"
               f"assert started == {LIMITS.processes - 2}, started\n")
    out = run(program, tmp_path)
    assert out.status == "pass", out.detail


def test_setsid_escapee_is_killed(tmp_path):
    program = ("import os, time\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               "    time.sleep(60)\n")
    assert run(program, tmp_path).status == "pass"  # run() asserts the sleeper is gone


def test_capacity_check_refuses_more_than_the_host_has():
    with pytest.raises(sandbox.SandboxError, match="use fewer --jobs"):
        sandbox.check_capacity(sandbox.Limits(memory_mb=1 << 30), jobs=1)
    sandbox.check_capacity(sandbox.Limits(memory_mb=64, disk_mb=1), jobs=1)


UNPRIVILEGED = """
import json, sys
from nanoqwen.eval import sandbox
limits = sandbox.Limits(timeout_s=5.0)
runs = [sandbox.run("print(open('/etc/hostname').read())", limits),
        sandbox.run("def f():\\n    return 1\\ndef check(c):\\n    assert c() == 1\\n", limits, "check(f)")]
print(json.dumps([[o.status, o.detail, o.applied] for o in runs]))
"""


@pytest.mark.skipif(os.getuid() != 0, reason="runs the caller's path as another uid: needs root")
def test_unprivileged_caller_is_confined_through_a_user_namespace():
    """The path a non-root caller takes (a user namespace of its own mapping only its uid), run as nobody:
    confined the same way, where the OS allows unprivileged user namespaces."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sandbox.__file__))))
    for python in (sandbox._interpreter(), "/usr/bin/python3"):
        try:
            proc = subprocess.run([python, "-I", "-c", f"import sys; sys.path.insert(0, {repo!r})\n" + UNPRIVILEGED],
                                  user=65534, group=65534, extra_groups=[], capture_output=True, text=True,
                                  timeout=60, cwd="/")
        except PermissionError:
            continue
        if proc.returncode == 0:
            break
    else:
        pytest.skip("no interpreter here that uid 65534 may run (with nanoqwen importable)")
    (attack, attack_detail, applied), (status, _, _) = json.loads(proc.stdout)
    require(applied, "processes", "own PID namespace")
    require(applied, "filesystem", "own root")
    assert applied["user"].startswith("the caller's uid, no capabilities") and applied["network"].startswith("none")
    assert attack == "fail" and attack_detail.startswith("FileNotFoundError"), attack_detail
    assert status == "pass"
