"""The code sandbox against real hostile programs, the harness's verdicts, adaptive timeouts, the CLI.

Every hostile case must end with this process alive, no process left in any sandbox, the host's
files unchanged, no secret printed, and a failing verdict within its time limit. The sandbox runs
for real: if no isolation works here the tests fail with the message that says how to enable it
(``.ci/run`` installs bubblewrap).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from support.jobs import sandboxed_pids

from rollpacker.reward import RewardConfig, RewardError
from rollpacker.reward import sandbox as sandbox_module
from rollpacker.reward.code import AdaptiveTimeout, case_key, code_reward, extract_code
from rollpacker.reward.sandbox import Run, Sandbox, SandboxConfig, SandboxUnavailable, same_output, verdict

TIMEOUT = 1.0  # per test case; every case must be over well within TIMEOUT + SLACK
SLACK = 4.0
SECRET = "rollpacker-test-secret-7f3a9c"


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def box() -> Sandbox:
    try:
        return Sandbox(SandboxConfig())
    except SandboxUnavailable as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def victim():
    """Host files the sandbox can see (read-only) but any user could write: only the sandbox protects them."""
    parent = "/var/tmp" if os.path.isdir("/var/tmp") else None
    root = Path(tempfile.mkdtemp(prefix="rollpacker-victim-", dir=parent))
    (root / "data.txt").write_text("precious\n")
    os.chmod(root, 0o777)
    os.chmod(root / "data.txt", 0o666)
    yield root
    for p in sorted(root.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    root.rmdir()


@pytest.fixture
def contained(victim, monkeypatch):
    """Checks after a case: no sandbox process left, the victim files unchanged."""
    monkeypatch.setenv("ROLLPACKER_SECRET_TOKEN", SECRET)
    before_pids, before_files = sandboxed_pids(), _snapshot(victim)
    yield victim
    assert sandboxed_pids() <= before_pids, "a sandboxed process outlived its run"
    assert _snapshot(victim) == before_files, "the sandbox changed host files"


HOSTILE = {
    "busy_loop": ("while True:\n    pass\n", {"TIMEOUT"}),
    "sleep_forever": ("import time\ntime.sleep(1e6)\n", {"TIMEOUT"}),
    "ignore_alarm_and_term": (
        "import signal, time\n"
        "for s in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
        "    signal.signal(s, signal.SIG_IGN)\n"
        "signal.alarm(1)\n"
        "while True:\n    time.sleep(0.01)\n",
        {"TIMEOUT"},
    ),
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        {"TIMEOUT", "RUNTIME_ERROR"},
    ),
    "thread_bomb": (
        "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(100,)).start()\n",
        {"TIMEOUT", "RUNTIME_ERROR"},
    ),
    "double_fork_daemon": (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.close(0); os.close(1); os.close(2)\n"
        "        time.sleep(1.5)\n"
        "        for path in ('{victim}/data.txt', '{victim}/daemon.txt', '/tmp/daemon.txt'):\n"
        "            try:\n"
        "                open(path, 'w').write('daemon was here')\n"
        "            except OSError:\n"
        "                pass\n"
        "        time.sleep(1e6)\n"
        "    os._exit(0)\n"
        "print('parent done')\n",
        {"WRONG"},
    ),
    "allocate_10gb": ("x = bytearray(10 * 1024 ** 3)\nprint(len(x))\n", {"MEMORY"}),
    "raise_own_limits": (
        "import resource\nresource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)\n",
        {"RUNTIME_ERROR"},
    ),
    "stdout_1gb": (
        "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)\n",
        {"OUTPUT_LIMIT"},
    ),
    "endless_stdout": ("while True:\n    print('y' * 1000)\n", {"OUTPUT_LIMIT"}),
    "big_file": (
        "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'z' * (1 << 20))\n",
        {"RUNTIME_ERROR"},
    ),
    "write_outside_workdir": (
        "import os\n"
        "for path in ('{victim}/data.txt', '{victim}/new.txt', '/etc/rollpacker', '/usr/rollpacker', "
        "'/root/rollpacker', '/var/tmp/rollpacker', '/dev/shm/rollpacker', '/proc/sys/kernel/hostname'):\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('pwned')\n"
        "    except OSError:\n"
        "        pass\n"
        "for path in ('{victim}/data.txt', '{victim}'):\n"
        "    try:\n"
        "        os.chmod(path, 0), os.unlink(path) if path.endswith('txt') else os.rmdir(path)\n"
        "    except OSError:\n"
        "        pass\n",
        {"WRONG"},
    ),
    "read_proc_1_environ": (
        "import os\n"
        "for pid in ['1', 'self'] + [p for p in os.listdir('/proc') if p.isdigit()]:\n"
        "    try:\n"
        "        print(open(f'/proc/{{pid}}/environ', 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(e)\n",
        {"WRONG"},
    ),
    "print_environment": (
        "import os, subprocess\nprint(dict(os.environ))\nprint(subprocess.run(['env'], capture_output=True).stdout)\n",
        {"WRONG"},
    ),
    "network_connect": (
        "import socket\n"
        "for address in (('127.0.0.1', {port}), ('1.1.1.1', 53), ('8.8.8.8', 443)):\n"
        "    try:\n"
        "        socket.create_connection(address, timeout=0.3)\n"
        "        print('connected', address)\n"
        "    except OSError:\n"
        "        pass\n",
        {"WRONG"},
    ),
    "kill_everything": (
        "import os, time\n"
        "if os.fork() == 0:\n    time.sleep(100)\n"
        "for pid in (-1, 1, os.getppid()):\n"
        "    try:\n        os.kill(pid, 9)\n    except OSError:\n        pass\n"
        "print('still here')\n",
        {"WRONG"},
    ),
    "killpg_own_group": ("import os\nos.killpg(0, 9)\n", {"RUNTIME_ERROR", "WRONG"}),
    "sys_exit_0_first": ("import sys\nsys.exit(0)\nprint(42)\n", {"WRONG"}),
    "os_exit_0_first": ("import os\nos._exit(0)\n", {"WRONG"}),
    "prefix_of_expected": ("print('1 2')\n", {"WRONG"}),
    "ctypes_segfault": ("import ctypes\nctypes.string_at(0)\n", {"RUNTIME_ERROR"}),
    "deep_recursion": (
        "import sys\nsys.setrecursionlimit(10 ** 8)\ndef f(n):\n    return f(n + 1) + 1\nf(0)\n",
        {"RUNTIME_ERROR", "MEMORY", "TIMEOUT"},  # a segfault, or the heap of 3.11's frames fills first
    ),
    "invalid_utf8_and_nul": ("import sys\nsys.stdout.buffer.write(b'1 2 3 4\\xff\\xfe\\x00\\n')\n", {"WRONG"}),
    "stdin_at_eof": ("a = input()\nb = input()\nprint(a, b)\n", {"RUNTIME_ERROR"}),
    "spin_on_eof": ("import sys\nwhile True:\n    sys.stdin.read()\n", {"TIMEOUT"}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_program_is_contained(box, contained, name):
    program, verdicts = HOSTILE[name]
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    program = program.format(victim=contained, port=listener.getsockname()[1])
    start = time.monotonic()
    run = box.run(program, "1 2\n", TIMEOUT)
    assert time.monotonic() - start < TIMEOUT + SLACK
    assert verdict(run, "1 2 3 4") in verdicts, (run, name)
    assert SECRET.encode() not in run.stdout + run.stderr
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached this process over the network
    listener.close()
    if name == "double_fork_daemon":
        time.sleep(2)  # when it would have written


@pytest.mark.parametrize("isolation", ["unshare"])
@pytest.mark.parametrize("name", ["write_outside_workdir", "read_proc_1_environ", "network_connect",
                                  "double_fork_daemon", "fork_bomb", "kill_everything", "allocate_10gb"])
def test_other_backend_contains_too(contained, isolation, name):
    """The fallback backend passes the isolation cases as well (skipped where it cannot run)."""
    try:
        other = Sandbox(SandboxConfig(isolation=isolation))
    except SandboxUnavailable as e:
        pytest.skip(f"{isolation} unavailable here: {e}")
    program, verdicts = HOSTILE[name]
    program = program.format(victim=contained, port=9)
    result = other.check(program, {"input": "1 2\n", "output": "1 2 3 4"}, TIMEOUT)
    assert result.verdict in verdicts, result
    if name == "double_fork_daemon":
        time.sleep(2)


MOUNTS = """
set -e
mount --make-rprivate /
for d in "$@"; do mkdir -p "$d" && mount -t tmpfs -o mode=1777,size=1m tmpfs "$d"; done
exec "$PYTHON" - "$@" <<'END'
import sys
from rollpacker.reward.sandbox import Sandbox, SandboxConfig
program = (f"for d in {sys.argv[1:]!r}:\\n"
           "    try: open(d + '/w', 'w'); print(d, 'WRITABLE')\\n"
           "    except OSError as e: print(d, e.strerror)\\n")
