"""Unit tests for the pure policy core (sandboxfs/core/policy.py) against the permission matrix
(what each trust level may read, write, list and delete in each zone) and the errno of each
refusal.

The expected outcomes are written out literally from the permission matrix below; they are
deliberately not derived from the code's own DEFAULT_PERMISSIONS.
"""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from sandboxfs.config import model as config
from sandboxfs.core.policy import BUILTIN_ZONES, Decision, Op, Policy, Trust, Zone, ZoneAccess
from sandboxfs.errors import UserError

OK = "allowed"
EROFS = errno.EROFS
EACCES = errno.EACCES

LEVELS = ["untrusted", "session", "workspace", "full"]
ZONES = ["session", "workspace", "repo", "staged", "workers"]
OPS = ["read", "write", "list", "delete"]

# The matrix, cell by cell: "r w l d" letters, "" for "—", or "create-only" for
# "w (create-only)".
MATRIX: dict[str, dict[str, str]] = {
    #             session   workspace  repo    staged          workers
    "untrusted": {"session": "rwld", "workspace": "", "repo": "", "staged": "create-only",
                  "workers": "rl"},
    "session":   {"session": "rwld", "workspace": "rwld", "repo": "", "staged": "rwld",
                  "workers": "rl"},
    "workspace": {"session": "rwld", "workspace": "rwld", "repo": "rl", "staged": "rwld",
                  "workers": "rl"},
    "full":      {"session": "rwld", "workspace": "rwld", "repo": "rwld", "staged": "rwld",
                  "workers": "rwld"},
}  # fmt: skip

# The outcome of `decide(zone, op)` on an existing entry, written out from the matrix:
# a denied write/delete in a zone the level can read is EROFS, every other denial EACCES;
# create-only staging refuses every operation on existing entries with EACCES.
#                         read    write   list    delete
EXPECTED: dict[tuple[str, str], tuple[object, object, object, object]] = {
    ("untrusted", "session"):   (OK, OK, OK, OK),
    ("untrusted", "workspace"): (EACCES, EACCES, EACCES, EACCES),
    ("untrusted", "repo"):      (EACCES, EACCES, EACCES, EACCES),
    ("untrusted", "staged"):    (EACCES, EACCES, EACCES, EACCES),  # create-only
    ("untrusted", "workers"):   (OK, EROFS, OK, EROFS),
    ("session", "session"):     (OK, OK, OK, OK),
    ("session", "workspace"):   (OK, OK, OK, OK),
    ("session", "repo"):        (EACCES, EACCES, EACCES, EACCES),
    ("session", "staged"):      (OK, OK, OK, OK),
    ("session", "workers"):     (OK, EROFS, OK, EROFS),
    ("workspace", "session"):   (OK, OK, OK, OK),
    ("workspace", "workspace"): (OK, OK, OK, OK),
    ("workspace", "repo"):      (OK, EROFS, OK, EROFS),
    ("workspace", "staged"):    (OK, OK, OK, OK),
    ("workspace", "workers"):   (OK, EROFS, OK, EROFS),
    ("full", "session"):        (OK, OK, OK, OK),
    ("full", "workspace"):      (OK, OK, OK, OK),
    ("full", "repo"):           (OK, OK, OK, OK),
    ("full", "staged"):         (OK, OK, OK, OK),
    ("full", "workers"):        (OK, OK, OK, OK),
}  # fmt: skip

ADJECTIVE = {"read": "readable", "write": "writable", "list": "listable", "delete": "deletable"}
LETTER = {"read": "r", "write": "w", "list": "l", "delete": "d"}

MATRIX_CASES = [
    pytest.param(level, zone, op, EXPECTED[(level, zone)][i], id=f"{level}-{zone}-{op}")
    for level in LEVELS
    for zone in ZONES
    for i, op in enumerate(OPS)
]


def _policy(trust: Trust | str, deny: list[str] | None = None) -> Policy:
    defaults = config.defaults()
    return Policy(defaults.matrix(), defaults.deny if deny is None else deny, Trust(trust))


def _matrix_zones_with(level: str, op: str) -> list[str]:
    """Zones (in `/` listing order) where the matrix grants `op` outright at `level`."""
    return [z for z in ZONES if LETTER[op] in MATRIX[level][z].replace("create-only", "")]


def test_expected_table_is_complete() -> None:
    assert len(MATRIX_CASES) == 80
    assert set(EXPECTED) == {(lv, z) for lv in LEVELS for z in ZONES}


