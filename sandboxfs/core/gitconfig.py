"""Judging a change to one of git's config files by the settings it adds or changes.

git never writes `.git/config` in place: it writes `config.lock` and renames it onto `config`
(`git config --file`, `remote add`, `checkout -b --track`, `branch -D` alike). The guard
(sandboxfs.core.guard.Guard.may_move) lets such a rename through only when every setting the
new content adds or changes decides no program git runs and no file git reads: branch tracking,
remotes with ordinary URLs of another machine (ordinary_url; `git push` to a repository on this
one runs its hooks), `user.*` and the like (ALLOWED, an allowlist: anything not named there is
refused). Removing settings is fine; keeping the user's own settings, whatever they are, is fine.

The parser reads the format as git's config.c does (git_parse_source, get_base_var,
get_extended_base_var, get_value, parse_value), character for character, so what is judged is
what git will read; anything git would reject is refused. Includes are not followed: adding an
`include.path` or `includeIf.*.path` is itself refused.

Standard library only, like the rest of sandboxfs.core.
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# The largest config file judged; a larger one is refused (git's own are a few KiB).
MAX_CONFIG_BYTES = 1 << 20

# The names of git's config files in a git directory (compared folded, as git_rule does).
CONFIG_NAMES = frozenset({"config", "config.worktree"})

_SPACE = frozenset(" \t\n\r")  # git's isspace (sane_ctype): not \v or \f
_ALPHA = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_KEYCHAR = _ALPHA | frozenset("0123456789-")
_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_BOM = "\ufeff"


class ConfigSyntaxError(ValueError):
    """Content git would refuse to read as config."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One setting as git reads it: `name` is the variable as git builds it (section and key
    lower-cased, a `[section "subsection"]`'s subsection as written), `value` None for a
    boolean written without "="."""

    name: str
    value: str | None
    line: int

    @property
    def parts(self) -> tuple[str, str | None, str]:
        """(section, subsection or None, key), split at the first and last dot as git does."""
        first, last = self.name.find("."), self.name.rfind(".")
        if first < 0:
            return "", None, self.name
        sub = self.name[first + 1 : last] if last > first else None
        return self.name[:first], sub, self.name[last + 1 :]


class _Source:
    """git's get_next_char: "\\r\\n" reads as "\\n", and the end of the text as "\\n" with
    `eof` set, as often as it is asked."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.eof = False
        self.line = 1

    def next(self) -> str:
        text, pos = self.text, self.pos
        if pos >= len(text):
            self.eof = True
            return "\n"
        c = text[pos]
        self.pos = pos + 1
        if c == "\r" and self.pos < len(text) and text[self.pos] == "\n":
            self.pos += 1
            c = "\n"
        if c == "\n":
            self.line += 1
        return c

    def error(self, what: str) -> ConfigSyntaxError:
        return ConfigSyntaxError(f"line {self.line}: {what}")


def parse(data: bytes) -> list[Entry]:
    """Every setting of a config file, in order; ConfigSyntaxError where git would fail."""
    if b"\0" in data:
        # git reads values as C strings: what follows a NUL would be judged but never read.
        raise ConfigSyntaxError("it holds a NUL byte")
    src = _Source(data.decode("utf-8", "surrogateescape"))
    if src.text.startswith(_BOM):  # git skips a UTF-8 byte order mark at the start
        src.pos = 1
    entries: list[Entry] = []
    base = ""
    comment = False
    while True:
        c = src.next()
        if c == "\n":
            if src.eof:
                return entries
            comment = False
            continue
        if comment:
            continue
        if c in _SPACE:
            continue
        if c in "#;":
            comment = True
            continue
        if c == "[":
            base = _section(src)
            if not base:
                raise src.error("an empty section name")
            base += "."
            continue
        if c not in _ALPHA:
            raise src.error(f"{c!r} cannot start a key")
        entries.append(_entry(src, base + c.translate(_LOWER)))


def _section(src: _Source) -> str:
    """git's get_base_var, after "[": the section name (lower-cased), with "." and the
    subsection of `[section "subsection"]`."""
    name: list[str] = []
    while True:
        c = src.next()
        if src.eof:
            raise src.error("an unterminated section header")
        if c == "]":
            return "".join(name)
        if c in _SPACE:
            return _subsection(src, "".join(name), c)
        if c not in _KEYCHAR and c != ".":
            raise src.error(f"{c!r} in a section name")
        name.append(c.translate(_LOWER))


