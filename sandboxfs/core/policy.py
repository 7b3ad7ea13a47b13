"""The pure policy core: trust levels, zones, operations and the decisions between them.

Nothing here touches the filesystem, the event loop or FUSE, so every rule can be tested as a
table. Decisions carry an errno and a reason written for the agent that was refused: what was
denied, why, and what would be allowed instead.
"""

from __future__ import annotations

import errno
import fnmatch
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar


class Trust(StrEnum):
    """Trust levels, lowest first; the order is the order of declaration."""

    UNTRUSTED = "untrusted"
    SESSION = "session"
    WORKSPACE = "workspace"
    FULL = "full"


class Zone:
    """A zone of the virtual tree: one of the five built-in zones or one a project declares.

    Zones are interned by name, so `is` compares them and they hash as fast as an enum member;
    what a mount knows of a zone (its backing directory, its permissions, its limits) lives in
    that mount's Policy and Store, not here.
    """

    __slots__ = ("value",)
    _known: ClassVar[dict[str, Zone]] = {}
    SESSION: ClassVar[Zone]
    WORKSPACE: ClassVar[Zone]
    REPO: ClassVar[Zone]
    STAGED: ClassVar[Zone]
    WORKERS: ClassVar[Zone]
    value: str

    def __new__(cls, name: str) -> Zone:
        zone = cls._known.get(name)
        if zone is None:
            zone = object.__new__(cls)
            zone.value = name
            cls._known[name] = zone
        return zone

    def __repr__(self) -> str:
        return f"Zone({self.value!r})"

    def __str__(self) -> str:
        return self.value

    def __reduce__(self) -> tuple[type[Zone], tuple[str]]:
        return (Zone, (self.value,))

    @property
    def builtin(self) -> bool:
        return self in BUILTIN_ZONES


Zone.SESSION = Zone("session")
Zone.WORKSPACE = Zone("workspace")
Zone.REPO = Zone("repo")
Zone.STAGED = Zone("staged")
Zone.WORKERS = Zone("workers")
# The built-in zones, in the order `/` lists them (project zones follow).
BUILTIN_ZONES: tuple[Zone, ...] = (
    Zone.SESSION,
    Zone.WORKSPACE,
    Zone.REPO,
    Zone.STAGED,
    Zone.WORKERS,
)


class Op(StrEnum):
    """Operations the matrix grants; every FUSE callback maps onto one of these."""

    READ = "read"
    WRITE = "write"
    LIST = "list"
    DELETE = "delete"


_OP_LETTERS = {"r": Op.READ, "w": Op.WRITE, "l": Op.LIST, "d": Op.DELETE}
CREATE_ONLY = "create-only"

_OP_ADJECTIVE = {
    Op.READ: "readable",
    Op.WRITE: "writable",
    Op.LIST: "listable",
    Op.DELETE: "deletable",
}


@dataclass(frozen=True, slots=True)
class ZoneAccess:
    """What one trust level may do in one zone.

    `create_only` grants creating new files and directories (and writing through the handle
    that created them) while everything else on existing entries stays refused.
    """

    ops: frozenset[Op] = frozenset()
    create_only: bool = False

    @classmethod
    def parse(cls, text: str) -> ZoneAccess:
        """Parse the config spelling: a subset of "rwld", "create-only", or "" for nothing."""
        text = text.strip()
        if text == CREATE_ONLY:
            return cls(create_only=True)
        if text in ("", "none", "-"):
            return cls()
        unknown = sorted(set(text) - set(_OP_LETTERS))
        if unknown or len(set(text)) != len(text):
            raise ValueError(
                f"invalid permission {text!r}: expected letters from 'rwld' (each once), "
                f"'{CREATE_ONLY}', or '' for no access"
            )
        return cls(ops=frozenset(_OP_LETTERS[c] for c in text))

    def spelling(self) -> str:
        if self.create_only:
            return CREATE_ONLY
        return "".join(c for c, op in _OP_LETTERS.items() if op in self.ops)

    @property
    def any(self) -> bool:
        return bool(self.ops) or self.create_only