run = Sandbox(SandboxConfig(isolation="unshare")).run(program, "", 10)
print(run.stdout.decode(), run.stderr.decode()[-2000:])
END
"""


def test_unshare_makes_mounts_with_any_name_read_only(victim):
    """unshare mode remounts every mount read-only by its mountinfo path: a UTF-8 name (or a space) was decoded
    wrong, its remount failed as "no such file", and the mount stayed writable in the sandbox. (The mounts are
    made in a mount namespace of the test's own; the sandbox hides /tmp.)"""
    tmp_path = victim
    names = [str(tmp_path / "mnt_ascii"), str(tmp_path / "mnt_\u00e9t\u00e9"), str(tmp_path / "with space")]
    try:
        probe = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs tmpfs {tmp_path}"],
                               capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        probe = None
    if probe is None or probe.returncode:
        pytest.skip(f"cannot make mounts here (needs root and unshare): {probe and probe.stderr.strip()}")
    done = subprocess.run(["unshare", "--mount", "bash", "-c", MOUNTS, "mounts", *names], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert sorted(done.stdout.split("\n")[:3]) == sorted(f"{d} Read-only file system" for d in names), (
        done.stdout + done.stderr)


def test_sandbox_view_of_the_machine(box):
    """What a program sees: no capability, no network but lo, an empty environment, /tmp, an empty /run,
    its own pids."""
    program = (
        "import os, socket\n"
        "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
        "print(int(status['CapEff'], 16), int(status['CapPrm'], 16))\n"
        "print(sorted(name for _, name in socket.if_nameindex()))\n"
        "print(sorted(k for k in os.environ if k not in ('LC_CTYPE', 'PWD')))\n"
        "print(os.getcwd(), os.listdir('/run'))\n"
        "print(len([p for p in os.listdir('/proc') if p.isdigit()]) <= 3)\n"
    )
    run = box.run(program, "", 10)
    assert run.exit_code == 0, run.stderr
    assert run.stdout.decode().split("\n")[:5] == ["0 0", "['lo']", "[]", "/tmp []", "True"]


def test_correct_program_passes_whatever_its_exit_code(box):
    """The verdict is the harness's: right output then a crash still passes; wrong output with exit 0 fails."""
    add = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert box.check(add, {"input": "2 3\n", "output": "5"}, 5).verdict == "PASS"
    assert box.check(add + "raise SystemExit(3)\n", {"input": "2 3\n", "output": "5\n\n"}, 5).verdict == "PASS"
    assert box.check(add, {"input": "2 2\n", "output": "5"}, 5).verdict == "WRONG"


def test_verdict_order():
    """Harness first: a sandbox that never started, the output cap, the clock; then the output; then why it failed."""
    run = lambda **kw: Run(**{"stdout": b"5\n", "stderr": b"", "exit_code": 0, "seconds": 0.1, "cpu_seconds": 0.1,
                              "started": True, **kw})
    assert verdict(run(), "5") == "PASS"
    assert verdict(run(started=False), "5") == "SANDBOX_ERROR"
    assert verdict(run(output_limited=True, exit_code=None), "5") == "OUTPUT_LIMIT"
    assert verdict(run(timed_out=True, exit_code=None), "5") == "TIMEOUT"
    assert verdict(run(exit_code=128 + 24), "5") == "TIMEOUT"  # SIGXCPU: the CPU rlimit
    assert verdict(run(exit_code=139), "5") == "PASS"  # crashed after printing the answer
    assert verdict(run(stdout=b"", exit_code=1, stderr=b"...\nMemoryError\n"), "5") == "MEMORY"
    assert verdict(run(stdout=b"4\n", exit_code=1), "5") == "RUNTIME_ERROR"
    assert verdict(run(stdout=b"4\n"), "5") == "WRONG"


def test_same_output():
    assert same_output(b"1 2  \n3\n\n", "1 2\n3")
    assert same_output(b"x\r\n", "x")
    assert not same_output(b"1 2", "1 2 3")
    assert not same_output(b"\xff4", "4")
    assert not same_output(b" 4", "4")


def test_unavailable_isolation_refuses_and_says_how(monkeypatch):
    def missing(name):
        raise FileNotFoundError(f"{name} is not installed")

    monkeypatch.setattr(sandbox_module, "_RESOLVED", {})
    monkeypatch.setattr(sandbox_module, "_tool", missing)
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap") as e:
        Sandbox(SandboxConfig())
    assert "--reward.sandbox.isolation none" in str(e.value)
    assert "bwrap" in str(e.value) and "unshare" in str(e.value) and "memory_mb" not in str(e.value)


def test_limits_that_leave_the_interpreter_no_room_are_named_not_the_isolation(box, monkeypatch):
    """memory_mb=8 (the interpreter cannot map its libraries) was told to install bubblewrap."""
    monkeypatch.setattr(sandbox_module, "_RESOLVED", {})
    with pytest.raises(SandboxUnavailable, match=r"started and died: .*\(reward.sandbox.memory_mb=8, num_files="):
        Sandbox(SandboxConfig(memory_mb=8))


def test_the_interpreter_is_found_on_path_and_a_missing_one_is_named_not_the_isolation(monkeypatch):
    """A missing reward.sandbox.python was told "no OS isolation works here ... install bubblewrap"."""
    monkeypatch.setattr(sandbox_module, "_RESOLVED", {})
    with pytest.raises(SandboxUnavailable, match=r"reward.sandbox.python='/no/python3' is no executable here") as e:
        Sandbox(SandboxConfig(python="/no/python3"))
    assert "bubblewrap" not in str(e.value)
    if not os.path.exists("/usr/bin/python3"):
        pytest.skip("no /usr/bin/python3 (the interpreter the sandbox's user can run) here")
    monkeypatch.setenv("PATH", "/usr/bin")
    box = Sandbox(SandboxConfig(python="python3"))
    assert box.python == "/usr/bin/python3" and box.run("print(6 * 7)", "", 5).stdout == b"42\n"


def test_auto_falls_back_to_unshare(monkeypatch):
    real_tool = sandbox_module._tool

    def no_bwrap(name):
        if name == "bwrap":
            raise FileNotFoundError("bwrap is not installed")
        return real_tool(name)

    monkeypatch.setattr(sandbox_module, "_RESOLVED", {})
    monkeypatch.setattr(sandbox_module, "_tool", no_bwrap)
    try:
        box = Sandbox(SandboxConfig())
    except SandboxUnavailable as e:
        pytest.skip(f"unshare unavailable here: {e}")
    assert box.isolation == "unshare" and box.run("print(6 * 7)", "", 5).stdout == b"42\n"


def test_opting_out_runs_without_isolation(victim):
    """isolation=none runs code, rlimits only; and the victim files are reachable: the checks above have teeth."""
    unisolated = Sandbox(SandboxConfig(isolation="none"))
    assert unisolated.run("print(6 * 7)", "", 5).stdout == b"42\n"
    (victim / "spare.txt").write_text("spare\n")
    os.chmod(victim / "spare.txt", 0o666)
    unisolated.run(f"open('{victim}/spare.txt', 'w').write('changed')", "", 5)
    assert (victim / "spare.txt").read_text() == "changed"
    (victim / "spare.txt").unlink()
    # a child left holding stdout: its output is what it wrote before it exited, not a TIMEOUT; the child is killed
    marker = "rollpacker-left-child-3b1e"
    child = f"import time; time.sleep(30)  # {marker}"
    program = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\nprint(42)\n"
    run = unisolated.run(program, "", 5)
    assert (run.stdout, run.exit_code, run.timed_out) == (b"42\n", 0, False) and run.seconds < 4
    assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 1  # none found


UNISOLATED_WORKER = """
import sys
from rollpacker.reward.sandbox import Sandbox, SandboxConfig

program = f"import os, time\\nopen({sys.argv[1]!r}, 'w').write(str(os.getpid()))\\ntime.sleep(60)"
Sandbox(SandboxConfig(isolation="none")).run(program, "", 60)
"""


def test_a_program_run_without_isolation_dies_with_the_worker_that_runs_it():
    """Without a pid 1 of its own, a program outlived the worker that ran it when the worker's end skipped the
    kill (a RETIRE landing before it; SIGKILL here): an orphan running the model's code. Now the kernel kills it
    as its parent dies."""
    where = Path(tempfile.mkdtemp())  # in /tmp: the program runs as nobody under root
    os.chmod(where, 0o777)
    said = where / "pid"
    worker = subprocess.Popen([sys.executable, "-c", UNISOLATED_WORKER, str(said)])
    try:
        deadline = time.monotonic() + 30
        while not (said.exists() and said.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        worker.kill()
        worker.wait()
    pid = int(said.read_text())
    shutil.rmtree(where)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    if alive:
        os.kill(pid, 9)
    assert not alive, "the program outlived its worker"


def test_sandbox_config_validates():
    with pytest.raises(ValueError,
                       match="reward.sandbox.isolation must be one of auto, bwrap, unshare, none, got 'docker'"):
        SandboxConfig(isolation="docker")
    with pytest.raises(ValueError, match="reward.sandbox.memory_mb must be positive, got 0"):
        SandboxConfig(memory_mb=0)


def test_a_null_input_is_empty_stdin_as_the_row_check_accepts_it(box):
    """Arrow and ``datasets`` fill a test's missing ``input`` with None: it runs, and keys, as no input."""
    hello = {"input": None, "output": "hi"}
    assert box.check("print('hi')\n", hello, 5).verdict == "PASS"
    assert case_key(hello) == case_key({"output": "hi"})


def test_extract_code():
    assert extract_code("Here:\n```python\nprint(1)\n```\nand better:\n```py\nprint(2)\n```") == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("print(4)") is None
    # a block of another language first: its closing fence opened no block (the prose after it ran as the program)
    assert extract_code("Input:\n```text\n5\n```\nSolution:\n```python\nprint(input())\n```\n") == "print(input())\n"
    assert extract_code("```bash\npython x.py\n```") is None
    # a bare block after the solution is its sample output, not the program (verl's and open-r1's last python block)
    assert extract_code("```python\nprint(1 + 2)\n```\nFor input `1 2` it prints:\n```\n3\n```") == "print(1 + 2)\n"
    assert extract_code("```python solution.py\nprint(6)\n```") == "print(6)\n"  # text after the label
    assert extract_code("```python\r\nprint(7)\r\n```") == "print(7)\r\n"


def test_code_reward(box):
    tests = [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"}]
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\nprint(5)\n```"
    score, info = code_reward(right, tests, [5, 5])
    assert score == 1.0 and info["verdicts"] == ["PASS", "PASS"] and len(info["seconds"]) == 2
    score, info = code_reward(wrong, tests, [5, 5])
    assert score == 0.0 and info["verdicts"] == ["PASS", "WRONG"]
    assert code_reward("no code here", tests, [5, 5]) == (0.0, {"verdicts": [], "seconds": []})
    with pytest.raises(RewardError, match="a row needs at least one test"):
        code_reward(right, [], [])


def test_adaptive_timeout():
    t1, t2 = {"input": "1", "output": "1"}, {"input": "2", "output": "2"}
    timeout = AdaptiveTimeout.from_config(RewardConfig())  # the defaults: 1.5, 2 s, 30 s
    assert (timeout.factor, timeout.minimum, timeout.maximum) == (1.5, 2.0, 30.0)
    assert timeout.timeouts([t1, t2]) == [2.0, 2.0]  # no correct run yet: T_min
    timeout.observe([t1, t2], {"verdicts": ["PASS", "PASS"], "seconds": [4.0, 0.1]})
    assert timeout.timeouts([t1, t2]) == [6.0, 2.0]  # 1.5 * 4; max(2, 0.15)
    timeout.observe([t1, t2], {"verdicts": ["PASS", "PASS"], "seconds": [3.0, 50.0]})
    assert timeout.timeouts([t1, t2]) == [6.0, 30.0]  # the longest correct run is kept; capped at T_max
    timeout.observe([t1, t2], {"verdicts": ["PASS", "WRONG"], "seconds": [9.0, 1.0]})  # not correct: ignored
    timeout.observe([t1, t2], {"verdicts": ["PASS"], "seconds": [9.0]})  # stopped early: ignored
    assert timeout.timeouts([t1, t2]) == [6.0, 30.0]
    state = json.loads(json.dumps(timeout.state_dict()))  # plain data
    resumed = AdaptiveTimeout(factor=1.5, minimum=2.0, maximum=30.0)
    resumed.load_state_dict(state)
    assert resumed.timeouts([t1, t2]) == [6.0, 30.0] and resumed.anchors == {case_key(t1): 4.0, case_key(t2): 50.0}


def test_cli(tmp_path, capsys):
    (tmp_path / "prog.py").write_text("print(sum(map(int, input().split())))\n")
    tests = [{"input": "1 2", "output": "3"}, {"input": "2 2", "output": "5"}, {"input": "", "output": "0"}]
    (tmp_path / "tests.json").write_text(json.dumps(tests))
    cmd = [sys.executable, "-m", "rollpacker.reward.code", "--code", str(tmp_path / "prog.py"),
           "--tests", str(tmp_path / "tests.json"), "--timeout", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    verdict = json.loads(lines[0])
    assert verdict["passed"] is False
    assert verdict["verdict"] == ["PASS", "WRONG", "RUNTIME_ERROR"]
    assert len(verdict["seconds"]) == 3 and all(0 < s < 5 for s in verdict["seconds"])
    # bad input exits 2 (1 is "a test failed") with one line, not a traceback; [] passed, which the trainer refuses
    from rollpacker.reward.code import main

    for text, timeout, said in (('[{"input": "1 2", "output": 3}]', "5", "must hold a non-empty list"),
                                ("[]", "5", "must hold a non-empty list"), ("{bad", "5", "tests.json is not JSON"),
                                (json.dumps(tests), "inf", "--timeout (inf) be in (0, 3600]")):
        (tmp_path / "tests.json").write_text(text)
        assert main(cmd[3:-1] + [timeout]) == 2 and said in capsys.readouterr().err