def _subsection(src: _Source, name: str, c: str) -> str:
    """git's get_extended_base_var: `[section "subsection"]`, the subsection kept as written
    but for backslashes, which escape the next character."""
    while True:
        if c == "\n":
            raise src.error("an unterminated section header")
        c = src.next()
        if c not in _SPACE:
            break
    if c != '"':
        raise src.error('a section header without "subsection"')
    chars = [name, "."]
    while True:
        c = src.next()
        if c == "\n":
            raise src.error("an unterminated subsection")
        if c == '"':
            break
        if c == "\\":
            c = src.next()
            if c == "\n":
                raise src.error("an unterminated subsection")
        chars.append(c)
    if src.next() != "]":
        raise src.error('a section header with more after "subsection"')
    return "".join(chars)


def _entry(src: _Source, name: str) -> Entry:
    """git's get_value: the rest of the key, then "=" and a value, or the end of the line."""
    line = src.line
    chars = [name]
    while True:
        c = src.next()
        if src.eof or c not in _KEYCHAR:
            break
        chars.append(c.translate(_LOWER))
    while c in " \t":
        c = src.next()
    value = None
    if c != "\n":
        if c != "=":
            raise src.error(f"{c!r} after a key")
        value = _value(src)
    return Entry("".join(chars), value, line)


def _value(src: _Source) -> str:
    """git's parse_value: quotes, the escapes \\\\ \\" \\n \\t \\b, a backslash before a line's
    end continuing it, comments outside quotes, surrounding white space dropped."""
    quote = comment = False
    trim = 0
    value: list[str] = []
    while True:
        c = src.next()
        if c == "\n":
            if quote:
                raise src.error("an unterminated quoted value")
            if trim:
                del value[trim:]
            return "".join(value)
        if comment:
            continue
        if c in _SPACE and not quote:
            if not trim:
                trim = len(value)
            if value:
                value.append(c)
            continue
        if not quote and c in ";#":
            comment = True
            continue
        trim = 0
        if c == "\\":
            c = src.next()
            if c == "\n":
                continue
            escaped = _ESCAPES.get(c)
            if escaped is None:
                raise src.error(f"an unknown escape \\{c}")
            value.append(escaped)
            continue
        if c == '"':
            quote = not quote
            continue
        value.append(c)


_ESCAPES = {"t": "\t", "b": "\b", "n": "\n", "\\": "\\", '"': '"'}


# ----- what may change -------------------------------------------------------------------------

# A check of a new value: None when it is fine, else what is wrong with it.
Check = Callable[[str | None], str | None]

_NETWORK_SCHEMES = frozenset({"http", "https", "ssh", "git", "git+ssh", "ssh+git"})
_SSH_SCHEMES = frozenset({"ssh", "git+ssh", "ssh+git"})
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
_REMOTE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
# A host spelled as a number in a form other than a dotted quad (2130706433, 0x7f.1, 127.1):
# the resolver reads those its own way.
_NUMBER = r"(?:0x[0-9a-f]*|[0-9]+)"
_NUMERIC = re.compile(rf"{_NUMBER}(?:\.{_NUMBER}){{0,3}}")


def ordinary_url(value: str | None, local: bool = False) -> str | None:
    """None when `value` is an ordinary URL of a remote repository: https://, http://, ssh://,
    git://, or scp-like `user@host:path`; with `local`, also a path or file://. Else what is
    wrong: a `<transport>::` form (`ext::`, `fd::`: git runs `git-remote-<transport>`, ext:: a
    shell command), another scheme (git runs `git-remote-<scheme>`), an option (`-...`),
    control characters; and without `local` a path, file:// or ssh to this machine (`git push`
    there runs the receiving repository's hooks, which the agent may have written)."""
    if not value:
        return "is not an ordinary URL (it is empty)"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return "is not an ordinary URL (it holds a control character)"
    if value.startswith("-"):
        return "is not an ordinary URL (it starts with '-', which a program takes for an option)"
    if "::" in value:
        return (
            "is not an ordinary URL: '<transport>::' makes git run the program "
            "git-remote-<transport> (ext:: runs any command)"
        )
    scheme = _SCHEME.match(value)
    ssh = True
    if scheme is not None:
        name = scheme[1].lower()
        if name == "file" and local:
            return None
        if name not in _NETWORK_SCHEMES:
            if name == "file":
                return _LOCAL
            return (
                f"is not an ordinary URL: for {scheme[1]}:// git runs the program "
                f"git-remote-{scheme[1]}"
            )
        ssh = name in _SSH_SCHEMES
        where = value[scheme.end() :].split("/", 1)[0]
    else:
        colon, slash = value.find(":"), value.find("/")
        if colon < 0 or 0 <= slash < colon:
            return None if local else _LOCAL  # a path
        where = value[:colon]  # scp-like: [user@]host:path, over ssh
    host = where.rsplit("@", 1)[-1]
    if where.startswith("-") or host.lstrip("[").startswith("-"):
        return "is not an ordinary URL (its user or host starts with '-', an option to ssh)"
    if ssh and not local and _this_machine(host):
        return _LOCAL
    return None


