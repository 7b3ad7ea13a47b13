"""What a confined program sees: the bubblewrap command line and the environment of `run`.

Everything here is pure (it reads the host's /etc and / to mirror them, and nothing else), so
the view can be tested without starting anything. The root of the sandbox is an allowlist, not
the host's root with holes: the mount at /sandbox, the system read-only (/usr, the /bin and
/lib* links, /etc without its secrets), and private /tmp, /proc and /dev. Homes, /root, /run,
/var, /sys, /mnt, /media, the host's /tmp and the real project are simply not there (but for
what sandboxfs.run.toolchain shows of a home for CMD, read-only: its package or prefix, never more).
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import functools
import os
import re
import resource
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

from sandboxfs.config.inputs import ENV_NAME
from sandboxfs.core.context import CONFINED_MOUNTPOINT
from sandboxfs.errors import SetupError

SANDBOX = CONFINED_MOUNTPOINT  # where the virtual tree is, inside
GUIDE = f"{SANDBOX}/.sandboxfs/README"  # the mount's plain-text guide (core.context.guide)
PROXY_ADDRESS = ("127.0.0.1", 3128)  # where the network proxy listens, inside (--net allow)
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The host's top-level system paths mirrored read-only (a symlink stays a symlink).
SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")

# Entries of /etc left out, as globs on the path below /etc. Passwords and their hashes, host
# keys, private TLS keys, network and VPN secrets, package-registry and repository credentials.
ETC_HIDDEN = (
    "shadow",
    "shadow-",
    "gshadow",
    "gshadow-",
    ".pwd.lock",
    "sudoers",
    "sudoers.d",
    "security/opasswd",
    "ssh/*_key",
    "ssl/private",
    "pki/tls/private",
    "NetworkManager/system-connections",
    "wpa_supplicant",
    "ppp",
    "ipsec.secrets",
    "ipsec.d",
    "krb5.keytab",
    "openvpn",
    "wireguard",
    "docker",
    "letsencrypt",
    "credstore",
    "credstore.encrypted",
    "apt/auth.conf",
    "apt/auth.conf.d",
    "npmrc",
    "pip.conf",
    "netrc",
    "sandboxfs",
)

# Variables passed from the caller's environment when set; everything else is dropped unless
# named with --env.
ENV_PASSED = ("TERM", "LANG", "LANGUAGE", "TZ", "COLORTERM", "USER", "LOGNAME", "SHELL")
ENV_PASSED_PREFIXES = ("LC_",)

# The first thing run inside: put CMD's stderr in place (fd 4), tell the supervisor that the
# sandbox is set up (fd 3), close both, and exec CMD as the leader of a session of its own, so
# that signals reach its process group and, on a pty, the pty is its controlling terminal
# (job control). setsid gives the exit codes of `docker run`: 127 when CMD is not found, 126
# when it cannot be executed.
LAUNCHER = (
    "exec 2>&4 4>&-; printf . >&3; exec 3>&- 5>&- 6>&- 8>&-; "
    'if [ "$1" = tty ]; then shift; exec setsid --ctty -- "$@"; fi; shift; exec setsid -- "$@"'
)
SYNC_FD, STDERR_FD, SECCOMP_FD, STATUS_FD = 3, 4, 5, 6
# bubblewrap reads its options from here (--args), not from its argv: /proc/1/cmdline inside
# would otherwise show every host path it binds, the user's home among them.
ARGS_FD = 8
# (--net none and allow) The sandbox's /etc/resolv.conf, which bubblewrap reads and closes: it
# names the only nameserver inside, run's stub, which answers nothing and tells the user.
DNS_FD = 9
# The first of the descriptors bubblewrap copies /etc's files from (EtcCopies); the last one
# decides how many fds the supervisor's child keeps.
ETC_COPY_FD = 10


def system_args(root: Path = Path("/")) -> list[str]:
    """/usr read-only, and /bin, /lib* as on the host: links where the host has links."""
    args: list[str] = []
    for name in SYSTEM:
        path = root / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), f"/{name}"]
        elif path.is_dir():
            args += ["--ro-bind", str(path), f"/{name}"]
    return args


class EtcCopies:
    """The regular files of a rebuilt /etc directory, copied into the sandbox rather than bound.

    bubblewrap reads its whole mount table again after every bind, so each bind costs more than
    the last: with /etc's 160 or so binds bubblewrap took 95 ms here, with the files copied
    (`--file`: bubblewrap reads each from a descriptor into the sandbox's own root, read-only
    like the rest) 30-40 ms.
    The k-th file's descriptor is `first + k` in bubblewrap (`fds`: there -> here). A copy is
    what the file held when the program started; whatever is not copied is bound as before.
    """

    def __init__(self, first: int, limit: int | None = None, max_bytes: int = 1 << 20) -> None:
        self.first = first
        self.fds: dict[int, int] = {}
        if limit is None:  # a quarter of what this process may open: run needs the rest
            limit = min(256, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)
        self._limit = limit
        self._max_bytes = max_bytes

    def add(self, path: str) -> tuple[int, int] | Literal["bind", "omit"]:
        """How `path`, a world-readable regular file when /etc was scanned, goes in: copied
        (the descriptor bubblewrap reads it from, and its mode), "bind" (too large, or past
        the limit: bound, as every file used to be) or "omit" (gone, or no longer a
        world-readable regular file: left out, as the scan would now leave it)."""
        if len(self.fds) >= self._limit:
            return "bind"
        try:
            fd = os.open(
                path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
            )
        except OSError as exc:
            return "bind" if exc.errno in (errno.EMFILE, errno.ENFILE) else "omit"
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _mode_world_readable(st.st_mode):
            os.close(fd)
            return "omit"
        if st.st_size > self._max_bytes:
            os.close(fd)
            return "bind"
        target = self.first + len(self.fds)
        self.fds[target] = fd
        return target, stat.S_IMODE(st.st_mode) & 0o777

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def etc_args(
    etc: Path = Path("/etc"),
    hidden: Sequence[str] = ETC_HIDDEN,
    resolv_conf: bool = False,
    copies: EtcCopies | None = None,
) -> list[str]:
    """/etc read-only, with only what every user of the host may read, minus `hidden`.

    A file is shown only when it is world-readable and a directory only when it is
    world-readable and searchable, whatever its name: a root caller's program is the host's uid
    0 and would otherwise read root-only files (/etc/default/cacerts, /etc/mysql/debian.cnf).
    `hidden` names world-readable files that are secret all the same. A directory that holds
    anything left out is rebuilt entry by entry; the rest is bound whole. Links are recreated as
    links (/etc/localtime, /etc/mtab); `resolv_conf` binds the file a linked resolv.conf points
    to (it usually lives under /run, which is not there), for --net host. With `copies`, the
    files of rebuilt directories are copied, not bound (see EtcCopies).
    """
    args = ["--dir", "/etc"]
    root = str(etc)
    for rel, kind in _EtcScan(root, tuple(hidden)).entries(""):
        host, inside = os.path.join(root, rel), f"/etc/{rel}"
        if kind == "dir":
            args += ["--dir", inside]
        elif kind == "link":
            target = Path(host).resolve() if rel == "resolv.conf" and resolv_conf else None
            if target is not None and _world_readable(target):
                args += ["--ro-bind", str(target), inside]
            else:
                args += ["--symlink", os.readlink(host), inside]
        elif kind == "file" and copies is not None:
            copy = copies.add(host)
            if isinstance(copy, tuple):
                args += ["--perms", f"{copy[1]:04o}", "--file", str(copy[0]), inside]
            elif copy == "bind":
                args += ["--ro-bind", host, inside]
        else:
            args += ["--ro-bind", host, inside]
    return args


def _world_readable(path: Path) -> bool:
    """A regular file every user may read, or a directory every user may list and enter."""
    try:
        st = path.stat()
    except OSError:
        return False
    return _mode_world_readable(st.st_mode)


def _mode_world_readable(mode: int) -> bool:
    if stat.S_ISDIR(mode):
        return mode & (stat.S_IROTH | stat.S_IXOTH) == stat.S_IROTH | stat.S_IXOTH
    return stat.S_ISREG(mode) and bool(mode & stat.S_IROTH)


@functools.cache
def _hidden_match(hidden: tuple[str, ...]) -> Callable[[str], re.Match[str] | None]:
    """Whether a path below /etc matches any of `hidden` (fnmatchcase's globs, as one regex)."""
    return re.compile("|".join(fnmatch.translate(p) for p in hidden) or "(?!)").match


class _EtcScan:
    """One pass over /etc: each directory listed once, each entry but a link lstat'ed once (a
    link is never followed: it is shown as a link)."""

    def __init__(self, root: str, hidden: tuple[str, ...]) -> None:
        self._root = root
        self._hidden = hidden
        self._is_hidden = _hidden_match(hidden)
        self._listings: dict[str, list[tuple[str, bool, int | None]]] = {}
        self._private: dict[str, bool] = {}

    def _listing(self, path: str) -> list[tuple[str, bool, int | None]]:
        """A directory's entries by name: (name, whether a link, its lstat mode: None for a
        link and for one that cannot be looked at); none when it cannot be listed."""
        known = self._listings.get(path)
        if known is not None:
            return known
        found: list[tuple[str, bool, int | None]] = []
        try:
            with os.scandir(path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            entries = []
        for entry in entries:
            try:
                link = entry.is_symlink()
            except OSError:
                link = False
            mode = None
            if not link:
                with contextlib.suppress(OSError):
                    mode = entry.stat(follow_symlinks=False).st_mode
            found.append((entry.name, link, mode))
        self._listings[path] = found
        return found

    def entries(self, below: str) -> Iterator[tuple[str, str]]:
        """(path below /etc, "link" | "file" | "bind" | "dir"), in the order bubblewrap gets
        them: "file" is a regular file, "bind" a directory shown whole, "dir" one rebuilt."""
        path = os.path.join(self._root, below[:-1]) if below else self._root
        for name, link, mode in self._listing(path):
            rel = f"{below}{name}"
            if self._is_hidden(rel):
                continue
            if link:
                yield rel, "link"
            elif mode is None or not _mode_world_readable(mode):
                continue  # root-only (or a socket, fifo or device): left out
            elif not stat.S_ISDIR(mode):
                yield rel, "file"
            elif any(p.startswith(rel + "/") for p in self._hidden) or self._holds_private(
                os.path.join(self._root, rel)
            ):
                yield rel, "dir"
                yield from self.entries(rel + "/")
            else:
                yield rel, "bind"

    def _holds_private(self, path: str) -> bool:
        """Whether anything below `path` is not world-readable (links excepted; what cannot be
        listed is passed over)."""
        known = self._private.get(path)
        if known is None:
            known = any(
                not link
                and (
                    mode is None
                    or not _mode_world_readable(mode)
                    or (stat.S_ISDIR(mode) and self._holds_private(os.path.join(path, name)))
                )
                for name, link, mode in self._listing(path)
            )
            self._private[path] = known
        return known


# /proc is the sandbox's own (its PID namespace), but some of it is the host kernel's: the
# tunables under /proc/sys, the magic SysRq key, IRQ and bus settings. For a root caller the
# program is the host's uid 0, which is all the kernel checks before such a write, so these are
# bound read-only over themselves. What shows other users' secrets or kernel internals is
# covered with an empty file or directory, as container runtimes do.
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs", "driver", "pressure", "mtrr")
PROC_MASKED_FILES = (
    "kcore", "keys", "key-users", "kmsg", "timer_list", "sched_debug", "latency_stats",
    "kpagecount", "kpageflags", "kpagecgroup", "kpageidle", "vmallocinfo", "slabinfo",
    "pagetypeinfo", "iomem", "ioports", "timer_stats", "config.gz",
)  # fmt: skip
PROC_MASKED_DIRS = ("acpi", "asound", "scsi", "tty/driver", "sysvipc")


def proc_args(proc: Path = Path("/proc")) -> list[str]:
    """A /proc of the sandbox's own, with the host's kernel knobs read-only or covered."""
    args = ["--proc", "/proc"]
    for name in PROC_READ_ONLY:
        if (proc / name).exists():
            args += ["--ro-bind", f"/proc/{name}", f"/proc/{name}"]
    for name in PROC_MASKED_FILES:
        if (proc / name).exists():
            args += ["--ro-bind", "/dev/null", f"/proc/{name}"]
    for name in PROC_MASKED_DIRS:
        if (proc / name).is_dir():
            args += ["--tmpfs", f"/proc/{name}", "--remount-ro", f"/proc/{name}"]
    return args


def bwrap_args(
    *,
    mountpoint: Path,
    cwd: str,
    net: str,
    root: Path = Path("/"),
    tools: Sequence[str] = (),
    etc_copies: EtcCopies | None = None,
) -> list[str]:
    """bubblewrap's options for `run` (handed over on ARGS_FD); `launcher_argv` follows them.
    `tools`: what sandboxfs.run.toolchain shows of the host for CMD (read-only binds and links,
    at the same paths), set up last, over the private /tmp. `etc_copies`: where /etc's copied
    files' descriptors go (EtcCopies); none: every file is bound.

    Own user, PID, IPC, UTS and cgroup namespaces; no capabilities and no further user
    namespaces; a new session (no controlling terminal but the one the launcher takes); dies
    with its parent. The network namespace is the host's (`host`), or the one the supervisor
    made, loopback only, with its DNS stub (and for `allow` the proxy's listener) in it: bwrap
    shares it, and /etc/resolv.conf inside is the one run hands over on DNS_FD.
    """
    own_network = net != "host"
    args = [
        "--unshare-user",
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",
        "--cap-drop",
        "ALL",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandboxfs",
        "--seccomp",
        str(SECCOMP_FD),
        "--json-status-fd",
        str(STATUS_FD),
        *system_args(root),
        *etc_args(
            root / "etc",
            hidden=(*ETC_HIDDEN, "resolv.conf") if own_network else ETC_HIDDEN,
            resolv_conf=not own_network,
            copies=etc_copies,
        ),
        *(
            ["--perms", "0644", "--ro-bind-data", str(DNS_FD), "/etc/resolv.conf"]
            if own_network
            else []
        ),
        *proc_args(root / "proc"),
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
        "--dir",
        "/var",
        "--symlink",
        "../tmp",
        "/var/tmp",
        "--bind",
        str(mountpoint),
        SANDBOX,
        *tools,
        "--remount-ro",
        "/",
        "--chdir",
        cwd,
    ]
    unsafe = targets_in_writable_binds(args)
    if unsafe:
        target, bind = unsafe[0]
        raise SetupError(
            f"bubblewrap would make {target} inside {bind}, which the sandbox shows writable "
            f"(the program could have put a link there for bubblewrap to follow while it sets "
            f"up: CVE-2026-87766); expose what lies inside it another way, or not at all"
        )
    return args


# bubblewrap's options by what they take: how many arguments, and for those that put something
# at a path inside, which argument is that path (the last). `--args` is not used with these.
_BWRAP_FLAGS = frozenset(
    {
        "--unshare-all", "--share-net", "--unshare-user", "--unshare-user-try", "--unshare-ipc",
        "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup",
        "--unshare-cgroup-try", "--disable-userns", "--assert-userns-disabled",
        "--die-with-parent", "--new-session", "--clearenv", "--as-pid-1",
    }
)  # fmt: skip
_BWRAP_ONE = frozenset(
    {
        "--hostname", "--seccomp", "--add-seccomp-fd", "--json-status-fd", "--info-fd",
        "--sync-fd", "--block-fd", "--userns-block-fd", "--cap-drop", "--cap-add", "--chdir",
        "--uid", "--gid", "--perms", "--size", "--unsetenv", "--exec-label", "--file-label",
        "--lock-file", "--userns", "--userns2", "--pidns",
    }
)  # fmt: skip
_BWRAP_MAKES_ONE = {
    "--dir": None, "--tmpfs": "own", "--proc": "own", "--dev": "own", "--mqueue": "own",
    "--remount-ro": None,
}  # fmt: skip
_BWRAP_MAKES_TWO = {
    "--bind": "writable", "--bind-try": "writable", "--dev-bind": "writable",
    "--dev-bind-try": "writable", "--bind-data": "writable", "--ro-bind": "read-only",
    "--ro-bind-try": "read-only", "--ro-bind-data": "read-only", "--file": None,
    "--symlink": None, "--setenv": "env", "--chmod": None,
}  # fmt: skip


def targets_in_writable_binds(args: Sequence[str]) -> list[tuple[str, str]]:
    """(path, the writable bind it lies in) for every path bubblewrap makes or mounts on, in
    `args`, inside a writable bind made before it. Everywhere else bubblewrap works in what it
    made itself (its fresh tmpfs root, a tmpfs, /proc, /dev) or in a read-only bind, where it
    can create nothing; inside a writable bind (the mount at /sandbox, a worktree's git
    directory) the program may have planted links in an earlier session, which a bubblewrap
    without the fix for CVE-2026-87766 (0.12.0, 0.11.2) follows while it makes the path.
    ValueError for an option this does not know (so a new one is classified, never missed)."""
    binds: list[tuple[str, str]] = [("/", "own")]  # (path inside, kind), in the order made
    found: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        option = args[i]
        if option in _BWRAP_FLAGS:
            i += 1
            continue
        if option in _BWRAP_ONE:
            i += 2
            continue
        if option in _BWRAP_MAKES_ONE:
            target, kind = args[i + 1], _BWRAP_MAKES_ONE[option]
            i += 2
        elif option in _BWRAP_MAKES_TWO:
            target, kind = args[i + 2], _BWRAP_MAKES_TWO[option]
            i += 3
            if kind == "env" or option == "--chmod":
                continue
        else:
            raise ValueError(f"unknown bubblewrap option {option!r}")
        target = os.path.normpath(target)
        holder = max(
            (b for b in binds if b[0] == target or _below(target, b[0])), key=lambda b: len(b[0])
        )
        if holder[1] == "writable" and holder[0] != target:
            found.append((target, holder[0]))
        if kind is not None:
            binds.append((target, kind))
    return found


def _below(path: str, directory: str) -> bool:
    return directory == "/" or path.startswith(directory.rstrip("/") + "/")


def launcher_argv(tty: bool, command: Sequence[str]) -> list[str]:
    """What bubblewrap runs inside: the launcher, then CMD (the only argv /proc shows)."""
    return [
        "/bin/sh",
        "-c",
        LAUNCHER,
        "sandboxfs",
        "tty" if tty else "pipe",
        *command,
    ]


def sandbox_env(
    caller: Mapping[str, str],
    *,
    home: str,
    session: str,
    extra: Mapping[str, str],
    proxy: bool,
    path: str = PATH,
) -> dict[str, str]:
    """The program's whole environment: a short allowlist of the caller's, then --env.
    `path`: the system's PATH, after the directories of CMD's toolchain
    (sandboxfs.run.toolchain). No variable names the trust level: one would be stale after a
    promotion or demotion; /sandbox/.sandboxfs/context.json always has the current one."""
    env = {"PATH": path, "HOME": home}
    for name, value in caller.items():
        if name in ENV_PASSED or name.startswith(ENV_PASSED_PREFIXES):
            env[name] = value
    env["SANDBOXFS"] = "1"
    env["SANDBOXFS_SESSION"] = session
    env["SANDBOXFS_GUIDE"] = GUIDE  # what the program may do here, in a few lines
    env.update(cache_env(home))
    if proxy:
        url = "http://{}:{}".format(*PROXY_ADDRESS)
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
            env[name] = url
        env["NO_PROXY"] = env["no_proxy"] = "localhost,127.0.0.1,::1"
    env.update(extra)
    return env


def cache_env(home: str) -> dict[str, str]:
    """Caches that tools write next to the code, sent to the session's home instead.

    At levels where the repo is read-only, a tool that writes `__pycache__` or `.pytest_cache`
    beside the sources fails or warns (pytest turns the warning into an error under
    `filterwarnings = error`). Pointed at `$HOME/.cache`, they work at every level and the
    project stays as it was; pytest's cache is turned off instead, as no option that moves it
    is one pytest always knows. Tools that already cache under `$HOME` (pip, npm, uv) need
    nothing. `--env` overrides any of these.
    """
    cache = f"{home}/.cache"
    return {
        "XDG_CACHE_HOME": cache,
        "PYTHONPYCACHEPREFIX": f"{cache}/pycache",
        # pytest's cache off rather than moved: `-o cache_dir=` is an unknown option, a warning
        # (an error under `filterwarnings = error`), wherever the cache provider is off already
        "PYTEST_ADDOPTS": "-p no:cacheprovider",
        "MYPY_CACHE_DIR": f"{cache}/mypy",
        "RUFF_CACHE_DIR": f"{cache}/ruff",
    }


def parse_env_option(text: str, caller: Mapping[str, str]) -> tuple[str, str]:
    """`--env NAME=VALUE`, or `--env NAME` for the caller's own value (which must be set)."""
    name, sep, value = text.partition("=")
    if not ENV_NAME.match(name):
        raise ValueError(
            f"--env {text!r}: expected NAME or NAME=VALUE with NAME made of letters, digits "
            f"and '_', not starting with a digit"
        )
    if not sep:
        if name not in caller:
            raise ValueError(f"--env {name}: {name} is not set in your environment")
        value = caller[name]
    return name, value


def virtual_cwd(text: str) -> str:
    """--cwd as a path inside the sandbox: `/repo/src` and `/sandbox/repo/src` are the same."""
    if not text.startswith("/"):
        raise ValueError(f"--cwd {text!r}: expected an absolute virtual path such as /repo/src")
    parts = [p for p in text.split("/") if p and p != "."]
    if ".." in parts:
        raise ValueError(f"--cwd {text!r}: '..' is not accepted")
    if parts[:1] == [SANDBOX.strip("/")]:
        parts = parts[1:]
    return "/".join([SANDBOX, *parts])
