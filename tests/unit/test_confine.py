"""The confined program's view, without starting anything: /etc without secrets, the system
links, the environment allowlist and the options that shape them."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandboxfs.config.model import load
from sandboxfs.errors import UserError
from sandboxfs.run import confine


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
        trust="session",
        extra={"GITHUB_TOKEN": "explicit"},
        proxy=False,
    )
    assert env["PATH"] == confine.PATH and env["HOME"] == "/sandbox/session/home"
    assert env["TERM"] == "xterm" and env["LC_ALL"] == "C.UTF-8"
    assert "SSH_AUTH_SOCK" not in env and "AWS_SECRET_ACCESS_KEY" not in env
    assert env["GITHUB_TOKEN"] == "explicit"
    assert env["SANDBOXFS_SESSION"] == "s1" and "HTTPS_PROXY" not in env
    proxied = confine.sandbox_env(caller, home="/h", session="s", trust="t", extra={}, proxy=True)
    assert proxied["HTTPS_PROXY"] == "http://127.0.0.1:3128"


def test_caches_go_to_the_session_home() -> None:
    env = confine.sandbox_env(
        {}, home="/sandbox/session/home", session="s", trust="workspace", extra={}, proxy=False
    )
    assert env["PYTHONPYCACHEPREFIX"] == "/sandbox/session/home/.cache/pycache"
    assert env["PYTEST_ADDOPTS"] == "-o cache_dir=/sandbox/session/home/.cache/pytest"
    assert env["XDG_CACHE_HOME"] == "/sandbox/session/home/.cache"
    mine = confine.sandbox_env(
        {}, home="/h", session="s", trust="t", extra={"PYTEST_ADDOPTS": "-x"}, proxy=False
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
