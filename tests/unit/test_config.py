from pathlib import Path

import pytest
import yaml

from llmtune.config import load_config, parse_overrides
from llmtune.errors import UserError
from tests.helpers import script_module

REPO = Path(__file__).resolve().parents[2]


def write_recipe(tmp_path, **sections) -> str:
    recipe = {"model": {"name_or_path": "m"}, "data": {"train_files": ["d.jsonl"]}, "train": {"output_dir": "out"}}
    for name, values in sections.items():
        recipe.setdefault(name, {}).update(values)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_defaults_overrides_and_numbers_written_as_strings(tmp_path):
    recipe = write_recipe(tmp_path, train={"learning_rate": "3e-5"})
    overrides, nproc = parse_overrides(["data.max_seq_len=1024", "--train.max_steps", "7", "--train.seed=3",
                                        "--nproc", "2"])
    config = load_config(recipe, overrides, "sft", world_size=2)
    assert nproc == 2
    assert config.train.learning_rate == 3e-5
    assert config.data.max_seq_len == 1024
    assert (config.train.max_steps, config.train.seed) == (7, 3)
    assert config.train.per_device_train_batch_size == 8 and config.parallel.cp_size == 1
    assert config.data.train_files == ["d.jsonl"]


def test_unknown_key_names_section_and_closest_key(tmp_path):
    with pytest.raises(UserError) as err:
        load_config(write_recipe(tmp_path, train={"learning_rat": 1e-4}), [], "sft", 1)
    assert str(err.value) == "train.learning_rat: unknown key in section 'train'; did you mean 'train.learning_rate'?"


@pytest.mark.parametrize("task, key, answer", [
    ("sft", "save_steps", "did you mean 'checkpoint.save_steps'?"),
    ("dpo", "beta", "did you mean 'dpo.beta'?"),
    ("dpo", "loss_type", "did you mean 'dpo.loss_type'?"),
    ("dpo", "max_length", "did you mean 'dpo.max_length'?"),
    ("sft", "save_total_limit", "did you mean 'checkpoint.save_total_limit'?"),
    ("sft", "beta", "it belongs to llmtune dpo (dpo.beta), llmtune kto (kto.beta) and llmtune grpo (grpo.beta), not "
                    "to sft"),
    ("sft", "pref_beta", "it belongs to llmtune dpo (dpo.beta) and llmtune kto (kto.beta), not to sft"),
])
def test_a_key_in_the_wrong_section_is_sent_to_the_section_that_has_it(tmp_path, task, key, answer):
    """Matched within its own section alone, train.save_steps suggested max_steps, train.beta adam_beta2,
    train.loss_type lr_scheduler_type, train.max_length max_steps, train.save_total_limit save_on_signals."""
    with pytest.raises(UserError) as err:
        load_config(write_recipe(tmp_path, train={key: 1}), [], task, 1)
    assert str(err.value) == f"train.{key}: unknown key in section 'train'; {answer}"


def test_another_trainers_name_in_the_wrong_section_is_sent_to_llmtunes_key(tmp_path):
    with pytest.raises(UserError) as err:
        load_config(write_recipe(tmp_path, peft={"cutoff_len": 1024}), [], "sft", 1)
    assert str(err.value) == "peft.cutoff_len: unknown key in section 'peft'; did you mean 'data.max_seq_len'?"


def test_unknown_section_and_override_key_are_reported_together(tmp_path):
    recipe = write_recipe(tmp_path)
    Path(recipe).write_text(Path(recipe).read_text() + "trian: {}\n")
    with pytest.raises(UserError) as err:
        load_config(recipe, ["data.max_seq_lenn=4"], "sft", 1)
    lines = str(err.value).splitlines()
    assert any("unknown section 'trian'; did you mean 'train'?" in line for line in lines)
    assert any(line.startswith("data.max_seq_lenn:") and "'data.max_seq_len'" in line for line in lines)


@pytest.mark.parametrize("key, value, expected", [
    ("gradient_accumulation_steps", "eight", "integer"),
    ("bf16", "yes please", "boolean"),
    ("learning_rate", "fast", "number"),
    ("max_steps", 2.5, "integer"),
])
def test_wrong_type_names_key_value_and_type(tmp_path, key, value, expected):
    with pytest.raises(UserError) as err:
        load_config(write_recipe(tmp_path, train={key: value}), [], "sft", 1)
    assert str(err.value) == f"train.{key}: {value!r} is not a valid {expected}" + (
        "" if expected != "boolean" else " (true/false)")


