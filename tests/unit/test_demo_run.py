"""How `llmtune demo` starts each stage: from the checkpoints its folder holds (a stage Ctrl-C stopped goes on),
else afresh; the user's own overwrite_output_dir or resume_from_checkpoint decides instead. (Ctrl-C itself:
tests/e2e/test_process_ends.py.)"""

from llmtune.demo.run import stage_start


def test_a_stage_goes_on_from_its_checkpoints_else_starts_afresh_unless_the_user_says_how(tmp_path):
    out = tmp_path / "pt"
    (out / "hf").mkdir(parents=True)  # an earlier demo's export, without checkpoints
    assert stage_start(out, ["train.max_steps=5"]) == ["train.overwrite_output_dir=true"]
    (out / "checkpoints" / "global_step_3").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("global_step_3")
    assert stage_start(out, ["train.max_steps=5"]) == ["checkpoint.resume_from_checkpoint=auto"]
    assert stage_start(out, ["train.overwrite_output_dir=true"]) == []
    assert stage_start(out, ["checkpoint.resume_from_checkpoint=runs/demo/pt/checkpoints/global_step_3"]) == []
