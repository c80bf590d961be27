"""Layer 3: the engine process holds no power even with arbitrary code running inside Node.

``js/escaped.js`` stands for an attacker who escaped the JavaScript sandbox: a plain Node script
with the whole Node API. It runs in a node process spawned the way the engine spawns its own
(``node_flags`` on the command line, ``preexec`` as ``preexec_fn``) and reports what it managed
to do; these tests check both its report and the side effects it would have left behind. Each
layer is tested on its own too, so that one layer failing cannot hide behind another.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import pytest

from codemode.runtime import find_node
from codemode.runtime.confinement import (
    LAYERS,
    MAX_OPEN_FILES,
    ConfinementError,
    ConfinementReport,
    _preexec_for,
    node_flags,
    preexec,
    probe,
)

JS = Path(__file__).parent / "js"
ESCAPED = JS / "escaped.js"
NODE = Path(find_node()).resolve()
REPORT = probe()
OS_LAYERS = tuple(layer for layer in LAYERS if layer != "node-permission")

# Which layers deny each attempt of escaped.js; an attempt none of the active layers denies is
# not checked (the unconfined test shows that every one of them can succeed).
DENIED_BY: dict[str, frozenset[str]] = {
    **dict.fromkeys(
        (
            "write_tmp",
            "write_allowed",
            "write_cwd",
            "open_read_path_for_write",
            "read_secret",
            "read_parent_environ",
            "proc_self_mem_write",
        ),
        frozenset({"node-permission", "landlock-fs"}),
    ),
    # Landlock (ABI <= 7) governs no metadata: seccomp refuses chmod and utimensat themselves.
    **dict.fromkeys(("chmod_secret", "utimes_secret"), frozenset({"node-permission", "seccomp"})),
    # Landlock denies executing /bin/sh; seccomp denies the fork before it.
    **dict.fromkeys(
        ("spawn_sync", "exec_file_sync", "raw_spawn"),
        frozenset({"node-permission", "landlock-fs", "seccomp"}),
    ),
    "worker": frozenset({"node-permission"}),  # a thread: no power the process lacks
    "kill_parent": frozenset({"landlock-scope"}),
    "renice_other": frozenset({"seccomp"}),  # Node's permission model lets os.setPriority through
    **dict.fromkeys(
        ("tcp_connect", "tcp_socket", "tcp_bind"), frozenset({"landlock-net", "seccomp"})
    ),
    "udp_send": frozenset({"seccomp"}),
    "abstract_unix_connect": frozenset({"landlock-scope"}),
    "unix_connect": frozenset({"seccomp-no-unix"}),  # only with preexec(unix_sockets=False)
}


def needs(*layers: str) -> pytest.MarkDecorator:
    missing = [layer for layer in layers if layer in REPORT.missing()]
    return pytest.mark.skipif(
        bool(missing), reason=f"this kernel lacks {', '.join(missing)}: {REPORT.describe()}"
    )


@dataclass
class Scene:
    """Everything escaped.js could touch, and how to tell afterwards whether it did."""

    tmp: Path
    allowed: Path
    cwd: Path
    secret: Path
    marker: Path
    tcp: socket.socket
    udp: socket.socket
    unix: socket.socket
    abstract: socket.socket
    abstract_name: str
    signals: list[int]
    victim: subprocess.Popen[bytes]

    @property
    def read_paths(self) -> list[Path]:
        return [JS, self.allowed]

    def config(self) -> str:
        return json.dumps(
            {
                "tmp": str(self.tmp),
                "allowed": str(self.allowed),
                "secret": str(self.secret),
                "marker": str(self.marker),
                "port": self.tcp.getsockname()[1],
                "udpPort": self.udp.getsockname()[1],
                "unixPath": str(self.tmp / "unix.sock"),
                "abstractName": self.abstract_name,
                "victim": self.victim.pid,
            }
        )

    def escape(self, flags: list[str], preexec_fn: Callable[[], None] | None) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("NODE_")}
        done = subprocess.run(
            [str(NODE), *flags, str(ESCAPED), self.config()],
            preexec_fn=preexec_fn,
            cwd=self.cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=8,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        outcomes: dict[str, str] = json.loads(done.stdout)
        assert set(outcomes) == set(DENIED_BY), outcomes
        return outcomes

    def accepted(self, listener: socket.socket) -> bool:
        """Whether anyone connected since the last look (the backlog is drained)."""
        listener.setblocking(False)
        count = 0
        while True:
            try:
                connection, _ = listener.accept()
            except BlockingIOError:
                return count > 0
            connection.close()
            count += 1

    def received(self) -> bool:
        self.udp.setblocking(False)
        count = 0
        while True:
            try:
                self.udp.recv(64)
            except BlockingIOError:
                return count > 0
            count += 1

    def take_effects(self) -> dict[str, bool]:
        """The traces the attempts left, whatever escaped.js says; cleared for the next run."""
        files = {
            "write_tmp": self.tmp / "escaped-tmp.txt",
            "write_allowed": self.allowed / "escaped-allowed.txt",
            "write_cwd": self.cwd / "escaped-cwd.txt",
            "spawn_sync": self.marker,
        }
        effects = {name: file.exists() for name, file in files.items()}
        for file in files.values():
            file.unlink(missing_ok=True)
        secret = self.secret.stat()
        effects |= {
            "chmod_secret": secret.st_mode & 0o777 != SECRET_MODE,
            "utimes_secret": secret.st_mtime < SECRET_MTIME,
        }
        self.secret.chmod(SECRET_MODE)
        os.utime(self.secret, (SECRET_MTIME, SECRET_MTIME))
        effects["renice_other"] = os.getpriority(os.PRIO_PROCESS, self.victim.pid) != 0
        if effects["renice_other"]:  # a nice value cannot be lowered without privileges
            self.victim.kill()
            self.victim.wait()
            self.victim = start_victim()
        effects |= {
            "tcp_connect": self.accepted(self.tcp),
            "udp_send": self.received(),
            "unix_connect": self.accepted(self.unix),
            "abstract_unix_connect": self.accepted(self.abstract),
            "kill_parent": bool(self.signals),
        }
        self.signals.clear()
        return effects

    def check(self, outcomes: dict[str, str], layers: set[str]) -> None:
        """Every attempt some layer in ``layers`` denies failed, and left no trace."""
        denied = {name for name, by in DENIED_BY.items() if by & layers}
        succeeded = {name for name in denied if outcomes[name] == "ok"}
        traces = {
            name for name, happened in self.take_effects().items() if happened and name in denied
        }
        assert not succeeded and not traces, (succeeded, traces, outcomes)


SECRET_MODE = 0o600
SECRET_MTIME = 2_000_000_000


def start_victim() -> subprocess.Popen[bytes]:
    """Another process of this user, at nice 0, that the escaped script must not reach."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.setpriority(os.PRIO_PROCESS, victim.pid, 0)
    return victim


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[Scene]:
    allowed = tmp_path / "allowed"
    cwd = tmp_path / "cwd"
    allowed.mkdir()
    cwd.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret")
    secret.chmod(SECRET_MODE)
    os.utime(secret, (SECRET_MTIME, SECRET_MTIME))
    signals: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        signals.append(signum)

    previous = signal.signal(signal.SIGUSR2, record)
    tcp = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(tmp_path / "unix.sock"))
    unix.listen()
    abstract_name = f"codemode-confinement-test-{os.getpid()}-{id(tmp_path)}"
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0{abstract_name}")
    abstract.listen()
    scene = Scene(
        tmp_path,
        allowed,
        cwd,
        secret,
        tmp_path / "marker",
        tcp,
        udp,
        unix,
        abstract,
        abstract_name,
        signals,
        start_victim(),
    )
    try:
        yield scene
    finally:
        scene.victim.kill()
        scene.victim.wait()
        for listener in (tcp, udp, unix, abstract):
            listener.close()
        signal.signal(signal.SIGUSR2, previous)


