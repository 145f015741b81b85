"""The benchmark command as a user meets it: turns between optimizers, what it prints and
when, where it writes, Ctrl-C, the C++ step's build, the options' help."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings

import pytest

from lowbit_optim.bench import __main__ as bench_main
from lowbit_optim.bench import harness
from lowbit_optim.bench.report import TERMINAL_WIDTH, TerminalTable
from lowbit_optim.step import cpu_kernel

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["--quick", "--device", "cpu", "--steps", "4"]


def runs_of(out: pathlib.Path) -> dict[str, dict]:
    return {run["optimizer"]: run for run in json.loads((out / "results.json").read_text())["config"]["runs"]}


@pytest.mark.slow
def test_interleaved_optimizers_train_exactly_as_each_one_alone(tmp_path, monkeypatch):
    """Turns of 2 steps across three optimizers (stochastic rounding among them, which draws
    random numbers): every first step comes before any turn, the turns alternate, and each
    optimizer's losses equal those of a run of it alone."""
    names = ["torch_adamw", "lowbit_4bit", "lowbit_4bit_bf16_sr"]
    order = []
    advance = bench_main.TrainingRun.advance

    def recorded(run, progress=None):
        order.append((run.name, run.steps_done))
        advance(run, progress)

    monkeypatch.setattr(bench_main.TrainingRun, "advance", recorded)
    argv = [*TINY, "--steps", "5", "--lr", "1e-2"]
    assert bench_main.main([*argv, "--block-steps", "2", "--out", str(tmp_path / "turns"),
                            "--optimizers", *names]) == 0
    assert order[:3] == [(name, 0) for name in names]
    assert [name for name, _ in order[3:9]] == [names[0]] * 2 + [names[1]] * 2 + [names[2]] * 2
    together = runs_of(tmp_path / "turns")
    for name in names:
        out = tmp_path / name
        assert bench_main.main([*argv, "--out", str(out), "--optimizers", name]) == 0
        alone = runs_of(out)[name]
        for key in ("final_train_loss", "final_val_loss", "curve", "state_bytes"):
            assert together[name][key] == alone[key], (name, key)
    # A control: the optimizers do differ, so the equality above is not vacuous.
    assert together["lowbit_4bit"]["final_val_loss"] != together["lowbit_4bit_bf16_sr"]["final_val_loss"]