def _this_machine(host: str) -> bool:
    """Whether `host` (of [user@]host[:port]) names this machine as written: localhost, a
    loopback or unspecified address, or a number in a form only a resolver reads. (A name
    that resolves to this machine is not seen: see SECURITY.md, what `run` does not block.)"""
    host = host[1:].split("]", 1)[0] if host.startswith("[") else host.split(":", 1)[0]
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith((".localhost", ".localdomain")):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return _NUMERIC.fullmatch(name) is not None
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or address.is_unspecified or bool(mapped and mapped.is_loopback)


_LOCAL = (
    "is a repository on this machine: git push there runs that repository's hooks, which the "
    "agent may have written (add it outside the sandbox)"
)


def _local_url(value: str | None) -> str | None:
    """A submodule's URL: a path too (cloning runs no hook of the source repository)."""
    return ordinary_url(value, local=True)


def _remote(value: str | None) -> str | None:
    """A branch's remote: "." (this repository), a remote's name, or a URL as ordinary_url."""
    if value is not None and (value == "." or _REMOTE_NAME.fullmatch(value)) and value != "..":
        return None
    return ordinary_url(value)


def _one_of(*allowed: str) -> Check:
    def check(value: str | None) -> str | None:
        if value in allowed:
            return None
        return f"is not one of {', '.join(allowed)}"

    return check


def _version(value: str | None) -> str | None:
    return None if value in ("0", "1") else "is not 0 or 1"


def _fetch_refspec(value: str | None) -> str | None:
    """A fetch refspec that updates remote-tracking refs only (refs/remotes/...), or none (a
    negative one, or FETCH_HEAD): never your branches or tags, which `git fetch` would then
    overwrite with whatever the remote holds."""
    if not value:
        return "is not a refspec"
    spec = value.removeprefix("+")
    if spec.startswith("^") or ":" not in spec:
        return None
    dst = spec.split(":", 1)[1]
    if dst == "" or dst.startswith("refs/remotes/"):
        return None
    return "would let git fetch overwrite refs other than refs/remotes/ (your branches or tags)"


# (section, whether it has a subsection) -> key -> check of a new value (None: any value).
# Keys are lower-case, as git reads them. Everything not here is refused when added or changed:
# also what only hides changes from you (status.showUntrackedFiles, submodule.*.ignore, sparse
# checkout), pushes or deletes more than you asked (remote.*.push, mirror), drops tags
# (pruneTags) or applies recorded resolutions (rerere: .git/rr-cache is writable).
ALLOWED: Mapping[tuple[str, bool], Mapping[str, Check | None]] = {
    ("core", False): {
        "repositoryformatversion": _version,
        "filemode": None,
        "bare": None,
        "logallrefupdates": None,
        "ignorecase": None,
        "precomposeunicode": None,
        "symlinks": None,
        "autocrlf": None,
        "safecrlf": None,
        "eol": None,
        "quotepath": None,
    },
    ("extensions", False): {"objectformat": None, "worktreeconfig": None, "refstorage": None},
    ("user", False): {"name": None, "email": None, "signingkey": None},
    ("author", False): {"name": None, "email": None},
    ("committer", False): {"name": None, "email": None},
    ("init", False): {"defaultbranch": None},
    ("branch", False): {"autosetupmerge": None, "autosetuprebase": None},
    ("branch", True): {
        "remote": _remote,  # a remote's name, or a URL git fetches from directly
        "pushremote": _remote,
        "merge": None,
        "rebase": None,
        "description": None,
    },
    ("remote", False): {"pushdefault": _remote},
    ("remote", True): {
        "url": ordinary_url,
        "pushurl": ordinary_url,
        "fetch": _fetch_refspec,
        "tagopt": _one_of("--tags", "--no-tags"),
        "prune": None,
        "skipdefaultupdate": None,
        "skipfetchall": None,
    },
    ("submodule", True): {
        "url": _local_url,
        "active": None,
        "update": _one_of("checkout", "rebase", "merge", "none"),  # not "!command"
        "branch": None,
        "fetchrecursesubmodules": None,
        "shallow": None,
    },
    ("pull", False): {"rebase": None, "ff": None},
    ("push", False): {"default": None, "autosetupremote": None, "followtags": None},
    ("fetch", False): {"prune": None},
    ("merge", False): {"ff": None, "conflictstyle": None},
    ("rebase", False): {"autosquash": None, "autostash": None, "updaterefs": None},
    ("gc", False): {"auto": None},
    ("lfs", False): {"repositoryformatversion": None},  # `git lfs install`
}
# Sections whose every key (without a subsection) is allowed: hints only.
_ANY_KEY = frozenset({"advice"})

