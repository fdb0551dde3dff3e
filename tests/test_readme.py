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
    first, native, compiled = re.findall(r"```python\n(.*?)```", section, re.S)[:3]
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "__quickstart__"}
    exec(compile(first, "README.md (quickstart)", "exec"), scope)
    # (a plan proven optimal, or one with its gap: the joint graph's per-tensor model is larger)
    assert capsys.readouterr().out.split()[0] in ("optimal", "feasible") and (tmp_path / "plan.json").exists()
    # the native loop after it, in the same session: the model's own forward, trained by the plan
    exec(compile(native, "README.md (native)", "exec"), scope)
    assert scope["run"].plan.predicted["native_peak_bytes"] <= scope["plan"].budget_bytes
    assert scope["loss"].requires_grad and scope["model"].net.conv1.weight.grad is not None
    # the compiled loop (aot_eager here: the same plan and partition as inductor's, without its
    # C++ compile on CI's two cores)
    capsys.readouterr()
    exec(compile(compiled.replace('backend="inductor"', 'backend="aot_eager"'), "README.md (compiled)", "exec"), scope)
    [region] = scope["compiled_backend"].regions
    assert region.program.peak_bytes <= region.budget_bytes and "region 0" in capsys.readouterr().out
