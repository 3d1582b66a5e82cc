"""The first code to run inside the code sandbox: finish the isolation, then exec the program.

:mod:`rollpacker.reward.sandbox` passes this file's text to the sandbox interpreter
(``python -I -S -c SOURCE CONFIG_JSON``). ``CONFIG_JSON`` names the file descriptors the parent
passed in and the ``mode``: ``bwrap``, ``unshare`` (build what bubblewrap would) or ``none``.

Invariants:

- Standard library only, never imported by the trainer: the package may be hidden in the sandbox.
- One byte on ``ready_fd`` just before the exec: no byte means the sandbox failed, not the program.
- In the namespace modes this init stays pid 1 and exits the moment the program does. Whatever the
  program left behind dies with the pid namespace.

Why our own init: its parent-death signal is one the program cannot clear, and as pid 1 its end
ends everything inside. The steps of each mode: ``docs/rewards-and-judge.md``.
"""

import contextlib
import ctypes
import json
import os
import re
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
# Per-mount flags a less privileged namespace may not clear: a read-only remount must repeat them.
LOCKED_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024,
                "nodiratime": 2048, "relatime": 1 << 21}
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 24, 38, 47, 4
CAPABILITY_VERSION_3 = 0x20080522

libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else os.fsencode(s)
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), "mount " + target)


def unescape(field):
    """A mountinfo path field (bytes) as the path: the kernel writes space, tab, newline and backslash as
    octal escapes ("\\040"), every other byte as it is (a UTF-8 name's too)."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field))


def _mount_points():
    """(mount point, its flags) for every mount, from ``/proc/self/mountinfo``."""
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            yield unescape(fields[4]), sum(LOCKED_FLAGS.get(opt, 0) for opt in fields[5].decode().split(","))


def build_file_system(cfg):
    """unshare mode: read-only everything, fresh /proc, masked secrets, tmpfs /tmp and /dev/shm."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for target, flags in _mount_points():
        if target == "/proc" or target.startswith("/proc/"):
            continue  # replaced below
        try:
            _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)
        except OSError as e:  # EACCES, ENOENT: under a directory we cannot enter (nor can the program)
            if e.errno not in (13, 2) or e.errno == 2 and os.path.lexists(target):
                raise
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    keep = {path: os.open(path, os.O_PATH) for path in cfg["keep"]}  # before a tmpfs hides them
    for path in cfg["masked"]:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in cfg["scratch"]:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,mode=1777" % cfg["tmpfs_bytes"])
    for path, fd in keep.items():
        os.makedirs(path, exist_ok=True)
        _mount("/proc/self/fd/%d" % fd, path, None, MS_BIND | MS_REC)  # read-only, as its source is by now
        os.close(fd)
    for path in cfg["masked"]:
        _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_capabilities():
    """No capability survives exec: empty bounding, ambient, inheritable and permitted sets."""
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability: fine
    _check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    _check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def exec_program(cfg, program):
    """Write ``main.py``, set the rlimits, say ready, become the program (empty environment)."""
    with open("main.py", "wb") as f:
        f.write(program)
    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.write(cfg["ready_fd"], b"1")
    os.close(cfg["ready_fd"])
    os.execve(cfg["python"], [cfg["python"], "-I", "main.py"], {})


def reap_until(child):
    """pid 1's job: reap everything; exit with ``child``'s status as soon as it is gone."""
    while True:
        pid, status = os.wait()
        if pid == child:
            os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def main():
    cfg = json.loads(sys.argv[1])
    with os.fdopen(cfg["program_fd"], "rb") as f:
        program = f.read()
    try:
        if cfg["mode"] == "unshare":
            host_pid = int(open("/proc/self/status").read().split("NSpid:")[1].split()[0])  # before /proc is ours
            pid_ns = os.stat("/proc/self/ns/pid").st_ino
            build_file_system(cfg)
            os.write(cfg["info_fd"], json.dumps({"child-pid": host_pid, "pid-namespace": pid_ns}).encode())
        with contextlib.suppress(OSError):
            os.close(cfg["info_fd"])  # bwrap wrote it already, or nobody will
        os.chdir(cfg["workdir"])
        if cfg["mode"] != "none":
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores the signals it does not handle
            os.setsid()  # killpg(0) in the program must not reach the outer process
            child = os.fork()
            if child:
                os.close(cfg["ready_fd"])
                reap_until(child)
        if cfg["mode"] == "unshare":
            drop_capabilities()
        if cfg["mode"] == "none":  # no pid 1 takes the program down with the worker that runs it: the kernel does
            _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "pdeathsig")
            if os.getppid() != cfg["parent"]:  # it died before the line above
                os._exit(125)
        exec_program(cfg, program)
    except OSError as e:
        sys.stderr.write("sandbox setup failed: %s\n" % e)
        os._exit(125)


if __name__ == "__main__":  # so under ``python -c``; importing this file does nothing
    main()