# --- the escaped script, layer by layer ------------------------------------------------------


def test_unconfined_the_escaped_script_has_every_power(scene: Scene) -> None:
    """The probes can fail: without confinement each of them succeeds."""
    outcomes = scene.escape([], None)
    assert {name: outcomes[name] for name in DENIED_BY} == dict.fromkeys(DENIED_BY, "ok")
    effects = scene.take_effects()
    assert all(effects.values()), effects


def test_node_permission_model_alone(scene: Scene) -> None:
    outcomes = scene.escape(node_flags(scene.read_paths), None)
    scene.check(outcomes, {"node-permission"})
    assert outcomes["write_allowed"] == "ERR_ACCESS_DENIED"


@needs(*OS_LAYERS)
def test_os_layers_alone_hold_with_the_whole_node_api(scene: Scene) -> None:
    """No --permission: the script has all of Node, as if the permission model were bypassed."""
    outcomes = scene.escape([], preexec(scene.read_paths, [NODE]))
    scene.check(outcomes, set(OS_LAYERS))
    assert outcomes["write_tmp"] == "EACCES"
    assert outcomes["tcp_connect"] == "EPERM"  # seccomp refuses the socket before Landlock


@needs(*LAYERS)
def test_all_layers_together(scene: Scene) -> None:
    outcomes = scene.escape(node_flags(scene.read_paths), preexec(scene.read_paths, [NODE]))
    scene.check(outcomes, set(LAYERS))


