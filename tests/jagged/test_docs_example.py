"""The worked example of docs/jagged.md runs as written, and prints what the page shows."""
import pathlib
import re

import pytest

pytest.importorskip("torchrec")

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "jagged.md"


def test_docs_example_runs(capsys):
    text = DOC.read_text()
    code = re.search(r"<!-- example:begin -->\n```python\n(.*?)```\n<!-- example:end -->", text, re.S).group(1)
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_example"})
    printed = capsys.readouterr().out.strip().splitlines()
    shown = re.search(r"Printed \(CPU, reference backend\):\n\n```\n(.*?)```", text, re.S).group(1).strip().splitlines()
    assert printed == shown
