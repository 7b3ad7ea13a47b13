"""Credentials found by their contents in package managers' config files."""

from __future__ import annotations

import pytest

from sandboxfs.core.credentials import credential_in


@pytest.mark.parametrize(
    "text",
    [
        "//registry.npmjs.org/:_authToken=npm_abcdefghijklmnop\n",
        'registry=https://r.example/\n//localhost:4873/:_authToken="s3cret"\n',
        "_auth=dXNlcjpwYXNz\n",
        "//r.example/:_password=cGFzcw==\n",
        'npmRegistries:\n  "//npm.pkg.github.com":\n    npmAuthToken: ghp_abc\n',
        "npmAuthIdent: user:pass\n",
        "[pypi]\nusername = __token__\npassword = pypi-AgEIcHlwaS5vcmc\n",
        "[global]\nindex-url = https://__token__:glpat-xyz@gitlab.example/api/simple\n",
        "extra-index-url=https://user:pw@pypi.example/simple\n",
        "db_password: hunter2\n",
    ],
)
def test_a_literal_credential_is_found_and_named_by_its_key_not_its_value(text: str) -> None:
    found = credential_in(text.encode())
    assert found is not None
    for secret in ("npm_abc", "s3cret", "dXNlcj", "cGFzcw", "ghp_abc", "pypi-Ag", "glpat", "pw@"):
        assert secret not in found


@pytest.mark.parametrize(
    "text",
    [
        "package-lock=false\nsave-exact=true\n",
        "//registry.npmjs.org/:_authToken=${NPM_TOKEN}\n",
        'npmAuthToken: "${NPM_TOKEN}"\n',
        "# _authToken=commented-out\n; password = old\n",
        "[pypi]\nusername = __token__\npassword =\n",
        "[global]\nindex-url = https://pypi.example/simple\ntimeout = 60\n",
        "registry=http://[::1]:8080/\nhttps-proxy=http://proxy@corp.example:3128/\n",
        "tokenizer=fast\npasswords_file=none\n",
        "",
    ],
)
def test_config_without_a_credential_is_not_a_secret(text: str) -> None:
    assert credential_in(text.encode()) is None
