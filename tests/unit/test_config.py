"""Unit tests for sandboxfs/config/model.py: shipped defaults, project overrides, error messages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import pytest
import yaml

from sandboxfs.config import model as config
from sandboxfs.config import user as userconfig
from sandboxfs.core.policy import BUILTIN_ZONES, Trust, Zone, ZoneAccess
from sandboxfs.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO_ROOT / "config").glob("example-*.yaml"))

DEFAULT_DENY = [
    ".env", ".env.*", "!.env.example", "!.env.sample", "!.env.template", "!.env.dist", ".netrc",
    ".git-credentials", ".ssh/", ".aws/", ".gnupg/",
]  # fmt: skip
DEFAULT_CREDENTIALS = [".npmrc", ".yarnrc", ".yarnrc.yml", ".pypirc", "pip.conf", "pip.ini"]
DEFAULT_PRIVATE_KEYS = [
    "*.pem", "*.key", "*.crt", "*.cer", "*.der", "*.p8", "*.pk8", "*.p12", "*.pfx", "*.ppk",
    "*.asc", "*.jks", "*.keystore", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*",
]  # fmt: skip

TOP_LEVEL_KEYS = [
    "default_trust",
    "deny",
    "inherit_deny",
    "permissions",
    "cache",
    "audit",
    "daemon",
]


def _write(project: Path, text: str | bytes, name: str = "sandboxfs.yaml") -> Path:
    path = project / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def _load_error(project: Path, config_file: Path | None = None) -> str:
    with pytest.raises(UserError) as info:  # exit 2
        config.load(project, config_file=config_file)
    message = info.value.message
    assert isinstance(message, str)
    assert "\n" not in message, message
    assert message.strip() == message
    return message


# --- the shipped defaults --------------------------------------------------------------------


def test_shipped_yaml_equals_pydantic_defaults() -> None:
    assert config.defaults() == config.Config()


def test_defaults_match_spec() -> None:
    defaults = config.defaults()
    assert defaults.default_trust is Trust.SESSION
    assert defaults.deny == DEFAULT_DENY
    assert defaults.deny_private_keys == DEFAULT_PRIVATE_KEYS
    assert defaults.cache.entry_timeout == defaults.cache.attr_timeout == 10.0
    assert set(defaults.permissions) == set(Trust)
    for row in defaults.permissions.values():
        assert set(row) == {z.value for z in BUILTIN_ZONES}


def test_repo_copy_of_defaults_is_identical() -> None:
    shipped = (REPO_ROOT / "sandboxfs" / "defaults.yaml").read_bytes()
    assert (REPO_ROOT / "config" / "defaults.yaml").read_bytes() == shipped


def test_packaged_resource_is_the_shipped_file() -> None:
    resource = resources.files("sandboxfs").joinpath("defaults.yaml")
    assert resource.is_file()
    shipped = (REPO_ROOT / "sandboxfs" / "defaults.yaml").read_text(encoding="utf-8")
    assert resource.read_text(encoding="utf-8") == shipped


def test_defaults_are_read_through_importlib_resources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Serve a modified defaults.yaml through importlib.resources: if defaults() picks it up,
    # it reads the package resource and not some path in the repository.
    shipped = resources.files("sandboxfs").joinpath("defaults.yaml").read_text(encoding="utf-8")
    assert "default_trust: session\n" in shipped
    fake = tmp_path / "pkg"
    fake.mkdir()
    _write(fake, shipped.replace("default_trust: session\n", "default_trust: full\n"),
           name="defaults.yaml")  # fmt: skip
    asked: list[object] = []

    def fake_files(package: object) -> Path:
        asked.append(package)
        return fake

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sandboxfs.config.model.resources.files", fake_files)
    assert config.defaults().default_trust is Trust.FULL
    assert asked == ["sandboxfs"]


def test_defaults_do_not_depend_on_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert config.defaults() == config.Config()


def test_defaults_matrix_is_parsed() -> None:
    matrix = config.defaults().matrix()
    assert matrix[Trust.UNTRUSTED][Zone.STAGED] == ZoneAccess(create_only=True)
    assert matrix[Trust.UNTRUSTED][Zone.REPO] == ZoneAccess()
    assert matrix[Trust.WORKSPACE][Zone.REPO] == ZoneAccess.parse("rl")
    assert all(matrix[Trust.FULL][z] == ZoneAccess.parse("rwld") for z in BUILTIN_ZONES)


# --- project overrides -----------------------------------------------------------------------


def test_no_project_file_gives_defaults(tmp_path: Path) -> None:
    assert config.load(tmp_path) == config.defaults()


def test_empty_project_file_gives_defaults(tmp_path: Path) -> None:
    _write(tmp_path, "")
    assert config.load(tmp_path) == config.defaults()


def test_comment_only_project_file_gives_defaults(tmp_path: Path) -> None:
    _write(tmp_path, "# nothing to see here\n\n")
    assert config.load(tmp_path) == config.defaults()


def test_project_overrides_keep_other_defaults(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "default_trust: untrusted\n"
        "cache:\n"
        "  entry_timeout: 2.5\n"
        "permissions:\n"
        "  workspace:\n"
        "    repo: r\n",
    )
    loaded = config.load(tmp_path)
    defaults = config.defaults()
    assert loaded.default_trust is Trust.UNTRUSTED
    assert loaded.cache.entry_timeout == 2.5
    assert loaded.cache.attr_timeout == defaults.cache.attr_timeout
    assert loaded.audit == defaults.audit
    assert loaded.deny == defaults.deny
    for trust in Trust:
        for zone in (z.value for z in BUILTIN_ZONES):
            expected = "r" if (trust, zone) == (Trust.WORKSPACE, "repo") else None
            assert loaded.permissions[trust][zone] == (
                expected or defaults.permissions[trust][zone]
            ), (trust, zone)
    assert loaded.matrix()[Trust.WORKSPACE][Zone.REPO] == ZoneAccess.parse("r")


def test_config_file_takes_precedence_over_project_file(tmp_path: Path) -> None:
    _write(tmp_path, "default_trust: full\n")
    other = _write(tmp_path, "default_trust: untrusted\n", name="other.yaml")
    assert config.load(tmp_path).default_trust is Trust.FULL
    assert config.load(tmp_path, config_file=other).default_trust is Trust.UNTRUSTED


def test_deny_adds_to_defaults(tmp_path: Path) -> None:
    _write(tmp_path, "deny:\n  - secrets/\n  - '*.sqlite'\n")
    assert config.load(tmp_path).deny == [*DEFAULT_DENY, "secrets/", "*.sqlite"]


def test_inherit_deny_false_replaces(tmp_path: Path) -> None:
    _write(tmp_path, "inherit_deny: false\ndeny: [secrets/]\n")
    assert config.load(tmp_path).deny == ["secrets/"]


def test_inherit_deny_false_without_deny_clears(tmp_path: Path) -> None:
    _write(tmp_path, "inherit_deny: false\n")
    assert config.load(tmp_path).deny == []


def test_default_patterns_are_not_repeated(tmp_path: Path) -> None:
    _write(tmp_path, "deny: ['.env', '*.pem', extra]\n")
    assert config.load(tmp_path).deny == [*DEFAULT_DENY, "*.pem", "extra"]


def test_private_key_patterns_add_to_defaults_and_follow_inherit_deny(tmp_path: Path) -> None:
    _write(tmp_path, "deny_private_keys: ['*.pem', '*.secret']\n")
    assert config.load(tmp_path).deny_private_keys == [*DEFAULT_PRIVATE_KEYS, "*.secret"]
    _write(tmp_path, "inherit_deny: false\ndeny_private_keys: ['*.secret']\n")
    loaded = config.load(tmp_path)
    assert (loaded.deny, loaded.deny_private_keys) == ([], ["*.secret"])


def test_credential_patterns_add_to_defaults_and_follow_inherit_deny(tmp_path: Path) -> None:
    assert config.load(tmp_path).deny_credentials == DEFAULT_CREDENTIALS
    _write(tmp_path, "deny_credentials: ['.npmrc', 'registry.ini']\n")
    assert config.load(tmp_path).deny_credentials == [*DEFAULT_CREDENTIALS, "registry.ini"]
    _write(tmp_path, "inherit_deny: false\ndeny_credentials: ['registry.ini']\n")
    loaded = config.load(tmp_path)
    assert (loaded.deny_private_keys, loaded.deny_credentials) == ([], ["registry.ini"])
    _write(tmp_path, "deny_credentials: ['']\n")
    assert "invalid pattern" in _load_error(tmp_path)


def test_exceptions_only_in_deny(tmp_path: Path) -> None:
    _write(tmp_path, "deny: ['!.env.local']\n")
    assert config.load(tmp_path).deny == [*DEFAULT_DENY, "!.env.local"]
    _write(tmp_path, "protect: ['!.git/hooks/']\n")
    assert "protect patterns have no exceptions" in _load_error(tmp_path)
    _write(tmp_path, "deny: ['!']\n")
    assert "invalid pattern" in _load_error(tmp_path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("deny: [extra, extra]\n", [*DEFAULT_DENY, "extra"]),
        ("inherit_deny: false\ndeny: [x, x]\n", ["x"]),
    ],
    ids=["inherited", "replaced"],
)
def test_project_duplicates_are_not_repeated(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    _write(tmp_path, text)
    assert config.load(tmp_path).deny == expected


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_load(tmp_path: Path, example: Path) -> None:
    loaded = config.load(tmp_path, config_file=example)
    assert isinstance(loaded, config.Config)
    loaded.matrix()


def test_examples_exist() -> None:
    assert {p.name for p in EXAMPLES} >= {
        "example-fast-cache.yaml",
        "example-readonly-workspace.yaml",
        "example-untrusted-agent.yaml",
    }


def test_example_contents_take_effect(tmp_path: Path) -> None:
    examples = REPO_ROOT / "config"
    fast = config.load(tmp_path, config_file=examples / "example-fast-cache.yaml")
    assert (fast.cache.entry_timeout, fast.cache.attr_timeout) == (300, 300)
    readonly = config.load(tmp_path, config_file=examples / "example-readonly-workspace.yaml")
    assert readonly.permissions[Trust.WORKSPACE]["repo"] == "r"
    assert readonly.permissions[Trust.WORKSPACE]["staged"] == "create-only"
    agent = config.load(tmp_path, config_file=examples / "example-untrusted-agent.yaml")
    assert agent.default_trust is Trust.UNTRUSTED
    assert agent.deny == [*DEFAULT_DENY, "secrets/", "*.sqlite", "config/production.yaml"]


# --- bad configuration: one line naming the file, the field path and what is accepted ---------

BAD_CONFIGS = [
    pytest.param("bogus: 1\n", ["bogus", "unknown key", *TOP_LEVEL_KEYS], id="unknown-top-key"),
    pytest.param(
        "cache:\n  entri_timeout: 3\n",
        ["cache.entri_timeout", "unknown key", "entry_timeout", "attr_timeout"],
        id="unknown-nested-key",
    ),
    pytest.param(
        "audit: {syncc: true}\n",
        ["audit.syncc", "sync", "flush_interval"],
        id="unknown-audit-key",
    ),
    pytest.param(
        "cache: {entry_timeout: fast}\n",
        ["cache.entry_timeout", "'fast'", "number"],
        id="wrong-type",
    ),
    pytest.param(
        "cache: {entry_timeout: -1}\n",
        ["cache.entry_timeout", "-1", "greater than or equal to 0"],
        id="negative-timeout",
    ),
    pytest.param(
        "audit: {flush_interval: 0}\n",
        ["audit.flush_interval", "greater than 0"],
        id="zero-flush-interval",
    ),
    pytest.param(
        "daemon: {spin_us: -5}\n",
        ["daemon.spin_us", "-5", "greater than or equal to 0"],
        id="negative-spin",
    ),
    pytest.param(
        "daemon: {spin_us: 1000000}\n",
        ["daemon.spin_us", "less than or equal to 10000"],
        id="huge-spin",
    ),
    pytest.param("cache: 5\n", ["cache", "dictionary"], id="cache-not-mapping"),
    pytest.param(
        "default_trust: admin\n",
        ["default_trust", "'admin'", "untrusted", "session", "workspace", "full"],
        id="unknown-trust",
    ),
    pytest.param(
        "permissions: {admin: {repo: r}}\n",
        ["unknown trust level 'admin' under permissions", "untrusted", "workspace", "full"],
        id="unknown-trust-in-permissions",
    ),
    pytest.param(
        "permissions: {workspace: {bogus: r}}\n",
        ["unknown zone 'bogus' under permissions.workspace", "session", "repo", "workers"],
        id="unknown-zone",
    ),
    pytest.param(
        "permissions: {workspace: {repo: rwx}}\n",
        ["permissions", "'rwx'", "rwld", "create-only"],
        id="invalid-permission",
    ),
    pytest.param(
        "inherit_deny: maybe\n",
        ["inherit_deny", "'maybe'", "boolean"],
        id="inherit-deny-not-bool",
    ),
    pytest.param("deny: .foo\n", ["deny", "list"], id="deny-not-list"),
    pytest.param("deny: ['/']\n", ["deny", "'/'"], id="deny-empty-pattern"),
    pytest.param(
        "cache:\n  entry_timeout: [1,\n",
        ["not valid YAML", "line 3"],
        id="invalid-yaml",
    ),
    pytest.param(
        "cache:\n\tentry_timeout: 1\n",
        ["not valid YAML", "line 2"],
        id="yaml-tab",
    ),
    pytest.param("- a\n- b\n", ["mapping", "top level"], id="top-level-list"),
    pytest.param("just a string\n", ["mapping", "top level"], id="top-level-scalar"),
]


@pytest.mark.parametrize(("text", "expected"), BAD_CONFIGS)
def test_bad_project_config(tmp_path: Path, text: str, expected: list[str]) -> None:
    path = _write(tmp_path, text)
    message = _load_error(tmp_path)
    assert str(path) in message
    assert "[key]" not in message  # pydantic's path to a mapping key is not for users
    for fragment in expected:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize(("text", "expected"), BAD_CONFIGS)
def test_bad_config_file_option(tmp_path: Path, text: str, expected: list[str]) -> None:
    path = _write(tmp_path, text, name="custom.yaml")
    message = _load_error(tmp_path / "elsewhere", config_file=path)
    assert str(path) in message
    for fragment in expected:
        assert fragment in message, (fragment, message)


def test_invalid_permission_names_the_cell(tmp_path: Path) -> None:
    _write(tmp_path, "permissions: {workspace: {repo: rwx}}\n")
    message = _load_error(tmp_path)
    assert "permissions.workspace.repo" in message
    assert "'untrusted'" not in message


@pytest.mark.parametrize("char", ["\x07", "\x00"], ids=["bell", "nul"])
def test_control_characters_give_one_line(tmp_path: Path, char: str) -> None:
    path = _write(tmp_path, f"deny: ['a{char}']\n")
    message = _load_error(tmp_path)
    assert str(path) in message


def test_non_utf8_file(tmp_path: Path) -> None:
    path = _write(tmp_path, b"deny: ['\xff\xfe']\n")
    message = _load_error(tmp_path)
    assert str(path) in message
    assert "UTF-8" in message


def test_missing_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    message = _load_error(tmp_path, config_file=missing)
    assert str(missing) in message
    assert "No such file" in message


def test_directory_as_config_file(tmp_path: Path) -> None:
    directory = tmp_path / "conf.d"
    directory.mkdir()
    message = _load_error(tmp_path, config_file=directory)
    assert str(directory) in message
    assert "directory" in message.lower()


def test_directory_named_like_project_file(tmp_path: Path) -> None:
    (tmp_path / "sandboxfs.yaml").mkdir()
    message = _load_error(tmp_path)
    assert str(tmp_path / "sandboxfs.yaml") in message


def _load_error_as_nobody(project: Path) -> str:
    """config.load's error message, from a forked child that dropped root (root reads any file)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            os.write(write_end, _load_error(project).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message


