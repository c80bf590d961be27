"""OS confinement of the engine process: layer 3 of defence in depth (decision 0005).

The engine process runs hostile JavaScript. Layers 1 and 2 (the JS sandbox, then Node's permission
model) keep cells away from Node's powers; this module assumes both have fallen and the attacker
runs arbitrary code inside Node. What is left to them must be nothing but the files Node reads to
start, the pipes it inherited, and CPU/memory:

* :func:`node_flags` turns on Node's permission model (read-only access to a list of paths, no
  child processes, workers, WASI, inspector or writes).
* :func:`preexec` returns the function a ``fork``-ed child runs before ``exec``: it sets
  ``no_new_privs``, then restricts itself with Landlock (read-only file access to an allow-list,
  execute only for the node binary and its ELF interpreter, no TCP, no signals or abstract UNIX
  sockets beyond its own domain), then installs a seccomp filter (no new processes, no non-UNIX
  sockets, no debugging of other processes, none of the root-only system calls, none of the
  metadata writes Landlock does not govern, no say over other processes' scheduling or limits,
  no memory the resident-size watchdog cannot see). All three survive
  ``exec`` and bind every thread and descendant of the process, as does the limit of
  :data:`MAX_OPEN_FILES` descriptors it sets first.

Everything is done with ``ctypes`` (no dependency, nothing to compile); only Linux on x86_64 and
aarch64 gets the kernel layers, and :func:`probe` says which layers this machine can apply.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import resource
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from codemode.errors import CodeModeError

__all__ = [
    "LAYERS",
    "MAX_OPEN_FILES",
    "ConfinementError",
    "ConfinementReport",
    "node_flags",
    "preexec",
    "probe",
    "require_all",
]

LAYERS: Final = ("node-permission", "landlock-fs", "landlock-net", "landlock-scope", "seccomp")


class ConfinementError(CodeModeError):
    """A confinement layer cannot be built for the given paths; the message names layer and cause."""


@dataclass(frozen=True)
class ConfinementReport:
    """Which confinement layers this machine can apply to the engine process."""

    permission_model: bool  # Node's --permission flags are used
    landlock_abi: int  # 0 when Landlock is unavailable
    landlock: bool  # file-system rules (ABI >= 4: TCP; >= 6: signal/abstract-socket scoping)
    seccomp: bool  # the seccomp filter
    reasons: tuple[str, ...] = field(default=(), compare=False)  # why layers are missing

    def active(self) -> tuple[str, ...]:
        """The layers that apply, in the order of ``LAYERS``."""
        on = {
            "node-permission": self.permission_model,
            "landlock-fs": self.landlock and self.landlock_abi >= 1,
            "landlock-net": self.landlock and self.landlock_abi >= 4,
            "landlock-scope": self.landlock and self.landlock_abi >= 6,
            "seccomp": self.seccomp,
        }
        return tuple(layer for layer in LAYERS if on[layer])

    def missing(self) -> tuple[str, ...]:
        """The layers of ``LAYERS`` that do not apply here."""
        active = self.active()
        return tuple(layer for layer in LAYERS if layer not in active)

    def describe(self) -> str:
        """One human line: what is active, then what is missing and why."""
        parts: list[str] = []
        if self.permission_model:
            parts.append("node-permission")
        if self.landlock:
            scopes = [
                name
                for name, since in (("fs", 1), ("net", 4), ("scope", 6))
                if self.landlock_abi >= since
            ]
            parts.append(f"landlock (ABI {self.landlock_abi}: {', '.join(scopes)})")
        if self.seccomp:
            parts.append("seccomp")
        line = "engine confinement: " + (", ".join(parts) or "none")
        if self.missing():
            line += "; missing: " + ", ".join(self.missing())
            if self.reasons:
                line += " (" + "; ".join(self.reasons) + ")"
        return line


# --- kernel ABI ------------------------------------------------------------------------------
# Landlock and most recent system calls share one number on every architecture.
_NR_LANDLOCK_CREATE_RULESET: Final = 444
_NR_LANDLOCK_ADD_RULE: Final = 445
_NR_LANDLOCK_RESTRICT_SELF: Final = 446
_LANDLOCK_CREATE_RULESET_VERSION: Final = 1
_LANDLOCK_RULE_PATH_BENEATH: Final = 1

_FS_EXECUTE: Final = 1 << 0
_FS_WRITE_FILE: Final = 1 << 1
_FS_READ_FILE: Final = 1 << 2
_FS_READ_DIR: Final = 1 << 3
_FS_TRUNCATE: Final = 1 << 14
# The rights a rule on a non-directory may carry (EXECUTE, WRITE_FILE, READ_FILE, TRUNCATE,
# IOCTL_DEV); anything else on a file is EINVAL.
_FS_FILE_RIGHTS: Final = 0b1100_0000_0000_0111
_NET_BIND_TCP: Final = 1 << 0
_NET_CONNECT_TCP: Final = 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET: Final = 1 << 0
_SCOPE_SIGNAL: Final = 1 << 1

_PR_SET_NO_NEW_PRIVS: Final = 38
_PR_GET_SECCOMP: Final = 21
_SECCOMP_SET_MODE_FILTER: Final = 1
_SECCOMP_GET_ACTION_AVAIL: Final = 2
_SECCOMP_RET_KILL_PROCESS: Final = 0x8000_0000
_SECCOMP_RET_ERRNO: Final = 0x0005_0000
_SECCOMP_RET_ALLOW: Final = 0x7FFF_0000
_EPERM: Final = 1
_ENOSYS: Final = 38

_O_PATH: Final = 0o10000000
_O_CLOEXEC: Final = 0o2000000
_AF_UNIX: Final = 1
_CLONE_THREAD: Final = 0x0001_0000
# CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET: a "thread" may not bring new
# namespaces with it (CLONE_NEWTIME shares its bit with the exit signal in clone(2)).
_CLONE_NEW_NAMESPACES: Final = 0x7E02_0000


@dataclass(frozen=True)
class _Arch:
    audit: int  # AUDIT_ARCH_* as seccomp_data.arch reports it
    elf_machine: int
    nr: dict[str, int]
    x32_bit: int = 0  # x86_64: syscalls with this bit set are the x32 ABI


# The same names on both architectures; fork, vfork, iopl, ioperm, uselib and the path-only
# chmod, chown, lchown, utime, utimes and futimesat exist on x86_64 only.
_X86_64: Final = _Arch(
    audit=0xC000_003E,
    elf_machine=62,
    x32_bit=0x4000_0000,
    nr={
        "socket": 41, "socketpair": 53, "clone": 56, "clone3": 435, "fork": 57, "vfork": 58,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "open_tree": 428,
        "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "open_tree_attr": 467, "unshare": 272, "setns": 308, "bpf": 321,
        "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249,
        "userfaultfd": 323, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
        "finit_module": 313, "delete_module": 176, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "personality": 135, "reboot": 169, "swapon": 167,
        "swapoff": 168, "syslog": 103, "acct": 163, "settimeofday": 164, "clock_settime": 227,
        "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170, "setdomainname": 171,
        "quotactl": 179, "quotactl_fd": 443, "open_by_handle_at": 304,
        "name_to_handle_at": 303, "lookup_dcookie": 212, "fanotify_init": 300, "vhangup": 153,
        "iopl": 172, "ioperm": 173, "uselib": 134, "seccomp": 317,
        "chmod": 90, "fchmod": 91, "fchmodat": 268, "fchmodat2": 452, "chown": 92, "fchown": 93,
        "lchown": 94, "fchownat": 260, "utime": 132, "utimes": 235, "futimesat": 261,
        "utimensat": 280, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190,
        "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199, "setxattrat": 463,
        "removexattrat": 466, "file_setattr": 469, "inotify_add_watch": 254,
        "setpriority": 141, "sched_setparam": 142, "sched_setscheduler": 144,
        "sched_setaffinity": 203, "sched_setattr": 314, "ioprio_set": 251, "prlimit64": 302,
        "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67, "semget": 64, "semop": 65,
        "semctl": 66, "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71,
        "memfd_create": 319, "memfd_secret": 447, "ioctl": 16, "fcntl": 72, "madvise": 28,
    },
)  # fmt: skip
_AARCH64: Final = _Arch(
    audit=0xC000_00B7,
    elf_machine=183,
    nr={
        "socket": 198, "socketpair": 199, "clone": 220, "clone3": 435, "ptrace": 117,
        "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438, "mount": 40,
        "umount2": 39, "pivot_root": 41, "chroot": 51, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "open_tree_attr": 467, "unshare": 97, "setns": 268, "bpf": 280, "perf_event_open": 241,
        "keyctl": 219, "add_key": 217, "request_key": 218, "userfaultfd": 282,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "personality": 92, "reboot": 142, "swapon": 224,
        "swapoff": 225, "syslog": 116, "acct": 89, "settimeofday": 170, "clock_settime": 112,
        "clock_adjtime": 266, "adjtimex": 171, "sethostname": 161, "setdomainname": 162,
        "quotactl": 60, "quotactl_fd": 443, "open_by_handle_at": 265, "name_to_handle_at": 264,
        "lookup_dcookie": 18, "fanotify_init": 262, "vhangup": 58, "seccomp": 277,
        "fchmod": 52, "fchmodat": 53, "fchmodat2": 452, "fchown": 55, "fchownat": 54,
        "utimensat": 88, "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14,
        "lremovexattr": 15, "fremovexattr": 16, "setxattrat": 463, "removexattrat": 466,
        "file_setattr": 469, "inotify_add_watch": 27, "setpriority": 140,
        "sched_setparam": 118, "sched_setscheduler": 119, "sched_setaffinity": 122,
        "sched_setattr": 274, "ioprio_set": 30, "prlimit64": 261, "shmget": 194, "shmat": 196,
        "shmctl": 195, "shmdt": 197, "semget": 190, "semop": 193, "semctl": 191,
        "semtimedop": 192, "msgget": 186, "msgsnd": 189, "msgrcv": 188, "msgctl": 187,
        "memfd_create": 279, "memfd_secret": 447, "ioctl": 29, "fcntl": 25, "madvise": 233,
    },
)  # fmt: skip

# Denied outright. ENOSYS where a caller has a fallback that the filter can check (clone3 ->
# clone, whose flags are a register and not a struct in memory) or that does without
# (libuv's io_uring -> its thread pool); EPERM for the rest.
_DENY_ENOSYS: Final = ("clone3", "io_uring_setup", "io_uring_enter", "io_uring_register")
_DENY_EPERM: Final = (
    # new processes (clone is checked by its flags below)
    "fork", "vfork",
    # reaching into other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    # file-system and namespace surgery (Landlock cannot be undone, but a mount could hide it)
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "open_tree_attr", "unshare", "setns",
    # kernel attack surface a JS engine never needs
    "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "userfaultfd", "personality",
    "uselib",
    # root-only powers over the machine (the engine may run as root, e.g. in a container)
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "syslog", "acct", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "sethostname", "setdomainname", "quotactl", "quotactl_fd", "open_by_handle_at",
    "name_to_handle_at", "lookup_dcookie", "fanotify_init", "vhangup", "iopl", "ioperm",
    # metadata writes, which Landlock (ABI <= 7) does not govern: with them a process that may
    # only read could chmod, chown, touch or set extended attributes (security.capability, say)
    # on any path it can name, and watch any directory for the names of the files made in it
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "utime",
    "utimes", "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr", "removexattr",
    "lremovexattr", "fremovexattr", "setxattrat", "removexattrat", "file_setattr",
    "inotify_add_watch",
    # other processes of the same user (the host, other engines), which Landlock's scopes do not
    # cover: their nice value, CPU affinity, scheduling policy and I/O priority; and our own, to
    # a real-time policy or a negative nice where the engine runs as root
    "setpriority", "sched_setparam", "sched_setscheduler", "sched_setaffinity", "sched_setattr",
    "ioprio_set",
    # memory the resident-size watchdog does not see (System V segments even outlive the
    # process), and other processes' System V objects
    "memfd_create", "memfd_secret", "shmget", "shmat", "shmctl", "shmdt", "semget", "semop",
    "semctl", "semtimedop", "msgget", "msgsnd", "msgrcv", "msgctl",
)  # fmt: skip

# Denied for some values of one argument: (system call, argument, mask, refused values). The
# argument is compared in its low 32 bits, after ``& mask``.
_DENY_ARGUMENT: Final = (
    # ioctl(2) commands of the file systems' types, on any descriptor: 'X' (FIFREEZE, FITHAW,
    # FITRIM, FS_IOC_FSSETXATTR, ext4's and XFS's shutdown), 'f' (FS_IOC_SETFLAGS: immutable,
    # append-only; fs-verity), 'v' (FS_IOC_SETVERSION), 0x94 (btrfs, FS_IOC_SETFSLABEL,
    # FICLONE) and 0xf5 (f2fs). A descriptor opened only for reading is enough for them, and
    # Landlock's IOCTL_DEV right covers device files only.
    ("ioctl", 1, 0xFF00, (0x5800, 0x6600, 0x7600, 0x9400, 0xF500)),
    # fcntl(2): F_SETLEASE (stall every writer of a file we may read), F_SETPIPE_SZ (pipe buffers
    # of up to pipe-max-size each, unseen by the resident-size watchdog)
    ("fcntl", 1, 0xFFFF_FFFF, (1024, 1031)),
    # madvise(2): MADV_HWPOISON and MADV_SOFT_OFFLINE take the machine's pages offline (root)
    ("madvise", 2, 0xFFFF_FFFF, (100, 101)),
)


def _arch() -> _Arch | None:
    if struct.calcsize("P") != 8:
        return None
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return _X86_64
    if machine in ("aarch64", "arm64"):
        return _AARCH64
    return None


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(number: int, *args: int) -> tuple[int, int]:
    """The raw result of syscall(2) and errno, for the parent-side probes."""
    call = _libc().syscall
    call.restype = ctypes.c_long
    result = call(ctypes.c_long(number), *(ctypes.c_long(arg) for arg in args))
    return int(result), ctypes.get_errno()


def _landlock_abi() -> tuple[int, str | None]:
    abi, err = _syscall(_NR_LANDLOCK_CREATE_RULESET, 0, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    if abi > 0:
        return abi, None
    why = {
        38: "the kernel has no Landlock (CONFIG_SECURITY_LANDLOCK)",
        95: "Landlock is disabled at boot (add it to lsm=)",
    }.get(err, f"landlock_create_ruleset failed: {os.strerror(err)}")
    return 0, why


def _seccomp_available(arch: _Arch | None) -> tuple[bool, str | None]:
    if arch is None:
        return False, f"no seccomp filter for the {platform.machine()} architecture"
    prctl = _libc().prctl
    prctl.restype = ctypes.c_int
    mode = prctl(_PR_GET_SECCOMP, 0, 0, 0, 0)
    err = ctypes.get_errno()
    if mode < 0:
        return False, f"the kernel has no seccomp ({os.strerror(err)})"
    for action in (_SECCOMP_RET_ERRNO, _SECCOMP_RET_KILL_PROCESS):
        code = ctypes.c_uint32(action)
        result, err = _syscall(
            arch.nr["seccomp"], _SECCOMP_GET_ACTION_AVAIL, 0, ctypes.addressof(code)
        )
        if result != 0:
            return False, f"seccomp action {action:#x} unavailable ({os.strerror(err)})"
    return True, None


def require_all() -> None:
    """Raise :class:`ConfinementError` unless this machine can apply every layer (the check of an
    engine that requires confinement: a property of the machine, known before any engine starts)."""
    missing = probe().missing()
    if missing:
        raise ConfinementError(
            "engine confinement required but unavailable here: " + ", ".join(missing)
        )


@functools.cache
def probe() -> ConfinementReport:
    """What this machine can apply (cached); off Linux only Node's permission model."""
    if sys.platform != "linux":
        return ConfinementReport(
            permission_model=True,
            landlock_abi=0,
            landlock=False,
            seccomp=False,
            reasons=(f"Landlock and seccomp are Linux-only (this is {sys.platform})",),
        )
    arch = _arch()
    abi, landlock_why = _landlock_abi()
    seccomp, seccomp_why = _seccomp_available(arch)
    reasons = [why for why in (landlock_why, seccomp_why) if why]
    if 1 <= abi < 4:
        reasons.append(f"Landlock ABI {abi} < 4 cannot deny TCP")
    if 1 <= abi < 6:
        reasons.append(f"Landlock ABI {abi} < 6 cannot scope signals and abstract sockets")
    return ConfinementReport(
        permission_model=True,
        landlock_abi=abi,
        landlock=abi >= 1,
        seccomp=seccomp,
        reasons=tuple(reasons),
    )