class Rule(StrEnum):
    """Which rule refused, for front ends that name it (the API's exception types)."""

    MATRIX = ""  # the trust matrix, and every refusal without a rule of its own
    DENY = "deny"  # the deny list, and files that hold a private key
    PROTECT = "protect"  # protected paths, git's code-running surface, pinned zone directories
    SUFFIX = "suffix"
    SIZE = "size"  # max_file_bytes
    QUOTA = "quota"
    APPROVAL = (
        "approval"  # an approval rule (core.approvals): asked, blocked or refused by the user
    )


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome of a policy check: allowed, or the errno and reason for the refusal."""

    allowed: bool
    errno: int = 0
    reason: str = ""
    rule: Rule = Rule.MATRIX  # which rule refused


ALLOW = Decision(True)


def deny(err: int, reason: str, rule: Rule = Rule.MATRIX) -> Decision:
    return Decision(False, err, reason, rule)


Matrix = Mapping[Trust, Mapping[Zone, ZoneAccess]]


def fold(text: str) -> str:
    """The form names and patterns are compared in: Unicode-normalised and case-folded.

    Backing storage may fold case (ext4 casefold, vfat, a macOS folder shared into a VM) or
    normalise Unicode, so `.ENV` can open `.env`; matching folded names on both sides keeps a
    pattern's protection whatever the storage does.
    """
    if text.isascii():
        return text.lower()
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())


class Patterns:
    """A list of globs in the deny-list forms: a trailing "/" matches directories only; a glob
    containing "/" matches the path relative to the zone root, any other glob a name. A glob
    written with a leading "!" is an exception: as in gitignore, the last entry that matches
    decides, so `.env.*` then `!.env.example` leaves `.env.example` out (an entry below a
    matching directory stays matched: match_within stops at the directory)."""

    def __init__(self, patterns: Sequence[str]) -> None:
        self.written = tuple(patterns)
        # (folded glob, directories only, as written); exceptions apart, with their positions
        parsed: list[tuple[str, bool, str]] = []
        self._exceptions: list[tuple[int, str, bool, bool]] = []
        self._ordered: list[tuple[int, str, bool, str, bool]] = []
        for index, written in enumerate(self.written):
            exception = written.startswith("!")
            body = written[1:] if exception else written
            glob, dir_only = fold(body.strip("/")), body.endswith("/")
            is_path = "/" in glob or body.startswith("/")
            if not exception:
                parsed.append((glob, dir_only, written))
                self._ordered.append((index, glob, dir_only, written, is_path))
            else:
                self._exceptions.append((index, glob, dir_only, is_path))
        self._names = [t for t in parsed if "/" not in t[0] and not t[2].startswith("/")]
        self._paths = [t for t in parsed if "/" in t[0] or t[2].startswith("/")]
        self._name_re = _compile(t[0] for t in self._names)
        self._path_re = _compile(t[0] for t in self._paths)
        # Each path pattern's glob split into tokens once, for match_below.
        self._path_tokens = [(_glob_tokens(t[0]), t[2]) for t in self._paths]
        # One regex each for "something above relpath matches" and "relpath itself matches"
        # (files; directories), so match_within costs one search, not one per component.
        name_part, path_part = r"(?:.*/)?", ""
        above = [
            f"{name_part if t in self._names else path_part}{_glob_re(t[0])}/.+" for t in parsed
        ]
        itself = [f"{name_part if t in self._names else path_part}{_glob_re(t[0])}" for t in parsed]
        self._above_re = _union(above)
        self._file_re = _union(x for x, t in zip(itself, parsed, strict=True) if not t[1])
        self._dir_re = _union(itself)

    @property
    def has_paths(self) -> bool:
        return bool(self._paths) or any(t[3] for t in self._exceptions)

    def match(self, name: str, relpath: str, is_dir: bool) -> str | None:
        """The pattern that `name` (at zone-relative `relpath`) matches, if any."""
        for regex, patterns, subject in (
            (self._name_re, self._names, name),
            (self._path_re, self._paths, relpath),
        ):
            if regex is None or not subject:
                continue
            folded = fold(subject)
            if regex.match(folded):
                for glob, dir_only, written in patterns:
                    if fnmatch.fnmatchcase(folded, glob) and (is_dir or not dir_only):
                        return self._unless_excepted(written, name, relpath, is_dir)
        return None

    def _unless_excepted(self, found: str, name: str, relpath: str, is_dir: bool) -> str | None:
        """`found` (a matching pattern), unless an exception written after every matching
        pattern matches too."""
        if not self._exceptions:
            return found
        last = -1
        for index, glob, dir_only, is_path in self._exceptions:
            if _fits(glob, dir_only, is_path, name, relpath, is_dir):
                last = index
        if last < 0:
            return found
        for index, glob, dir_only, written, is_path in self._ordered:
            if index > last and _fits(glob, dir_only, is_path, name, relpath, is_dir):
                return written
        return None

    def match_within(self, relpath: str, is_dir: bool) -> str | None:
        """The pattern that `relpath` or one of the directories above it matches."""
        folded = fold(relpath)
        itself = self._dir_re if is_dir else self._file_re
        above = self._above_re
        if not (
            (above is not None and above.fullmatch(folded))
            or (itself is not None and itself.fullmatch(folded))
        ):
            return None
        parts = relpath.split("/")
        for depth in range(1, len(parts) + 1):
            last = depth == len(parts)
            found = self.match(parts[depth - 1], "/".join(parts[:depth]), is_dir or not last)
            if found is not None:
                return found
        return None

    def may_match_under(self, dir_relpath: str) -> bool:
        """Whether anything inside the directory at `dir_relpath` ("" for the zone root) could
        match: a name pattern, a pattern matching the directory or one above it, or a path
        pattern that reaches below it."""
        if not self.written:
            return False
        if self._names or not dir_relpath:
            return True
        return (
            self.match_within(dir_relpath, True) is not None
            or self.match_below(dir_relpath) is not None
        )

    def match_below(self, relpath: str) -> str | None:
        """A path pattern that could match something inside the directory at `relpath`: moving
        that directory would carry such an entry out from under its pattern."""
        prefix = fold(relpath) + "/"
        for tokens, written in self._path_tokens:
            if _glob_prefix(tokens, prefix):
                return written
        return None


# ----- git's code-running surface ------------------------------------------------------------
#
# What decides which code the user's git runs later, outside, wherever the user runs it. These
# rules hold in every zone at every trust level, whatever a config says (sandboxfs.yaml cannot
# drop them), on top of the protect list: matching paths stay readable where the level allows,
# and are never created, changed, renamed, linked or deleted through sandboxfs.
#
# - A `.git` entry (directory or `gitdir:` file) at any depth, the zone root's included: it
#   picks the repository, and so the config and hooks, that git uses in and below its directory.
#   One that exists stays as it is (nested clones and submodule checkouts keep working); none
#   can be created, replaced, moved or removed.
# - A file named `HEAD` outside every git directory: with `objects/` and `refs/` next to it, it
#   makes its directory a bare repository to git run inside it (safe.bareRepository=all is git's
#   default), and that repository's `config` names programs to run.
# - Inside a git directory (below any `.git`): what git reads to find config, hooks and the
#   common directory: `config`, `config.worktree`, `commondir`, `gitdir`, `hooks/`, the legacy
#   remote definitions `branches/` and `remotes/`, `objects/info/alternates`; what hides changes
#   from the user's `git status` and `git diff`: `info/` (exclude, attributes, sparse-checkout,
#   grafts), `refs/replace/`, and the `index` and `packed-refs` (renamed onto only by a new one
#   that sets no assume-unchanged or skip-worktree flag, adds no replace ref:
#   Guard._judge_index); and the same below
#   `modules/` (submodules' git directories, whose names may hold "/") and `worktrees/<id>/`
#   (linked worktrees') at any depth. No symbolic link, and no second name for a file from
#   outside, is made inside a git directory: `.git/modules -> ../elsewhere` would send the next
#   submodule's hooks into the working tree.
#
# What these rules cannot see by name (a core.hooksPath inside the project, a `.git/hooks` or
# `.git` that links to another directory there) sandboxfs.config.model.git_surface_protect finds by
# asking the user's git, and adds to the mount's protect list.
#
# Deliberately not here: .gitattributes and .gitignore (in the working tree, where the user's
# review shows them), .gitmodules (git takes no `!command` from it), refs, objects, and an
# interrupted rebase's todo list (see SECURITY.md, what `run` does not block).

# Zones git's rules do not hold in: the sandbox's own scratch space under the state dir
# (`.sandbox/`, never part of the project's work tree), where an agent may `git init` and
# `git clone`. A repository there is the agent's; git run in it outside runs its config.
GIT_ZONES_EXEMPT = frozenset({Zone.SESSION, Zone.WORKSPACE})

# Names in a git directory that decide what git runs or where it finds its repository.
GIT_DIR_ENTRIES = frozenset({"config", "config.worktree", "commondir", "gitdir", "hooks"})
# Names in a git directory that hide changes from the user's review; not below objects/, whose
# info/ is git's own (packs, commit-graph).
GIT_DIR_HIDING = frozenset({"info", "index", "packed-refs"})
# refs/replace/ swaps one object for another in everything the user's git shows.
_REPLACE_REFS = ("refs", "replace")
# At the top of a git directory only: legacy remotes (below modules/ these are ref namespaces).
_GIT_DIR_TOP_ENTRIES = GIT_DIR_ENTRIES | GIT_DIR_HIDING | {"branches", "remotes"}
# Directories of further git directories: submodules' and linked worktrees'.
_GIT_DIR_NESTING = frozenset({"modules", "worktrees"})
_ALTERNATES = frozenset({"alternates", "http-alternates"})


def is_dotgit(folded: str) -> bool:
    """Whether a folded name is `.git` as storage may spell it: any case (folded), and the
    NTFS spellings git itself refuses (`.git.`, `.git `, the short name `git~1`)."""
    return folded == ".git" or folded == "git~1" or folded.rstrip(". ") == ".git"


def git_name(name: str) -> bool:
    """Whether `name` is judged by the git rules wherever it is: `.git`, or `HEAD`."""
    folded = fold(name)
    return folded == "head" or is_dotgit(folded)


def _alternates(rest: Sequence[str]) -> bool:
    return len(rest) >= 3 and rest[0] == "objects" and rest[1] == "info" and rest[2] in _ALTERNATES


def git_dir_rule(rest: Sequence[str]) -> str | None:
    """The rule that protects `rest` (folded components below a git directory), if one does."""
    top = rest[0]
    if top in _GIT_DIR_TOP_ENTRIES:
        return f".git/{top}"
    if _alternates(rest):
        return ".git/objects/info/alternates"
    if tuple(rest[:2]) == _REPLACE_REFS:
        return ".git/refs/replace"
    if top in _GIT_DIR_NESTING:
        # modules/<name>/... where <name> may hold "/": every depth may be a git directory.
        for k in range(2, len(rest)):
            if rest[k] in GIT_DIR_ENTRIES or (
                rest[k] in GIT_DIR_HIDING and rest[k - 1] != "objects"
            ):
                return f".git/{top}/**/{rest[k]}"
            if _alternates(rest[k:]):
                return f".git/{top}/**/objects/info/alternates"
            if tuple(rest[k : k + 2]) == _REPLACE_REFS:
                return f".git/{top}/**/refs/replace"
    return None


def _git_dir_holds(rest: Sequence[str]) -> str | None:
    """A rule that could protect something strictly inside the directory `rest` (folded
    components below a git directory): moving it would carry that out from under the rule."""
    top = rest[0]
    if top in _GIT_DIR_TOP_ENTRIES:
        return f".git/{top}"
    if top in _GIT_DIR_NESTING:
        return f".git/{top}/**"
    if top == "objects" and (len(rest) == 1 or (len(rest) == 2 and rest[1] == "info")):
        return ".git/objects/info/alternates"
    if top == "refs" and len(rest) == 1:
        return ".git/refs/replace"
    return None


def _folded_parts(relpath: str) -> list[str]:
    # Split first, then fold: NFKC turns a fullwidth solidus into "/".
    return [fold(part) for part in relpath.split("/")]


def git_rule(relpath: str, pointer: bool = False) -> str | None:
    """The git rule that protects zone-relative `relpath`, if any (a label for reasons).

    `pointer`: the entry being made there is a symbolic link, or a second name for a file
    outside every git directory; refused anywhere inside a git directory.
    """
    parts = _folded_parts(relpath)
    last = len(parts) - 1
    inside = False
    for i, part in enumerate(parts):
        if not is_dotgit(part):
            continue
        if i == last:
            return ".git"
        rule = git_dir_rule(parts[i + 1 :])
        if rule is not None:
            return rule
        inside = True
    if inside:
        return ".git/**: no links" if pointer else None
    return "HEAD" if parts[last] == "head" else None


def git_rule_below(relpath: str) -> str | None:
    """A git rule that could protect something strictly inside the directory at `relpath`,
    which depends on where that directory is (names judged anywhere, `.git` and `HEAD`, are
    judged the same wherever it moves)."""
    parts = _folded_parts(relpath)
    for i, part in enumerate(parts):
        if is_dotgit(part):
            rest = parts[i + 1 :]
            rule = _git_dir_holds(rest) if rest else ".git"
            if rule is not None:
                return rule
    return None


def in_git_dir(relpath: str) -> bool:
    """Whether zone-relative `relpath` is a `.git` entry or inside one."""
    return any(is_dotgit(part) for part in _folded_parts(relpath))


def git_path(relpath: str, git_root: bool) -> str:
    """`relpath` as git's rules judge it: in a zone whose root is itself a git directory
    (`git_root`: the main repository's git dir of a linked-worktree project,
    sandboxfs.project.gitdir), as if below a `.git` (its `hooks/` and `config` are `.git/hooks`
    and `.git/config`)."""
    return f".git/{relpath}" if git_root else relpath


class Policy:
    """The matrix, the deny list and the protected paths of one mount, with decisions
    precomputed per zone and op.

    Decisions depend only on trust level, zone, operation and name, so the hot path of every
    FUSE callback is a dictionary lookup.
    """

    def __init__(
        self,
        matrix: Matrix,
        deny_patterns: Sequence[str],
        trust: Trust,
        protect_patterns: Sequence[str] = (),
        private_key_patterns: Sequence[str] = (),
        git_dirs: Iterable[Zone] = (),
        worker: tuple[str, Mapping[str, str]] | None = None,
        credential_patterns: Sequence[str] = (),
    ) -> None:
        self.matrix = matrix
        # The worker the matrix was narrowed to (name, declared mode per zone), named in
        # refusals: its declaration, not the trust level, is what a refusal often comes from.
        self.worker = worker
        # Zones whose root is a git directory: git's rules hold there as below a `.git`.
        self.git_dirs = frozenset(git_dirs)
        self.trust = trust
        self.deny = Patterns(deny_patterns)
        self.protect = Patterns(protect_patterns)
        # Files refused as deny-listed ones only when their contents hold a secret: a private
        # key or a credential (sandboxfs.core.secrets scans each for both).
        self.private_keys = Patterns([*private_key_patterns, *credential_patterns])
        self.deny_patterns = self.deny.written
        self.protect_patterns = self.protect.written
        self.private_key_patterns = Patterns(private_key_patterns).written
        self.credential_patterns = Patterns(credential_patterns).written
        # The mount's zones, in the order `/` lists them: the built-in ones, then the project's.
        self.zones: tuple[Zone, ...] = tuple(matrix[trust])
        self._decisions = {(zone, op): self._decide(zone, op) for zone in self.zones for op in Op}

    @property
    def has_path_patterns(self) -> bool:
        return self.deny.has_paths

    def access(self, zone: Zone) -> ZoneAccess:
        return self.matrix[self.trust][zone]

    def decide(self, zone: Zone, op: Op) -> Decision:
        """May the mount's trust level perform `op` on an existing entry of `zone`?"""
        return self._decisions[(zone, op)]

    def decide_create(self, zone: Zone) -> Decision:
        """May a new file, directory, symlink or FIFO be created in `zone`?"""
        if self.access(zone).create_only:
            return ALLOW
        return self._decisions[(zone, Op.WRITE)]

    def decide_lookup(self, zone: Zone, is_dir: bool, created_here: bool) -> Decision:
        """Resolving an existing name: every name resolves in a zone the level may read or list.

        In a create-only zone directories resolve (so new entries can be made inside them) and
        so do entries this mount created itself; other existing files are refused.
        """
        access = self.access(zone)
        if Op.READ in access.ops or Op.LIST in access.ops:
            return ALLOW
        if access.create_only and (is_dir or created_here):
            return ALLOW
        if access.create_only:
            return deny(errno.EACCES, self._create_only_reason(zone, Op.READ))
        return self._decisions[(zone, Op.READ)]

    def denied_name(self, name: str, relpath: str, is_dir: bool) -> str | None:
        """The deny pattern that `name` (at zone-relative `relpath`) matches, if any."""
        return self.deny.match(name, relpath, is_dir)

    def deny_list_decision(self, vpath: str, pattern: str, err: int = errno.EACCES) -> Decision:
        return deny(
            err,
            f"{vpath} matches the deny pattern {pattern!r}; deny-listed entries are never "
            f"read, listed, created, changed, renamed or deleted through sandboxfs, at every "
            f"trust level (where the level may list the zone they are shown, with their "
            f"attributes)",
            Rule.DENY,
        )

    def with_trust(self, trust: Trust) -> Policy:
        """The same policy at another trust level (a live promotion or demotion)."""
        return Policy(
            self.matrix,
            self.deny_patterns,
            trust,
            self.protect_patterns,
            self.private_key_patterns,
            self.git_dirs,
            self.worker,
            self.credential_patterns,
        )

    def private_key_decision(self, vpath: str, pattern: str, what: str) -> Decision:
        """The refusal of a file matching contents-checked pattern `pattern` that holds `what`
        (a private key or a credential)."""
        credential = pattern in self.credential_patterns
        secret = "a credential" if credential else "a private key"
        # A config file the project's tools must read keeps working once the secret moves to
        # the environment, which the file then names.
        fix = "; to let tools read it, name a variable instead (${NPM_TOKEN})" if credential else ""
        return deny(
            errno.EACCES,
            f"{vpath} holds {what} (files matching {pattern!r} are refused when their contents "
            f"hold {secret}); it is never read, changed, renamed or deleted through "
            f"sandboxfs, at every trust level{fix}",
            Rule.DENY,
        )

    def protect_decision(self, vpath: str, pattern: str) -> Decision:
        return deny(
            errno.EROFS,
            f"{vpath} is protected by the pattern {pattern!r}: it can be read where the trust "
            f"level allows, but never created, changed, renamed, linked or deleted through "
            f"sandboxfs",
            Rule.PROTECT,
        )

    def git_decision(self, vpath: str, rule: str) -> Decision:
        """The refusal of a change to `vpath` that git rule `rule` (from git_rule) protects."""
        if rule == ".git":
            why = (
                "a .git entry picks the repository, and so the config and hooks, that git uses "
                "there; an existing one stays as it is and none is created below a zone root "
                "(make scratch repositories in /tmp)"
            )
        elif rule == "HEAD":
            why = (
                "a file named HEAD outside .git makes its directory a bare repository to git, "
                "whose config names programs to run"
            )
        elif rule.endswith(": no links"):
            return deny(
                errno.EROFS,
                f"{vpath}: no symbolic link, and no second name for a file from outside, is made "
                f"inside a git directory, at any trust level: one there would move what git "
                f"reads into the working tree (git's code-running surface)",
                Rule.PROTECT,
            )
        elif rule.rsplit("/", 1)[-1] in GIT_DIR_HIDING:
            why = f"what {rule} holds can hide changes from the user's git status and git diff"
        else:
            why = f"git runs code or finds its repository from what {rule} holds"
        return deny(
            errno.EROFS,
            f"{vpath} is protected, part of git's code-running surface ({rule}): {why}; it can "
            f"be read where the trust level allows, but never created, changed, renamed, linked or "
            f"deleted through sandboxfs, at any trust level",
            Rule.PROTECT,
        )

    def protected(
        self,
        vpath: str,
        relpath: str,
        is_dir: bool,
        pointer: bool = False,
        git: bool = True,
        git_root: bool = False,
    ) -> Decision | None:
        """The refusal of creating, changing, renaming, linking or deleting the entry at
        zone-relative `relpath` (`vpath` names it in the reason), or of anything inside it:
        by the protect list, or (`git`: in a zone git's rules apply to, GIT_ZONES_EXEMPT) by
        git's rules (`git_rule`; `pointer` as there; `git_root` as in `git_path`)."""
        pattern = self.protect.match_within(relpath, is_dir)
        if pattern is not None:
            return self.protect_decision(vpath, pattern)
        if not git:
            return None
        rule = git_rule(git_path(relpath, git_root), pointer)
        return self.git_decision(vpath, rule) if rule is not None else None

    def protected_below(
        self, vpath: str, relpath: str, git: bool = True, git_root: bool = False
    ) -> Decision | None:
        """The refusal of moving the directory at `relpath` away or onto: something inside it
        would leave, or come under, a protect pattern or a git rule that depends on its path."""
        pattern = self.protect.match_below(relpath)
        if pattern is not None:
            return self.protect_decision(vpath, pattern)
        if not git:
            return None
        rule = git_rule_below(git_path(relpath, git_root))
        return self.git_decision(vpath, rule) if rule is not None else None

    def may_protect_under(self, dir_relpath: str, git: bool = True, git_root: bool = False) -> bool:
        """Whether anything in the directory at `dir_relpath` could be protected by its path
        (a protect pattern, or being in a git directory). `.git` and `HEAD` are protected by
        name anywhere: `git_name` tells those apart without the path."""
        return self.protect.may_match_under(dir_relpath) or (
            git and (git_root or in_git_dir(dir_relpath))
        )

    @property
    def root_create_reason(self) -> str:
        names = ", ".join(z.value for z in self.zones)
        return f"nothing can be created at /; create inside one of the zones: {names}"

    def zones_with(self, op: Op) -> list[str]:
        row = self.matrix[self.trust]
        return [z.value for z in self.zones if op in row[z].ops]

    def _decide(self, zone: Zone, op: Op) -> Decision:
        access = self.access(zone)
        if op in access.ops:
            return ALLOW
        if access.create_only:
            return deny(errno.EACCES, self._create_only_reason(zone, op))
        # A refused change in a zone the level can read looks like a read-only file system.
        readable = Op.READ in access.ops or Op.LIST in access.ops
        err = errno.EROFS if op in (Op.WRITE, Op.DELETE) and readable else errno.EACCES
        return deny(
            err,
            f"{zone.value} is not {_OP_ADJECTIVE[op]} at trust level {self.trust.value}"
            f"{self._for_worker(zone)}; {self._alternatives(op)}",
        )

    def _for_worker(self, zone: Zone) -> str:
        if self.worker is None:
            return ""
        name, modes = self.worker
        mode = modes.get(zone.value)
        return f" for worker {name}" + (f", which declared it {mode}" if mode else "")

    def _alternatives(self, op: Op) -> str:
        adjective = _OP_ADJECTIVE[op]
        text = f"{adjective} zones: {', '.join(self.zones_with(op)) or 'none'}"
        create_only = [z.value for z in self.zones if self.matrix[self.trust][z].create_only]
        if op is Op.WRITE and create_only:
            text += f"; new files only: {', '.join(create_only)}"
        return text

    def _create_only_reason(self, zone: Zone, op: Op) -> str:
        return (
            f"{zone.value} is create-only at trust level {self.trust.value}: new files and "
            f"directories may be created and written, existing ones cannot be read, listed, "
            f"changed or deleted; {self._alternatives(op)}"
        )


