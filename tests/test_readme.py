"""The README is a manual that works: its quickstart runs as written, and it stays short."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_is_a_manual_of_at_most_400_lines():
    assert len(README.read_text().splitlines()) <= 400


def test_the_quickstart_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    text = README.read_text()
    section = text[text.index("## Quickstart"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md (quickstart)", "exec"), {"__name__": "__quickstart__"})
    # (a plan proven optimal, or one with its gap: the joint graph's per-tensor model is larger)
    assert capsys.readouterr().out.split()[0] in ("optimal", "feasible") and (tmp_path / "plan.json").exists()