@needs("landlock-fs")
def test_landlock_alone(scene: Scene) -> None:
    report = dataclasses.replace(REPORT, seccomp=False)
    outcomes = scene.escape([], _preexec_for(report, scene.read_paths, [NODE]))
    scene.check(outcomes, set(report.active()) - {"node-permission"})
    assert outcomes["spawn_sync"] == "EACCES"  # forked, then refused /bin/sh
    if "landlock-net" in report.active():
        assert outcomes["tcp_connect"] == "EACCES"


@needs("seccomp")
def test_seccomp_alone(scene: Scene) -> None:
    report = dataclasses.replace(REPORT, landlock=False, landlock_abi=0)
    outcomes = scene.escape([], _preexec_for(report, scene.read_paths, [NODE]))
    scene.check(outcomes, {"seccomp"})
    assert outcomes["spawn_sync"] == outcomes["tcp_bind"] == "EPERM"


@needs("seccomp")
def test_pathname_unix_sockets_are_closed_only_on_request(scene: Scene) -> None:
    """Landlock's file rights do not cover connect() to a socket file; AF_UNIX is allowed by default."""
    flags = node_flags(scene.read_paths)
    default = scene.escape(flags, preexec(scene.read_paths, [NODE]))
    assert default["unix_connect"] == "ok"
    assert scene.take_effects()["unix_connect"]
    closed = scene.escape(flags, preexec(scene.read_paths, [NODE], unix_sockets=False))
    scene.check(closed, {*REPORT.active(), "seccomp-no-unix"})
    assert closed["unix_connect"] == "EPERM"


# --- the seccomp filter, system call by system call ------------------------------------------

