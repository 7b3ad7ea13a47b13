"""Agents under `sandboxfs run`, as root and as an ordinary user: installed the usual ways in
the user's home, they run inside read-only and see nothing else of it; `--expose` and the user
config show what the user names and refuse secrets; the program's home persists across
sessions of a workspace (per trust level) and is seeded and reset from outside; agent
profiles set the hosts and variables at once.

The agents are small stand-ins installed as real ones are: a node script under
~/.local/lib/node_modules with a bin link (`npm install -g --prefix ~/.local`), a python
entry point in a virtualenv with a link in ~/.local/bin (pipx), a single binary under
~/.local/share/<tool>/versions/ (Claude Code's native installer).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.cli import SANDBOXFS, wait_until
from tests.support.mounts import make_project
from tests.support.run import NOBODY, NOBODY_UID, audit, fuse_mounts, nobody_env, nobody_home, sbx

__all__ = ["nobody_home"]  # a fixture used here, from test_run

pytestmark = pytest.mark.skipif(
    not os.path.exists("/usr/bin/bwrap") or not os.path.exists("/usr/bin/node"),
    reason="bubblewrap is installed by .ci/setup; the node stand-in needs /usr/bin/node",
)

NODE_AGENT = r"""#!/usr/bin/env node
const fs = require('fs');
console.log('node-agent: ' + require('../lib/helper.js'));
for (const arg of process.argv.slice(2)) {
  const [verb, path] = arg.includes(':') ? arg.split(/:(.*)/s) : ['read', arg];
  try {
    if (verb === 'ls') console.log(arg + ': ' + fs.readdirSync(path).sort().join(' '));
    else if (verb === 'write') { fs.writeFileSync(path, 'x'); console.log(arg + ': written'); }
    else { fs.readFileSync(path); console.log(arg + ': readable'); }
  } catch (e) { console.log(arg + ': ' + e.code); }
}
"""

PY_AGENT = """\
import os, sys
import py_agent_lib
print("py-agent: " + py_agent_lib.WHO + " in " + sys.prefix)
for path in sys.argv[1:]:
    print(path + ": " + (f"{os.path.getsize(path)} bytes" if os.path.exists(path) else "ENOENT"))
