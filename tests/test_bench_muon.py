"""The benchmark's Muon rows (``--optimizers muon muon8bit muon4bit``): torch's Muon with fp32
AdamW against ours on the same split, in the same columns as every other optimizer."""

import json

import pytest
import torch

from lowbit_optim.bench import __main__ as bench_main
from lowbit_optim.bench import harness
from lowbit_optim.bench.model import ByteGPT

TINY = ["--quick", "--device", "cpu", "--steps", "3"]


@pytest.mark.slow  # three optimizers train (about 30 s on 2 cores)
def test_muon_rows_train_and_report_memory_speed_loss_and_the_gap_to_torch_muon(tmp_path):
    names = ["muon", "muon8bit", "muon4bit"]
    assert bench_main.main([*TINY, "--out", str(tmp_path), "--optimizers", *names]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    runs = {run["optimizer"]: run for run in results["config"]["runs"]}
    assert set(runs) == set(names)
    for run in runs.values():
        assert run["complete"] and not run["nonfinite_loss"]
        assert run["step_ms"] > 0 and run["peak_memory_bytes"] > 0 and run["final_val_loss"] > 0
    # Float momentum and fp32 AdamW moments against quantized states: fewer bytes per parameter.
    assert runs["muon"]["state_bytes_per_param"] > runs["muon8bit"]["state_bytes_per_param"]
    assert runs["muon8bit"]["state_bytes_per_param"] > runs["muon4bit"]["state_bytes_per_param"]
    gaps = {row["optimizer"]: row.get("val_gap_vs_reference_pct") for row in results["rows"]}
    assert gaps["muon"] is None and all(isinstance(gaps[name], float) for name in ("muon8bit", "muon4bit"))


def test_torch_muon_row_and_ours_split_the_model_alike_and_one_scheduler_drives_both_parts():
    """Hidden matrices to Muon; embeddings (the tied head), norms and biases to AdamW."""
    model = ByteGPT(bench_main.PRESETS["quick"]["model"])
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    torch_pair = harness.OPTIMIZERS["muon"].build(model, **hyper)
    ours = harness.OPTIMIZERS["muon8bit"].build(model, **hyper)
    hidden = {id(p) for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("blocks.")}
    assert {id(p) for group in torch_pair.muon.param_groups for p in group["params"]} == hidden
    assert {id(p) for group in ours.param_groups if group["use_muon"] for p in group["params"]} == hidden
    assert all(group["adjust_lr_fn"] == "match_rms_adamw"
               for group in [*torch_pair.muon.param_groups, *ours.param_groups] if "adjust_lr_fn" in group)
    torch.optim.lr_scheduler.LambdaLR(torch_pair, lambda step: 0.5)
    groups = [*torch_pair.muon.param_groups, *torch_pair.adamw.param_groups]
    assert [group["lr"] for group in groups] == [5e-4] * 2
