"""The manual builds strict and clean, and its generated reference pages match the code."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from sandboxfs.cli import docs, manpage
from sandboxfs.cli.main import build_parser
from sandboxfs.config import model
from sandboxfs.core.entry import AuditOp

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"


def test_the_reference_pages_are_what_the_code_generates() -> None:
    stale = docs.stale(REFERENCE, write=False)
    assert not stale, (
        f"docs/reference/ is stale ({', '.join(stale)}): run .venv/bin/python -m sandboxfs.cli.docs"
    )


def test_the_generator_rewrites_a_stale_page(tmp_path: Path) -> None:
    assert docs.stale(tmp_path, write=True) == sorted(docs.pages(), key=list(docs.pages()).index)
    (tmp_path / "cli.md").write_text("edited by hand\n")
    assert docs.stale(tmp_path, write=False) == ["cli.md"]
    assert docs.main(["--check", "--dir", str(tmp_path)]) == 1
    assert docs.main(["--dir", str(tmp_path)]) == 0
    assert docs.stale(tmp_path, write=False) == []


def test_every_subcommand_and_option_is_in_the_cli_reference() -> None:
    text = (REFERENCE / "cli.md").read_text()
    parser = build_parser()
    for path, node, _ in manpage.walk(parser):
        assert f"sandboxfs {' '.join(path)}".strip() in text
        for action in node._actions:
            if action.help == argparse.SUPPRESS:  # hidden from --help too
                continue
            for option in action.option_strings:
                assert option in text, (path, option)


def test_every_config_key_and_audit_op_is_named() -> None:
    config = (REFERENCE / "config.md").read_text()
    for name in model.ProjectConfig.model_fields:
        assert f"| `{name}` |" in config, name
    for name in model.CacheConfig.model_fields:
        assert f"| `cache.{name}` |" in config, name
    ops = (REFERENCE / "audit-ops.md").read_text()
    for op in AuditOp:
        assert f"| `{op.value}` |" in ops, op


def test_mkdocs_builds_strict(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert not warnings, warnings
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()


def test_the_readme_keeps_the_set_up_and_test_commands_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    quick_start = readme[readme.index("## Quick start") :]
    quick_start = quick_start[: quick_start.index("\n## ", 1)]
    for command in (
        "bash .ci/setup && .venv/bin/sandboxfs run --trust untrusted -- bash",
        "bash .ci/setup && mkdir -p mnt && .venv/bin/sandboxfs mount mnt --trust untrusted",
        "bash .ci/setup --test && .venv/bin/python -m pytest",
    ):
        assert f"\n{command}\n" in quick_start, command
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\nbash .ci/setup --test && .venv/bin/python -m pytest || rc=$?\n" in ci


def test_the_readme_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert local, "the README links to the manual"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing
    pages = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")}
    assert pages <= set(local), pages - set(local)  # every manual page is linked