def test_global_batch_size_derives_accumulation(tmp_path):
    recipe = write_recipe(tmp_path, train={"global_batch_size": 32, "per_device_train_batch_size": 4})
    assert load_config(recipe, [], "sft", world_size=2).train.gradient_accumulation_steps == 4
    with pytest.raises(UserError, match=r"global_batch_size: 30 is not a multiple of .* = 8"):
        load_config(recipe, ["train.global_batch_size=30"], "sft", world_size=2)
    with pytest.raises(UserError, match="set only one of them"):
        load_config(recipe, ["train.gradient_accumulation_steps=2"], "sft", world_size=2)


@pytest.mark.parametrize("train, world_size, expected", [
    ({}, 1, "train.per_device_train_batch_size: auto keeps the global batch through accumulation; set "
            "train.global_batch_size (samples per optimizer step over all ranks)"),
    ({"global_batch_size": 16, "gradient_accumulation_steps": 2}, 1,
     "train.gradient_accumulation_steps: with per_device_train_batch_size auto, accumulation is global_batch_size / "
     "(micro-batch x data-parallel size); leave gradient_accumulation_steps out"),
    ({"global_batch_size": 6}, 4, "train.global_batch_size: 6 is not a multiple of the data-parallel size 4; choose a "
                                  "multiple of 4"),
    ({"global_batch_size": 16, "per_device_train_batch_size": "eight"}, 1,
     "train.per_device_train_batch_size: 'eight' is neither a number of samples nor auto"),
])
def test_auto_micro_batch_needs_a_global_batch_whole_on_every_rank(tmp_path, train, world_size, expected):
    recipe = write_recipe(tmp_path, train={"per_device_train_batch_size": "auto", **train})
    with pytest.raises(UserError) as err:
        load_config(recipe, [], "sft", world_size)
    assert str(err.value) == expected


def test_auto_micro_batch_resolved_keeps_the_global_batch(tmp_path):
    recipe = write_recipe(tmp_path, train={"per_device_train_batch_size": "auto", "global_batch_size": 24})
    config = load_config(recipe, [], "sft", world_size=2)
    assert config.train.per_device_train_batch_size == "auto"
    config.use_micro_batch(3, world_size=2)
    assert (config.train.per_device_train_batch_size, config.train.gradient_accumulation_steps) == (3, 4)
    # --global_batch_size on the command line wins over a recipe's accumulation, with auto too.
    recipe = write_recipe(tmp_path, train={"per_device_train_batch_size": "auto", "gradient_accumulation_steps": 2})
    assert load_config(recipe, ["train.global_batch_size=8"], "sft", 1).train.global_batch_size == 8


def test_resolved_recipe_with_a_global_batch_loads_on_another_number_of_ranks(tmp_path):
    recipe = write_recipe(tmp_path, train={"global_batch_size": 32, "per_device_train_batch_size": 4})
    config = load_config(recipe, [], "sft", world_size=2)
    config.write(tmp_path / "config.yaml")
    assert load_config(str(tmp_path / "config.yaml"), [], "sft", world_size=2) == config
    assert load_config(str(tmp_path / "config.yaml"), [], "sft", world_size=4).train.gradient_accumulation_steps == 2


def test_choices_and_required_fields(tmp_path):
    recipe = write_recipe(tmp_path, train={"lr_scheduler_type": "cosin", "output_dir": ""})
    with pytest.raises(UserError) as err:
        load_config(recipe, [], "sft", 1)
    message = str(err.value)
    assert "train.lr_scheduler_type: 'cosin' is not valid; did you mean 'cosine'?" in message
    assert "train.output_dir: not set" in message


def test_text_sample_by_takes_the_text_builders_choices_and_reads_lines_by_default(tmp_path):
    recipe = write_recipe(tmp_path, data={"text_sample_by": "sentence"})
    with pytest.raises(UserError) as err:
        load_config(recipe, [], "pt", 1)
    assert str(err.value) == "data.text_sample_by: 'sentence' is not valid; valid: line, paragraph, document"
    assert load_config(recipe, parse_overrides(["--text_sample_by", "paragraph"])[0], "pt", 1).data.text_sample_by \
        == "paragraph"
    assert load_config(write_recipe(tmp_path), [], "pt", 1).data.text_sample_by == "line"