def test_rows_are_printed_as_each_seed_finishes_within_a_hundred_columns(tmp_path, capsys):
    assert bench_main.main([*TINY, "--seeds", "0", "1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    seed0, seed1, means = (printed.index(text) for text in ("seed 0:", "seed 1:", "means over seeds"))
    assert seed0 < seed1 < means
    for block in (printed[seed0:seed1], printed[seed1:means], printed[means:]):
        for name in bench_main.DEFAULT_OPTIMIZERS:
            assert f"\n{name} " in block
    table = printed[seed0:printed.index("B/param:")]
    assert max(len(line) for line in table.splitlines()) <= TERMINAL_WIDTH
    assert "±" in printed[means:]  # two seeds: the gap's spread
    assert "training B/param" in (tmp_path / "table.md").read_text()  # every column stays there


def test_terminal_table_fits_a_hundred_columns_with_every_optimizer_and_column():
    table = TerminalTable.for_run(list(harness.OPTIMIZERS), references=True)
    widest = {"optimizer": max(harness.OPTIMIZERS, key=len), "state_bytes_per_param": 12.05,
              "step_ms": 1234.5, "train_step_ms": 12345.6, "first_step_s": 123.45, "final_val_loss": 5.5452,
              "val_gap_pct": -9.34, "val_gap_pct_sd": 2.21, "val_gap_vs_reference_pct": 9.99,
              "val_gap_vs_reference_pct_sd": 9.99}
    assert len(table.header()) <= TERMINAL_WIDTH and len(table.line(widest)) <= TERMINAL_WIDTH


def test_list_optimizers_groups_every_name_once(capsys):
    assert bench_main.main(["--list-optimizers"]) == 0
    printed = capsys.readouterr().out
    for group in ("fp32 references:", "lowbit_optim AdamW:", "lowbit_optim Lion:", "lowbit_optim AdEMAMix:",
                  "torchao:", "bitsandbytes:"):
        assert f"\n{group}\n" in f"\n{printed}"
    listed = [line.split()[0] for line in printed.splitlines() if line.startswith("  ")]
    assert sorted(listed) == sorted(harness.OPTIMIZERS)
    groups = bench_main.optimizer_groups()
    assert "torch_adamw" in groups["fp32 references"] and "bnb_lion_32bit" in groups["fp32 references"]
    assert "lowbit_lion_4bit" in groups["lowbit_optim Lion"] and "bnb_8bit" in groups["bitsandbytes"]


def test_every_option_has_a_help_line_and_help_lists_no_optimizer_names():
    parser = bench_main.build_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
    text = parser.format_help()
    assert "--list-optimizers" in text and "where the model trains" in text
    assert "lowbit_ademamix_8bit_compile" not in text and "torchao_fp8" not in text


def test_each_preset_writes_its_own_default_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outs = {preset: bench_main.parse_args(argv).out for preset, argv in
            (("small", []), ("quick", ["--quick"]), ("medium", ["--model-size", "medium"]),
             ("front-page", ["--front-page"]))}
    assert outs == {preset: pathlib.Path("bench_out") / preset for preset in outs}


def test_another_presets_results_are_not_replaced_without_overwrite(tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps({"config": {"preset": "small"}}))
    with pytest.raises(SystemExit):
        bench_main.parse_args(["--quick", "--out", str(tmp_path)])
    assert "holds the results of another preset (small)" in capsys.readouterr().err
    assert bench_main.parse_args(["--out", str(tmp_path)]).out == tmp_path  # the same preset: replaced
    assert bench_main.parse_args(["--quick", "--overwrite", "--out", str(tmp_path)]).preset == "quick"


@pytest.mark.slow
def test_ctrl_c_stops_with_one_line_and_keeps_the_partial_rows(tmp_path):
    """SIGINT while the optimizers take turns: exit status 130, no traceback, one line saying
    what was kept, and results.json and table.md hold every optimizer's partial row."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "lowbit_optim.bench", "--quick", "--device", "cpu", "--steps", "100000",
               "--block-steps", "2", "--optimizers", "torch_adamw", "lowbit_4bit", "--out", str(out)]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    # SIGINT back to its default in the child, as a terminal gives it: a suite started as a
    # background job (``pytest &``) has it ignored, which the child would inherit, and Python
    # then installs no KeyboardInterrupt handler.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": path},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (out / "results.json").is_file() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)  # a few more turns
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        # A run that ignored the signal would otherwise train its 100,000 steps after the test.
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == bench_main.INTERRUPTED, stderr[-2000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("stopped (Ctrl-C): kept torch_adamw ") and "lowbit_4bit " in last, last
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [row["optimizer"] for row in rows] == ["torch_adamw", "lowbit_4bit"]
    assert not any(row["complete"] for row in rows)
    assert all(row["step_ms"] > 0 for row in rows)
    assert "(stopped after" in (out / "table.md").read_text()


def test_ctrl_c_before_any_step_ended_says_nothing_was_kept(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "table.md").write_text("an earlier quick run's table")

    def interrupted(run, progress=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_main.TrainingRun, "advance", interrupted)
    assert bench_main.main([*TINY, "--out", str(out)]) == bench_main.INTERRUPTED
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"stopped (Ctrl-C) before any training step ended: nothing kept in {out}/")
    assert list(out.iterdir()) == []  # no earlier run's files to be taken for this one's


def test_ctrl_c_during_an_evaluation_keeps_the_steps_and_no_half_point(tmp_path, monkeypatch, capsys):
    """Interrupted after a run's train loss was measured and before its val loss: the rows keep
    the steps done, and the loss curve has no point whose val loss is missing."""
    from lowbit_optim.bench import train as bench_train

    train_loss = bench_train.Evaluator.loss

    def interrupted_at_val(evaluator, model, split):
        if split == "val":
            raise KeyboardInterrupt
        return train_loss(evaluator, model, split)

    monkeypatch.setattr(bench_train.Evaluator, "loss", interrupted_at_val)
    out = tmp_path / "out"
    assert bench_main.main([*TINY, "--out", str(out)]) == bench_main.INTERRUPTED
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("stopped (Ctrl-C): kept ")
    runs = json.loads((out / "results.json").read_text())["config"]["runs"]
    # The first evaluation was the one interrupted: no run has a val loss, and steps are kept.
    assert runs and max(run["steps_done"] for run in runs) == 4
    assert all(run["final_val_loss"] is None for run in runs)
    assert all(len(set(map(len, run["curve"].values()))) == 1 for run in runs)


def test_the_cpu_step_build_is_announced_on_stderr_with_its_cache(monkeypatch, capsys):
    import torch.utils.cpp_extension as cpp_extension

    def failed_build(**options):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_kernel, "_load_built", lambda: False)
    monkeypatch.setattr(cpp_extension, "load", failed_build)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_kernel.load.__wrapped__() is False
    err = capsys.readouterr().err
    assert err.count("building the C++ CPU step") == 1
    assert "~30-60 s" in err and f"cached in {cpu_kernel.library_path().parent}" in err
    assert any("could not be built" in str(warning.message) for warning in caught)


def test_the_main_job_reports_the_cpu_step_build_apart_from_the_first_step(tmp_path, monkeypatch, capsys):
    assert cpu_kernel.load()  # built or loaded now; the run below then finds it loaded
    monkeypatch.setattr(cpu_kernel, "library_path", lambda: tmp_path / "not_built_yet.so")
    assert bench_main.main([*TINY, "--optimizers", "lowbit_4bit", "--out", str(tmp_path / "out")]) == 0
    assert "C++ CPU step: built in " in capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "results.json").read_text())["config"]
    assert config["cpu_kernel"]["built"] and config["cpu_kernel"]["available"]
    assert config["cpu_kernel"]["seconds"] >= 0