@pytest.mark.parametrize(("level", "zone", "op", "expected"), MATRIX_CASES)
def test_permission_matrix(level: str, zone: str, op: str, expected: object) -> None:
    decision = _policy(level).decide(Zone(zone), Op(op))
    assert isinstance(decision, Decision)
    if expected == OK:
        assert decision.allowed
        assert decision.errno == 0
        return
    assert not decision.allowed
    assert decision.errno == expected, errno.errorcode[decision.errno]
    assert zone in decision.reason
    assert level in decision.reason
    if MATRIX[level][zone] == "create-only":
        assert "create-only" in decision.reason
        return
    adjective = ADJECTIVE[op]
    match = re.fullmatch(
        rf"{zone} is not {adjective} at trust level {level}; {adjective} zones: "
        rf"(.*?)(?:; new files only: staged)?",
        decision.reason,
    )
    assert match is not None, decision.reason
    assert match.group(1).split(", ") == (_matrix_zones_with(level, op) or ["none"])


def test_reason_matches_spec_example() -> None:
    decision = _policy("untrusted").decide(Zone.REPO, Op.READ)
    assert decision.reason == (
        "repo is not readable at trust level untrusted; readable zones: session, workers"
    )


def test_decide_is_independent_of_deny_list() -> None:
    for level in LEVELS:
        with_deny, without = _policy(level), _policy(level, deny=[])
        for zone in BUILTIN_ZONES:
            for op in Op:
                assert with_deny.decide(zone, op) == without.decide(zone, op)


# --- decide_create -------------------------------------------------------------------------

CREATE_EXPECTED: dict[str, tuple[object, object, object, object, object]] = {
    #            session workspace repo    staged workers
    "untrusted": (OK,    EACCES,   EACCES, OK,    EROFS),
    "session":   (OK,    OK,       EACCES, OK,    EROFS),
    "workspace": (OK,    OK,       EROFS,  OK,    EROFS),
    "full":      (OK,    OK,       OK,     OK,    OK),
}  # fmt: skip


@pytest.mark.parametrize(
    ("level", "zone", "expected"),
    [
        pytest.param(level, zone, CREATE_EXPECTED[level][i], id=f"{level}-{zone}")
        for level in LEVELS
        for i, zone in enumerate(ZONES)
    ],
)
def test_decide_create(level: str, zone: str, expected: object) -> None:
    decision = _policy(level).decide_create(Zone(zone))
    if expected == OK:
        assert decision.allowed
        return
    assert not decision.allowed
    assert decision.errno == expected
    assert zone in decision.reason
    assert level in decision.reason
    assert f"writable zones: {', '.join(_matrix_zones_with(level, 'write'))}" in decision.reason


def test_create_only_staging_allows_create_but_nothing_else() -> None:
    policy = _policy("untrusted")
    assert policy.access(Zone.STAGED) == ZoneAccess(create_only=True)
    assert policy.decide_create(Zone.STAGED).allowed
    for op in Op:
        decision = policy.decide(Zone.STAGED, op)
        assert not decision.allowed
        assert decision.errno == EACCES
        assert "staged is create-only at trust level untrusted" in decision.reason


# --- decide_lookup -------------------------------------------------------------------------

LOOKUP_FLAGS = [(False, False), (True, False), (False, True), (True, True)]


def _lookup_expected(level: str, zone: str, is_dir: bool, created_here: bool) -> object:
    spelling = MATRIX[level][zone]
    if spelling == "create-only":
        return OK if (is_dir or created_here) else EACCES
    if "r" in spelling or "l" in spelling:
        return OK
    return EACCES


@pytest.mark.parametrize(
    ("level", "zone", "is_dir", "created_here"),
    [
        pytest.param(
            level, zone, is_dir, created,
            id=f"{level}-{zone}-{'dir' if is_dir else 'file'}{'-created' if created else ''}",
        )
        for level in LEVELS
        for zone in ZONES
        for is_dir, created in LOOKUP_FLAGS
    ],
)  # fmt: skip
def test_decide_lookup(level: str, zone: str, is_dir: bool, created_here: bool) -> None:
    expected = _lookup_expected(level, zone, is_dir, created_here)
    decision = _policy(level).decide_lookup(Zone(zone), is_dir=is_dir, created_here=created_here)
    if expected == OK:
        assert decision.allowed
        return
    assert not decision.allowed
    assert decision.errno == expected
    assert zone in decision.reason
    assert level in decision.reason


