"""Credentials found by their contents, in the package managers' config files.

`.npmrc`, `.yarnrc.yml`, `.pypirc`, `pip.conf` and the like are config files the project's own
tools must read (`package-lock=false`, an index URL, a registry scope), and they are committed;
what makes one a secret is a credential written in it. So such a file is refused only when it
holds one (sandboxfs.core.secrets scans it as it scans a `*.pem` for a private key):

- a value of a key that names a credential (npm's `_authToken`, `_auth`, `_password`, also
  scoped as `//registry/:_authToken`; yarn's `npmAuthToken`, `npmAuthIdent`; `.pypirc`'s
  `password`; any `token`, `password`, `secret` or `api_key`), in `key = value` or
  `key: value` form;
- a URL with a password in it (`https://user:secret@host/...`, pip's index URLs).

A value that only names an environment variable (`${NPM_TOKEN}`, `$TOKEN`) is no credential:
the secret lives in the environment, not in the file. Not found: a credential under a key not
listed here, or after the first bytes the scanner reads (add the file's name to `deny:`).
"""

from __future__ import annotations

import re

# key = value / key: value, the key possibly scoped ("//registry.npmjs.org/:_authToken").
_KEYED = re.compile(
    rb"""^[ \t]*(?:[^\s=#;]*:)?(?:[\w.-]*[_.-])?"""
    rb"""(_authToken|_auth|_password|npmAuthToken|npmAuthIdent|password|passwd|token"""
    rb"""|secret|api[_-]?key|access[_-]?token)"""
    rb"""[ \t]*[=:][ \t]*["']?([^\s"'#;]+)""",
    re.IGNORECASE | re.MULTILINE,
)
# scheme://user:password@ (the password part non-empty).
_URL_PASSWORD = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:([^/\s@]+)@")


def _literal(value: bytes) -> bool:
    """Whether a value is the secret itself rather than a reference to the environment."""
    return not value.startswith(b"$")


def credential_in(data: bytes) -> str | None:
    """What credential `data` (a config file's first bytes) holds, in words, or None. The
    words name the key, never the value."""
    for found in _KEYED.finditer(data):
        if _literal(found.group(2)):
            key = found.group(1).decode("ascii")
            return f"a credential (a value for {key!r})"
    for found in _URL_PASSWORD.finditer(data):
        if _literal(found.group(1)):
            return "a credential (a URL with a password)"
    return None