_RUNS = "would make git run a program"
_WHY_SECTION = {
    "alias": _RUNS,
    "filter": _RUNS,
    "credential": _RUNS,
    "gpg": _RUNS,
    "pager": _RUNS,
    "difftool": _RUNS,
    "mergetool": _RUNS,
    "sequence": _RUNS,
    "interactive": _RUNS,
    "uploadpack": _RUNS,
    "receive": _RUNS,
    "include": "would make git read settings from another file",
    "includeif": "would make git read settings from another file",
    "url": "would change where git connects",
    "http": "would change where git connects or what it sends",
    "protocol": "would change which transports git allows",
}
_WHY_KEY = {
    ("core", "fsmonitor"): _RUNS,
    ("core", "hookspath"): "would make git run hooks from another directory",
    ("core", "sshcommand"): _RUNS,
    ("core", "editor"): _RUNS,
    ("core", "pager"): _RUNS,
    ("core", "askpass"): _RUNS,
    ("core", "gitproxy"): _RUNS,
    ("core", "alternaterefscommand"): _RUNS,
    ("core", "worktree"): "would point git's work tree elsewhere",
    ("core", "excludesfile"): "would make git read another file",
    ("core", "attributesfile"): "would make git read another file",
    ("remote", "uploadpack"): _RUNS,
    ("remote", "receivepack"): _RUNS,
    ("remote", "vcs"): _RUNS,
    ("remote", "proxy"): "would change where git connects",
}
_RUNNING_KEYS = frozenset({"program", "command", "cmd", "driver", "textconv", "helper", "hook"})


def _rule(entry: Entry) -> tuple[bool, Check | None]:
    """Whether the setting may be added or changed, and the check of its new value."""
    section, sub, key = entry.parts
    if section in _ANY_KEY and sub is None:
        return True, None
    keys = ALLOWED.get((section, sub is not None))
    if keys is None or key not in keys:
        return False, None
    return True, keys[key]


def _why(entry: Entry) -> str:
    section, _sub, key = entry.parts
    why = _WHY_KEY.get((section, key)) or _WHY_SECTION.get(section)
    if why is None and (key in _RUNNING_KEYS or key.endswith(("cmd", "command", "program"))):
        why = _RUNS
    return why or "is not among the settings the sandbox may add or change"


def shown(entry: Entry) -> str:
    """The setting as `git config` names it."""
    section, sub, key = entry.parts
    return f"{section}.{_printable(sub)}.{key}" if sub is not None else entry.name


def _printable(text: str, limit: int = 80) -> str:
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a new config is refused; `key` the setting refused (as `git config` names it), ""
    when the content as a whole is."""

    key: str
    reason: str


def judge(old: bytes, new: bytes) -> Refusal | None:
    """Whether the config `new` may replace `old` (b"" when there was none): None when every
    setting it adds or changes is allowed (ALLOWED, with its value's check); removed ones are
    fine, and so is every setting of `old` kept as it was, in its order. An `old` git cannot
    read counts as empty."""
    if len(new) > MAX_CONFIG_BYTES:
        return Refusal("", f"the new content is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        after = parse(new)
    except ConfigSyntaxError as exc:
        return Refusal("", f"git could not read the new content ({exc})")
    try:
        before = parse(old)
    except ConfigSyntaxError:
        before = []
    kept = Counter((e.name, e.value) for e in before if _rule(e)[0])
    # Settings the sandbox may not add or change must be the user's own, in their order: git
    # takes the last value of a key, and an include's place decides what it overrides.
    theirs = [(e.name, e.value) for e in before if not _rule(e)[0]]
    at = 0
    for entry in after:
        allowed, check = _rule(entry)
        setting = (entry.name, entry.value)
        if allowed:
            if kept[setting] > 0:
                kept[setting] -= 1
                continue
            problem = check(entry.value) if check is not None else None
            if problem is not None:
                value = _printable(entry.value or "")
                return Refusal(shown(entry), f"{shown(entry)} = '{value}' {problem}")
            continue
        while at < len(theirs) and theirs[at] != setting:
            at += 1
        if at == len(theirs):
            return Refusal(shown(entry), f"{shown(entry)} {_why(entry)}")
        at += 1
    return None


def read_bounded(
    dir_fd: int, name: bytes, expect: tuple[int, int] | None, limit: int = MAX_CONFIG_BYTES
) -> bytes | None:
    """The content of the regular file `name` in `dir_fd`, never following a link: None when
    absent, not a regular file, larger than `limit`, or not the file `expect`
    ((st_dev, st_ino)) names."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        return None  # never open anything else: opening a device can act on it
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        if expect is not None and (st.st_dev, st.st_ino) != expect:
            return None
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            chunk = os.pread(fd, limit + 1 - total, total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks) if total <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)