def test_lookup_in_create_only_zone() -> None:
    policy = _policy("untrusted")
    assert policy.decide_lookup(Zone.STAGED, is_dir=True, created_here=False).allowed
    assert policy.decide_lookup(Zone.STAGED, is_dir=False, created_here=True).allowed
    refused = policy.decide_lookup(Zone.STAGED, is_dir=False, created_here=False)
    assert (refused.allowed, refused.errno) == (False, EACCES)
    assert "create-only" in refused.reason


def test_lookup_in_no_access_zone_names_readable_zones() -> None:
    refused = _policy("untrusted").decide_lookup(Zone.REPO, is_dir=True, created_here=True)
    assert (refused.allowed, refused.errno) == (False, EACCES)
    assert refused.reason == (
        "repo is not readable at trust level untrusted; readable zones: session, workers"
    )


# --- custom matrices: the EROFS/EACCES rule is about the cell, not the default table ---------


def _custom_policy(spelling: str) -> Policy:
    matrix = config.defaults().matrix()
    row = dict(matrix[Trust.SESSION])
    row[Zone.REPO] = ZoneAccess.parse(spelling)
    return Policy({**matrix, Trust.SESSION: row}, [], Trust.SESSION)


@pytest.mark.parametrize(
    ("spelling", "op", "expected"),
    [
        ("r", Op.WRITE, EROFS),
        ("r", Op.DELETE, EROFS),
        ("r", Op.LIST, EACCES),
        ("w", Op.READ, EACCES),
        ("w", Op.DELETE, EACCES),  # not readable: no read-only file system to speak of
        ("wd", Op.READ, EACCES),
        ("", Op.WRITE, EACCES),
    ],
)
def test_errno_rule_on_custom_cells(spelling: str, op: Op, expected: int) -> None:
    decision = _custom_policy(spelling).decide(Zone.REPO, op)
    assert (decision.allowed, decision.errno) == (False, expected)


def test_lookup_with_read_only_or_list_only_cell() -> None:
    for spelling in ("r", "l"):
        policy = _custom_policy(spelling)
        assert policy.decide_lookup(Zone.REPO, is_dir=False, created_here=False).allowed
    refused = _custom_policy("w").decide_lookup(Zone.REPO, is_dir=True, created_here=False)
    assert (refused.allowed, refused.errno) == (False, EACCES)


# --- deny list -----------------------------------------------------------------------------

DENIED = [
    (".env", False, ".env"),
    (".env", True, ".env"),
    (".env.local", False, ".env.*"),
    (".env.production", False, ".env.*"),
    (".env.example.bak", False, ".env.*"),
    (".netrc", False, ".netrc"),
    (".git-credentials", False, ".git-credentials"),
    (".ssh", True, ".ssh/"),
    (".aws", True, ".aws/"),
    (".gnupg", True, ".gnupg/"),
]

NOT_DENIED = [
    ("env", False),
    (".envrc", False),  # `.env.*` needs the dot
    ("environment.py", False),
    ("key.txt", False),
    ("pem", False),
    ("server.pem.txt", False),
    ("my_id_rsa", False),
    ("README.md", False),
    # Templates meant to be committed: exceptions to `.env.*`.
    (".env.example", False),
    (".env.sample", False),
    (".ENV.Template", False),
    (".env.dist", False),
    # Refused by their contents only (deny_private_keys, deny_credentials), never by name.
    (".npmrc", False),
    (".pypirc", False),
    ("pip.conf", False),
    ("server.pem", False),
    ("tls.key", False),
    ("id_rsa", False),
    ("id_rsa.pub", False),
    ("id_ed25519", False),
    (".ssh", False),  # `.ssh/` is directories only
    (".aws", False),
    (".gnupg", False),
    ("ssh", True),
]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(("name", "is_dir", "pattern"), DENIED)
def test_default_deny_patterns_match(level: str, name: str, is_dir: bool, pattern: str) -> None:
    policy = _policy(level)
    assert not policy.has_path_patterns
    matched = policy.denied_name(name, "", is_dir)
    # A directory-only pattern may be reported with or without its trailing "/".
    assert matched in (pattern, pattern.rstrip("/"))
    # The zone-relative path does not change a name match, at any depth.
    assert policy.denied_name(name, f"a/b/{name}", is_dir) == matched


@pytest.mark.parametrize(("name", "is_dir"), NOT_DENIED)
def test_default_deny_patterns_do_not_overmatch(name: str, is_dir: bool) -> None:
    policy = _policy("full")
    assert policy.denied_name(name, "", is_dir) is None
    assert policy.denied_name(name, f"sub/{name}", is_dir) is None


