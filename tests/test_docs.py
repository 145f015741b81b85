"""The documentation's complete examples run as written.

Only the pages whose every ``python`` block is a whole program are listed; other pages
continue one example across blocks (``model`` from the block before). A page's examples run in
one fresh interpreter, one after another, each as ``python -c`` would run it (its own globals,
``__name__ == "__main__"``) in an empty folder of its own, as a reader would run it: the files
an example writes (checkpoint.pt, out/) land there, not in the repository. One interpreter per
page, not per example, pays torch's import once per page.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
COMPLETE_PAGES = ("usage.md", "triton.md", "gradient_release.md", "cpu_kernel.md", "muon.md")

# Runs the examples given as JSON on stdin, each in its folder; on the first that raises, prints
# which one and its traceback, and exits with status 1.
RUNNER = """
import json, os, sys, traceback
for index, (code, folder) in enumerate(json.load(sys.stdin)):
    os.chdir(folder)
    try:
        exec(compile(code, f"<example {index}>", "exec"), {"__name__": "__main__"})
    except BaseException:
        sys.stdout.flush()
        print(f"example {index} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def examples(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


# Slow tier: fresh interpreters, and examples that train.
@pytest.mark.slow
@pytest.mark.parametrize("page", COMPLETE_PAGES)
def test_documented_examples_run(page, tmp_path):
    codes = examples(page)
    assert codes, f"{page} has no python example"
    folders = [tmp_path / f"example-{index}" for index in range(len(codes))]
    for folder in folders:
        folder.mkdir()
    # The package is found through PYTHONPATH, as the tests find it.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    runs = json.dumps(list(zip(codes, map(str, folders))))
    done = subprocess.run([sys.executable, "-c", RUNNER], input=runs, capture_output=True, text=True,
                          timeout=900, cwd=tmp_path, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("page", COMPLETE_PAGES)
def test_an_example_that_checks_a_result_prints_it(page):
    """A reader running an example that checks a result sees the result, not silence."""
    silent = [index for index, code in enumerate(examples(page))
              if "assert " in code and "print(" not in code]
    assert not silent, f"{page}: examples {silent} assert a result but print nothing"