SYSCALL_PROBE = textwrap.dedent(
    """
    import ctypes, fcntl, json, mmap, os, platform, socket, sys, threading
    from pathlib import Path
    from codemode.runtime import confinement

    nr = confinement._arch().nr
    # The numbers of the calls the filter checks by their arguments, or that only the probe
    # makes, from the kernel's tables rather than the module's.
    nr |= {
        "x86_64": {
            "fchmod": 91, "fchown": 93, "ioctl": 16, "fcntl": 72, "madvise": 28,
            "setpriority": 141, "sched_getaffinity": 204, "sched_setaffinity": 203,
            "sched_setscheduler": 144, "ioprio_get": 252, "ioprio_set": 251, "prlimit64": 302,
            "memfd_create": 319, "shmget": 29, "shmctl": 31, "msgget": 68, "msgctl": 71,
        },
        "aarch64": {
            "fchmod": 52, "fchown": 55, "ioctl": 29, "fcntl": 25, "madvise": 233,
            "setpriority": 140, "sched_getaffinity": 123, "sched_setaffinity": 122,
            "sched_setscheduler": 119, "ioprio_get": 31, "ioprio_set": 30, "prlimit64": 261,
            "memfd_create": 279, "shmget": 194, "shmctl": 195, "msgget": 186, "msgctl": 187,
        },
    }[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # A file this process owns, opened for reading only before it confines itself: it stands
    # for the libraries and scripts an engine may read.
    readable = os.open(sys.argv[1], os.O_RDONLY)
    flags = ctypes.c_long(0)
    fcntl.ioctl(readable, 0x80086601, flags)  # FS_IOC_GETFLAGS; set back unchanged below
    mode = os.stat(readable).st_mode & 0o777
    read_end, write_end = os.pipe()
    mapping = mmap.mmap(-1, 4096)
    confine = confinement.preexec([], [Path(sys.executable)])
    confine()  # the same calls as before an exec, on this very process
    results = {}

    def call(name, number, *args):
        result = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
        results[name] = f"ok {result}" if result >= 0 else os.strerror(ctypes.get_errno())
        return result

    def attempt(name, action):
        try:
            action()
            results[name] = "ok"
        except OSError as error:
            results[name] = os.strerror(error.errno)

    attempt("socket_inet", lambda: socket.socket(socket.AF_INET).close())
    attempt("socket_inet6", lambda: socket.socket(socket.AF_INET6).close())
    attempt("socket_netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW).close())
    attempt("socket_unix", lambda: socket.socket(socket.AF_UNIX).close())
    attempt("socketpair_unix", lambda: [s.close() for s in socket.socketpair()])
    def fork():
        if os.fork() == 0:
            os._exit(0)
    attempt("fork", fork)
    thread = threading.Thread(target=lambda: results.__setitem__("thread", "ok"))
    thread.start()
    thread.join()
    call("clone3", nr["clone3"], 0, 0)
    # CLONE_VM|CLONE_SIGHAND|CLONE_THREAD|CLONE_NEWUSER: the kernel says EINVAL, the filter EPERM
    call("clone_thread_newuser", nr["clone"], 0x00000100 | 0x00000800 | 0x00010000 | 0x10000000, 0, 0, 0, 0)
    call("ptrace", nr["ptrace"], 0, 0, 0, 0)  # PTRACE_TRACEME
    call("process_vm_readv", nr["process_vm_readv"], os.getppid(), 0, 0, 0, 0, 0)
    call("unshare", nr["unshare"], 0)
    call("setns", nr["setns"], -1, 0)
    call("mount", nr["mount"], 0, 0, 0, 0, 0)
    call("chroot", nr["chroot"], 0)
    call("bpf", nr["bpf"], 0, 0, 0)
    call("perf_event_open", nr["perf_event_open"], 0, 0, -1, -1, 0)
    call("keyctl", nr["keyctl"], 0, 0, 0, 0, 0)
    call("userfaultfd", nr["userfaultfd"], 0)
    call("io_uring_setup", nr["io_uring_setup"], 1, 0)
    call("personality", nr["personality"], 0xFFFFFFFF)
    call("init_module", nr["init_module"], 0, 0, 0)
    call("kexec_load", nr["kexec_load"], 0, 0, 0, 0)
    call("reboot", nr["reboot"], 0, 0, 0, 0)  # wrong magic: EINVAL even unfiltered
    # Each of these changes nothing here, so that it is harmless should the filter let it by.
    call("fchmod", nr["fchmod"], readable, mode)
    call("fchown", nr["fchown"], readable, -1, -1)
    attempt("utime", lambda: os.utime(readable, ns=(os.stat(readable).st_atime_ns,) * 2))
    attempt("setxattr", lambda: os.setxattr(readable, "user.codemode", b"", os.XATTR_REPLACE))
    attempt("inotify_add_watch", lambda: libc.inotify_add_watch(libc.inotify_init1(0), b"/", 0x100) >= 0 or (_ for _ in ()).throw(OSError(ctypes.get_errno(), "")))
    call("ioctl_setflags", nr["ioctl"], readable, 0x40086602, ctypes.addressof(flags))
    call("ioctl_fionbio", nr["ioctl"], write_end, 0x5421, ctypes.addressof(ctypes.c_int(0)))
    call("fcntl_setlease", nr["fcntl"], readable, 1024, 2)  # F_UNLCK
    call("fcntl_setpipe_sz", nr["fcntl"], write_end, 1031, 65536)
    call("fcntl_getfl", nr["fcntl"], write_end, 3)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    call("madvise_hwpoison", nr["madvise"], 0, 4096, 100)  # not mapped: EFAULT/EINVAL unfiltered
    call("madvise_dontneed", nr["madvise"], address, 4096, 4)
    call("setpriority", nr["setpriority"], 0, 0, os.getpriority(os.PRIO_PROCESS, 0))
    mask = ctypes.create_string_buffer(128)
    size = libc.syscall(ctypes.c_long(nr["sched_getaffinity"]), ctypes.c_long(0), ctypes.c_long(128), ctypes.c_long(ctypes.addressof(mask)))
    call("sched_setaffinity", nr["sched_setaffinity"], 0, size, ctypes.addressof(mask))
    call("sched_setscheduler", nr["sched_setscheduler"], 0, 0, ctypes.addressof(ctypes.c_int(0)))
    call("ioprio_set", nr["ioprio_set"], 1, 0, libc.syscall(ctypes.c_long(nr["ioprio_get"]), ctypes.c_long(1), ctypes.c_long(0)))
    limit = (ctypes.c_uint64 * 2)()
    call("prlimit64_self", nr["prlimit64"], 0, 7, 0, ctypes.addressof(limit))
    call("prlimit64_parent", nr["prlimit64"], os.getppid(), 7, 0, ctypes.addressof(limit))
    call("memfd_create", nr["memfd_create"], ctypes.addressof(ctypes.create_string_buffer(b"m")), 0)
    if call("shmget", nr["shmget"], 0, 4096, 0o1600) >= 0:  # IPC_PRIVATE: remove what was made
        libc.syscall(ctypes.c_long(nr["shmctl"]), ctypes.c_long(int(results["shmget"][3:])), ctypes.c_long(0), ctypes.c_long(0))
    if call("msgget", nr["msgget"], 0, 0o1600) >= 0:
        libc.syscall(ctypes.c_long(nr["msgctl"]), ctypes.c_long(int(results["msgget"][3:])), ctypes.c_long(0), ctypes.c_long(0))
    if confinement._arch().x32_bit:
        call("x32_getpid", confinement._arch().x32_bit | 39)
    call("getpid", 39 if confinement._arch() is confinement._X86_64 else 172)
    attempt("read_etc_passwd", lambda: open("/etc/passwd").close())
    print(json.dumps({name: "ok" if result.startswith("ok") else result for name, result in results.items()}))
    """
)