def test_deny_decision_is_eacces_naming_the_pattern() -> None:
    policy = _policy("full")
    pattern = policy.denied_name(".env.local", "", False)
    assert pattern is not None
    decision = policy.deny_list_decision("/repo/config/.env.local", pattern)
    assert (decision.allowed, decision.errno) == (False, EACCES)
    assert "/repo/config/.env.local" in decision.reason
    assert repr(".env.*") in decision.reason
    assert "\n" not in decision.reason


def test_exceptions_last_matching_entry_decides() -> None:
    """`!glob` is an exception; as in gitignore the last entry that matches decides, so a
    project can refuse a template again by naming it after the defaults."""
    policy = _policy("full", deny=[".env.*", "!.env.example", "*.example"])
    assert policy.denied_name(".env.example", "", False) == "*.example"
    policy = _policy("full", deny=[".env.*", "!.env.example"])
    assert policy.denied_name(".env.example", "", False) is None
    assert policy.denied_name(".env.local", "", False) == ".env.*"
    policy = _policy("full", deny=[*config.defaults().deny, ".env.example"])
    assert policy.denied_name(".env.example", "a/.env.example", False) == ".env.example"
    # Path exceptions, and exceptions that match directories only.
    policy = _policy("full", deny=["data/*", "!data/public.csv", "keys/", "!keys/"])
    assert policy.has_path_patterns
    assert policy.denied_name("public.csv", "data/public.csv", False) is None
    assert policy.denied_name("x.csv", "data/x.csv", False) == "data/*"
    assert policy.denied_name("keys", "keys", True) is None


def test_an_exception_does_not_reopen_a_denied_directory() -> None:
    policy = _policy("full", deny=[".ssh/", "!config"])
    assert policy.deny.match_within(".ssh/config", False) == ".ssh/"


def test_default_private_key_patterns() -> None:
    keys = config.defaults().deny_private_keys
    policy = Policy(config.defaults().matrix(), [], Trust.FULL, (), keys)
    for name in ("server.pem", "tls.key", "id_rsa", "id_rsa.pub", "a.p12", "b.pfx", "k.ppk"):
        assert policy.private_keys.match(name, "", False) is not None, name
    for name in ("README.md", "key.txt", "pem", "my_id_rsa"):
        assert policy.private_keys.match(name, "", False) is None, name
    assert policy.private_key_patterns == tuple(keys)
    decision = policy.private_key_decision("/repo/a.key", "*.key", "a private key (DER)")
    assert (decision.allowed, decision.errno, decision.rule) == (False, EACCES, "deny")
    assert "/repo/a.key holds a private key (DER)" in decision.reason


def test_credential_patterns_are_checked_by_contents_and_survive_a_level_change() -> None:
    defaults = config.defaults()
    policy = Policy(
        defaults.matrix(), defaults.deny, Trust.FULL, (), defaults.deny_private_keys,
        credential_patterns=defaults.deny_credentials,
    )  # fmt: skip
    for name in (".npmrc", ".yarnrc.yml", ".pypirc", "pip.conf", "server.pem"):
        assert policy.deny.match(name, "", False) is None, name
        assert policy.private_keys.match(name, "", False) is not None, name
    demoted = policy.with_trust(Trust.UNTRUSTED)
    assert demoted.trust is Trust.UNTRUSTED
    assert demoted.private_keys.match(".npmrc", "", False) == ".npmrc"
    assert demoted.credential_patterns == tuple(defaults.deny_credentials)
    what = "a credential (a value for '_authToken')"
    decision = demoted.private_key_decision("/repo/.npmrc", ".npmrc", what)
    assert (decision.allowed, decision.errno, decision.rule) == (False, EACCES, "deny")
    assert "refused when their contents hold a credential" in decision.reason
    assert decision.reason.endswith("name a variable instead (${NPM_TOKEN})")
    assert "hold a private key" in demoted.private_key_decision("/r/a.pem", "*.pem", "k").reason


def test_non_utf8_names_do_not_crash() -> None:
    policy = _policy("full", deny=[*config.defaults().deny, "*.pem", "data/*.bin"])
    assert policy.has_path_patterns
    pem = b"\xff\xfe.pem".decode("utf-8", "surrogateescape")
    plain = b"caf\xe9.txt".decode("utf-8", "surrogateescape")
    binary = b"\x80.bin".decode("utf-8", "surrogateescape")
    assert policy.denied_name(pem, pem, False) == "*.pem"
    assert policy.denied_name(plain, f"dir/{plain}", False) is None
    assert policy.denied_name(binary, f"data/{binary}", False) == "data/*.bin"


