"""`Sandbox`: the in-process Python API, with the mount's rules and audit entries.

Every operation goes through the gate (sandboxfs.core.gate) as the FUSE adapter's does: a
lookup per component (`Gate.lookup`), then the operation's own method (`open`, `replace`,
`create`, `make`, `opendir`, `remove`, `rename`), which runs the rules in their one order,
charges and refunds sizes and quotas, calls the backend and records the entry. The backends
(disk.py, memory.py) only find, read, write, create, list, remove and rename. Permission
questions (`check_permission`, `can_read`, `can_write`) run the same checks through the same
gate without effect (`Gate.without_effect`): nothing audited, charged or changed.

The node-level steps under the operations (lookups, each operation's checks, creating) are
in nodes.py, which `Sandbox` builds on; the approver's plumbing is in approver.py.

Not thread-safe by itself (the core's statx buffer is shared): every call holds one lock.
"""

from __future__ import annotations

import builtins
import codecs
import contextlib
import errno
import fnmatch
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from sandboxfs.config.model import Config, defaults, load
from sandboxfs.core.approvals import Mode
from sandboxfs.core.entry import AuditOp
from sandboxfs.project.zones import approval_broker, new_session_id, validate_project

from ..core.context import context
from ..core.errors import SandboxError
from ..core.gate import Gate
from ..core.guard import Guard
from ..core.inodes import FIRST_DYNAMIC_INO, Node, StatLike
from ..core.policy import ZONE_ROOT_REASON, Decision, Op, Trust, Zone
from ..errors import SandboxfsError, UserError
from ..project.workers import (
    WiderThanParent,
    Worker,
    attach,
    attachment_names,
    discard_attachments,
    find,
    narrow,
)
from . import tools as tool_defs
from .approver import NO_APPROVER, Approver, answering
from .arguments import (
    Call,
    VirtualPath,
    as_bytes,
    as_limit,
    as_trust,
    parse_path,
    repo_parts,
    shown,
)
from .disk import check_id, open_disk, read_entries
from .errors import (
    InvalidPath,
    OutsideSandbox,
    PermissionDenied,
    SandboxAPIError,
    SandboxIOError,
    SandboxSetupError,
    WorkerRefused,
    api_error,
    make_error,
)
from .memory import MemoryBackend, MemorySink, memory_guard, open_memory
from .nodes import NodeSteps
from .types import Backend, Caller, ClosableSink, FileInfo, Permission, StagedCommit

_LOCK = threading.RLock()
_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}
_OPS = {op.value: op for op in Op}
# The actions that change a path (what `stage` can do instead, for the repository).
_CHANGES = ("write", "append to", "create directory", "rename", "check write on")
STAGE_HINT = (
    "to change the repository, propose the change with stage: it goes to /staged/<id>/ for "
    "the user to review and commit"
)


def _in_repo(path: str | None) -> bool:
    return path is not None and (path == "/repo" or path.startswith("/repo/"))


def _worker_error(exc: UserError) -> WorkerRefused:
    err = errno.EACCES if isinstance(exc, WiderThanParent) else errno.EINVAL
    message = f"Cannot restrict the sandbox: {exc.message}"
    return WorkerRefused(message, errno=err, reason=exc.message)


def _setup_error(exc: SandboxfsError | SandboxError | OSError) -> SandboxSetupError:
    if isinstance(exc, SandboxfsError):
        message = exc.message
    elif isinstance(exc, SandboxError):
        message = exc.reason or os.strerror(exc.errno)
    else:
        message = str(exc)
    err = getattr(exc, "errno", None) or errno.EINVAL
    return SandboxSetupError(f"Cannot open the sandbox: {message}", errno=err, reason=message)


# What each API call is audited as when the audit log refuses it (fail closed, as the mount).
_AUDITED_AS = {
    "read": AuditOp.READ,
    "list": AuditOp.LIST,
    "write": AuditOp.WRITE,
    "append to": AuditOp.WRITE,
    "create directory": AuditOp.MKDIR,
    "delete": AuditOp.DELETE,
    "rename": AuditOp.RENAME,
    "stage": AuditOp.STAGE,
}