def node_flags(read_paths: Sequence[Path]) -> list[str]:
    """Node's permission-model flags: read-only access to ``read_paths``, and native addons."""
    # Node 24's permission model has no network switch (--allow-net came in 25); Landlock and
    # seccomp close the network. --allow-addons is needed for isolated-vm and lets native code
    # ignore the model, which is why the OS layers do not rely on it.
    flags = ["--permission"]
    flags.extend(f"--allow-fs-read={Path(path).absolute()}" for path in read_paths)
    flags.append("--allow-addons")
    return flags


# --- Landlock plan ---------------------------------------------------------------------------


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


# Files Node reads while it starts, and why (decision 0005 has the measurements). The child opens
# each path itself, so /proc/self is the child: a rule binds the inode, here the child's own.
# - /etc/ld.so.cache: the dynamic loader's index of libraries.
# - /proc/self/maps: glibc's pthread_getattr_np reads it for V8's main-thread stack start
#   (conservative stack scanning), and V8 for remapping its embedded builtins next to JIT code.
# - /proc/self/cgroup, /proc/meminfo and the memory cgroup's limit files: libuv's constrained and
#   total memory, from which Node sizes V8's heap.
# - /sys/devices/system/cpu/online: glibc's get_nprocs (std::thread::hardware_concurrency), by
#   which isolated-vm sizes its thread pool.
# - /etc/ssl/openssl.cnf: OpenSSL's configuration, which Node loads at start.
# - /dev/urandom: OpenSSL's entropy source where getrandom(2) is unavailable.
_SYSTEM_READ: Final = (
    "/etc/ld.so.cache",
    "/proc/self/maps",
    "/proc/self/cgroup",
    "/proc/meminfo",
    "/sys/devices/system/cpu/online",
    "/etc/ssl/openssl.cnf",
    "/dev/urandom",
)