def _fits(glob: str, dir_only: bool, is_path: bool, name: str, relpath: str, is_dir: bool) -> bool:
    subject = relpath if is_path else name
    return bool(subject) and (is_dir or not dir_only) and fnmatch.fnmatchcase(fold(subject), glob)


def _compile(patterns: Iterable[str]) -> re.Pattern[str] | None:
    parts = [fnmatch.translate(p) for p in patterns]
    return re.compile("|".join(f"(?:{p})" for p in parts)) if parts else None


def _glob_re(glob: str) -> str:
    """fnmatch's regex for `glob`, without its end anchor, to embed in a larger one."""
    translated = fnmatch.translate(glob)
    assert translated.endswith(r"\Z"), translated
    return f"(?:{translated[:-2]})"


def _union(parts: Iterable[str]) -> re.Pattern[str] | None:
    alternatives = list(parts)
    return re.compile("|".join(f"(?:{p})" for p in alternatives)) if alternatives else None


def _glob_tokens(glob: str) -> tuple[str, ...]:
    """A glob split as fnmatch reads it: "*", "?", "[...]" classes and single characters."""
    tokens: list[str] = []
    i = 0
    while i < len(glob):
        c = glob[i]
        if c == "[":
            j = i + 1
            if j < len(glob) and glob[j] == "!":
                j += 1
            if j < len(glob) and glob[j] == "]":
                j += 1
            while j < len(glob) and glob[j] != "]":
                j += 1
            if j < len(glob):
                tokens.append(glob[i : j + 1])
                i = j + 1
                continue
        if c != "*" or not tokens or tokens[-1] != "*":
            tokens.append(c)
        i += 1
    return tuple(tokens)


