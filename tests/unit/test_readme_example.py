"""The manual's Python API example runs, and prints what the manual says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"


def test_python_api_example_prints_what_the_manual_shows() -> None:
    section = PAGE.read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", section, re.S)
    shown = re.search(r"prints\n\n```text\n(.*?)```", section, re.S)
    assert code is not None and shown is not None
    result = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    staged_id = re.compile(r"/staged/\d{8}T\d{6}Z-[0-9a-f]{6}")
    assert staged_id.sub("/staged/ID", result.stdout) == staged_id.sub("/staged/ID", shown.group(1))