def _elf_interpreter(binary: Path, arch: _Arch | None) -> str:
    """PT_INTERP of a 64-bit little-endian ELF executable (which the kernel opens on exec)."""
    try:
        with binary.open("rb") as file:
            header = file.read(64)
            if header[:6] != b"\x7fELF\x02\x01":
                raise ConfinementError(
                    f"landlock-fs: {binary} is not a 64-bit little-endian ELF executable"
                )
            (machine,) = struct.unpack_from("<H", header, 18)
            if arch is not None and machine != arch.elf_machine:
                raise ConfinementError(
                    f"seccomp: {binary} is built for ELF machine {machine}, not {platform.machine()}"
                )
            phoff, phentsize, phnum = (
                struct.unpack_from("<Q", header, 32)[0],
                *struct.unpack_from("<HH", header, 54),
            )
            for index in range(phnum):
                file.seek(phoff + index * phentsize)
                p_type, _, p_offset, _, _, p_filesz = struct.unpack("<IIQQQQ", file.read(40))
                if p_type == 3:  # PT_INTERP
                    file.seek(p_offset)
                    return file.read(p_filesz).rstrip(b"\0").decode()
    except OSError as error:
        raise ConfinementError(f"landlock-fs: cannot read {binary}: {error}") from None
    raise ConfinementError(f"landlock-fs: {binary} is static or has no ELF interpreter")


