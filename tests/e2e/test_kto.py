"""llmtune kto on one process: at step 0, where the policy is its reference, every reference mode gives log-ratios
of exactly 0, the reference point 0 and every example's loss 1/2; the per-step losses do not depend on how many rows
a micro-batch takes (the reference point is the whole step's); a resumed run repeats the uninterrupted one bitwise.
(Two processes: tests/dist/test_dpo_ranks.py.)"""


import pytest

import llmtune
from tests.helpers import StopAt, read_metrics


def recipe(model, examples, out, train=None, **sections) -> dict:
    return {
        "model": {"name_or_path": model},
        "data": {"train_files": [examples], "chat_template": "basic", "max_seq_len": 128, "shuffle": False},
        "train": {"output_dir": out, "max_steps": 3, "per_device_train_batch_size": 1, "global_batch_size": 4,
                  "logging_steps": 1, "learning_rate": 5e-3, "per_device_eval_batch_size": 2, **(train or {})},
        "checkpoint": {"export_hf": False},
        "monitor": {"plots": False},
        **sections,
    }


@pytest.mark.parametrize("reference, peft", [("model", {}), ("adapter_off", {"method": "lora", "r": 4}),
                                             ("precomputed", {})])
def test_every_reference_gives_half_a_loss_per_example_at_step_zero(tiny_model, examples_file, tmp_path, reference,
                                                                      peft):
    out = tmp_path / reference
    llmtune.train("kto", recipe(tiny_model, examples_file, out, train={"max_steps": 1},
                                kto={"reference": reference}, peft=peft or {"method": "none"}))
    first = read_metrics(out)[0]
    assert first["loss"] == pytest.approx(0.5, abs=1e-7)
    rewards = [first[key] for key in ("rewards/chosen", "rewards/rejected") if key in first]
    assert rewards and rewards == [0.0] * len(rewards) and first["kl"] == 0.0
    assert first["examples_per_s"] > 0 and min(first.get("logps/chosen", -1), first.get("logps/rejected", -1)) < 0


def test_the_losses_do_not_depend_on_how_many_rows_a_micro_batch_takes(tiny_model, examples_file, tmp_path):
    runs = {}
    for micro in (1, 2, 4):
        out = tmp_path / f"micro{micro}"
        llmtune.train("kto", recipe(tiny_model, examples_file, out, train={"per_device_train_batch_size": micro}))
        runs[micro] = [(r["loss"], r["kl"]) for r in read_metrics(out) if "loss" in r]
    log = (tmp_path / "micro1" / "train.log").read_text()
    assert "48 examples (42 desirable, 6 undesirable), each micro-batch's packed into" in log
    assert len(runs[1]) == 3 and runs[1][-1][1] > 0, "the reference point is above 0, estimated over the whole step"
    for micro in (2, 4):
        assert [loss for loss, _ in runs[micro]] == pytest.approx([loss for loss, _ in runs[1]], rel=1e-5)


def test_a_resumed_run_repeats_the_uninterrupted_one_and_evaluates(tiny_model, examples_file, tmp_path):
    sections = {"kto": {"reference": "precomputed"}, "checkpoint": {"save_steps": 2, "export_hf": False}}
    data = {"train_files": [str(examples_file)], "val_files": [str(examples_file)], "chat_template": "basic",
            "max_seq_len": 128, "shuffle": False}
    whole, part = tmp_path / "whole", tmp_path / "part"
    for out, callbacks, resume in ((whole, [], None), (part, [StopAt(2)], None), (part, [], "auto")):
        run = recipe(tiny_model, examples_file, out, train={"max_steps": 4, "eval_steps": 2}, **sections)
        result = llmtune.train("kto", {**run, "data": data}, callbacks=callbacks, resume_from_checkpoint=resume)
    expected, got = ([(r["step"], r.get("loss"), r.get("eval_loss"), r.get("eval_kl")) for r in read_metrics(out)]
                     for out in (whole, part))
    assert len(expected) == 4 and got == expected
    assert all(r["eval_loss"] > 0 for r in read_metrics(whole) if "eval_loss" in r)

    # What the run shows: TRL's margin, the console's rewards and kl, the result's last metrics.
    records = read_metrics(part)
    both = [r for r in records if "rewards/rejected" in r]
    assert both and all(r["rewards/margins"] == r["rewards/chosen"] - r["rewards/rejected"] for r in both)
    assert all("rewards/margins" not in r for r in records if "loss" in r and r not in both)
    log = (part / "train.log").read_text()
    for r in records:
        shown = "".join(f" {key} {r[key]:.4f}" for key in ("rewards/chosen", "rewards/rejected", "kl") if key in r)
        after = "eval_loss" if "eval_loss" in r else "lr"
        assert f"step {r['step']}/4 epoch {r['epoch']:.2f} loss {r['loss']:.4f}{shown} {after} " in log
    names = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl", "rewards/margins")
    assert result.metrics == {name: records[-1][name] for name in names if name in records[-1]}
    assert "kl" in result.metrics
    assert result.eval_metrics == {key: value for key, value in records[-1].items() if key.startswith("eval_")}
    assert {"eval_loss", "eval_kl", "eval_rewards/margins"} <= set(result.eval_metrics)
