"""What `run` shows of the host for CMD (sandboxfs.run.toolchain), the user config and the agent
profiles (sandboxfs.config.user): pure resolution against trees made in tmp_path, nothing run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sandboxfs.config import user as userconfig
from sandboxfs.config.model import load
from sandboxfs.core.policy import Op, Patterns, Trust, Zone
from sandboxfs.errors import NotRunnable, UserError
from sandboxfs.project.zones import HOME_ZONE, prepare_zones, with_home
from sandboxfs.run import allowlist, confine, toolchain


def make_home(root: Path) -> Path:
    """A home with tools installed the usual ways, and secrets beside them."""
    home = root / "home" / "u"
    local = home / ".local"
    package = local / "lib" / "node_modules" / "@acme" / "agent"
    (package / "bin").mkdir(parents=True)
    (package / "node_modules" / "dep").mkdir(parents=True)
    script = package / "bin" / "agent.js"
    script.write_text("#!/usr/bin/env node\nconsole.log('hi')\n")
    script.chmod(0o755)
    (local / "bin").mkdir(parents=True)
    (local / "bin" / "acme").symlink_to("../lib/node_modules/@acme/agent/bin/agent.js")
    versions = local / "share" / "bin-agent" / "versions"
    versions.mkdir(parents=True)
    (versions / "1.0.0").write_bytes(Path("/usr/bin/true").read_bytes())
    (versions / "1.0.0").chmod(0o755)
    (local / "bin" / "bin-agent").symlink_to(versions / "1.0.0")
    venv = local / "share" / "pipx" / "venvs" / "py-agent"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    entry = venv / "bin" / "py-agent"
    entry.write_text(f"#!{venv}/bin/python\nprint('hi')\n")
    entry.chmod(0o755)
    (local / "bin" / "py-agent").symlink_to(entry)
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_rsa").write_text("secret")
    (home / ".config" / "gh").mkdir(parents=True)
    return home


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return make_home(tmp_path)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    proj = tmp_path / "work" / "project"
    proj.mkdir(parents=True)
    return proj


def limits(home: Path, project: Path, tmp_path: Path) -> toolchain.Limits:
    return toolchain.Limits.of(project, [project / ".sandbox", tmp_path / "state"], str(home))


def resolve(
    name: str, home: Path, project: Path, tmp_path: Path, **env: str
) -> toolchain.Toolchain:
    caller = {"PATH": f"{home}/.local/bin:/usr/bin:/bin", "HOME": str(home), **env}
    return toolchain.resolve(
        [name], caller_env=caller, limits=limits(home, project, tmp_path), project=project
    )


def test_a_node_package_is_shown_with_its_link_and_interpreter(
    home: Path, project: Path, tmp_path: Path
) -> None:
    tools = resolve("acme", home, project, tmp_path)
    package = f"{home}/.local/lib/node_modules/@acme/agent"
    assert tools.binds == [package]  # the package (its node_modules with it), not the rest
    assert tools.links == {
        f"{home}/.local/bin/acme": "../lib/node_modules/@acme/agent/bin/agent.js"
    }
    assert tools.path == [f"{home}/.local/bin"]  # node is /usr/bin/node: nothing more
    args = tools.bwrap_args()
    assert args[:3] == ["--ro-bind", package, package]
    assert ["--symlink", tools.links[f"{home}/.local/bin/acme"], f"{home}/.local/bin/acme"] == (
        args[3:]
    )
    assert tools.env_path().startswith(f"{home}/.local/bin:") and tools.env_path().endswith(
        confine.PATH
    )


def test_a_single_binary_is_shown_alone(home: Path, project: Path, tmp_path: Path) -> None:
    tools = resolve("bin-agent", home, project, tmp_path)
    assert tools.binds == [f"{home}/.local/share/bin-agent/versions/1.0.0"]


def test_a_venv_entry_point_brings_its_venv(home: Path, project: Path, tmp_path: Path) -> None:
    tools = resolve("py-agent", home, project, tmp_path)
    venv = f"{home}/.local/share/pipx/venvs/py-agent"
    assert tools.binds == [venv]  # its python is a link to /usr/bin/python3, there already
    assert f"{venv}/bin/python" in tools.links  # inside the venv: nothing to add for it
    assert tools.bwrap_args() == [
        "--ro-bind",
        venv,
        venv,
        "--symlink",
        f"{venv}/bin/py-agent",
        f"{home}/.local/bin/py-agent",
    ]


def test_an_interpreter_found_on_the_callers_path_is_shown_and_put_first(
    home: Path, project: Path, tmp_path: Path
) -> None:
    nvm = home / ".nvm" / "versions" / "node" / "v22.1.0"
    (nvm / "bin").mkdir(parents=True)
    (nvm / "lib").mkdir()
    (nvm / "bin" / "node").write_bytes(b"\x7fELF")
    (nvm / "bin" / "node").chmod(0o755)
    caller = {"PATH": f"{nvm}/bin:{home}/.local/bin:/usr/bin:/bin", "HOME": str(home)}
    tools = toolchain.resolve(
        ["acme"], caller_env=caller, limits=limits(home, project, tmp_path), project=project
    )
    assert sorted(tools.binds) == sorted([f"{home}/.local/lib/node_modules/@acme/agent", str(nvm)])
    assert tools.path == [f"{home}/.local/bin", f"{nvm}/bin"]


def test_a_pyenv_shim_stands_for_the_version_it_runs(
    home: Path, project: Path, tmp_path: Path
) -> None:
    pyenv = home / ".pyenv"
    (pyenv / "shims").mkdir(parents=True)
    for version in ("3.12.1", "3.11.7"):
        prefix = pyenv / "versions" / version
        (prefix / "bin").mkdir(parents=True)
        (prefix / "lib").mkdir()
        (prefix / "bin" / "python3").write_bytes(b"\x7fELF")
        (prefix / "bin" / "python3").chmod(0o755)
    shim = pyenv / "shims" / "python3"
    shim.write_text('#!/usr/bin/env bash\nexec pyenv exec "$@"\n')
    shim.chmod(0o755)
    (pyenv / "version").write_text("3.12.1\n")
    caller = {"PATH": f"{pyenv}/shims:/usr/bin:/bin", "HOME": str(home)}
    lim = limits(home, project, tmp_path)

    def shown(**env: str) -> list[str]:
        return toolchain.resolve(
            ["python3"], caller_env={**caller, **env}, limits=lim, project=project
        ).binds

    assert shown() == [f"{pyenv}/versions/3.12.1"]
    (project / ".python-version").write_text("3.11.7\n")
    assert shown() == [f"{pyenv}/versions/3.11.7"]
    assert shown(PYENV_VERSION="3.12.1") == [f"{pyenv}/versions/3.12.1"]
    assert shown(PYENV_VERSION="system") == []  # /usr/bin/python3: there already


def test_not_found_and_not_shown_say_why_in_one_line(
    home: Path, project: Path, tmp_path: Path
) -> None:
    with pytest.raises(NotRunnable) as missing:
        resolve("no-such-agent", home, project, tmp_path)
    assert type(missing.value) is NotRunnable  # exit 127
    assert "not found on your PATH nor on the sandbox's" in missing.value.message
    (project / "bin").mkdir()
    (project / "bin" / "tool").write_text("#!/bin/sh\n")
    (project / "bin" / "tool").chmod(0o755)
    caller = {"PATH": f"{project}/bin:/usr/bin", "HOME": str(home)}
    with pytest.raises(NotRunnable) as inside:
        toolchain.resolve(
            ["tool"], caller_env=caller, limits=limits(home, project, tmp_path), project=project
        )
    message = inside.value.message
    assert "not found on the sandbox's PATH" in message and "in the project" in message
    assert "/sandbox/repo/bin/tool" in message and "\n" not in message
    secret = home / ".ssh" / "tool"
    secret.write_text("#!/bin/sh\n")
    secret.chmod(0o755)
    with pytest.raises(NotRunnable) as hidden:
        resolve(str(secret), home, project, tmp_path)
    assert "~/.ssh/tool" in hidden.value.message and "secret" in hidden.value.message
    # With the user's own PATH (--env PATH=...), a name not found is left to the sandbox.
    caller = {"PATH": "/usr/bin", "HOME": str(home)}
    lim = limits(home, project, tmp_path)
    none = toolchain.resolve(["x"], caller_env=caller, limits=lim, project=project, strict=False)
    assert none.binds == [] and none.path == []


def test_what_is_never_shown(home: Path, project: Path, tmp_path: Path) -> None:
    lim = limits(home, project, tmp_path)
    never = {
        "/": "whole system directory",
        "/home": "whole system directory",
        "/tmp": "whole system directory",
        "/etc/shadow": "has its own",
        "/proc/1": "has its own",
        "/run/user/0": "has its own",
        f"{home}": "is your home",
        f"{home.parent}": "holds your home",
        f"{home}/.ssh": "secret (.ssh)",
        f"{home}/.SSH": "secret (.SSH)",
        f"{home}/.aws/config": "secret (.aws)",
        f"{home}/.config/gh": "secret (~/.config/gh)",
        f"{home}/.config": "holds ~/.config/gh",
        f"{home}/.local": "holds ~/.local/share/keyrings",
        f"{home}/.claude": "holds ~/.claude/.credentials.json",
        f"{home}/work/.env": "secret (.env)",
        f"{home}/certs/server.pem": "secret (server.pem)",
        f"{project}": "in the project",
        f"{project}/src": "in the project",
        f"{project.parent}": "holds the project",
        f"{project}/.sandbox": "in the project",
        f"{tmp_path}/state/anchors": "sandboxfs's state",
    }
    for path, why in never.items():
        refusal = lim.refusal(path)
        assert refusal is not None and why in refusal, (path, refusal)
    for path in (f"{home}/.local/bin", f"{home}/.nvm/versions/node/v22", "/opt/tool", "/nix"):
        assert lim.refusal(path) is None, path
    # `home seed` copies an agent's login: for it that is no secret, ~/.ssh still is.
    assert lim.refusal(f"{home}/.claude/.credentials.json", credentials=False) is None
    assert lim.refusal(f"{home}/.ssh", credentials=False) is not None


def test_expose_shows_links_and_paths_and_refuses_secrets(
    home: Path, project: Path, tmp_path: Path
) -> None:
    tools_dir = tmp_path / "tools"
    (tools_dir / "bin").mkdir(parents=True)
    (home / "tools").symlink_to(tools_dir)
    caller = {"PATH": f"{home}/tools/bin:/usr/bin", "HOME": str(home)}
    lim = limits(home, project, tmp_path)
    tools = toolchain.expose([(f"{home}/tools", "--expose")], caller_env=caller, limits=lim)
    assert tools.binds == [str(tools_dir)]
    assert tools.links == {f"{home}/tools": str(tools_dir)}
    assert tools.path == [f"{home}/tools/bin"]
    for path in (f"{home}/.ssh", str(home), str(project), "/"):
        with pytest.raises(UserError, match=r"--expose .*: refused: "):
            toolchain.expose([(path, "--expose")], caller_env=caller, limits=lim)
    (home / "keys").symlink_to(home / ".ssh")  # a link to a secret is the secret
    with pytest.raises(UserError, match="secret"):
        toolchain.expose([(f"{home}/keys", "--expose")], caller_env=caller, limits=lim)
    with pytest.raises(UserError, match="No such file"):
        toolchain.expose([(f"{home}/missing", "--expose")], caller_env=caller, limits=lim)
    assert toolchain.expose([("/usr/bin", "--expose")], caller_env=caller, limits=lim).binds == []


def test_nested_binds_collapse(tmp_path: Path) -> None:
    tools = toolchain.Toolchain()
    tools.bind("/opt/a/lib/x")
    tools.bind("/opt/a")
    tools.bind("/opt/a/bin/y")
    tools.bind("/opt/ab")
    assert tools.binds == ["/opt/a", "/opt/ab"]
    tools.links["/opt/a/bin/link"] = "y"  # inside a bound tree: there already
    tools.links["/home/u/bin/a"] = "/opt/a/bin/y"
    assert tools.bwrap_args() == [
        "--ro-bind",
        "/opt/a",
        "/opt/a",
        "--ro-bind",
        "/opt/ab",
        "/opt/ab",
        "--symlink",
        "/opt/a/bin/y",
        "/home/u/bin/a",
    ]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("#!/usr/bin/env node\n", ("/usr/bin/env", "node")),
        ("#!/usr/bin/env -S node --no-warnings\n", ("/usr/bin/env", "node")),
        ("#!/usr/bin/env -S NODE_OPTIONS=x node\n", ("/usr/bin/env", "node")),
        ("#! /opt/venv/bin/python -u\n", ("/opt/venv/bin/python", None)),
        ("#!/bin/sh\n", ("/bin/sh", None)),
        ("echo no shebang\n", None),
        ("#!/usr/bin/env\n", None),
    ],
)
def test_shebang(tmp_path: Path, line: str, expected: tuple[str, str | None] | None) -> None:
    script = tmp_path / "s"
    script.write_text(line)
    assert toolchain._shebang(str(script)) == expected


def test_resolution_costs_milliseconds(home: Path, project: Path, tmp_path: Path) -> None:
    started = time.perf_counter()
    for name in ("true", "sh", "acme", "py-agent", "bin-agent"):
        resolve(name, home, project, tmp_path)
    assert time.perf_counter() - started < 0.2


def test_the_environment_gets_the_toolchains_path() -> None:
    env = confine.sandbox_env(
        {},
        home="/sandbox/home",
        session="s",
        extra={},
        proxy=False,
        path="/home/u/.local/bin:" + confine.PATH,
    )
    assert env["PATH"] == "/home/u/.local/bin:" + confine.PATH
    args = confine.bwrap_args(
        mountpoint=Path("/m"), cwd="/sandbox", net="none", tools=["--ro-bind", "/a", "/a"]
    )
    at = args.index("/a")
    assert args[at - 1 : at + 2] == ["--ro-bind", "/a", "/a"]
    assert args.index("/tmp") < at < args.index("--remount-ro", args.index(confine.SANDBOX))


# ----- the user config and the agent profiles ----------------------------------------------------


def write_config(tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    config = tmp_path / "xdg" / "sandboxfs" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(text)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return config


def test_user_config_and_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "none"))
    assert userconfig.load() == userconfig.UserConfig()
    config = write_config(
        tmp_path,
        "expose: [~/tools]\n"
        "agents:\n"
        "  claude: {allow_hosts: [mcp.example.com], env: [EXTRA=1]}\n"
        "  mine: {allow_hosts: [api.example.com], env: [MINE_KEY, MODE=sandboxed]}\n",
        monkeypatch,
    )
    assert userconfig.path() == config
    user = userconfig.load()
    assert user.expose == ["~/tools"]
    claude = userconfig.agent("claude", user)
    assert claude.allow_hosts[:3] == ["api.anthropic.com", "claude.ai", "platform.claude.com"]
    assert claude.allow_hosts[-1] == "mcp.example.com" and "EXTRA=1" in claude.env
    mine = userconfig.agent("mine", user)
    assert mine.environment({"MINE_KEY": "k", "OTHER": "o"}) == {
        "MINE_KEY": "k",
        "MODE": "sandboxed",
    }
    assert userconfig.agent("codex", user).environment({}) == {}  # keys only when set
    with pytest.raises(UserError, match="no such agent profile; profiles: aider, claude, codex"):
        userconfig.agent("nope", user)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("colour: red\n", "colour: unknown key; accepted keys: expose, agents"),
        ("agents: {x: {hosts: [a]}}\n", "unknown key; accepted keys: description, allow_hosts"),
        ("agents: {X!: {}}\n", "not a plain name"),
        ("agents: {x: {env: ['1BAD']}}\n", "expected NAME or NAME=VALUE"),
        ("agents: {x: {seed: [/etc/passwd]}}\n", "a path relative to your home"),
        ("[1, 2]\n", "expected a mapping"),
        ("a: [\n", "not valid YAML"),
    ],
)
def test_user_config_errors_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, needle: str
) -> None:
    write_config(tmp_path, text, monkeypatch)
    with pytest.raises(UserError) as error:
        userconfig.load()
    assert needle in error.value.message and "\n" not in error.value.message


def test_a_project_config_cannot_widen_confinement(tmp_path: Path) -> None:
    for text in ("expose: [/home]\n", "agents: {x: {}}\n", "run: {expose: [/home]}\n"):
        (tmp_path / "sandboxfs.yaml").write_text(text)
        with pytest.raises(UserError, match="unknown key"):
            load(tmp_path)


def test_builtin_profiles_are_valid() -> None:
    for name, profile in userconfig.BUILTIN_AGENTS.items():
        assert profile.programs == [name] and profile.allow_hosts, name
        for host in profile.allow_hosts:
            allowlist.parse_allow_host(host)
        for rel in profile.seed:
            assert not os.path.isabs(rel)


# ----- the program's home zone --------------------------------------------------------------------


def test_the_home_zone_is_per_workspace_and_trust_level(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    config = with_home(load(project), project, "ws", Trust.UNTRUSTED)
    dirs = prepare_zones(project, "ws", "s1", config, "test")
    assert dirs[Zone(HOME_ZONE)] == project / ".sandbox/workspaces/ws/homes/untrusted"
    assert dirs[Zone(HOME_ZONE)].is_dir()
    for level in Trust:  # the program's own: every operation at every level
        assert config.matrix()[level][Zone(HOME_ZONE)].ops == frozenset(Op)
    other = with_home(load(project), project, "ws", Trust.FULL)
    assert prepare_zones(project, "ws", "s2", other, "t")[Zone(HOME_ZONE)].name == "full"
    (project / "sandboxfs.yaml").write_text("zones: {home: {path: /srv}}\n")
    with pytest.raises(UserError, match="declares a zone named 'home'"):
        with_home(load(project), project, "ws", Trust.FULL)


def test_credentials_in_a_bound_tree_are_covered(tmp_path: Path) -> None:
    prefix = tmp_path / "nvm" / "versions" / "node" / "v22"
    (prefix / "etc").mkdir(parents=True)
    (prefix / "etc" / "npmrc").write_text("//registry.npmjs.org/:_authToken=secret\n")
    (prefix / "pip.conf").mkdir()  # not a file: nothing to cover
    tools = toolchain.Toolchain()
    tools.bind(str(prefix))
    assert tools.bwrap_args() == [
        "--ro-bind", str(prefix), str(prefix),
        "--ro-bind", "/dev/null", f"{prefix}/etc/npmrc",
    ]  # fmt: skip


def test_an_exposed_tree_is_covered_at_every_depth(tmp_path: Path) -> None:
    tree = tmp_path / "other"
    (tree / "a" / "b" / ".sandbox").mkdir(parents=True)
    (tree / "a" / "b" / ".env").write_text("x\n")
    (tree / "a" / "b" / ".env.example").write_text("x\n")
    (tree / "a" / "plain.txt").write_text("x\n")
    (tree / "a" / "data.txt").write_text("x\n")
    (tree / "a" / "secrets").mkdir()
    (tree / ".env").symlink_to("a/data.txt")  # a link so named covers what it leads to
    found = toolchain.covered(str(tree), Patterns(["secrets/", ".env", "!.env.example"]))
    assert sorted(found) == sorted(
        [
            (str(tree / "a" / "b" / ".sandbox"), True),
            (str(tree / "a" / "b" / ".env"), False),
            (str(tree / "a" / "b" / ".env.example"), False),  # a secret name all the same
            (str(tree / "a" / "secrets"), True),
            (str(tree / "a" / "data.txt"), False),
        ]
    )