@functools.cache
def _shared_libraries(binary: str, interpreter: str) -> tuple[str, ...]:
    """The libraries the loader maps for ``binary`` (``ld.so --list``; no code of it runs)."""
    try:
        listing = subprocess.run(
            [interpreter, "--list", binary],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
        ).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise ConfinementError(
            f"landlock-fs: cannot list the shared libraries of {binary} with {interpreter}: {error}"
        ) from None
    found: list[str] = []
    for line in listing.splitlines():
        _, arrow, target = line.partition("=>")
        candidate = (target if arrow else line).strip().split(" (", 1)[0].strip()
        if candidate.startswith("/"):
            found.append(os.path.realpath(candidate))
    return tuple(dict.fromkeys(found))


def _cgroup_memory_files() -> list[str]:
    """The memory-limit files libuv reads for this process's cgroup (the child inherits it)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    files: list[Path] = []
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":  # cgroup v2: libuv also looks at the ancestors' limits
            base = Path("/sys/fs/cgroup", group.lstrip("/"))
            for directory in (base, *base.parents):
                files += [directory / name for name in ("memory.max", "memory.high")]
                if directory == Path("/sys/fs/cgroup"):
                    break
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory", group.lstrip("/"))
            files += [base / "memory.limit_in_bytes", base / "memory.soft_limit_in_bytes"]
    return [str(file) for file in files if file.exists()]


@dataclass
class _Rule:
    path: bytes
    rule: _PathBeneath
    required: bool


def _landlock_rules(
    abi: int, read_paths: Sequence[Path], exec_paths: Sequence[Path], arch: _Arch | None
) -> list[_Rule]:
    def rights(path: str, wanted: int) -> int:
        return wanted if os.path.isdir(path) else wanted & _FS_FILE_RIGHTS

    rules: dict[str, int] = {}

    def grant(path: str, wanted: int) -> None:
        rules[path] = rules.get(path, 0) | rights(path, wanted)

    if not exec_paths:
        raise ConfinementError("landlock-fs: no executable given, so the child could not exec")
    read = _FS_READ_FILE | _FS_READ_DIR
    required: set[str] = set()
    for path in read_paths:
        resolved = os.path.realpath(path)
        if not os.path.exists(resolved):
            raise ConfinementError(f"landlock-fs: read path {path} does not exist")
        grant(resolved, read)
        required.add(resolved)
    for path in exec_paths:
        binary = os.path.realpath(path)
        if not os.path.isfile(binary):
            raise ConfinementError(f"landlock-fs: executable {path} does not exist")
        interpreter = os.path.realpath(_elf_interpreter(Path(binary), arch))
        for target in (binary, interpreter):
            grant(target, _FS_EXECUTE | _FS_READ_FILE)
            required.add(target)
        for library in _shared_libraries(binary, interpreter):
            grant(library, _FS_READ_FILE)
    for system in (*_SYSTEM_READ, *_cgroup_memory_files()):
        if os.path.exists(system):
            grant(system, _FS_READ_FILE)
    dev_null = _FS_READ_FILE | _FS_WRITE_FILE | (_FS_TRUNCATE if abi >= 3 else 0)
    grant("/dev/null", dev_null)
    return [
        _Rule(os.fsencode(granted), _PathBeneath(access, -1), granted in required)
        for granted, access in rules.items()
    ]


def _handled_fs(abi: int) -> int:
    rights = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        rights |= 1 << 13  # REFER
    if abi >= 3:
        rights |= 1 << 14  # TRUNCATE
    if abi >= 5:
        rights |= 1 << 15  # IOCTL_DEV
    return rights


# --- seccomp program -------------------------------------------------------------------------

_BPF_LD_W_ABS: Final = 0x20
_BPF_JEQ_K: Final = 0x15
_BPF_JGE_K: Final = 0x35
_BPF_JSET_K: Final = 0x45
_BPF_ALU_AND_K: Final = 0x54
_BPF_RET_K: Final = 0x06
_OFFSET_NR: Final = 0
_OFFSET_ARCH: Final = 4
_OFFSET_ARG0_LOW: Final = 16  # args[0], low 32 bits (both architectures are little-endian)
_ARG_SIZE: Final = 8


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _seccomp_program(arch: _Arch, unix_sockets: bool) -> list[tuple[int, int, int, int]]:
    def errno(code: int) -> tuple[int, int, int, int]:
        return (_BPF_RET_K, 0, 0, _SECCOMP_RET_ERRNO | code)

    allow = (_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW)
    program = [
        (_BPF_LD_W_ABS, 0, 0, _OFFSET_ARCH),
        (_BPF_JEQ_K, 1, 0, arch.audit),
        (_BPF_RET_K, 0, 0, _SECCOMP_RET_KILL_PROCESS),
        (_BPF_LD_W_ABS, 0, 0, _OFFSET_NR),
    ]
    if arch.x32_bit:
        program += [(_BPF_JGE_K, 0, 1, arch.x32_bit), errno(_EPERM)]
    for name, code in [(name, _ENOSYS) for name in _DENY_ENOSYS] + [
        (name, _EPERM) for name in _DENY_EPERM
    ]:
        if name in arch.nr:
            program += [(_BPF_JEQ_K, 0, 1, arch.nr[name]), errno(code)]
    # socket(2) and socketpair(2): AF_UNIX only (the domain is a C int: its low 32 bits), or none
    for name in ("socket", "socketpair"):
        if unix_sockets:
            program += [
                (_BPF_JEQ_K, 0, 4, arch.nr[name]),
                (_BPF_LD_W_ABS, 0, 0, _OFFSET_ARG0_LOW),
                (_BPF_JEQ_K, 0, 1, _AF_UNIX),
                allow,
                errno(_EPERM),
            ]
        else:
            program += [(_BPF_JEQ_K, 0, 1, arch.nr[name]), errno(_EPERM)]
    # prlimit64(2): the calling process's limits only, pid 0 as glibc passes it (a pid_t: the
    # low 32 bits); another process's would let it lower the host's or another engine's limits
    program += [
        (_BPF_JEQ_K, 0, 4, arch.nr["prlimit64"]),
        (_BPF_LD_W_ABS, 0, 0, _OFFSET_ARG0_LOW),
        (_BPF_JEQ_K, 0, 1, 0),
        allow,
        errno(_EPERM),
    ]
    for name, argument, mask, refused in _DENY_ARGUMENT:
        block = [(_BPF_LD_W_ABS, 0, 0, _OFFSET_ARG0_LOW + _ARG_SIZE * argument)]
        if mask != 0xFFFF_FFFF:
            block.append((_BPF_ALU_AND_K, 0, 0, mask))
        block += [
            (_BPF_JEQ_K, len(refused) - index, 0, value) for index, value in enumerate(refused)
        ]
        block += [allow, errno(_EPERM)]
        program += [(_BPF_JEQ_K, 0, len(block), arch.nr[name]), *block]
    # clone(2): threads only, and without new namespaces
    program += [
        (_BPF_JEQ_K, 0, 5, arch.nr["clone"]),
        (_BPF_LD_W_ABS, 0, 0, _OFFSET_ARG0_LOW),
        (_BPF_JSET_K, 0, 2, _CLONE_THREAD),
        (_BPF_JSET_K, 1, 0, _CLONE_NEW_NAMESPACES),
        allow,
        errno(_EPERM),
        allow,
    ]
    return program


# --- the pre-exec function -------------------------------------------------------------------


#: The descriptors an engine process may hold: it uses about 20 (pipes, epoll, eventfds), with
#: 20 cells running. Node raises its soft limit to the hard one (20,000 here), and an escaped
#: engine could fill that with pipes, 64 KiB of kernel memory each, which the resident-size
#: watchdog does not see.
MAX_OPEN_FILES: Final = 256
_RLIMIT_NOFILE: Final = resource.RLIMIT_NOFILE


class _Confine:
    """The pre-exec callable; it owns every buffer the kernel reads, built before the fork."""

    def __init__(
        self, report: ConfinementReport, rules: list[_Rule], arch: _Arch | None, unix_sockets: bool
    ) -> None:
        libc = _libc()
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._prctl = libc.prctl
        self._prctl.restype = ctypes.c_int
        self._open = libc.open
        self._open.restype = ctypes.c_int
        self._open.argtypes = (ctypes.c_char_p, ctypes.c_int)
        self._close = libc.close
        self._close.restype = ctypes.c_int
        self._close.argtypes = (ctypes.c_int,)
        c_long = ctypes.c_long
        self._zero = c_long(0)
        self._setrlimit = libc.setrlimit
        self._setrlimit.restype = ctypes.c_int
        # Soft and hard: Node raises its soft limit to the hard one at start. Never above the
        # hard limit we have (raising it is for root alone).
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        most = MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else min(MAX_OPEN_FILES, hard)
        self._nofile = (ctypes.c_ulong * 2)(most, most)

        self._landlock = report.landlock
        self._attr = (ctypes.c_uint64 * 3)()
        size = 0
        if report.landlock:
            self._attr[0] = _handled_fs(report.landlock_abi)
            size = 8
            if report.landlock_abi >= 4:
                self._attr[1] = _NET_BIND_TCP | _NET_CONNECT_TCP  # handled, no port allowed
                size = 16
            if report.landlock_abi >= 6:
                self._attr[2] = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL
                size = 24
        self._create_args = (
            c_long(_NR_LANDLOCK_CREATE_RULESET),
            c_long(ctypes.addressof(self._attr)),
            c_long(size),
            self._zero,
        )
        self._nr_add = c_long(_NR_LANDLOCK_ADD_RULE)
        self._nr_restrict = c_long(_NR_LANDLOCK_RESTRICT_SELF)
        self._path_beneath = c_long(_LANDLOCK_RULE_PATH_BENEATH)
        self._rules = [
            (rule.path, rule.rule, c_long(ctypes.addressof(rule.rule)), not rule.required)
            for rule in rules
        ]

        self._seccomp = report.seccomp and arch is not None
        program = _seccomp_program(arch, unix_sockets) if arch is not None else []
        self._filter = ctypes.create_string_buffer(
            b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
        )
        self._fprog = _SockFprog(len(program), ctypes.addressof(self._filter))
        self._seccomp_args = (
            c_long(arch.nr["seccomp"] if arch is not None else -1),
            c_long(_SECCOMP_SET_MODE_FILTER),
            self._zero,
            c_long(ctypes.addressof(self._fprog)),
        )

    def _fail(self, what: bytes, path: bytes = b"") -> None:
        code = ctypes.get_errno()
        os.write(
            2,
            b"codemode: cannot confine the engine process: %s%s (errno %d)\n" % (what, path, code),
        )
        os._exit(126)

    def __call__(self) -> None:
        if self._setrlimit(_RLIMIT_NOFILE, self._nofile) != 0:
            self._fail(b"setrlimit(RLIMIT_NOFILE)")
        if self._prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            self._fail(b"prctl(PR_SET_NO_NEW_PRIVS)")
        if self._landlock:
            ruleset = self._syscall(*self._create_args)
            if ruleset < 0:
                self._fail(b"landlock_create_ruleset")
            ruleset_fd = ctypes.c_long(ruleset)
            for path, rule, address, optional in self._rules:
                fd = self._open(path, _O_PATH | _O_CLOEXEC)
                if fd < 0:
                    if optional:
                        continue
                    self._fail(b"landlock: open ", path)
                rule.parent_fd = fd
                if self._syscall(self._nr_add, ruleset_fd, self._path_beneath, address, self._zero):
                    self._fail(b"landlock_add_rule ", path)
                self._close(fd)
            if self._syscall(self._nr_restrict, ruleset_fd, self._zero) != 0:
                self._fail(b"landlock_restrict_self")
            self._close(ruleset)
        if self._seccomp and self._syscall(*self._seccomp_args) != 0:
            self._fail(b"seccomp(SECCOMP_SET_MODE_FILTER)")


def preexec(
    read_paths: Sequence[Path], exec_paths: Sequence[Path], *, unix_sockets: bool = True
) -> Callable[[], None] | None:
    """The ``preexec_fn`` confining a child before it execs one of ``exec_paths``; None if nothing applies.

    ``unix_sockets=False`` also denies creating AF_UNIX sockets: none of the Landlock rights used
    here (ABI <= 7) covers connect(2) to a *pathname* UNIX socket, so without it the process can
    reach any socket file it can name (a container runtime's or D-Bus's, say).
    """
    return _preexec_for(probe(), read_paths, exec_paths, unix_sockets=unix_sockets)


def _preexec_for(
    report: ConfinementReport,
    read_paths: Sequence[Path],
    exec_paths: Sequence[Path],
    *,
    unix_sockets: bool = True,
) -> Callable[[], None] | None:
    if not (report.landlock or report.seccomp):
        return None
    arch = _arch()
    rules = (
        _landlock_rules(report.landlock_abi, read_paths, exec_paths, arch)
        if report.landlock
        else []
    )
    return _Confine(report, rules, arch, unix_sockets)
