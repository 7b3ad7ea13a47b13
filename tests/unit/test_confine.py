"""The confined program's view, without starting anything: /etc without secrets, the system
links, the environment allowlist and the options that shape them."""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import os
import random
import resource
import stat
import subprocess
from pathlib import Path

import pytest

from sandboxfs.config.model import load
from sandboxfs.core.policy import Trust
from sandboxfs.errors import SetupError, UserError
from sandboxfs.project import gitdir, zones
from sandboxfs.run import confine, toolchain


def fake_etc(root: Path) -> Path:
    etc = root / "etc"
    (etc / "ssh").mkdir(parents=True)
    (etc / "ssl" / "private").mkdir(parents=True)
    (etc / "ssl" / "certs").mkdir()
    for name in ("passwd", "group", "shadow", "gshadow", "hosts", "npmrc"):
        (etc / name).write_text(name)
    (etc / "ssh" / "ssh_config").write_text("config")
    (etc / "ssh" / "ssh_host_ed25519_key").write_text("secret")
    (etc / "ssh" / "ssh_host_ed25519_key.pub").write_text("public")
    (etc / "sudoers.d").mkdir()
    (etc / "localtime").symlink_to("/usr/share/zoneinfo/UTC")
    (etc / "resolv.conf").symlink_to(root / "run-resolv.conf")
    (root / "run-resolv.conf").write_text("nameserver 127.0.0.53\n")
    return etc


def inside_paths(args: list[str]) -> dict[str, str]:
    """Destination -> what is put there ("bind:<src>", "dir", "link:<target>")."""
    found = {}
    i = 0
    while i < len(args):
        if args[i] == "--dir":
            found[args[i + 1]] = "dir"
            i += 2
        elif args[i] in ("--ro-bind", "--symlink"):
            kind = "bind" if args[i] == "--ro-bind" else "link"
            found[args[i + 2]] = f"{kind}:{args[i + 1]}"
            i += 3
        else:
            i += 1
    return found


def test_etc_leaves_out_secrets_and_keeps_the_rest(tmp_path: Path) -> None:
    etc = fake_etc(tmp_path)
    seen = inside_paths(confine.etc_args(etc))
    for secret in (
        "shadow",
        "gshadow",
        "npmrc",
        "sudoers.d",
        "ssl/private",
        "ssh/ssh_host_ed25519_key",
    ):
        assert f"/etc/{secret}" not in seen, secret
    assert seen["/etc/passwd"] == f"bind:{etc}/passwd"
    assert seen["/etc/ssh"] == "dir"  # rebuilt one level down, without the private key
    assert seen["/etc/ssh/ssh_config"] == f"bind:{etc}/ssh/ssh_config"
    assert "/etc/ssh/ssh_host_ed25519_key.pub" in seen
    assert seen["/etc/ssl"] == "dir" and "/etc/ssl/certs" in seen
    assert seen["/etc/localtime"] == "link:/usr/share/zoneinfo/UTC"
    assert seen["/etc/resolv.conf"].startswith("link:")
    with_dns = inside_paths(confine.etc_args(etc, resolv_conf=True))
    assert with_dns["/etc/resolv.conf"] == f"bind:{tmp_path}/run-resolv.conf"


def test_system_links_mirror_the_host(tmp_path: Path) -> None:
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "bin").symlink_to("usr/bin")
    (tmp_path / "lib64").mkdir()
    seen = inside_paths(confine.system_args(tmp_path))
    assert seen == {
        "/usr": f"bind:{tmp_path}/usr",
        "/bin": "link:usr/bin",
        "/lib64": f"bind:{tmp_path}/lib64",
    }