def test_path_pattern_is_relative_to_zone_root() -> None:
    policy = _policy("full", deny=["config/secret.json"])
    assert policy.has_path_patterns
    assert policy.denied_name("secret.json", "config/secret.json", False) == "config/secret.json"
    assert policy.denied_name("secret.json", "other/config/secret.json", False) is None
    assert policy.denied_name("secret.json", "secret.json", False) is None
    assert policy.denied_name("secret.json.bak", "config/secret.json.bak", False) is None
    assert policy.denied_name("config", "config", True) is None


def test_path_pattern_wildcards_cross_slashes() -> None:
    # fnmatch's `*` also matches "/", so a path pattern's wildcard reaches into subdirectories.
    # Unlike gitignore, this over-denies; for a deny list that is the safe direction.
    policy = _policy("full", deny=["config/*.json"])
    assert policy.denied_name("x.json", "config/x.json", False) == "config/*.json"
    assert policy.denied_name("x.json", "config/sub/x.json", False) == "config/*.json"
    assert policy.denied_name("x.json", "x.json", False) is None
    assert policy.denied_name("x.yaml", "config/x.yaml", False) is None


def test_name_pattern_wildcards_match_only_the_name() -> None:
    policy = _policy("full", deny=["*.pem"])
    assert policy.denied_name("a.pem", "deep/dir/a.pem", False) == "*.pem"
    assert policy.denied_name("dir", "a.pem/dir", True) is None


def test_dir_only_name_pattern_on_a_file_falls_through_to_other_patterns() -> None:
    policy = _policy("full", deny=["secrets/", "secret*"])
    assert policy.denied_name("secrets", "", False) == "secret*"
    assert policy.denied_name("secrets", "", True) in ("secrets", "secrets/")


def test_file_pattern_not_weakened_by_same_dir_only_pattern() -> None:
    policy = _policy("full", deny=[*config.defaults().deny, ".ssh"])
    assert policy.denied_name(".ssh", "", False) == ".ssh"


def test_dir_only_path_pattern_does_not_match_files() -> None:
    policy = _policy("full", deny=["config/keys/"])
    assert policy.denied_name("keys", "config/keys", True) is not None
    assert policy.denied_name("keys", "config/keys", False) is None


def test_leading_slash_pattern_is_not_silently_ineffective(tmp_path: Path) -> None:
    (tmp_path / "sandboxfs.yaml").write_text("deny: ['/secrets.txt']\n")
    try:
        loaded = config.load(tmp_path)
    except UserError:
        return  # rejecting the pattern is an acceptable fix
    policy = Policy(loaded.matrix(), loaded.deny, Trust.FULL)
    assert policy.denied_name("secrets.txt", "secrets.txt", False) is not None


# --- ZoneAccess.parse ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ops", "create_only", "spelling"),
    [
        ("rwld", {Op.READ, Op.WRITE, Op.LIST, Op.DELETE}, False, "rwld"),
        ("dlwr", {Op.READ, Op.WRITE, Op.LIST, Op.DELETE}, False, "rwld"),
        ("rl", {Op.READ, Op.LIST}, False, "rl"),
        ("r", {Op.READ}, False, "r"),
        ("w", {Op.WRITE}, False, "w"),
        ("", set(), False, ""),
        ("none", set(), False, ""),
        ("create-only", set(), True, "create-only"),
    ],
)
def test_zone_access_parse(text: str, ops: set[Op], create_only: bool, spelling: str) -> None:
    access = ZoneAccess.parse(text)
    assert access.ops == frozenset(ops)
    assert access.create_only is create_only
    assert access.any is bool(ops or create_only)
    assert access.spelling() == spelling
    assert ZoneAccess.parse(access.spelling()) == access


@pytest.mark.parametrize("text", ["rwx", "rr", "write", "R", "create_only", "rw ld", "read"])
def test_zone_access_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError) as info:
        ZoneAccess.parse(text)
    message = str(info.value)
    assert repr(text.strip()) in message
    assert "rwld" in message
    assert "create-only" in message
    assert "''" in message
    assert "\n" not in message


def test_every_default_spelling_round_trips() -> None:
    for row in config.defaults().permissions.values():
        for spelling in row.values():
            assert ZoneAccess.parse(spelling).spelling() == spelling


# --- enums ---------------------------------------------------------------------------------


def test_trust_order() -> None:
    assert [t.value for t in Trust] == ["untrusted", "session", "workspace", "full"]


def test_zone_and_op_names() -> None:
    assert [z.value for z in BUILTIN_ZONES] == ZONES
    assert {o.value for o in Op} == set(OPS)
