"""docs/transformers.md's examples run as written, and the report it shows is the one ``convert`` prints.

Oracle: the page's Python blocks executed in order in one namespace; the abridged report's header lines and the
leading columns (module, type, status, kind) of each row it shows, compared with ``str(conversion_report(model))``
of the converted model (rows ending in "..." are compared up to the "...").
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "transformers.md"


def test_examples_run_and_the_report_is_the_printed_one(capsys: pytest.CaptureFixture[str]) -> None:
    text = PAGE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 3, "docs/transformers.md: expected the convert, with_attention and SDPA examples"
    namespace: dict[str, Any] = {"__name__": "docs_transformers"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/transformers.md block {i}", "exec"), namespace)  # noqa: S102
    printed = capsys.readouterr().out.splitlines()
    (shown,) = [b for b in re.findall(r"```text\n(.*?)```", text, re.S) if b.startswith("lowprec conversion")]
    shown_lines = shown.strip().splitlines()
    assert shown_lines[0] == printed[0]
    for line in shown_lines[1:]:
        stem = line.split("...")[0].rstrip() if "..." in line else line
        matches = [p for p in printed if p.startswith(stem)]
        assert matches, f"the page shows {line!r}, which the report does not print"
    assert namespace["loss"].requires_grad and namespace["model"].model.layers[0].mlp.experts.gate_up_proj.grad \
        is not None