"""


def install_agents(home: Path) -> None:
    """The three stand-ins, a package beside them that is not theirs, and secrets."""
    local = home / ".local"
    package = local / "lib" / "node_modules" / "@acme" / "agent"
    (package / "bin").mkdir(parents=True)
    (package / "lib").mkdir()
    (package / "lib" / "helper.js").write_text("module.exports = 'helper from its package';\n")
    (package / "bin" / "agent.js").write_text(NODE_AGENT)
    (package / "bin" / "agent.js").chmod(0o755)
    (local / "lib" / "node_modules" / "other").mkdir(parents=True)
    (local / "lib" / "node_modules" / "other" / "secret.txt").write_text("not the agent's\n")
    (local / "bin").mkdir(parents=True)
    (local / "bin" / "acme-agent").symlink_to("../lib/node_modules/@acme/agent/bin/agent.js")

    venv = local / "share" / "pipx" / "venvs" / "py-agent"
    version = subprocess.run(
        ["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    site = venv / "lib" / f"python{version}" / "site-packages"
    site.mkdir(parents=True)
    (site / "py_agent_lib.py").write_text("WHO = 'module from its venv'\n")
    (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\nversion = {version}\n")
    (venv / "pip.conf").write_text("[global]\nindex-url = https://user:token@pypi.example/simple\n")
    (venv / "bin").mkdir()
    (venv / "bin" / "python").symlink_to("/usr/bin/python3")
    (venv / "bin" / "py-agent").write_text(f"#!{venv}/bin/python\n{PY_AGENT}")
    (venv / "bin" / "py-agent").chmod(0o755)
    (local / "bin" / "py-agent").symlink_to("../share/pipx/venvs/py-agent/bin/py-agent")

    versions = local / "share" / "bin-agent" / "versions"
    versions.mkdir(parents=True)
    shutil.copy("/usr/bin/echo", versions / "1.0.0")
    shutil.copy("/usr/bin/echo", versions / "0.9.0")
    (local / "bin" / "bin-agent").symlink_to(versions / "1.0.0")

    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_rsa").write_text("private key\n")
    (home / "notes.txt").write_text("the user's notes\n")
    (home / ".claude" / "keys").mkdir(parents=True)
    (home / ".claude" / ".credentials.json").write_text('{"token": "seeded"}\n')
    (home / ".claude" / ".credentials.json").chmod(0o600)
    (home / ".claude" / "settings.json").write_text("{}\n")
    (home / ".claude" / "keys" / "id_ed25519").write_text("private key\n")
    (home / "tools").mkdir()
    (home / "tools" / "data.txt").write_text("exposed data\n")


@dataclass
class Caller:
    """Who runs sandboxfs: root or nobody, with a home of agents and a project."""

    name: str
    project: Path
    home: Path
    env: dict[str, str]
    prefix: list[str]

    def sbx(self, *args: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
        return sbx(*args, prefix=self.prefix, env={**self.env, **env})

    def run(self, *args: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
        return self.sbx("run", "--project", self.project, *args, **env)


@pytest.fixture(params=["root", "nobody"])
def caller(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Caller]:
    if request.param == "root":
        home = tmp_path / "home"
        install_agents(home)
        env = {**os.environ, "HOME": str(home)}
        env.pop("XDG_CONFIG_HOME", None)
        env["PATH"] = f"{home}/.local/bin:/usr/local/bin:/usr/bin:/bin"
        yield Caller("root", make_project(tmp_path), home, env, [])
        return
    root: Path = request.getfixturevalue("nobody_home")
    home = root / "home"
    install_agents(home)
    subprocess.run(["chown", "-R", f"{NOBODY_UID}:{NOBODY_UID}", str(home)], check=True)
    env = nobody_env(root)
    env["PATH"] = f"{home}/.local/bin:{env['PATH']}"
    yield Caller("nobody", root / "project", home, env, NOBODY)


@pytest.fixture(autouse=True)
def nothing_left_behind(caller: Caller) -> Iterator[None]:
    """No mount and no run directory of this caller's runs is left (only theirs are looked
    at: other mounts on the machine are none of these tests' business)."""
    yield
    state = Path(caller.env.get("SANDBOXFS_STATE_DIR") or os.environ["SANDBOXFS_STATE_DIR"])
    left: list[str] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [m for m in fuse_mounts() if m.startswith(f"{state}/")]
        runs = list((state / "run").iterdir()) if (state / "run").is_dir() else []
        if not left and not runs:
            return
        time.sleep(0.05)
    for mnt in left:
        subprocess.run(["fusermount3", "-u", "-z", mnt], check=False)
    raise AssertionError(f"left behind: {left or runs}")