def test_bwrap_args_shape(tmp_path: Path) -> None:
    args = confine.bwrap_args(mountpoint=tmp_path, cwd="/sandbox/repo", net="none")
    for flag in (
        "--unshare-user",
        "--unshare-pid",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
    ):
        assert flag in args
    assert args[args.index("--cap-drop") + 1] == "ALL"
    assert args[args.index("--bind") + 1 : args.index("--bind") + 3] == [str(tmp_path), "/sandbox"]
    assert "--" not in args  # options only: they travel on ARGS_FD, CMD on the argv
    assert confine.launcher_argv(False, ["ls", "-l"])[-3:] == ["pipe", "ls", "-l"]
    for net in ("none", "allow"):  # the supervisor's own namespace, with its DNS stub
        shared = confine.bwrap_args(mountpoint=tmp_path, cwd="/sandbox", net=net)
        assert "--unshare-net" not in shared
        at = shared.index("--ro-bind-data")
        assert shared[at - 2 : at + 3] == [
            "--perms",
            "0644",
            "--ro-bind-data",
            "9",
            "/etc/resolv.conf",
        ]
        assert shared.count("/etc/resolv.conf") == 1  # not the host's as well
    host = confine.bwrap_args(mountpoint=tmp_path, cwd="/sandbox", net="host")
    assert "--ro-bind-data" not in host and "--unshare-net" not in host
    assert confine.launcher_argv(True, ["sh"])[-2:] == ["tty", "sh"]
    assert "8>&-" in confine.LAUNCHER and confine.ARGS_FD == 8


def test_etc_shows_only_what_every_user_may_read(tmp_path: Path) -> None:
    """Whatever its name: a root caller's program is the host's uid 0 and would read it."""
    etc = fake_etc(tmp_path)
    (etc / "default").mkdir()
    (etc / "default" / "cacerts").write_text("private")
    (etc / "default" / "cacerts").chmod(0o600)
    (etc / "default" / "locale").write_text("LANG=C")
    (etc / "mysql").mkdir(mode=0o700)
    (etc / "mysql" / "debian.cnf").write_text("password")
    (etc / "group-only").write_text("x")
    (etc / "group-only").chmod(0o640)
    seen = inside_paths(confine.etc_args(etc))
    assert seen["/etc/default"] == "dir"  # rebuilt: it holds a private file
    assert seen["/etc/default/locale"] == f"bind:{etc}/default/locale"
    for private in ("default/cacerts", "mysql", "mysql/debian.cnf", "group-only"):
        assert f"/etc/{private}" not in seen, private
    assert seen["/etc/ssl/certs"] == f"bind:{etc}/ssl/certs"  # whole: nothing private below


