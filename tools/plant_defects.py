"""Plant one small defect at a time in the package and check that the fast test tier fails.

Each defect is one text substitution in one source file: the math, a quantization map, a C++
kernel functor (the next step rebuilds the kernel, about a minute), checkpoint conversion and a
Triton piece. For each, the file is changed, the fast tier runs with ``-x`` (README's test
command), the first failing test is printed, and the file is restored, whatever happens. It
exits non-zero if a defect was not caught, or if a defect's text is no longer in its file (the
code moved: update ``DEFECTS``).

    python tools/plant_defects.py                        # every defect, the whole fast tier
    python tools/plant_defects.py map kernel             # some of them
    python tools/plant_defects.py math -- tests/test_optimizer.py   # pytest arguments after --
    python tools/plant_defects.py --list
"""

import argparse
import pathlib
import re
import subprocess
import sys
import time
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAST_TIER = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-x", "-p", "no:cacheprovider"]


class Defect(NamedTuple):
    path: str
    original: str
    planted: str
    what: str


DEFECTS = {
    "math": Defect(
        "lowbit_optim/step/math.py",
        "denom = second_moment.sqrt() / bias_correction2_sqrt + eps",
        "denom = (second_moment.sqrt() + eps) / bias_correction2_sqrt",
        "eps added before the bias correction instead of after it"),
    "map": Defect(
        "lowbit_optim/formats/maps.py",
        "values = [torch.tensor([0.0, 1.0])]",
        "values = [torch.tensor([0.0, 0.99])]",
        "the dynamic maps' largest code stands for 0.99 instead of 1"),
    "kernel": Defect(
        "lowbit_optim/step/csrc/rules/adamw.h",
        "return V::add(exp_avg, V::mul(V::set1(one_minus_beta1), V::sub(g, exp_avg)));",
        "return V::add(exp_avg, V::mul(V::set1(one_minus_beta1), V::sub(exp_avg, g)));",
        "the C++ AdamW functor's first moment moves away from the gradient"),
    "checkpoint": Defect(
        "lowbit_optim/checkpoint/convert.py",
        'converted["step"] = torch.as_tensor(entry["step"]).to(',
        'converted["step"] = (torch.as_tensor(entry["step"]) + 1).to(',
        "a torch.optim.AdamW state dict's step count is loaded one too high"),
    "triton": Defect(
        "lowbit_optim/step/rules/lion.py",
        "new_param = param * decay - lr * direction",
        "new_param = param * decay + lr * direction",
        "Lion's Triton piece steps up the sign instead of down"),
}


def plant_and_run(name: str, defect: Defect, pytest_args: list[str]) -> bool:
    """Whether the fast tier fails with ``defect`` planted; the file is restored after."""
    path = ROOT / defect.path
    source = path.read_text()
    if source.count(defect.original) != 1:
        print(f"{name}: the text to change is not (once) in {defect.path}: update DEFECTS", flush=True)
        return False
    print(f"{name}: {defect.what} ({defect.path})", flush=True)
    start = time.monotonic()
    try:
        path.write_text(source.replace(defect.original, defect.planted))
        done = subprocess.run([*FAST_TIER, *pytest_args], cwd=ROOT, capture_output=True, text=True)
    finally:
        path.write_text(source)
    seconds = time.monotonic() - start
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    if done.returncode == 0 or not failed:
        tail = done.stdout.strip().splitlines()[-1:] or ["no output"]
        print(f"  NOT CAUGHT in {seconds:.0f} s (exit {done.returncode}: {tail[0]})", flush=True)
        return False
    print(f"  caught in {seconds:.0f} s by {failed[0]}", flush=True)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("defects", nargs="*", help=f"some of {', '.join(DEFECTS)} (default: all)")
    parser.add_argument("--list", action="store_true", help="name and describe the defects")
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.list:
        for name, defect in DEFECTS.items():
            print(f"{name}: {defect.what} ({defect.path})")
        return 0
    unknown = [name for name in args.defects if name not in DEFECTS]
    if unknown:
        parser.error(f"unknown defects {unknown}: choose from {', '.join(DEFECTS)}")
    names = args.defects or list(DEFECTS)
    caught = [plant_and_run(name, DEFECTS[name], pytest_args) for name in names]
    return 0 if all(caught) else 1


if __name__ == "__main__":
    sys.exit(main())