@needs("seccomp", "landlock-fs")
def test_seccomp_filter_denies_each_listed_system_call(tmp_path: Path) -> None:
    readable = tmp_path / "readable.txt"
    readable.write_text("")
    done = subprocess.run(
        [sys.executable, "-c", SYSCALL_PROBE, str(readable)],
        capture_output=True,
        text=True,
        timeout=8,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    results: dict[str, str] = json.loads(done.stdout)
    eperm, enosys = os.strerror(1), os.strerror(38)
    expected = {
        "socket_inet": eperm,
        "socket_inet6": eperm,
        "socket_netlink": eperm,
        "socket_unix": "ok",
        "socketpair_unix": "ok",
        "fork": eperm,
        "thread": "ok",
        "clone3": enosys,
        "clone_thread_newuser": eperm,
        "ptrace": eperm,
        "process_vm_readv": eperm,
        "unshare": eperm,
        "setns": eperm,
        "mount": eperm,
        "chroot": eperm,
        "bpf": eperm,
        "perf_event_open": eperm,
        "keyctl": eperm,
        "userfaultfd": eperm,
        "io_uring_setup": enosys,
        "personality": eperm,
        "init_module": eperm,
        "kexec_load": eperm,
        "reboot": eperm,
        "fchmod": eperm,
        "fchown": eperm,
        "utime": eperm,
        "setxattr": eperm,
        "inotify_add_watch": eperm,
        "ioctl_setflags": eperm,
        "ioctl_fionbio": "ok",
        "fcntl_setlease": eperm,
        "fcntl_setpipe_sz": eperm,
        "fcntl_getfl": "ok",
        "madvise_hwpoison": eperm,
        "madvise_dontneed": "ok",
        "setpriority": eperm,
        "sched_setaffinity": eperm,
        "sched_setscheduler": eperm,
        "ioprio_set": eperm,
        "prlimit64_self": "ok",
        "prlimit64_parent": eperm,
        "memfd_create": eperm,
        "shmget": eperm,
        "msgget": eperm,
        "getpid": "ok",
        "read_etc_passwd": os.strerror(13),
    }
    if "x32_getpid" in results:
        expected["x32_getpid"] = eperm
    assert results == expected


# --- a confined node still works ---------------------------------------------------------------

ADDON_C = """
#include <node_api.h>
static napi_value add(napi_env env, napi_callback_info info) {
  size_t argc = 2; napi_value argv[2], sum; double a, b;
  napi_get_cb_info(env, info, &argc, argv, NULL, NULL);
  napi_get_value_double(env, argv[0], &a);
  napi_get_value_double(env, argv[1], &b);
  napi_create_double(env, a + b, &sum);
  return sum;
}
NAPI_MODULE_INIT() {
  napi_value fn;
  napi_create_function(env, "add", NAPI_AUTO_LENGTH, add, NULL, &fn);
  napi_set_named_property(env, exports, "add", fn);
  return exports;
}
"""


def build_addon(directory: Path) -> Path | None:
    """A tiny N-API addon, if a C compiler and Node's headers are at hand."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    headers = next(
        (
            candidate
            for candidate in (NODE.parent.parent / "include" / "node",)
            if (candidate / "node_api.h").exists()
        ),
        None,
    )
    if compiler is None or headers is None:
        return None
    source = directory / "add.c"
    source.write_text(ADDON_C)
    addon = directory / "add.node"
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", f"-I{headers}", "-o", str(addon), str(source)],
        capture_output=True,
        timeout=8,
        check=False,
    )
    return addon if built.returncode == 0 else None


def run_confined(read_paths: list[Path], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(NODE), *node_flags(read_paths), *args],
        preexec_fn=preexec(read_paths, [NODE]),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=8,
        check=False,
    )


def test_confined_node_runs_scripts_and_requires_from_read_paths(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "double.js").write_text("module.exports = (x) => 2 * x;\n")
    (allowed / "data.txt").write_text("21")
    source = (
        f"const double = require({json.dumps(str(allowed / 'double.js'))});"
        f"const n = Number(require('fs').readFileSync({json.dumps(str(allowed / 'data.txt'))}, 'utf8'));"
        "console.log(JSON.stringify([6 * 7, double(n), require('crypto').randomBytes(4).length]))"
    )
    done = run_confined([allowed], "-e", source, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [42, 42, 4]


def test_a_confined_engine_holds_at_most_its_share_of_descriptors(tmp_path: Path) -> None:
    # Node raises its soft limit to the hard one (20,000 here): an escaped engine could fill it
    # with pipes, 64 KiB of kernel memory each, which the resident-size watchdog does not see.
    if preexec([tmp_path], [NODE]) is None:
        pytest.skip("no OS confinement layer on this machine")
    (tmp_path / "data.txt").write_text("x")
    source = (
        f"const path = {json.dumps(str(tmp_path / 'data.txt'))}; let n = 0;"
        "try { for (; n < 1000; n++) require('fs').openSync(path, 'r'); }"
        "catch (error) { console.log(JSON.stringify([n, error.code])); }"
    )
    done = run_confined([tmp_path], "-e", source, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    opened, code = json.loads(done.stdout)
    assert code == "EMFILE"
    assert MAX_OPEN_FILES - 32 < opened < MAX_OPEN_FILES


async def test_confined_node_spawns_through_asyncio(tmp_path: Path) -> None:
    """The engine's own way in: asyncio's subprocess support passes preexec_fn to the fork."""
    process = await asyncio.create_subprocess_exec(
        str(NODE),
        *node_flags([JS]),
        "-e",
        "process.stdin.on('data', (d) => process.stdout.write(String(2 * Number(d))))",
        preexec_fn=preexec([JS], [NODE]),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(b"21"), 8)
    assert process.returncode == 0, stderr
    assert stdout == b"42"


def test_confined_node_loads_a_native_addon_from_a_read_path(tmp_path: Path) -> None:
    addon_dir = tmp_path / "addon"
    addon_dir.mkdir()
    addon = build_addon(addon_dir)
    if addon is None:
        pytest.skip("no C compiler or Node headers to build a test addon")
    source = f"console.log(require({json.dumps(str(addon))}).add(40, 2))"
    done = run_confined([addon_dir], "-e", source, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "42"
    outside = run_confined([JS], "-e", source, cwd=tmp_path)
    assert outside.returncode != 0


# --- the API ---------------------------------------------------------------------------------


def test_node_flags_grant_reads_and_addons_only(tmp_path: Path) -> None:
    flags = node_flags([tmp_path, Path("relative")])
    assert flags == [
        "--permission",
        f"--allow-fs-read={tmp_path}",
        f"--allow-fs-read={Path('relative').absolute()}",
        "--allow-addons",
    ]
    forbidden = ("--allow-worker", "--allow-child-process", "--allow-wasi", "--allow-fs-write")
    assert not [flag for flag in flags if flag.startswith((*forbidden, "--allow-inspector"))]


def test_report_lists_layers_and_describes_them() -> None:
    full = ConfinementReport(permission_model=True, landlock_abi=7, landlock=True, seccomp=True)
    assert full.active() == LAYERS
    assert full.missing() == ()
    assert full.describe() == (
        "engine confinement: node-permission, landlock (ABI 7: fs, net, scope), seccomp"
    )
    old = ConfinementReport(True, 3, True, False, reasons=("no seccomp here",))
    assert old.active() == ("node-permission", "landlock-fs")
    assert old.missing() == ("landlock-net", "landlock-scope", "seccomp")
    assert old.describe() == (
        "engine confinement: node-permission, landlock (ABI 3: fs); "
        "missing: landlock-net, landlock-scope, seccomp (no seccomp here)"
    )
    bare = ConfinementReport(True, 0, False, False)
    assert bare.missing() == ("landlock-fs", "landlock-net", "landlock-scope", "seccomp")
    assert _preexec_for(bare, [], [NODE]) is None


def test_probe_is_cached_and_consistent() -> None:
    assert probe() is probe()
    assert REPORT.permission_model
    assert set(REPORT.active()) | set(REPORT.missing()) == set(LAYERS)
    if sys.platform != "linux":
        assert REPORT.active() == ("node-permission",)
    assert REPORT.describe().startswith("engine confinement: node-permission")


@needs("landlock-fs")
def test_preexec_refuses_paths_it_cannot_grant(tmp_path: Path) -> None:
    with pytest.raises(ConfinementError, match=r"^landlock-fs: read path .*missing does not exist"):
        preexec([tmp_path / "missing"], [NODE])
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(ConfinementError, match="not a 64-bit little-endian ELF"):
        preexec([tmp_path], [script])
    with pytest.raises(ConfinementError, match=r"^landlock-fs: no executable given"):
        preexec([tmp_path], [])


@needs("landlock-fs")
def test_a_failing_step_in_the_child_stops_it_before_exec(tmp_path: Path) -> None:
    vanishing = tmp_path / "vanishing"
    vanishing.mkdir()
    confine = preexec([vanishing], [NODE])
    vanishing.rmdir()
    done = subprocess.run(
        [str(NODE), "-e", "console.log('ran')"],
        preexec_fn=confine,
        capture_output=True,
        text=True,
        timeout=8,
        check=False,
    )
    assert done.returncode == 126
    assert done.stdout == ""
    assert "cannot confine the engine process: landlock: open " in done.stderr
    assert str(vanishing) in done.stderr
