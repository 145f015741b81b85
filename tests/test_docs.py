"""The documentation's complete examples run as written (each in a fresh interpreter).

Only the pages whose every ``python`` block is a whole program are listed; other pages
continue one example across blocks (``model`` from the block before).
"""

import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
COMPLETE_PAGES = ("usage.md", "triton.md", "cpu_kernel.md")


def examples():
    for page in COMPLETE_PAGES:
        blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)
        for index, code in enumerate(blocks):
            yield pytest.param(code, id=f"{page}-{index}")


@pytest.mark.parametrize("code", examples())
def test_documented_example_runs(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=DOCS.parent)
    assert done.returncode == 0, done.stderr[-3000:]
