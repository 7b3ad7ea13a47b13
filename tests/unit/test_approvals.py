"""Approval rules, pending requests, grants, grouping and the rate limit (core.approvals), and
their configuration: pure units, no mount."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sandboxfs.api import ApprovalRequired, PermissionDenied, Sandbox
from sandboxfs.config import model as config
from sandboxfs.core.approval_grants import Answer, Grant
from sandboxfs.core.approval_rules import PROFILES, Kind, Rule, Verdict, strictest
from sandboxfs.core.approvals import ApprovalError, Broker, Mode
from sandboxfs.errors import UserError

ASK_DELETE = Rule("repo-delete", Verdict.ASK, frozenset({Kind.DELETE}), frozenset({"repo"}))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def broker(*rules: Rule, **kw: object) -> Broker:
    return Broker(rules or (ASK_DELETE,), **kw)  # type: ignore[arg-type]


def delete(b: Broker, path: str, pid: int = 7) -> object:
    return b.consult("full", "repo", [Kind.DELETE], path, pid=pid, comm="rm")


@pytest.mark.parametrize(
    ("rules", "kind", "zone", "trust", "expected"),
    [
        ((), Kind.DELETE, "repo", "full", "default"),
        ((ASK_DELETE,), Kind.DELETE, "repo", "full", "repo-delete"),
        ((ASK_DELETE,), Kind.DELETE, "session", "full", "default"),
        ((ASK_DELETE,), Kind.WRITE, "repo", "full", "default"),
        (
            (ASK_DELETE, Rule("no", Verdict.BLOCKED, frozenset({Kind.DELETE}))),
            Kind.DELETE,
            "repo",
            "full",
            "no",
        ),
        (
            (Rule("lvl", Verdict.ASK, frozenset({Kind.READ}), trust=frozenset({"workspace"})),),
            Kind.READ,
            "repo",
            "full",
            "default",
        ),
    ],
)
def test_the_strictest_matching_rule_decides(
    rules: tuple[Rule, ...], kind: Kind, zone: str, trust: str, expected: str
) -> None:
    assert strictest(rules, trust, zone, kind).id == expected


def test_preapproved_passes_and_blocked_names_its_rule() -> None:
    blocked = Rule("no-deletes", Verdict.BLOCKED, frozenset({Kind.DELETE}))
    b = broker(blocked)
    out = b.consult("full", "repo", [Kind.DELETE], "/repo/x", pid=1)
    assert not out.allowed and "blocked by approval rule no-deletes" in out.reason
    assert out.request is None and not b.pending()
    assert b.consult("full", "repo", [Kind.WRITE], "/repo/x", pid=1).allowed


def test_ask_makes_a_pending_request_and_an_answer_lets_the_retry_pass() -> None:
    b = broker()
    out = b.consult("full", "repo", [Kind.DELETE], "/repo/x", pid=7, cmdline=lambda: "rm x")
    assert not out.allowed and out.new and out.request is not None
    assert "delete of /repo/x waits for approval 1" in out.reason
    assert b.pending()[0].cmdline == "rm x"
    again = b.consult("full", "repo", [Kind.DELETE], "/repo/x", pid=7)
    assert not again.allowed and not again.new and again.request is out.request
    _, grant, _ = b.answer(1, Answer.ONCE, "test", shown=1)
    assert not b.pending() and grant.allow
    assert b.consult("full", "repo", [Kind.DELETE], "/repo/x", pid=7).allowed
    # once: the next delete of the same path asks again
    assert not b.consult("full", "repo", [Kind.DELETE], "/repo/x", pid=7).allowed
    with pytest.raises(ApprovalError, match="no pending request 1"):
        b.answer(1, Answer.ONCE, "test")  # stale id


def test_deny_refuses_the_retry_and_never_stops_asking() -> None:
    b = broker()
    delete(b, "/repo/d/x")
    b.answer(1, Answer.DENY, "test")
    out = b.consult("full", "repo", [Kind.DELETE], "/repo/d/x", pid=7)
    assert not out.allowed and "refused by the user (request 1" in out.reason
    delete(b, "/repo/d/x")  # asks again: a deny is for that try
    assert [r.id for r in b.pending()] == [2]
    b.answer(2, Answer.NEVER, "test")
    for path in ("/repo/d/x", "/repo/d/y", "/repo/d/sub/z"):
        out = b.consult("full", "repo", [Kind.DELETE], path, pid=8)
        assert not out.allowed and out.request is None and "refused by the user" in out.reason
    assert not b.pending()


def test_allow_directory_covers_the_directory_not_a_sibling() -> None:
    b = broker()
    delete(b, "/repo/a/one")
    _, grant, _ = b.answer(1, Answer.DIR, "test")
    assert "under /repo/a/" in grant.describe()["text"]
    assert b.consult("full", "repo", [Kind.DELETE], "/repo/a/two", pid=9).allowed
    assert b.consult("full", "repo", [Kind.DELETE], "/repo/a/sub/three", pid=9).allowed
    assert b.consult("full", "repo", [Kind.DELETE], "/repo/a", pid=9).allowed
    assert not b.consult("full", "repo", [Kind.DELETE], "/repo/ab/one", pid=9).allowed
    assert not b.consult("full", "repo", [Kind.DELETE], "/repo/b/one", pid=9).allowed
    b.revoke(grant.id)
    assert not b.consult("full", "repo", [Kind.DELETE], "/repo/a/four", pid=9).allowed
    with pytest.raises(ApprovalError):
        b.revoke(grant.id)


def test_a_directory_grant_settles_the_requests_below() -> None:
    b = broker()
    delete(b, "/repo/a/one")
    delete(b, "/repo/a/sub/two")
    delete(b, "/repo/b/three")
    _, grant, _ = b.answer(1, Answer.DIR, "test")
    assert [r.id for r in b.settled(grant)] == [2]
    assert [r.id for r in b.pending()] == [3]


def test_a_host_grant_covers_that_host_only() -> None:
    b = broker(Rule("hosts", Verdict.ASK, frozenset({Kind.CONNECT})))
    out = b.consult("full", "net", [Kind.CONNECT], "example.com:443", pid=1)
    assert out.request is not None and out.request.directory == "example.com:443"
    _, grant, _ = b.answer(1, Answer.DIR, "test")
    assert grant.describe()["text"].startswith("allow connections to example.com:443, for")
    assert b.consult("full", "net", [Kind.CONNECT], "example.com:443", pid=2).allowed
    assert not b.consult("full", "net", [Kind.CONNECT], "api.example.com:443", pid=2).allowed
    assert not b.consult("full", "net", [Kind.CONNECT], "example.com:4430", pid=2).allowed


def test_everywhere_is_for_that_kind_only() -> None:
    rules = (Rule("r", Verdict.ASK, frozenset({Kind.DELETE, Kind.RENAME})),)
    b = broker(*rules)
    delete(b, "/repo/x")
    b.answer(1, Answer.EVERYWHERE, "test")
    assert b.consult("full", "workspace", [Kind.DELETE], "/workspace/y", pid=1).allowed
    assert not b.consult("full", "repo", [Kind.RENAME], "/repo/x", pid=1).allowed


def test_same_rule_process_and_directory_make_one_request() -> None:
    b = broker()
    for n in range(500):
        delete(b, f"/repo/d/f{n}")
    delete(b, "/repo/other/f", pid=7)  # another directory
    delete(b, "/repo/d/g", pid=8)  # another process
    requests = b.pending()
    assert [(r.directory, r.pid, r.count) for r in requests] == [
        ("/repo/d", 7, 500),
        ("/repo/other", 7, 1),
        ("/repo/d", 8, 1),
    ]
    shown = requests[0].describe(0)
    assert shown["count"] == 500 and shown["paths"] == [f"/repo/d/f{n}" for n in range(5)]
    b.answer(1, Answer.ONCE, "test", shown=shown["shown"])
    assert all(delete_ok(b, f"/repo/d/f{n}") for n in range(500))


def delete_ok(b: Broker, path: str) -> bool:
    return b.consult("full", "repo", [Kind.DELETE], path, pid=7).allowed


def test_rate_limit_refuses_without_a_request() -> None:
    clock = Clock()
    b = broker(per_minute=3, clock=clock)
    for n in range(3):
        delete(b, f"/repo/d{n}/x")
    out = b.consult("full", "repo", [Kind.DELETE], "/repo/d9/x", pid=7)
    assert not out.allowed and out.limited and out.request is None
    assert "more than 3 requests came in a minute" in out.reason
    clock.now += 61
    assert b.consult("full", "repo", [Kind.DELETE], "/repo/d9/x", pid=7).new


def test_requests_time_out() -> None:
    clock = Clock()
    b = broker(timeout=60, clock=clock)
    delete(b, "/repo/x", pid=7)
    clock.now += 59
    assert not b.expire()
    clock.now += 2
    assert [r.path for r in b.expire()] == ["/repo/x"]
    assert not b.pending()
    assert delete(b, "/repo/x", pid=7).new  # type: ignore[attr-defined]


def test_a_retry_by_another_process_joins_its_request() -> None:
    b = broker()
    first = delete(b, "/repo/x", pid=7)
    again = delete(b, "/repo/x", pid=99)
    assert again.request is first.request and first.request.count == 1  # type: ignore[attr-defined]
    b.answer(1, Answer.ONCE, "test", shown=1)
    assert delete_ok(b, "/repo/x")


def test_modes_none_and_off() -> None:
    none = broker(mode=Mode.NONE)
    out = none.consult("full", "repo", [Kind.DELETE], "/repo/x", pid=1)
    assert not out.allowed and "--approvals none" in out.reason and not none.pending()
    off = broker(mode=Mode.OFF)
    out = off.consult("full", "repo", [Kind.DELETE], "/repo/x", pid=1)
    assert out.allowed and out.unasked
    blocked = broker(Rule("b", Verdict.BLOCKED, frozenset({Kind.DELETE})), mode=Mode.OFF)
    assert not blocked.consult("full", "repo", [Kind.DELETE], "/repo/x", pid=1).allowed


def test_rename_over_a_file_is_an_overwrite_too() -> None:
    b = broker(Rule("ow", Verdict.ASK, frozenset({Kind.OVERWRITE})))
    assert b.consult("full", "repo", [Kind.RENAME], "/repo/a", pid=1).allowed
    out = b.consult("full", "repo", [Kind.RENAME, Kind.OVERWRITE], "/repo/a", pid=1)
    assert not out.allowed and out.request is not None and out.request.kind is Kind.OVERWRITE


def test_pending_text_for_the_guide() -> None:
    b = broker()
    assert b.pending_text() == ""
    delete(b, "/repo/d/x")
    delete(b, "/repo/d/y")
    assert "1: delete of /repo/d/x and 1 more in /repo/d (rule repo-delete)" in b.pending_text()


# ----- configuration ---------------------------------------------------------------------------


def write_config(project: Path, text: str) -> config.Config:
    (project / "sandboxfs.yaml").write_text(text)
    return config.load(project)


def test_profile_in_one_line_and_rule_ids(tmp_path: Path) -> None:
    loaded = write_config(tmp_path, "approvals: {profile: agent}\n")
    rules = loaded.approvals.rule_list("sandboxfs.yaml")
    assert rules == list(PROFILES["agent"])
    loaded = write_config(
        tmp_path,
        "approvals:\n  rules:\n    - {ops: [delete], zones: [repo], decision: blocked}\n"
        "    - {id: mine, ops: [write], trust: [full], decision: ask}\n",
    )
    ids = [r.id for r in loaded.approvals.rule_list("sandboxfs.yaml")]
    assert ids == ["sandboxfs.yaml#1", "mine"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("approvals: {profile: nope}\n", "unknown approvals profile 'nope'; profiles: agent"),
        ("approvals: {rules: [{ops: [delete], zones: [nowhere], decision: ask}]}\n", "nowhere"),
        ("approvals: {rules: [{ops: [erase], decision: ask}]}\n", "erase"),
        ("approvals: {rules: [{ops: [delete], decision: maybe}]}\n", "maybe"),
        ("approvals: {timeout: 0}\n", "timeout"),
        ("approvals: {bogus: 1}\n", "bogus"),
    ],
)
def test_bad_approvals_config_is_one_line(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(UserError) as info:
        write_config(tmp_path, text)
    assert needle in info.value.message and "\n" not in info.value.message


def test_a_project_cannot_loosen_the_users_rules() -> None:
    user = config.ApprovalsConfig.model_validate(
        {
            "rules": [{"id": "u", "ops": ["delete"], "zones": ["repo"], "decision": "blocked"}],
            "timeout": 30,
        }
    )
    project = config.ApprovalsConfig.model_validate(
        {"rules": [{"id": "p", "ops": ["delete"], "decision": "preApproved"}], "timeout": 600}
    )
    b = config.make_broker(project, user, Mode.ASK)
    out = b.consult("full", "repo", [Kind.DELETE], "/repo/x", pid=1)
    assert not out.allowed and out.rule.id == "u"
    assert b.timeout == 30


# ----- the Python API: Sandbox.open(approver=...) -----------------------------------------------


def api_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    for directory in ("a", "b"):
        (project / directory).mkdir(parents=True)
        for name in ("one", "two"):
            (project / directory / name).write_text(name)
    (project / "sandboxfs.yaml").write_text(
        "approvals:\n  rules:\n    - {id: repo-delete, ops: [delete], zones: [repo], "
        "decision: ask}\n"
    )
    return project


def test_without_an_approver_ask_raises_a_typed_error(tmp_path: Path) -> None:
    project = api_project(tmp_path)
    with Sandbox.open(project, trust="full") as sb:
        with pytest.raises(ApprovalRequired) as info:
            sb.delete("/repo/a/one")
        assert isinstance(info.value, PermissionDenied)
        assert "needs the user's approval (rule repo-delete)" in str(info.value)
        assert "pass approver=callable to Sandbox.open" in str(info.value)
        text = sb.call_tool("delete", {"path": "/repo/a/one"})
        assert text.startswith("Error:") and "needs the user's approval" in text
        sb.write("/repo/a/new", "x")  # preApproved where no rule asks
    assert (project / "a" / "one").exists()


def test_the_approver_is_asked_once_for_a_directory(tmp_path: Path) -> None:
    project = api_project(tmp_path)
    asked: list[dict[str, object]] = []

    def approver(request: dict[str, object]) -> str:
        asked.append(request)
        return "dir"

    with Sandbox.open(project, trust="full", approver=approver) as sb:
        sb.delete("/repo/a/one")
        sb.delete("/repo/a/two")
        entries = [e for e in sb.audit_entries() if e["op"] == "approval"]
    assert [r["path"] for r in asked] == ["/repo/a/one"]
    assert asked[0]["rule"] == "repo-delete"
    assert "under /repo/a/" in str(asked[0]["grants"])
    assert not (project / "a" / "one").exists() and not (project / "a" / "two").exists()
    answer = next(e for e in entries if e["approval"].get("answer") == "dir")
    assert answer["approval"]["by"] == "the API's approver"


@pytest.mark.parametrize("answer", [False, None, "deny", "nonsense", "slow", "raises"])
def test_an_approver_that_refuses_fails_or_is_late_refuses(
    tmp_path: Path, answer: str | bool | None
) -> None:
    project = api_project(tmp_path)

    def approver(request: dict[str, object]) -> str | bool | None:
        if answer == "slow":
            time.sleep(5)
            return "once"
        if answer == "raises":
            raise RuntimeError("no")
        return answer

    sb = Sandbox.open(project, trust="full", approver=approver, approval_timeout=0.2)
    with sb, pytest.raises(ApprovalRequired, match="refused by the user"):
        sb.delete("/repo/b/one")
    assert (project / "b" / "one").exists()


def test_the_permission_probe_judges_approvals_without_asking(tmp_path: Path) -> None:
    """check_permission is the gate run without effect: an `ask` with no grant is "not
    allowed, needs approval", and nobody is asked, nothing is pending, nothing is audited;
    once a directory grant exists the probe says allowed there and still asks nobody."""
    project = api_project(tmp_path)
    asked: list[dict[str, object]] = []

    def approver(request: dict[str, object]) -> str:
        asked.append(request)
        return "dir"

    with Sandbox.open(project, trust="full", approver=approver) as sb:
        before = len(sb.audit_entries())
        probe = sb.check_permission("delete", "/repo/a/one")
        assert not probe.allowed and probe.error == "ApprovalRequired"
        assert "needs the user's approval (rule repo-delete)" in probe.reason
        assert asked == [] and len(sb.audit_entries()) == before
        sb.delete("/repo/a/one")  # asks: the approver grants /repo/a/
        assert len(asked) == 1
        assert sb.check_permission("delete", "/repo/a/two").allowed
        assert not sb.check_permission("delete", "/repo/b/one").allowed
        assert len(asked) == 1
    assert (project / "a" / "two").exists() and (project / "b" / "one").exists()


# ----- a grant is exactly what was shown ----------------------------------------------------------

ASK_RENAME = Rule("repo-rename", Verdict.ASK, frozenset({Kind.RENAME}), frozenset({"repo"}))


def rename(b: Broker, path: str, dest: str, pid: int = 7) -> bool:
    kinds = [Kind.RENAME]
    return b.consult("full", "repo", kinds, path, pid=pid, comm="mv", dest=dest).allowed


def test_once_covers_the_paths_shown_not_those_that_joined_after() -> None:
    """Case 5: the answer carries the version it saw; paths that joined later stay pending
    in a request of their own and are refused until it is answered."""
    b = broker()
    for n in range(7):
        delete(b, f"/repo/d/f{n}")
    shown = b.pending()[0].describe(0)
    assert shown["shown"] == 7 and len(shown["paths"]) == 5  # "and N more", listed on request
    assert b.listing(1)["paths"] == [f"/repo/d/f{n}" for n in range(7)]
    for n in range(7, 10):  # joined after the user looked
        delete(b, f"/repo/d/f{n}")
    request, grant, remainder = b.answer(1, Answer.ONCE, "test", shown=shown["shown"])
    assert request.count == 7 and len(grant.pairs) == 7 and "7 paths" in grant.describe()["text"]
    assert remainder is not None and remainder.paths == [f"/repo/d/f{n}" for n in range(7, 10)]
    assert all(delete_ok(b, f"/repo/d/f{n}") for n in range(7))
    assert not any(delete_ok(b, f"/repo/d/f{n}") for n in range(7, 10))
    assert [r.id for r in b.pending()] == [remainder.id]


def test_an_answer_must_match_what_the_request_held() -> None:
    b = broker()
    delete(b, "/repo/d/a")
    delete(b, "/repo/d/b")
    with pytest.raises(ApprovalError, match="names how many of its paths were shown"):
        b.answer(1, Answer.ONCE, "test")
    with pytest.raises(ApprovalError, match="held 2 paths, not 3"):
        b.answer(1, Answer.ONCE, "test", shown=3)
    _, grant, remainder = b.answer(1, Answer.ONCE, "test", shown=1)
    assert grant.paths == ["/repo/d/a"] and remainder is not None
    assert remainder.paths == ["/repo/d/b"]


def test_the_api_approver_covers_only_what_it_was_given(tmp_path: Path) -> None:
    project = api_project(tmp_path)
    given: list[dict[str, object]] = []

    def approver(request: dict[str, object]) -> str:
        given.append(request)
        return "once"

    with Sandbox.open(project, trust="full", approver=approver) as sb:
        sb.delete("/repo/a/one")
        sb.delete("/repo/a/two")  # its own request: the first grant covered one path
    assert [r["shown"] for r in given] == [1, 1]
    assert [r["path"] for r in given] == ["/repo/a/one", "/repo/a/two"]


def test_a_rename_grant_binds_source_and_destination() -> None:
    """Case 6: once for notes.txt -> notes.old is not notes.txt -> src/main.py; a directory
    grant for renames needs both ends under it."""
    b = broker(ASK_RENAME)
    assert not rename(b, "/repo/notes.txt", "/repo/notes.old")
    _, grant, _ = b.answer(1, Answer.ONCE, "test", shown=1)
    assert grant.paths == ["/repo/notes.txt -> /repo/notes.old"]
    assert not rename(b, "/repo/notes.txt", "/repo/src/main.py")
    assert rename(b, "/repo/notes.txt", "/repo/notes.old")
    b = broker(ASK_RENAME)
    assert not rename(b, "/repo/docs/a", "/repo/docs/b")
    _, grant, _ = b.answer(1, Answer.DIR, "test")
    assert "under /repo/docs/ (from and to it)" in grant.describe()["text"]
    assert rename(b, "/repo/docs/c", "/repo/docs/sub/d")
    assert not rename(b, "/repo/docs/c", "/repo/src/main.py")
    assert not rename(b, "/repo/src/main.py", "/repo/docs/x")


def test_grouped_renames_keep_each_destination() -> None:
    b = broker(ASK_RENAME)
    rename(b, "/repo/a", "/repo/a.old")
    rename(b, "/repo/b", "/repo/b.old")
    assert b.listing(1)["dests"] == ["/repo/a.old", "/repo/b.old"]
    b.answer(1, Answer.ONCE, "test", shown=2)
    assert not rename(b, "/repo/a", "/repo/b.old")
    assert rename(b, "/repo/a", "/repo/a.old") and rename(b, "/repo/b", "/repo/b.old")


def test_a_directory_grant_does_not_cover_what_is_moved_in() -> None:
    """Case 7: src/ moved into build/ after the grant for build/ is not deletable under it;
    what is made or moved within build/ still is."""
    b = broker()
    delete(b, "/repo/build/old.o")
    _, grant, _ = b.answer(1, Answer.DIR, "test")
    assert b.moved("/repo/src", "/repo/build/src") == []
    assert b.moved("/repo/build/a.o", "/repo/build/b.o") == []  # within: still covered
    assert not delete_ok(b, "/repo/build/src/main.py")
    assert not delete_ok(b, "/repo/build/src")
    assert delete_ok(b, "/repo/build/b.o") and delete_ok(b, "/repo/build/new.o")
    b.moved("/repo/build/src", "/repo/build/src2")  # moved on: still not covered
    assert not delete_ok(b, "/repo/build/src2/main.py")
    assert grant.describe()["moved_in"] == 2


def test_moving_onto_a_granted_path_or_above_a_granted_directory_drops_the_grant() -> None:
    b = broker()
    delete(b, "/repo/build/old.o")
    b.answer(1, Answer.ONCE, "test", shown=1)
    b.moved("/repo/src/main.py", "/repo/build/old.o")  # not the file the user saw
    assert not delete_ok(b, "/repo/build/old.o")
    b = broker()
    delete(b, "/repo/a/build/x")
    _, grant, _ = b.answer(1, Answer.DIR, "test")
    b.moved("/repo/a", "/repo/a.gone")
    assert b.moved("/repo/src", "/repo/a") == [grant]  # a/build/ may now be src/build/
    assert not delete_ok(b, "/repo/a/build/x") and not b.grants()


def test_lookups_are_indexed_and_requests_bounded() -> None:
    """Case 29: ~10,000 grants cost a lookup its path's depth (counted, not timed); a
    request holds at most MAX_PATHS paths and MAX_REQUEST_BYTES, the rest refused unasked."""
    b = broker(per_minute=100_000)
    for n in range(10_000):
        delete(b, f"/repo/d{n}/x", pid=n)
        b.answer(n + 1, Answer.DIR if n % 2 else Answer.ONCE, "test", shown=1)
    calls = 0
    real = Grant.covers

    def counting(self: Grant, kind: Kind, path: str, dest: str | None = None) -> bool:
        nonlocal calls
        calls += 1
        return real(self, kind, path, dest)

    Grant.covers = counting  # type: ignore[method-assign]
    try:
        assert delete_ok(b, "/repo/d9999/sub/y") and not delete_ok(b, "/repo/other/y")
    finally:
        Grant.covers = real  # type: ignore[method-assign]
    assert calls <= 4
    b = broker()
    for n in range(Broker.MAX_PATHS + 5):
        out = b.consult("full", "repo", [Kind.DELETE], f"/repo/d/f{n}", pid=7)
    assert b.pending()[0].count == Broker.MAX_PATHS
    assert out.limited and "already holds 1000 paths" in out.reason
    long = "x" * 4000
    b = broker()
    for n in range(100):
        out = b.consult("full", "repo", [Kind.DELETE], f"/repo/d/{long}{n}", pid=7)
    assert b.pending()[0].size <= Broker.MAX_REQUEST_BYTES and out.limited


def test_the_grants_of_a_session_are_bounded() -> None:
    b = broker(per_minute=100)
    b.MAX_GRANTS = 2
    for n in range(3):
        delete(b, f"/repo/d{n}/x")
    b.answer(1, Answer.DIR, "test")
    b.answer(2, Answer.DIR, "test")
    with pytest.raises(ApprovalError, match=r"holds 2 grants.*revoke some first"):
        b.answer(3, Answer.DIR, "test")


def test_a_link_grant_binds_its_source_and_a_new_name_is_not_made_there() -> None:
    """Case 6 and 7 for links: a grant for a link names its source; a second name for a file
    from outside a directory grant is not covered by it (writing through it writes the file)."""
    ask_create = Rule("c", Verdict.ASK, frozenset({Kind.CREATE}), frozenset({"repo"}))
    b = broker(ask_create)

    def create(path: str, source: str | None = None) -> bool:
        return b.consult("full", "repo", [Kind.CREATE], path, pid=7, dest=source).allowed

    assert not create("/repo/n", "/repo/notes.txt")
    b.answer(1, Answer.ONCE, "test", shown=1)
    assert not create("/repo/n", "/repo/src/main.py") and not create("/repo/n")
    assert create("/repo/n", "/repo/notes.txt")
    b = broker()
    delete(b, "/repo/build/old.o")
    b.answer(1, Answer.DIR, "test")
    b.moved("/repo/src/main.py", "/repo/build/main.o")  # what Gate.link tells it
    assert not delete_ok(b, "/repo/build/main.o")


def test_refusals_that_ask_nobody_are_kept_for_the_control_channel() -> None:
    """Blocked, or nobody to answer: the last REFUSALS_KEPT, numbered, for a run without a
    prompt to tell; a probe's verdict keeps none."""
    from sandboxfs.core import approvals as approvals_mod

    broker = Broker([ASK_DELETE], mode=Mode.NONE)
    assert not broker.verdict("full", "repo", [Kind.DELETE], "/repo/x").allowed
    assert broker.snapshot()["refused"] == []
    for i in range(approvals_mod.REFUSALS_KEPT + 5):
        outcome = broker.consult("full", "repo", [Kind.DELETE], f"/repo/f{i}", pid=7, comm="rm")
        assert not outcome.allowed
    snapshot = broker.snapshot()
    assert snapshot["refused_total"] == approvals_mod.REFUSALS_KEPT + 5
    assert len(snapshot["refused"]) == approvals_mod.REFUSALS_KEPT
    assert snapshot["refused"][-1]["seq"] == approvals_mod.REFUSALS_KEPT + 5
    assert "nobody can answer" in snapshot["refused"][-1]["reason"]