def test_etc_files_are_copied_from_descriptors(tmp_path: Path) -> None:
    """With EtcCopies, a rebuilt directory's regular files go in as copies read from the
    descriptors handed to bubblewrap; directories shown whole, links, what is too large or
    too many, and what is no longer a world-readable regular file are not copied."""
    etc = fake_etc(tmp_path)
    (etc / "hosts").chmod(0o755)
    (etc / "big").write_bytes(b"x" * 2048)
    copies = confine.EtcCopies(first=10, limit=50, max_bytes=1024)
    try:
        args = confine.etc_args(etc, copies=copies)
        copied = {}
        for i, arg in enumerate(args):
            if arg == "--file":
                assert args[i - 2] == "--perms"
                fd = copies.fds[int(args[i + 1])]
                copied[args[i + 2]] = (args[i - 1], os.pread(fd, 100, 0))
        assert copied["/etc/passwd"] == ("0644", b"passwd")
        assert copied["/etc/hosts"] == ("0755", b"hosts")
        assert copied["/etc/ssh/ssh_config"] == ("0644", b"config")
        assert sorted(copies.fds) == list(range(10, 10 + len(copied)))
        seen = inside_paths(args)
        assert seen["/etc/big"] == f"bind:{etc}/big"  # too large: bound
        assert seen["/etc/ssl/certs"] == f"bind:{etc}/ssl/certs"  # a directory, whole
        assert seen["/etc/localtime"] == "link:/usr/share/zoneinfo/UTC"
        for secret in ("/etc/shadow", "/etc/npmrc", "/etc/ssh/ssh_host_ed25519_key"):
            assert secret not in seen and secret not in copied
    finally:
        copies.close()
    assert copies.fds == {}
    few = confine.EtcCopies(first=10, limit=2)
    try:
        args = confine.etc_args(etc, copies=few)
        assert args.count("--file") == 2 and len(few.fds) == 2
        assert inside_paths(args)["/etc/passwd"] == f"bind:{etc}/passwd"  # past the limit
    finally:
        few.close()
    # Between the scan and the copy, a file may have become a fifo, a directory or private.
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "private").write_text("root only")
    (tmp_path / "private").chmod(0o600)
    (tmp_path / "link").symlink_to(etc / "passwd")
    # Left out then, never bound: a bind would show what the scan would now leave out.
    late = confine.EtcCopies(first=10)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert late._limit == min(256, soft // 4)  # run needs the other descriptors
    for path in ("fifo", "private", "link", "missing"):
        assert late.add(str(tmp_path / path)) == "omit", path
    assert late.add(str(etc)) == "omit"
    assert late.fds == {}


def test_proc_knobs_are_read_only_or_covered(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for name in ("sys", "irq", "acpi", "tty/driver"):
        (proc / name).mkdir(parents=True)
    for name in ("sysrq-trigger", "keys", "kcore", "cpuinfo"):
        (proc / name).write_text("")
    args = confine.proc_args(proc)
    assert args[:2] == ["--proc", "/proc"]
    pairs = {(args[i], args[i + 2]) for i in range(len(args) - 2) if args[i].startswith("--")}
    assert ("--ro-bind", "/proc/sys") in pairs and ("--ro-bind", "/proc/sysrq-trigger") in pairs
    assert args[args.index("/proc/keys") - 1] == "/dev/null"
    assert "/proc/cpuinfo" not in args and "/proc/bus" not in args  # absent here: nothing
    assert args[args.index("/proc/acpi") - 1] == "--tmpfs"
    assert "--remount-ro" in args


def test_environment_is_an_allowlist() -> None:
    caller = {
        "PATH": "/root/.local/bin:/usr/bin",
        "TERM": "xterm",
        "LC_ALL": "C.UTF-8",
        "SSH_AUTH_SOCK": "/tmp/agent",
        "AWS_SECRET_ACCESS_KEY": "x",
        "GITHUB_TOKEN": "y",
        "HOME": "/root",
    }
    env = confine.sandbox_env(
        caller,
        home="/sandbox/session/home",
        session="s1",
        extra={"GITHUB_TOKEN": "explicit"},
        proxy=False,
    )
    assert env["PATH"] == confine.PATH and env["HOME"] == "/sandbox/session/home"
    assert env["TERM"] == "xterm" and env["LC_ALL"] == "C.UTF-8"
    assert "SSH_AUTH_SOCK" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["GITHUB_TOKEN"] == "explicit"
    assert env["SANDBOXFS_SESSION"] == "s1" and "HTTPS_PROXY" not in env
    assert "SANDBOXFS_TRUST" not in env  # stale after a promotion: context.json has the level
    proxied = confine.sandbox_env(caller, home="/h", session="s", extra={}, proxy=True)
    assert proxied["HTTPS_PROXY"] == "http://127.0.0.1:3128"


def test_caches_go_to_the_session_home() -> None:
    env = confine.sandbox_env({}, home="/sandbox/session/home", session="s", extra={}, proxy=False)
    assert env["PYTHONPYCACHEPREFIX"] == "/sandbox/session/home/.cache/pycache"
    assert env["PYTEST_ADDOPTS"] == "-p no:cacheprovider"  # never an unknown `-o cache_dir`
    assert env["XDG_CACHE_HOME"] == "/sandbox/session/home/.cache"
    mine = confine.sandbox_env(
        {}, home="/h", session="s", extra={"PYTEST_ADDOPTS": "-x"}, proxy=False
    )
    assert mine["PYTEST_ADDOPTS"] == "-x"  # --env wins


def test_env_and_cwd_options() -> None:
    assert confine.parse_env_option("A=1=2", {}) == ("A", "1=2")
    assert confine.parse_env_option("HOME", {"HOME": "/root"}) == ("HOME", "/root")
    for bad in ("1A=x", "A B=x", "=x", "UNSET_HERE"):
        with pytest.raises(ValueError, match="--env"):
            confine.parse_env_option(bad, {})
    assert confine.virtual_cwd("/repo/src") == "/sandbox/repo/src"
    assert confine.virtual_cwd("/sandbox/repo/./src/") == "/sandbox/repo/src"
    for bad in ("repo", "/repo/../.."):
        with pytest.raises(ValueError, match="--cwd"):
            confine.virtual_cwd(bad)


def test_project_config_sets_the_network_but_cannot_switch_confinement_off(
    tmp_path: Path,
) -> None:
    (tmp_path / "sandboxfs.yaml").write_text(
        "run:\n  network: allow\n  allow_hosts: [api.example.com]\n"
    )
    cfg = load(tmp_path)
    assert cfg.run.network == "allow" and cfg.run.allow_hosts == ["api.example.com"]
    for text in ("run:\n  confine: false\n", "run:\n  network: off\n"):
        (tmp_path / "sandboxfs.yaml").write_text(text)
        with pytest.raises(UserError, match="run"):
            load(tmp_path)


def reference_etc_args(etc: Path, hidden: tuple[str, ...], resolv_conf: bool) -> list[str]:
    """etc_args, computed the plain way: every entry looked at by path, every directory's
    whole subtree walked again to decide whether it is bound whole."""

    def readable(path: Path) -> bool:
        try:
            st = path.stat()
        except OSError:
            return False
        if stat.S_ISDIR(st.st_mode):
            return st.st_mode & 0o005 == 0o005
        return stat.S_ISREG(st.st_mode) and bool(st.st_mode & 0o004)

    def holds_private(rel: str) -> bool:
        if any(p.startswith(rel + "/") for p in hidden):
            return True
        for top, dirs, files in os.walk(etc / rel):
            for name in dirs + files:
                path = Path(top) / name
                if not path.is_symlink() and not readable(path):
                    return True
        return False

    def entries(below: str) -> list[tuple[str, str]]:
        try:
            names = sorted(os.listdir(etc / below))
        except OSError:
            return []
        found = []
        for name in names:
            rel = below + name
            if any(fnmatch.fnmatchcase(rel, p) for p in hidden):
                continue
            path = etc / rel
            if path.is_symlink():
                found.append((rel, "link"))
            elif not readable(path):
                continue
            elif path.is_dir() and holds_private(rel):
                found += [(rel, "dir"), *entries(rel + "/")]
            else:
                found.append((rel, "bind"))
        return found

    args = ["--dir", "/etc"]
    for rel, kind in entries(""):
        host = etc / rel
        if kind == "dir":
            args += ["--dir", f"/etc/{rel}"]
        elif kind == "link" and rel == "resolv.conf" and resolv_conf and readable(host.resolve()):
            args += ["--ro-bind", str(host.resolve()), f"/etc/{rel}"]
        elif kind == "link":
            args += ["--symlink", os.readlink(host), f"/etc/{rel}"]
        else:
            args += ["--ro-bind", str(host), f"/etc/{rel}"]
    return args


def random_etc(root: Path, seed: int) -> Path:
    """A tree of files, directories, links and a fifo, with every kind of mode, some of them
    named as the hidden patterns name secrets, a few levels deep."""
    rng = random.Random(seed)
    etc = fake_etc(root)
    names = ["a", "b", "ssh", "ssl", "private", "x_key", "conf.d", "shadow", "sub", "c.conf"]
    modes = [0o644, 0o600, 0o640, 0o604, 0o000, 0o755, 0o700, 0o750, 0o705, 0o701, 0o704]
    dirs = [etc]
    for _ in range(120):
        parent = rng.choice(dirs)
        path = parent / f"{rng.choice(names)}{rng.randrange(3) or ''}"
        if path.exists() or path.is_symlink():
            continue
        kind = rng.random()
        if kind < 0.35:
            path.mkdir()
            dirs.append(path)
        elif kind < 0.85:
            path.write_text("x")
        elif kind < 0.95:
            path.symlink_to(rng.choice(["/etc/passwd", "../a", "nowhere", str(root)]))
        else:
            os.mkfifo(path)
        if not path.is_symlink():
            path.chmod(rng.choice(modes))
    return etc


@pytest.mark.parametrize("seed", range(12))
def test_etc_args_is_the_plain_computation(tmp_path: Path, seed: int) -> None:
    """The one-pass scan gives bubblewrap exactly what looking at each path does, on trees of
    root-only and group-only files, directories nobody may list, links and secrets."""
    etc = random_etc(tmp_path, seed)
    try:
        for hidden in (confine.ETC_HIDDEN, (*confine.ETC_HIDDEN, "resolv.conf", "*/x_key"), ()):
            for resolv_conf in (False, True):
                expected = reference_etc_args(etc, tuple(hidden), resolv_conf)
                assert confine.etc_args(etc, hidden, resolv_conf) == expected
        assert confine.etc_args(Path("/etc")) == reference_etc_args(
            Path("/etc"), confine.ETC_HIDDEN, False
        )
    finally:  # tmp_path's cleanup must be able to list and remove what was locked
        for top, dirs, _files in os.walk(tmp_path):
            for name in dirs:
                if not os.path.islink(os.path.join(top, name)):
                    with contextlib.suppress(OSError):
                        os.chmod(os.path.join(top, name), 0o755)


def test_the_childs_descriptors_are_each_their_own_source(tmp_path: Path) -> None:
    """The child bubblewrap becomes gets each descriptor at its number (200 /etc copies among
    them): no dup2 may replace a source still to be placed, whatever the order and wherever
    the sources lie."""
    from sandboxfs.run.processes import _arrange_fds

    sources, content = [], {}
    for i in range(200):
        path = tmp_path / f"f{i}"
        path.write_text(str(i))
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 400)  # above every target
        os.close(fd)
        sources.append(high)
        content[high] = str(i).encode()
    report_r, report_w = os.pipe()
    order = list(range(200))
    random.Random(7).shuffle(order)
    targets = {10 + i: sources[i] for i in order}  # 10..209, placed in a random order
    targets[3] = report_w
    pid = os.fork()
    if pid == 0:
        try:
            _arrange_fds(targets)
            wrong = [t for t, fd in targets.items() if t != 3 and os.pread(t, 8, 0) != content[fd]]
            left = sorted(int(n) for n in os.listdir("/proc/self/fd"))
            os.write(3, f"{wrong} {left[-2:]}".encode())
        finally:
            os._exit(0)
    os.close(report_w)
    os.waitpid(pid, 0)
    report = os.read(report_r, 4096).decode()
    os.close(report_r)
    for fd in sources:
        os.close(fd)
    # The last two: fd 209 and listdir's own descriptor (nothing above the targets is left).
    assert report.startswith("[] [209, "), report


# ----- CVE-2026-87766: nothing is made inside a writable bind ------------------------------------


def test_a_runs_targets_are_never_inside_a_writable_bind(tmp_path: Path) -> None:
    """Every path bubblewrap makes for a run with a persistent home, a worktree's git
    directory, the nest and --expose (a tree holding a masked .env) lies in what bubblewrap
    made itself or in a read-only bind; the only writable binds are the mount and the git
    directory, and nothing is made inside either."""
    main, project = tmp_path / "main", tmp_path / "wt"
    for cmd in (
        ["init", "-q", str(main)],
        ["-C", str(main), "commit", "-q", "--allow-empty", "-m", "i"],
        ["-C", str(main), "worktree", "add", "-q", str(project)],
    ):
        git = ["git", "-c", "user.name=a", "-c", "user.email=a@b.invalid", *cmd]
        subprocess.run(git, check=True, capture_output=True)  # fmt: skip
    exposed = tmp_path / "tools"
    (exposed / "bin").mkdir(parents=True)
    (exposed / ".env").write_text("TOKEN=x\n")
    config = gitdir.with_git_dir(
        zones.with_home(load(project), project, "default", Trust.FULL), project
    )
    mnt = tmp_path / "mnt"
    limits = toolchain.Limits.of(project, [tmp_path / "state"], home=str(tmp_path / "home"))
    tools = toolchain.expose([(str(exposed), "--expose")], caller_env={}, limits=limits)
    options = [
        *gitdir.bwrap_binds(config, Trust.FULL, mnt),
        "--ro-bind", str(tmp_path / "nest"), "/sandboxfs",
        *tools.bwrap_args(),
    ]  # fmt: skip
    args = confine.bwrap_args(mountpoint=mnt, cwd="/sandbox/repo", net="none", tools=options)
    assert confine.targets_in_writable_binds(args) == []
    writable = [args[i + 2] for i, a in enumerate(args) if a == "--bind"]
    assert writable == ["/sandbox", str(main / ".git")]
    assert f"--ro-bind /dev/null {exposed}/.env" in " ".join(args)


def test_a_target_inside_a_writable_bind_is_refused() -> None:
    made = [
        "--bind", "/m", "/sandbox", "--dir", "/sandbox/x", "--ro-bind", "/t", "/sandbox/t",
        "--ro-bind", "/dev/null", "/sandbox/t/.env", "--tmpfs", "/tmp", "--dir", "/tmp/a",
    ]  # fmt: skip
    assert confine.targets_in_writable_binds(made) == [
        ("/sandbox/x", "/sandbox"),
        ("/sandbox/t", "/sandbox"),
    ]
    with pytest.raises(ValueError, match="--overlay-src"):
        confine.targets_in_writable_binds(["--overlay-src", "/a"])
    with pytest.raises(SetupError, match="CVE-2026-87766"):
        confine.bwrap_args(
            mountpoint=Path("/m"), cwd="/sandbox", net="none", tools=["--dir", "/sandbox/x"]
        )