def _glob_prefix(tokens: Sequence[str], text: str) -> bool:
    """Whether some string that starts with `text` matches the glob split into `tokens`
    (_glob_tokens; fnmatch rules: "*" also matches "/"). Runs the glob as a set of positions,
    one character at a time: no recursion, nothing built per call but the sets."""
    end = len(tokens)

    def closure(positions: set[int]) -> set[int]:
        # A "*" may match nothing: a position before one also stands after it.
        for t in sorted(positions):
            while t < end and tokens[t] == "*":
                t += 1
                positions.add(t)
        return positions

    positions = closure({0})
    for char in text:
        following: set[int] = set()
        for t in positions:
            if t == end:
                continue
            token = tokens[t]
            if token == "*":
                following.add(t)
            elif token in ("?", char) or (len(token) > 1 and fnmatch.fnmatchcase(char, token)):
                following.add(t + 1)
        if not following:
            return False
        positions = closure(following)
    return True  # the rest of the glob can match what follows


ZONE_ROOT_REASON = "zone roots and / cannot be removed, renamed or changed"
CONTEXT_REASON = "/.sandboxfs is generated by sandboxfs and read-only at every trust level"


def cross_zone_reason(what: str, src: Zone | None, dst: Zone | None) -> str:
    src_name = src.value if src else "/"
    dst_name = dst.value if dst else "/"
    return f"{what} cannot cross zones ({src_name} -> {dst_name}); copy the file instead"
