"""The documentation's complete examples run as written (each in a fresh interpreter).

Only the pages whose every ``python`` block is a whole program are listed; other pages
continue one example across blocks (``model`` from the block before).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

# Slow tier: each example runs in a fresh interpreter (an import of torch each).
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
COMPLETE_PAGES = ("usage.md", "triton.md", "gradient_release.md", "cpu_kernel.md", "muon.md")


def examples() -> list:
    return [pytest.param(code, id=f"{page}-{index}") for page in COMPLETE_PAGES
            for index, code in enumerate(re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S))]


@pytest.mark.parametrize("code", examples())
def test_documented_example_runs(code, tmp_path):
    # In an empty folder, as a reader would run it: the files an example writes
    # (checkpoint.pt, out/) land there, not in the repository. The package is found through
    # PYTHONPATH, as the tests find it.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]
    # A reader running an example that checks a result sees the result, not silence.
    if "assert " in code and "print(" not in code:
        pytest.fail("the example asserts a result but prints nothing")