class Sandbox(NodeSteps):
    """A view of a project's zones at one trust level, enforced and audited like a mount.

    Build one with `Sandbox.open(project)` (the project's files) or `Sandbox.memory()`.
    """

    def __init__(
        self,
        backend: Backend,
        guard: Guard,
        audit: ClosableSink,
        entries: Callable[[], list[dict[str, Any]]],
        project: Path | None = None,
        config: Config | None = None,
        config_file: Path | None = None,
        audit_sync: bool = False,
        owns_backend: bool = True,
    ) -> None:
        self._backend = backend
        # How it was built, for a worker's narrower sandbox beside it (restrict).
        self._config = config if config is not None else defaults()
        self._config_file = config_file
        self._audit_sync = audit_sync
        self._owns_backend = owns_backend
        self._owns_attachments = False  # made by restrict for this one: removed at close
        # The approver given to open, and its timeout: a worker's sandbox asks it too.
        self._approval: tuple[Approver, float | None] | None = None
        self._guard = guard
        self._audit = audit
        self._entries = entries
        self.project = project
        self._gate = Gate(guard, backend, guard.effects)
        self._caller = Caller(os.getpid(), os.getuid(), os.getgid())
        self._zone_names = {zone.value: zone for zone in guard.policy.zones}
        self._held: list[Node] = []
        self._opened = time.time()
        self._closed = False

    # ----- building ---------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        project: str | os.PathLike[str],
        *,
        trust: str | Trust | None = None,
        workspace: str = "default",
        session: str | None = None,
        config: str | os.PathLike[str] | None = None,
        audit_sync: bool = False,
        worker: str | None = None,
        approver: Approver | None = None,
        approval_timeout: float | None = None,
    ) -> Sandbox:
        """A sandbox on the project's files (disk backend); its entries go to the project's
        audit log. `session`: None starts a new one; a given id is created if missing.
        `worker`: narrowed to what `<worker>.worker` declares (sandboxfs.project.workers), under
        a parent at `trust`; WorkerRefused when it asks more.

        `approver`: asked when an approval rule (the config's `approvals:`) asks about an
        operation: called with the request (a dict: id, op, path, zone, rule, rule_text, pid,
        cmdline, and `grants`, the text of each possible answer) and returns an answer:
        "once", "dir", "everywhere", "deny" or "never" (True: once; False or None: deny). It
        is called in the calling thread's stead and given `approval_timeout` seconds (default:
        the config's approvals.timeout); no answer in time refuses. Without an approver such
        an operation raises ApprovalRequired. A worker's sandbox made by `restrict` asks the
        same approver."""
        check_id("workspace", workspace)
        session_id = check_id("session", session) if session is not None else new_session_id()
        try:
            root = validate_project(Path(project), discover=False)
            config_file = Path(config).absolute() if config is not None else None
            loaded = load(root, config_file)
        except SandboxfsError as exc:
            raise _setup_error(exc) from None
        level = as_trust(trust, loaded.default_trust)
        if worker is not None:
            try:
                loaded = narrow(loaded, level, find(root, worker, loaded))
            except UserError as exc:
                raise _worker_error(exc) from None
        return cls.on_disk(
            root,
            loaded,
            config_file,
            level,
            workspace,
            session_id,
            audit_sync,
            approver=approver,
            approval_timeout=approval_timeout,
        )

    @classmethod
    def on_disk(
        cls,
        root: Path,
        config: Config,
        config_file: Path | None,
        level: Trust,
        workspace: str,
        session_id: str,
        audit_sync: bool = False,
        *,
        approver: Approver | None = None,
        approval_timeout: float | None = None,
    ) -> Sandbox:
        """A sandbox on `root` (validated) with `config` as given (the CLI's, with a run's
        zones): what `open` and `restrict` build."""
        try:
            mode = Mode.ASK if approver is not None else Mode.NONE
            broker = approval_broker(config, mode, NO_APPROVER)
            backend, guard, audit = open_disk(
                root, config, config_file, level, workspace, session_id, audit_sync, broker
            )
        except (SandboxfsError, SandboxError, OSError) as exc:
            raise _setup_error(exc) from None
        if approver is not None:
            wait = approval_timeout if approval_timeout is not None else broker.timeout
            guard.effects.consent.approver = answering(approver, wait)
        made = cls(
            backend,
            guard,
            audit,
            lambda: read_entries(root, session_id, workspace),
            root,
            config,
            config_file,
            audit_sync,
        )
        if approver is not None:
            made._approval = (approver, approval_timeout)
        return made

    def restrict(
        self,
        declaration: Worker | Mapping[str, str] | str | None,
        *,
        name: str = "child",
        attachments: Sequence[str] = (),
    ) -> Sandbox:
        """A worker's sandbox beside this one (seed 001's RestrictedSandbox): the same
        project or memory, session and trust level, with exactly the zones `declaration` asks
        and at most their modes. `declaration`: a Worker, a mapping of zone to "ro"/"rw" (the
        worker called `name`), the name of a worker of the project's workers layers, or None
        (no zones at all). WorkerRefused when it asks more than this sandbox has. Closing it
        leaves this one open.

        `attachments`: virtual paths of files this sandbox may read (each read here, checked
        and audited as any read: PermissionDenied, NotFound... otherwise), given to the child
        read-only as /attachments/<name> (copies; a sandbox on disk only)."""
        try:
            if isinstance(declaration, Worker):
                worker = declaration
            elif isinstance(declaration, str):
                if self.project is None:
                    raise UserError("a memory sandbox has no workers layers; pass a mapping")
                worker = find(self.project, declaration, self._config)
            else:
                worker = Worker.declare(name, declaration)
            config = narrow(self._config, self.trust, worker)
            named = attachment_names(list(attachments))
            if named and self.project is None:
                raise UserError("attachments need a sandbox on disk (Sandbox.open)")
        except UserError as exc:
            raise _worker_error(exc) from None
        if named and self.project is not None:
            files = {name: self.read_bytes(path) for name, path in named.items()}
            try:
                config = attach(config, self.project, self.workspace, files)
            except UserError as exc:
                raise _worker_error(exc) from None
            try:
                child = self._worker_on_disk(config)
            except BaseException:
                discard_attachments(config)
                raise
            child._owns_attachments = True
            return child
        if self.project is None:
            assert isinstance(self._backend, MemoryBackend)
            assert isinstance(self._audit, MemorySink)
            sink = self._audit
            guard = memory_guard(
                config, self.trust, self.session, self.workspace, self._backend, sink
            )
            return type(self)(
                self._backend,
                guard,
                sink,
                lambda: [dict(e) for e in sink.entries],
                None,
                config,
                owns_backend=False,
            )
        return self._worker_on_disk(config)

    def _worker_on_disk(self, config: Config) -> Sandbox:
        """A worker's sandbox on this one's project and session, asking this one's approver."""
        assert self.project is not None
        approver, timeout = self._approval if self._approval is not None else (None, None)
        return self.on_disk(
            self.project,
            config,
            self._config_file,
            self.trust,
            self.workspace,
            self.session,
            self._audit_sync,
            approver=approver,
            approval_timeout=timeout,
        )

    @classmethod
    def memory(
        cls,
        *,
        trust: str | Trust | None = None,
        files: Mapping[str, str | bytes] | None = None,
        config: Config | None = None,
        session: str = "memory",
        workspace: str = "default",
    ) -> Sandbox:
        """A sandbox whose zones live in memory, holding `files` (virtual path -> content,
        created before it starts, unchecked and unaudited); its entries are kept in a list."""
        check_id("workspace", workspace)
        check_id("session", session)
        if config is None:
            config = defaults()
        elif not isinstance(config, Config):
            raise TypeError(f"config must be a sandboxfs.config.model.Config, not {type(config)}")
        level = as_trust(trust, config.default_trust)
        names = {zone.value: zone for zone in config.zone_list()}
        seeds = []
        for key, content in (files or {}).items():
            path = parse_path(key, names, "create")
            if path.zone is None or not path.parts:
                reason = "only files inside a zone can be given"
                raise make_error(InvalidPath, "create", path.text, reason, errno.EINVAL)
            seeds.append((path.zone, path.parts, as_bytes(content)))
        backend, guard, sink = open_memory(config, level, session, workspace, seeds)
        return cls(backend, guard, sink, lambda: [dict(e) for e in sink.entries], None, config)

    # ----- description ------------------------------------------------------------------------

    @property
    def trust(self) -> Trust:
        return self._guard.policy.trust

    @property
    def session(self) -> str:
        return self._guard.info.session

    @property
    def workspace(self) -> str:
        return self._guard.info.workspace

    @property
    def zones(self) -> list[str]:
        return list(self._zone_names)

    @property
    def worker(self) -> str | None:
        """The worker whose declaration narrowed this sandbox, if any."""
        return self._guard.info.worker

    def __repr__(self) -> str:
        where = str(self.project) if self.project is not None else "memory"
        return f"<Sandbox {where} trust={self.trust.value} session={self.session}>"

    def security_context(self) -> dict[str, Any]:
        """What the mount shows at /.sandboxfs/context.json, with "via": "api"."""
        guard = self._guard
        return context(guard.policy, guard.info, os.getpid(), guard.limits)

    def audit_entries(self) -> list[dict[str, Any]]:
        """This sandbox's audit entries (disk: read back from the project's log)."""
        with _LOCK:
            if not self._closed:
                self._audit.settle()
            return self._entries()

    # ----- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Flush and close the audit log and release every descriptor; later calls do nothing."""
        with _LOCK:
            if self._closed:
                return
            self._closed = True
            try:
                if self._owns_backend:  # a memory worker's sink and backend are its parent's
                    self._audit.close()
            finally:
                self._guard.close()
                if self._owns_backend:
                    self._backend.close()
                if self._owns_attachments:
                    discard_attachments(self._config)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _call(
        self, action: str, path: object, dest: object = None, *, checked: bool = True
    ) -> Iterator[Call]:
        """One API call: under the lock, with every error mapped to the API's exceptions and
        the nodes it remembered released. `checked`: refused while the audit log is failing,
        as the mount refuses audited operations then (it fails closed)."""
        call = Call(action, shown(path), shown(dest))
        with _LOCK:
            if self._closed:
                raise make_error(
                    SandboxIOError, action, call.path, "this sandbox is closed", errno.EBADF
                )
            outer, self._held = self._held, []  # a nested call keeps its caller's nodes
            try:
                if checked:  # as the mount: recorded and refused while the log fails
                    op = _AUDITED_AS.get(action, AuditOp.WRITE)
                    caller = self._caller
                    self._gate.fail_closed(op, call.path, pid=caller.pid, uid=caller.uid)
                yield call
            except (SandboxAPIError, TypeError, ValueError):
                raise
            except (SandboxError, OSError) as exc:
                error = api_error(exc, call.action, call.path, call.dest)
                raise self._stage_hint(error, call.action) from None
            except Exception as exc:
                self._gate.effects.internal_error(f"api {action}", exc)
                reason = f"internal error: {type(exc).__name__}: {exc}"
                raise make_error(SandboxIOError, action, call.path, reason, errno.EIO) from exc
            finally:
                held, self._held = self._held, outer
                for node in held:
                    self._backend.release(node)
                self._audit.try_flush()

    def _path(self, call: Call, path: object, dest: bool = False) -> VirtualPath:
        parsed = parse_path(path, self._zone_names, call.action)
        if dest:
            call.dest = parsed.text
        else:
            call.path = parsed.text
        return parsed

    def _stage_hint(self, exc: SandboxAPIError, action: str) -> SandboxAPIError:
        """A change in /repo that the trust level refuses: say how the repository is changed at
        this level (where it may stage), rather than only what is refused."""
        if (
            not isinstance(exc, PermissionDenied)
            or exc.rule  # the deny list, protected paths...: staging would not help
            or action not in _CHANGES
            or not any(_in_repo(p) for p in (exc.path, exc.dest))
            or Zone.STAGED not in self._guard.policy.zones
            or not self._guard.policy.decide_create(Zone.STAGED).allowed
        ):
            return exc
        reason = f"{exc.reason}; {STAGE_HINT}"
        return make_error(type(exc), action, exc.path, reason, exc.errno, exc.rule, exc.dest)

    # ----- permissions (not audited) ----------------------------------------------------------

    def check_permission(self, op: str | Op, path: str) -> Permission:
        """Whether `op` ("read", "write", "list", "delete") on `path` would be allowed, and
        why not; nothing is audited or changed. Sizes and quotas are not judged."""
        operation = _OPS.get(op) if isinstance(op, str) else op
        if not isinstance(operation, Op):
            raise ValueError(f"unknown operation {op!r}; one of: {', '.join(_OPS)}")
        trust = self.trust.value
        with self._call(f"check {operation.value} on", path, checked=False) as call:
            try:
                p = self._path(call, path)
            except OutsideSandbox as exc:
                name = type(exc).__name__
                return Permission(
                    False, operation.value, exc.path or "", None, trust, exc.reason, name
                )
            zone = p.zone.value if p.zone is not None else None
            try:
                self._probe_op(operation, p)
            except (SandboxError, OSError) as exc:
                refused = self._stage_hint(api_error(exc, operation.value, p.text), call.action)
                reason, name = refused.reason, type(refused).__name__
                return Permission(False, operation.value, p.text, zone, trust, reason, name)
            return Permission(True, operation.value, p.text, zone, trust, "")

    def can_read(self, path: str) -> bool:
        return self.check_permission(Op.READ, path).allowed

    def can_write(self, path: str) -> bool:
        return self.check_permission(Op.WRITE, path).allowed

    def resolve(self, path: str) -> str:
        """The normalized virtual path; InvalidPath or OutsideSandbox if there is none."""
        return parse_path(path, self._zone_names, "resolve").text

    # ----- reading ----------------------------------------------------------------------------

    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes:
        """The file's contents (the first `max_bytes` of them, if given)."""
        limit = as_limit(max_bytes, "max_bytes")
        with self._call("read", path) as call:
            g = self._gate
            node = self._file(g, self._path(call, path), Op.READ)

            def read() -> bytes:
                self._regular(g, Op.READ, node)
                return self._backend.read(node, limit)

            return g.open(self._caller, node, read, read=True, write=False)

    def read_text(self, path: str, max_chars: int | None = None, encoding: str = "utf-8") -> str:
        """The file's text (the first `max_chars` characters, if given); undecodable bytes
        become U+FFFD."""
        limit = as_limit(max_chars, "max_chars")
        try:
            codecs.lookup(encoding)
        except LookupError:
            raise ValueError(f"unknown encoding {encoding!r}") from None
        # No character takes more than 4 bytes in any common encoding (+4 for a BOM).
        data = self.read_bytes(path, None if limit is None else limit * 4 + 4)
        text = data.decode(encoding, errors="replace")
        return text if limit is None else text[:limit]

    def stat(self, path: str) -> FileInfo:
        with self._call("stat", path, checked=False) as call:
            p = self._path(call, path)
            self._refuse_closed_zone(self._gate, p, Op.READ)
            node = self._node(self._gate, p)
            zone = p.zone.value if p.zone is not None else None
            st: StatLike | None = None
            if node.ino >= FIRST_DYNAMIC_INO:
                st = self._backend.stat(node)
            elif p.zone is not None and self._guard.readable(p.zone):
                with contextlib.suppress(SandboxError, OSError):  # the workers root: a union
                    st = self._backend.stat(node)
            if st is None:  # `/`, or a zone root this level cannot read: nothing to show
                return FileInfo(p.text, zone, "dir", 0, self._opened, False)
            kind = _KINDS.get(stat.S_IFMT(st.st_mode), "other")
            mtime = st.st_mtime_ns / 1e9
            return FileInfo(p.text, zone, kind, st.st_size, mtime, node.created_here)

    def list(
        self, path: str = "/", pattern: str | None = None, recursive: bool = False
    ) -> list[str]:
        """Virtual paths of the entries in `path` (and below, if recursive: subdirectories
        this level may not list are skipped), sorted; `pattern` is an fnmatch glob on each
        path relative to `path` ("*" matches "/" too). Listing "/" gives the zones."""
        if pattern is not None and not isinstance(pattern, str):
            raise TypeError(f"pattern must be a str or None, not {type(pattern).__name__}")
        with self._call("list", path) as call:
            p = self._path(call, path)
            g = self._gate
            found: list[str] = []
            pending: list[tuple[Node, str]] = []
            if p.zone is None:
                found, pending = self._zones_listed(g, recursive)
            else:
                pending.append((self._listable(g, p), p.text))
            while pending:
                node, prefix = pending.pop()
                own_only = node.zone is not None and g.guard.reads_own(node.zone)
                for name, is_dir in self._backend.list_entries(node):
                    own = own_only and self._created_here(node, name)
                    if not g.listed(node, name, is_dir, own=own):
                        continue
                    child_path = f"{prefix}/{name.decode('utf-8', 'surrogateescape')}"
                    found.append(child_path)
                    if recursive and is_dir:
                        child = self._descend(g, node, name)
                        if child is not None:
                            pending.append((child, child_path))
            if pattern is not None:
                skip = len(p.text) if p.zone is None else len(p.text) + 1
                found = [f for f in found if fnmatch.fnmatchcase(f[skip:], pattern)]
            return sorted(found)

    # ----- changing ---------------------------------------------------------------------------

    def write(self, path: str, data: str | bytes) -> int:
        """Create the file or replace its contents; returns the bytes written."""
        return self._put("write", path, as_bytes(data), append=False)

    def append(self, path: str, data: str | bytes) -> int:
        """Append to the file (created if missing); returns the bytes written."""
        return self._put("append to", path, as_bytes(data), append=True)

    def _put(self, action: str, path: str, payload: bytes, append: bool) -> int:
        with self._call(action, path) as call:
            g = self._gate
            parent, name, node, _ = self._target(g, self._path(call, path))
            if node is None:
                self._create_file(parent, name, payload)
                return len(payload)
            existing = node

            def write(before: Callable[[int], None]) -> None:
                self._backend.write(existing, payload, append, before)

            def regular() -> None:
                self._regular(g, Op.WRITE, existing)

            g.replace(self._caller, node, len(payload), append, write, check=regular)
            return len(payload)

    def mkdir(self, path: str, parents: bool = False) -> None:
        """Create a directory (with `parents`, also the missing ones above it, and an
        existing directory is fine)."""
        with self._call("create directory", path) as call:
            p = self._path(call, path)
            if p.zone is None or not p.parts:
                if parents:
                    return
                raise SandboxError(errno.EEXIST, f"{p.text} already exists")
            self._refuse_closed_zone(self._gate, p, Op.WRITE, AuditOp.MKDIR)
            node = self._backend.zone_roots[p.zone]
            for name in p.parts[:-1]:
                node = self._ensure_dir(node, name, create=parents, last=False)
            name = p.parts[-1]
            try:
                existing = self._lookup(self._gate, node, name)
            except SandboxError as exc:
                if exc.errno != errno.ENOENT:
                    raise
                existing = None
            if existing is not None:
                if parents and existing.is_dir:
                    return
                kind = "a directory" if existing.is_dir else "not a directory"
                raise SandboxError(errno.EEXIST, f"{p.text} already exists ({kind})")
            self._make_dir(node, name)

    def delete(self, path: str) -> None:
        """Delete a file, or an empty directory."""
        with self._call("delete", path) as call:
            g = self._gate
            parent, name = self._removal(g, self._path(call, path))

            def remove(zone: Zone, st: StatLike, layer: int) -> None:
                self._backend.remove(parent, name, st, layer)

            g.remove(self._caller, parent, name, remove)

    def rename(self, src: str, dst: str) -> None:
        """Move src to dst within one zone (replacing a file, or an empty directory, at dst)."""
        with self._call("rename", src, dst) as call:
            ps, pd = self._path(call, src), self._path(call, dst, dest=True)
            if ps.zone is None or pd.zone is None:
                reason = (
                    ZONE_ROOT_REASON if ps.zone is None else self._guard.policy.root_create_reason
                )
                raise SandboxError(errno.EACCES, reason)
            g, caller = self._gate, self._caller
            for end in (ps, pd):
                self._refuse_closed_zone(g, end, Op.WRITE, AuditOp.RENAME)
            old_parent, old_name = self._seen_parent(g, ps)
            new_parent, new_name = self._parent(g, pd)

            def rename(zone: Zone, src_st: StatLike, layer: int, dst_st: StatLike | None) -> None:
                self._backend.rename(
                    old_parent, old_name, layer, new_parent, new_name, src_st, dst_st
                )

            g.rename(caller, old_parent, old_name, new_parent, new_name, rename)

    # ----- LLM tools (tools.py) ------------------------------------------------------------

    def tools(self) -> builtins.list[dict[str, Any]]:
        """Tool definitions in the common function-calling shape (see api.tools)."""
        return tool_defs.tools(self)

    def anthropic_tools(self) -> builtins.list[dict[str, Any]]:
        return tool_defs.anthropic_tools(self)

    def call_tool(self, name: str, arguments: Mapping[str, Any] | str | None = None) -> str:
        """Run one tool call; its result, or "Error: ..." text for the model. Never raises."""
        return tool_defs.call_tool(self, name, arguments)

    # ----- staging ----------------------------------------------------------------------------

    def stage(self, files: Mapping[str, str | bytes], message: str) -> StagedCommit:
        """Propose changes to the repository: writes /staged/<id>/files/<repo path> for each
        file and /staged/<id>/message.txt. Works at untrusted, where /staged is create-only.
        Every name and size is checked before anything is written."""
        if not isinstance(files, Mapping):
            raise TypeError(f"files must be a mapping, not {type(files).__name__}")
        if not isinstance(message, str):
            raise TypeError(f"message must be a str, not {type(message).__name__}")
        if not files:
            raise ValueError("stage needs at least one file")
        commit_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)
        with self._call("stage", f"/staged/{commit_id}"):
            layout: dict[tuple[bytes, ...], bytes] = {}
            for key, content in files.items():
                parts = repo_parts(key)
                if (b"files", *parts) in layout:
                    reason = "the same repository path is given twice"
                    raise make_error(InvalidPath, "stage", key, reason, errno.EINVAL)
                layout[(b"files", *parts)] = as_bytes(content)
            paths = tuple(
                b"/".join(parts[1:]).decode("utf-8", "surrogateescape") for parts in layout
            )
            layout[(b"message.txt",)] = message.encode("utf-8")
            self._precheck(commit_id.encode(), layout)
            base = self._make_dir(self._backend.zone_roots[Zone.STAGED], commit_id.encode())
            for parts, data in layout.items():
                parent = base
                for name in parts[:-1]:
                    parent = self._ensure_dir(parent, name, create=True, last=False)
                self._create_file(parent, parts[-1], data)
            return StagedCommit(commit_id, f"/staged/{commit_id}", paths, message)

    def _precheck(self, commit_id: bytes, layout: Mapping[tuple[bytes, ...], bytes]) -> None:
        """Run every creation's checks on nodes that do not exist yet, through the permission
        guard; the first refusal is audited (as the write it would have been) and raised."""
        g, caller = self._gate.without_effect(), self._caller
        staged = self._backend.zone_roots[Zone.STAGED]
        dirs: dict[tuple[bytes, ...], Node] = {}

        def check(parent: Node, name: bytes, kind: str, size: int = 0) -> Node:
            try:
                zone = g.check_create(caller, parent, name, kind, size=size)
            except SandboxError as exc:
                decision = Decision(False, exc.errno, exc.reason, exc.rule)
                raise self._gate.refusal(
                    caller, Op.WRITE, parent.vpath(name), parent.zone, decision
                ) from None
            return Node(0, zone, parent, name, kind == "mkdir")

        dirs[()] = check(staged, commit_id, "mkdir")
        for parts, data in layout.items():
            for depth in range(1, len(parts)):
                if parts[:depth] not in dirs:
                    dirs[parts[:depth]] = check(dirs[parts[: depth - 1]], parts[depth - 1], "mkdir")
            check(dirs[parts[:-1]], parts[-1], "file", len(data))