def test_unreadable_file(tmp_path: Path) -> None:
    project = Path(tempfile.mkdtemp(prefix="sandboxfs-config-")) if os.geteuid() == 0 else tmp_path
    try:
        project.chmod(0o755)
        path = _write(project, "default_trust: full\n")
        path.chmod(0)
        message = _load_error_as_nobody(project) if os.geteuid() == 0 else _load_error(project)
    finally:
        if os.geteuid() == 0:
            shutil.rmtree(project)
    assert str(path) in message
    assert "Permission denied" in message


def test_the_fast_parser_reads_the_defaults_as_the_plain_one_does() -> None:
    """The package's defaults are parsed with libyaml where PyYAML has it (start-up time);
    users' files keep their own guarded loader."""
    text = resources.files("sandboxfs").joinpath("defaults.yaml").read_text(encoding="utf-8")
    assert yaml.load(text, Loader=config._FAST_LOADER) == yaml.safe_load(text)


def test_the_command_loads_no_pydantic_plugin() -> None:
    """A pydantic plugin installed beside sandboxfs would run inside the supervisor and the
    daemon; the command turns plugins off before its models are built, and so also skips
    pydantic's scan of every installed distribution at each start."""
    code = (
        "import sandboxfs.cli.main\n"
        "from sandboxfs.config import model\n"
        "model.defaults()\n"
        "from pydantic.plugin import _loader\n"
        "print(_loader._plugins)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert (out.returncode, out.stdout) == (0, "None\n"), out.stderr


# ----- run's network: only the user widens it -----------------------------------------------------


def _choice(
    net: str | None = None,
    allow_host: tuple[str, ...] = (),
    agent: str | None = None,
    mine: str = "",
    project: str = "",
) -> userconfig.NetworkChoice:
    user = userconfig.UserConfig.model_validate(yaml.safe_load(mine) or {})
    profile = userconfig.agent(agent, user) if agent else None
    run = config.RunConfig.model_validate(yaml.safe_load(project) or {})
    return userconfig.network_choice(net, list(allow_host), profile, user, run)


def test_a_project_file_only_narrows_the_network() -> None:
    wider = _choice(project="{network: allow, allow_hosts: ['127.0.0.1:5432']}")
    assert (wider.mode, wider.hosts) == ("none", [])
    assert wider.ignored is not None and "run.network: allow" in wider.ignored
    assert "127.0.0.1:5432" in wider.ignored
    assert _choice(project="{network: host}").mode == "none"
    # What the user chose, narrowed: a narrower mode, or fewer of the user's hosts.
    agent = _choice(agent="claude", project="{network: none}")
    assert (agent.mode, agent.ignored) == ("none", None)
    fewer = _choice(agent="claude", project="{allow_hosts: [api.anthropic.com, evil.example]}")
    assert fewer.hosts == ["api.anthropic.com"]
    assert fewer.ignored is not None and "evil.example" in fewer.ignored
    mine = "run: {network: allow, allow_hosts: [pypi.org]}"
    assert _choice(mine=mine, project="{network: host}").mode == "allow"
    assert _choice(mine=mine).hosts == ["pypi.org"]
    # The command line wins over both files.
    cli = _choice("allow", ("example.org",), project="{network: none, allow_hosts: [x.org]}")
    assert (cli.mode, cli.hosts, cli.ignored) == ("allow", ["example.org"], None)
    assert _choice("host", project="{network: none}").mode == "host"
    assert _choice("allow", project="{allow_hosts: [x.org]}").hosts == []