def outcomes(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    found = {}
    for line in result.stdout.splitlines():
        name, sep, outcome = line.rpartition(": ")
        if sep:
            found[name] = outcome
    return found


def one_line(result: subprocess.CompletedProcess[str], status: int, *needles: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == status, (result.returncode, result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ----- installed agents run inside, and see nothing else of the home -----------------------------


def test_installed_agents_run_and_see_nothing_else(caller: Caller) -> None:
    home = caller.home
    others = [
        f"{home}/.ssh/id_rsa",
        f"{home}/notes.txt",
        f"{home}/.local/lib/node_modules/other/secret.txt",
        f"{home}/.local/share/bin-agent/versions/0.9.0",
        f"{home}/.claude/.credentials.json",
        f"{caller.project}/README.md",
    ]
    package = f"{home}/.local/lib/node_modules/@acme/agent"
    result = caller.run(
        "-q", "--", "acme-agent", *others, f"ls:{home}/.local/bin", f"write:{package}/planted"
    )
    assert result.returncode == 0, result.stderr
    found = outcomes(result)
    assert found["node-agent"] == "helper from its package", result.stdout
    for path in others:
        assert found[path] == "ENOENT", (path, result.stdout)
    assert found[f"ls:{home}/.local/bin"] == "acme-agent"  # only the link it came by
    assert found[f"write:{package}/planted"] == "EROFS"  # read-only
    assert not os.path.exists(f"{package}/planted")

    venv = f"{home}/.local/share/pipx/venvs/py-agent"
    result = caller.run("-q", "--", "py-agent", *others, f"{venv}/pip.conf")
    assert result.returncode == 0, result.stderr
    found = outcomes(result)
    assert found["py-agent"] == f"module from its venv in {venv}", result.stdout
    assert all(found[path] == "ENOENT" for path in others), result.stdout
    assert found[f"{venv}/pip.conf"] == "0 bytes"  # a credential in its tree: covered

    result = caller.run("-q", "--", "bin-agent", "hello", "from", "a", "binary")
    assert (result.returncode, result.stdout) == (0, "hello from a binary\n"), result.stderr

    # By its path too, and from a shell that the profile's programs are given to.
    result = caller.run("-q", "--", f"{home}/.local/bin/bin-agent", "by path")
    assert result.stdout == "by path\n", result.stderr


def test_not_found_inside_is_one_line_with_the_reason(caller: Caller) -> None:
    result = caller.run("--", "no-such-agent")
    one_line(result, 127, "no-such-agent: not found on your PATH nor on the sandbox's")
    tool = caller.project / "bin" / "tool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho tool\n")
    tool.chmod(0o755)
    if caller.name == "nobody":
        subprocess.run(["chown", "-R", f"{NOBODY_UID}:{NOBODY_UID}", str(tool.parent)], check=True)
    result = caller.run("--", "tool", PATH=f"{tool.parent}:/usr/bin:/bin")
    one_line(result, 127, "tool: not found on the sandbox's PATH", "/sandbox/repo/bin/tool")
    # The way it says: at a level that reads /repo it runs by its path inside.
    result = caller.run("-q", "--trust", "workspace", "--", "/sandbox/repo/bin/tool")
    assert (result.returncode, result.stdout) == (0, "tool\n"), result.stderr


# ----- --expose and the user config ---------------------------------------------------------------


def test_expose_shows_read_only_and_refuses_secrets(caller: Caller) -> None:
    home = caller.home
    result = caller.run(
        "-q",
        "--expose",
        f"{home}/tools",
        "--",
        "sh",
        "-c",
        f"cat {home}/tools/data.txt; echo x > {home}/tools/new || echo refused",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["exposed data", "refused"], result.stdout
    assert "Read-only file system" in result.stderr
    for path, why in (
        (f"{home}/.ssh", "is secret (.ssh)"),
        (f"{home}/.claude", "holds ~/.claude/.credentials.json"),
        (str(home), "is your home"),
        (str(caller.project), "in the project"),
        (caller.env.get("SANDBOXFS_STATE_DIR") or os.environ["SANDBOXFS_STATE_DIR"], "state"),
        ("/", "whole system directory"),
        ("/home", "whole system directory"),
    ):
        result = caller.run("--expose", path, "--", "true")
        one_line(result, 125, f"--expose {path}: refused: ", why)
    one_line(caller.run("--expose", f"{home}/missing", "--", "true"), 125, "No such file")


def test_user_config_exposes_and_is_strict(caller: Caller) -> None:
    config = caller.home / ".config" / "sandboxfs" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("expose: [~/tools]\nagents:\n  mine: {env: [MINE=1]}\n")
    if caller.name == "nobody":
        subprocess.run(
            ["chown", "-R", f"{NOBODY_UID}:{NOBODY_UID}", str(config.parent.parent)], check=True
        )
    result = caller.run(
        "-q",
        "--agent",
        "mine",
        "--",
        "sh",
        "-c",
        f"cat {caller.home}/tools/data.txt; echo MINE=$MINE",
    )
    assert result.stdout.splitlines() == ["exposed data", "MINE=1"], result.stderr
    config.write_text("expose: [~/.ssh]\n")
    one_line(caller.run("--", "true"), 125, f"{config}: expose: ~/.ssh: refused: ", "secret")
    config.write_text("exposed: [~/tools]\n")
    one_line(caller.run("--", "true"), 125, "exposed: unknown key; accepted keys: expose, agents")


EXPOSED_SIBLING = (
    "cd $1; for f in README.md .env sub/deep/.env config/.env.local sub/.ssh/id_rsa "
    "keys/server.pem .sandbox/workspaces/default/homes/full/.claude/.credentials.json "
    "sub/.sandbox/audit.jsonl; do "
    'if [ -s "$f" ] && cat "$f" >/dev/null 2>&1; then echo "$f: $(cat "$f")"; '
    'else echo "$f: hidden"; fi; done; find .sandbox sub/.sandbox -mindepth 1 | wc -l'
)


def test_an_exposed_tree_gets_the_deny_list_and_no_state_dir(caller: Caller) -> None:
    """A sibling project exposed: its .env files at every depth, its keys and every project's
    state dir (with the login `home seed` copied there) are hidden; the rest is shown."""
    other = caller.home / "other"
    files = {
        "README.md": "other readme",
        ".env": "TOP=secret",
        "sub/deep/.env": "DEEP=secret",
        "config/.env.local": "LOCAL=secret",
        "sub/.ssh/id_rsa": "private key",
        "keys/server.pem": "-----BEGIN PRIVATE KEY-----",
        ".sandbox/workspaces/default/homes/full/.claude/.credentials.json": "oauth",
        "sub/.sandbox/audit.jsonl": "log",
    }
    for rel, text in files.items():
        (other / rel).parent.mkdir(parents=True, exist_ok=True)
        (other / rel).write_text(text + "\n")
    if caller.name == "nobody":
        subprocess.run(["chown", "-R", f"{NOBODY_UID}:{NOBODY_UID}", str(other)], check=True)
    result = caller.run("-q", "--expose", other, "--", "sh", "-c", EXPOSED_SIBLING, "p", other)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "README.md: other readme",
        *(f"{rel}: hidden" for rel in list(files)[1:]),
        "0",
    ], result.stderr
    inside = caller.run(
        "--expose", other / ".sandbox" / "workspaces" / "default" / "homes", "--", "true"
    )
    one_line(inside, 125, "refused: ", "a project's state dir")


# ----- the persistent home ------------------------------------------------------------------------


def test_home_persists_per_workspace_and_trust_level(caller: Caller) -> None:
    first = caller.run(
        "-q", "--trust", "session", "--", "sh", "-c", "echo kept > ~/state.txt && echo $HOME"
    )
    assert (first.returncode, first.stdout) == (0, "/sandbox/home\n"), first.stderr
    again = caller.run("-q", "--trust", "session", "--", "cat", "/sandbox/home/state.txt")
    assert (again.returncode, again.stdout) == (0, "kept\n"), again.stderr
    for other in (["--workspace", "other", "--trust", "session"], ["--trust", "full"]):
        result = caller.run("-q", *other, "--", "cat", "/sandbox/home/state.txt")
        assert result.returncode == 1 and "No such file" in result.stderr, (other, result)
    stored = caller.project / ".sandbox" / "workspaces" / "default" / "homes" / "session"
    assert (stored / "state.txt").read_text() == "kept\n"
    assert not (caller.home / "state.txt").exists()  # never the user's own home
    writes = [e for e in audit(caller.project, "--op", "write") if e["zone"] == "home"]
    assert any(e["path"] == "/home/state.txt" for e in writes), writes


SHOW_LOGIN = "cat ~/.claude/.credentials.json; ls -A ~/.claude"


def test_home_seed_copies_and_reset_empties(caller: Caller) -> None:
    seeded = caller.sbx("home", "seed", "--agent", "claude", "--project", caller.project)
    assert seeded.returncode == 0, seeded.stderr
    assert "copied 2 files (~/.claude) into the home of workspace default" in seeded.stdout
    result = caller.run("-q", "--trust", "session", "--", "sh", "-c", SHOW_LOGIN)
    assert result.stdout.splitlines() == [
        '{"token": "seeded"}',
        ".credentials.json",
        "settings.json",
    ], result.stderr

    # A whole directory: its secrets are left out. A link the sandbox left in its home is
    # replaced, never written through.
    victim = caller.project.parent / "victim.txt"
    victim.write_text("untouched\n")
    home = caller.project / ".sandbox" / "workspaces" / "default" / "homes" / "session"
    (home / ".claude" / "settings.json").unlink()
    (home / ".claude" / "settings.json").symlink_to(victim)
    seeded = caller.sbx(
        "home",
        "seed",
        "--from",
        f"{caller.home}/.claude",
        "--force",
        "--trust",
        "session",
        "--project",
        caller.project,
    )
    assert seeded.returncode == 0, seeded.stderr
    assert victim.read_text() == "untouched\n"
    assert (home / ".claude" / "settings.json").read_text() == "{}\n"
    assert not (home / ".claude" / "keys" / "id_ed25519").exists()

    refused = caller.sbx(
        "home", "seed", "--from", f"{caller.home}/.ssh", "--project", caller.project
    )
    one_line(refused, 2, "refused: ~/.ssh is secret")
    log = [e for e in audit(caller.project, "--op", "home")]
    assert [e["detail"].split(":")[0] for e in log][:2] == [
        "seed 2 files into trust session, workspace, full",
        "seed 2 files into trust session",
    ]

    reset = caller.sbx("home", "reset", "--yes", "--project", caller.project)
    assert reset.returncode == 0, reset.stderr
    result = caller.run("-q", "--trust", "session", "--", "ls", "-A", "/sandbox/home")
    assert (result.returncode, result.stdout) == (0, ""), result


def test_home_seed_gives_untrusted_nothing_unless_named(caller: Caller) -> None:
    """The agent's login goes to the levels named; untrusted only when named, with a warning."""
    seeded = caller.sbx("home", "seed", "--agent", "claude", "--project", caller.project)
    assert seeded.returncode == 0, seeded.stderr
    assert "at trust session, workspace, full" in seeded.stdout
    assert "untrusted not seeded" in seeded.stdout
    untrusted = caller.run("-q", "--trust", "untrusted", "--", "sh", "-c", SHOW_LOGIN)
    assert "seeded" not in untrusted.stdout and "No such file" in untrusted.stderr, untrusted

    named = caller.sbx(
        "home", "seed", "--agent", "claude", "--trust", "workspace", "--trust", "full",
        "--project", caller.project,
    )  # fmt: skip
    assert named.returncode == 0 and "at trust workspace, full" in named.stdout, named

    explicit = caller.sbx(
        "home", "seed", "--agent", "claude", "--trust", "untrusted", "--project", caller.project
    )
    assert explicit.returncode == 0, explicit.stderr
    assert explicit.stderr.startswith("sandboxfs: warning: the untrusted home now holds"), explicit
    untrusted = caller.run("-q", "--trust", "untrusted", "--", "sh", "-c", SHOW_LOGIN)
    assert untrusted.stdout.splitlines()[0] == '{"token": "seeded"}', untrusted.stderr


# ----- agent profiles -----------------------------------------------------------------------------


def test_agent_profile_sets_hosts_and_environment(caller: Caller) -> None:
    probe = (
        "echo $DISABLE_AUTOUPDATER ${ANTHROPIC_API_KEY-unset} ${OPENAI_API_KEY-unset} $HTTPS_PROXY"
    )
    result = caller.run(
        "-q",
        "--agent",
        "claude",
        "--",
        "sh",
        "-c",
        probe,
        ANTHROPIC_API_KEY="sk-ant-test",
        OPENAI_API_KEY="sk-test",
    )
    assert result.stdout.split() == ["1", "sk-ant-test", "unset", "http://127.0.0.1:3128"], result
    start = [e for e in audit(caller.project, "--op", "run") if e["detail"].startswith("start")]
    assert start[-1]["net"] == "allow"
    assert start[-1]["allow_hosts"][:3] == ["api.anthropic.com", "claude.ai", "platform.claude.com"]
    one_line(caller.run("--agent", "nope", "--", "true"), 125, "no such agent profile")
    # --net wins over the profile's; its program is given to a shell too.
    result = caller.run(
        "-q", "--agent", "claude", "--net", "none", "--", "sh", "-c", "echo ${HTTPS_PROXY-none}"
    )
    assert result.stdout == "none\n", result.stderr


def test_profile_programs_are_there_for_a_shell(caller: Caller) -> None:
    config = caller.home / ".config" / "sandboxfs" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("agents:\n  acme: {programs: [acme-agent, py-agent]}\n")
    if caller.name == "nobody":
        subprocess.run(
            ["chown", "-R", f"{NOBODY_UID}:{NOBODY_UID}", str(config.parent.parent)], check=True
        )
    result = caller.run("-q", "--agent", "acme", "--", "sh", "-c", "acme-agent; py-agent")
    assert result.returncode == 0, result.stderr
    assert "node-agent: helper from its package" in result.stdout
    assert "py-agent: module from its venv" in result.stdout


# ----- a home is no project unless the user says so ---------------------------------------------

HOME_SECRETS_READ = (
    "for f in .gitconfig .config/gh/hosts.yml .claude/.credentials.json .claude.json "
    "other/.sandbox/workspaces/default/homes/full/.claude/.credentials.json notes.txt; do "
    'if cat "/sandbox/repo/$f" >/dev/null 2>&1; then echo "$f: read"; else echo "$f: refused"; fi; '
    "done"
)


def plant_home_logins(home: Path) -> None:
    """The logins a whole home holds: git's token, the GitHub CLI's, Claude's (from
    install_agents), and another project's seeded agent home."""
    (home / ".gitconfig").write_text("[credential]\n\thelper = store\n[github]\n\ttoken = ghp_x\n")
    (home / ".config" / "gh").mkdir(parents=True)
    (home / ".config" / "gh" / "hosts.yml").write_text("github.com:\n  oauth_token: gho_x\n")
    (home / ".claude.json").write_text('{"oauthAccount": "x"}\n')
    seeded = home / "other" / ".sandbox" / "workspaces" / "default" / "homes" / "full" / ".claude"
    seeded.mkdir(parents=True)
    (seeded / ".credentials.json").write_text('{"token": "other project"}\n')
    (home / "other" / ".sandbox" / "audit.jsonl").write_text("")


def test_a_home_is_no_project_unless_named(caller: Caller) -> None:
    plant_home_logins(caller.home)
    if caller.name == "nobody":
        subprocess.run(["chown", "-R", f"{NOBODY_UID}:{NOBODY_UID}", str(caller.home)], check=True)
    started = subprocess.run(  # from the home, without --project: as a newcomer would
        [*caller.prefix, *SANDBOXFS, "run", "--trust", "full", "--", "sh", "-c", "cat .gitconfig"],
        cwd=caller.home,
        env=caller.env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    one_line(started, 125, "is your home directory", "--allow-home-project")
    assert "ghp_x" not in started.stdout
    named = caller.sbx("run", "--project", caller.home, "--trust", "full", "--", "true")
    one_line(named, 125, "is your home directory")
    above = caller.sbx("run", "--project", caller.home.parent, "--trust", "full", "--", "true")
    one_line(above, 125, "holds your home directory")
    mount = caller.sbx("mount", "--project", caller.home, caller.home.parent / "mnt")
    one_line(mount, 2, "is your home directory")
    assert not (caller.home / ".sandbox").exists()  # refused before anything was written

    allowed = caller.sbx(
        "run", "-q", "--allow-home-project", "--project", caller.home, "--trust", "full",
        "--", "sh", "-c", HOME_SECRETS_READ,
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stdout.splitlines() == [
        ".gitconfig: refused",
        ".config/gh/hosts.yml: refused",
        ".claude/.credentials.json: refused",
        ".claude.json: refused",
        "other/.sandbox/workspaces/default/homes/full/.claude/.credentials.json: refused",
        "notes.txt: read",
    ], allowed.stderr

    # A login its program replaces while the run goes on (git config --global, an agent
    # rewriting ~/.claude.json: a new file renamed over the old) stays hidden.
    replace = (
        "touch /sandbox/repo/started; "
        'while [ "$(cat /sandbox/repo/notes.txt)" != go ]; do sleep 0.1; done; '
        "for f in .gitconfig .claude.json; do "
        'if cat "/sandbox/repo/$f" >/dev/null 2>&1; then echo "$f: read"; '
        'else echo "$f: refused"; fi; done; ls -A /sandbox/repo | grep -c -e gitconfig -e claude'
    )
    proc = subprocess.Popen(
        [*caller.prefix, *SANDBOXFS, "run", "-q", "--allow-home-project", "--project",
         caller.home, "--trust", "full", "--", "sh", "-c", replace],
        env=caller.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert wait_until(lambda: (caller.home / "started").exists(), timeout=60)
        for name in (".gitconfig", ".claude.json"):
            fresh = caller.home / f"{name}.new"
            fresh.write_text("[github]\n\ttoken = ghp_new\n")
            os.replace(fresh, caller.home / name)
        (caller.home / "notes.txt").write_text("go\n")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert out.splitlines() == [".gitconfig: refused", ".claude.json: refused", "0"], err
