"""examples/fsdp_train.py runs as docs/distributed.md shows it (2 ranks on CPU with gloo,
through torchrun): trained, saved with DCP halfway, resumed, and identical to the uninterrupted
run, with bf16 parameters and 24-bit master weights and with another update rule."""

import os
import pathlib
import subprocess
import sys

import pytest
from helpers import free_port

# Slow tier: each example is a 2-rank torchrun of its own.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("flags", [["--param-dtype", "bfloat16", "--master-weight-bits", "24"],
                                   ["--optimizer", "AdEMAMix8bit"]], ids=["bf16-master-weights", "ademamix"])
def test_fsdp_example_resumes_identically(tmp_path, flags):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()),
         str(ROOT / "examples" / "fsdp_train.py"), "--steps", "4", "--checkpoint", str(tmp_path / "ckpt"),
         *flags],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "PYTHONPATH": path})
    assert done.returncode == 0, f"stdout: {done.stdout[-1000:]}\nstderr: {done.stderr[-3000:]}"
    assert "identical: True" in done.stdout