def test_stop_signals_and_the_collective_timeout_are_checked(tmp_path):
    recipe = write_recipe(tmp_path, train={"save_on_signals": ["SIGTERM", "SIGKILL", "SIGTREM"]},
                          parallel={"timeout_minutes": 0})
    with pytest.raises(UserError) as err:
        load_config(recipe, [], "sft", 1)
    message = str(err.value)
    assert "train.save_on_signals: 'SIGKILL' is not a signal a process can catch" in message
    assert "train.save_on_signals: 'SIGTREM' is not a signal" in message
    assert "'SIGTERM'" not in message
    assert "parallel.timeout_minutes: 0.0 must be above 0" in message


def test_dataloader_settings_that_torch_or_a_stream_cannot_take_are_refused_together(tmp_path):
    recipe = write_recipe(tmp_path, data={"prefetch_factor": 2, "persistent_workers": True, "streaming": True},
                          train={"max_steps": 4})
    with pytest.raises(UserError) as err:
        load_config(recipe, [], "sft", 1)
    assert str(err.value).splitlines() == [
        "data.prefetch_factor: only DataLoader workers prefetch or persist; set data.num_workers > 0 or leave "
        "data.prefetch_factor out",
        "data.persistent_workers: only DataLoader workers prefetch or persist; set data.num_workers > 0 or leave "
        "data.persistent_workers out"]
    with pytest.raises(UserError) as err:
        load_config(recipe, ["data.num_workers=2", "data.prefetch_factor=0"], "sft", 1)
    assert str(err.value).splitlines() == [
        "data.prefetch_factor: 0 must be at least 1",
        "data.num_workers: a stream is read in the training process (workers would change the order of its "
        "samples); set data.num_workers=0 with data.streaming"]
    assert load_config(recipe, ["data.num_workers=2", "data.streaming=false"], "sft", 1).data.prefetch_factor == 2
    with pytest.raises(UserError, match=r"^data.num_workers: -1 must be 0 \(no workers\) or more$"):
        load_config(write_recipe(tmp_path), ["data.num_workers=-1"], "sft", 1)


def test_resolved_config_round_trips(tmp_path):
    config = load_config(write_recipe(tmp_path), ["train.learning_rate=1e-4"], "pt", 1)
    config.write(tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"), [], "pt", 1)
    assert again == config


def test_recipe_reference_page_lists_every_field():
    generator = script_module(REPO / "docs" / "recipe_table.py")
    assert (REPO / "docs" / "recipe.md").read_text() == generator.page(), \
        "docs/recipe.md is stale: python docs/recipe_table.py"


def test_running_page_names_every_task_llmtune_train_takes():
    from llmtune.tasks.registry import TASKS

    sentence = (REPO / "docs" / "running.md").read_text().partition("`task` is ")[2].partition(";")[0]
    assert [task for task in TASKS if f'`"{task}"`' not in sentence] == []


def test_recipe_reference_introduction_names_every_section():
    from llmtune.config import SECTIONS

    introduction = (REPO / "docs" / "recipe.md").read_text().partition("| key |")[0]
    assert [section for section in SECTIONS if f"`{section}`" not in introduction] == []


def test_expert_parallel_below_one_is_refused():
    from llmtune.config import ParallelConfig
    assert any("parallel.expert_parallel: 0" in p for p in ParallelConfig(expert_parallel=0).problems())


def test_expert_parallel_with_context_parallel_is_refused():
    from llmtune.config import ParallelConfig
    assert any("cp_size 2" in p for p in ParallelConfig(expert_parallel=2, cp_size=2).problems())


def test_expert_parallel_must_divide_dp_shard():
    from llmtune.config import ParallelConfig
    assert "does not divide dp_shard 3" in ParallelConfig(expert_parallel=2).layout_problem(3)
    assert ParallelConfig(expert_parallel=2).layout_problem(4) is None


def test_describe_names_expert_parallel_only_when_on():
    from llmtune.config import ParallelConfig
    assert "ep 2" in ParallelConfig(expert_parallel=2).describe(4)
    assert "ep " not in ParallelConfig().describe(4)
