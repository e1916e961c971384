"""The pieces of callbacks and save-best without a run: the control a callback returns or sets, a raising callback's
message, the agreement's outcome, state by class, early stopping's count, importing train.callbacks entries, the
best checkpoint's folder of hard links, the recipe keys (HF's load_best_model_at_end and metric_for_best_model
included), and the callbacks' args against the HF TrainingArguments of the same run."""

import json

import pytest
from transformers import EarlyStoppingCallback, TrainingArguments

from llmtune.checkpoint.best import BEST, better, keep_as_best
from llmtune.config import load_config
from llmtune.errors import TrainingStopped, UserError
from llmtune.training.callbacks import (Callback, CallbackArgs, Callbacks, CallbackState, EarlyStopping,
                                        TrainerControl, hf_log_entries, import_callback, recipe_callbacks)


class OneRank:
    """ParallelState's collectives in a world of one."""

    @staticmethod
    def highest(values):
        return list(values)

    @staticmethod
    def first_error(error):
        return error


class Asks(Callback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_save = True


class Replaces(Callback):
    def on_step_end(self, args, state, control, **kwargs):
        return TrainerControl(should_evaluate=True)


class Fails(Callback):
    def on_step_end(self, args, state, control, **kwargs):
        raise KeyError("missing")


def callbacks(*made) -> Callbacks:
    return Callbacks(list(made), None, CallbackState(0, 1, 10), {})


def test_a_callback_sets_or_replaces_the_control_and_the_agreement_keeps_it():
    events = callbacks(Asks(), Replaces())
    events("on_step_end")
    assert events.control == TrainerControl(should_evaluate=True), "a returned control replaces the one passed"
    events = callbacks(Replaces(), Asks())
    events("on_step_end")
    assert events.agree(OneRank, signal_number=15) == 15
    assert (events.control.should_evaluate, events.control.should_save) == (True, True)


def test_a_raising_callback_is_named_once_and_stops_the_run_at_the_agreement():
    events = callbacks(Fails(), Asks())
    events("on_step_end")
    events("on_step_end")
    assert events.control.should_save, "the callbacks after it still ran"
    with pytest.raises(TrainingStopped, match=r"^callback Fails raised in on_step_end: KeyError: 'missing'; the run "
                                              r"stopped on every rank$"):
        events.agree(OneRank)


def test_callback_state_goes_back_to_the_callback_of_the_same_class():
    stopping = EarlyStopping(patience=3)
    stopping.best, stopping.waited = 1.5, 2
    saved = callbacks(Callback(), stopping).state_dict()
    assert saved == [{"name": "Callback", "state": {}}, {"name": "EarlyStopping", "state": {"best": 1.5, "waited": 2}}]
    fresh = EarlyStopping(patience=3)
    callbacks(Callback(), fresh).load_state_dict(saved)
    assert (fresh.best, fresh.waited) == (1.5, 2)
    other = EarlyStopping(patience=3)
    callbacks(other, Callback()).load_state_dict(saved)
    assert other.best is None, "another class at that place starts as made"


def test_early_stopping_counts_evaluations_without_an_improvement_above_the_threshold():
    stopping = EarlyStopping(patience=2, threshold=0.1)
    control = TrainerControl()
    for loss in (3.0, 2.95, 2.5, 2.45):
        stopping.on_evaluate(None, None, control, metrics={"eval_loss": loss})
        assert not control.should_training_stop
    stopping.on_evaluate(None, None, control, metrics={"eval_loss": 2.41})
    assert control.should_training_stop, "2.95, 2.45 and 2.41 improved by 0.1 or less: two in a row after 2.5"
    higher = EarlyStopping(patience=1, metric="eval_accuracy", greater_is_better=True)
    higher.on_evaluate(None, None, control := TrainerControl(), metrics={"eval_accuracy": 0.5})
    higher.on_evaluate(None, None, control, metrics={"eval_accuracy": 0.6})
    assert not control.should_training_stop


def test_better_reads_the_direction_and_the_threshold():
    assert better(1.0, None, greater_is_better=False)
    assert better(1.0, 2.0, greater_is_better=False) and not better(2.0, 1.0, greater_is_better=False)
    assert better(2.0, 1.0, greater_is_better=True)
    assert not better(1.05, 1.0, greater_is_better=True, threshold=0.1)
    assert not better(float("nan"), 1.0, greater_is_better=False)


def test_callback_entries_import_or_say_why_not():
    assert import_callback("llmtune.training.callbacks:EarlyStopping") is EarlyStopping
    with pytest.raises(UserError, match="cannot import 'no_such_module:Thing'"):
        import_callback("no_such_module:Thing")
    with pytest.raises(UserError, match="cannot import 'llmtune.training.callbacks:Nothing'"):
        import_callback("llmtune.training.callbacks:Nothing")
    with pytest.raises(UserError, match="is not a class"):
        import_callback("llmtune.training.callbacks:better")


def recipe(tmp_path, train=None, checkpoint=None, data=None):
    return {"model": {"name_or_path": str(tmp_path)},
            "data": {"train_files": ["t.jsonl"], **(data or {})},
            "train": {"output_dir": str(tmp_path / "out"), **(train or {})},
            "checkpoint": checkpoint or {}}


def test_the_recipe_makes_early_stopping_and_named_callbacks_without_arguments(tmp_path):
    config = load_config(recipe(tmp_path, {"early_stopping_patience": 2, "early_stopping_threshold": 0.5,
                                           "callbacks": ["llmtune.training.callbacks:Callback"]},
                                {"best_metric": "eval_accuracy"}, {"val_ratio": 0.1}), [], "sft", 1)
    made = recipe_callbacks(config)
    assert [type(c) for c in made] == [EarlyStopping, Callback]
    assert (made[0].patience, made[0].threshold, made[0].metric, made[0].greater_is_better) == \
        (2, 0.5, "eval_accuracy", True)
    config.train.callbacks = ["llmtune.training.callbacks:EarlyStopping"]
    with pytest.raises(UserError, match="made without arguments"):
        recipe_callbacks(config)


def test_hf_names_for_the_best_model_read_as_save_best_and_export_from_best(tmp_path):
    config = load_config(recipe(tmp_path, {"load_best_model_at_end": True, "metric_for_best_model": "accuracy",
                                           "greater_is_better": True}, {"save_steps": 10}, {"val_ratio": 0.1}),
                         [], "sft", 1)
    checkpoint = config.checkpoint
    assert (checkpoint.save_best, checkpoint.export_from, checkpoint.best_metric, checkpoint.greater()) == \
        (True, "best", "eval_accuracy", True)
    assert not load_config(recipe(tmp_path, checkpoint={"best_metric": "eval_loss"}), [], "sft", 1).checkpoint.greater()


@pytest.mark.parametrize("train, checkpoint, data, message", [
    ({}, {"export_from": "best", "save_steps": 5}, {"val_ratio": 0.1}, "checkpoint.export_from: best exports"),
    ({}, {"save_best": True}, {"val_ratio": 0.1}, "checkpoint.save_best: the best checkpoint is chosen among the "
                                                  "saved ones, and this run saves none"),
    ({}, {"save_best": True, "save_steps": 5}, {}, "checkpoint.save_best: this run has no validation data"),
    ({"eval_on_start": True}, {}, {}, "train.eval_on_start: this run has no validation data"),
    ({"eval_epochs": -1}, {}, {"val_ratio": 0.1}, "train.eval_epochs: -1 must not be negative"),
    ({"callbacks": ["my_callbacks.Stopper"]}, {}, {}, "train.callbacks: 'my_callbacks.Stopper' is not written "
                                                      "package.module:Class"),
])
def test_settings_that_cannot_work_are_refused_with_the_key(tmp_path, train, checkpoint, data, message):
    with pytest.raises(UserError, match=message):
        load_config(recipe(tmp_path, train, checkpoint, data), [], "sft", 1)


def test_save_best_on_a_train_metric_needs_no_validation(tmp_path):
    config = load_config(recipe(tmp_path, checkpoint={"save_best": True, "save_steps": 5, "best_metric": "loss"}),
                         [], "sft", 1)
    assert not config.checkpoint.greater()


def test_the_best_checkpoint_is_a_folder_of_hard_links_swapped_in_whole(tmp_path):
    first, second = tmp_path / "global_step_2", tmp_path / "global_step_4"
    for folder, text in ((first, "two"), (second, "four")):
        (folder / "extra_state").mkdir(parents=True)
        (folder / "trainer_state.json").write_text(text)
        (folder / "extra_state" / "rank_0.pt").write_text(text)
    keep_as_best(first)
    keep_as_best(second)
    best = tmp_path / BEST
    assert (best / "trainer_state.json").read_text() == "four"
    assert (best / "extra_state" / "rank_0.pt").stat().st_ino == (second / "extra_state" / "rank_0.pt").stat().st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == [BEST, "global_step_2", "global_step_4"], "nothing left over"


# A run as the HF Trainer's arguments give it, each name also a recipe key llmtune reads (its own or an alias).
HF_RUN = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "per_device_eval_batch_size": 16,
          "learning_rate": 3e-4, "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
          "warmup_steps": 0.1, "weight_decay": 0.01, "adam_beta2": 0.95, "max_grad_norm": 0.5,
          "label_smoothing_factor": 0.1, "num_train_epochs": 2.0, "logging_steps": 5, "eval_steps": 50,
          "load_best_model_at_end": True, "metric_for_best_model": "eval_loss", "report_to": "tensorboard",
          "run_name": "r", "seed": 3, "gradient_checkpointing": True, "torch_compile": True,
          "dataloader_num_workers": 2, "dataloader_persistent_workers": True, "full_determinism": True}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
def test_callback_args_answer_the_training_arguments_names_as_the_hf_trainer_holds_them(tmp_path):
    hf = TrainingArguments(output_dir=str(tmp_path / "out"), eval_strategy="steps", save_strategy="steps",
                           save_steps=50, save_total_limit=2, project="p", **HF_RUN)
    config = load_config(recipe(tmp_path, HF_RUN, {"save_steps": 50, "save_total_limit": 2}, {"val_ratio": 0.1}),
                         ["monitor.project=p"], "sft", 1)
    args = CallbackArgs(config, total_steps=100)
    compared = [name for name in args.values if hasattr(hf, name)]
    assert len(compared) >= 40
    assert {name: (getattr(args, name), type(getattr(args, name))) for name in compared} == \
        {name: (getattr(hf, name), type(getattr(hf, name))) for name in compared}
    assert (args.max_steps, args.report_to, args.push_to_hub, args.train_batch_size) == (-1, ["tensorboard"], False, 4)
    assert (args.train.output_dir, args.task, args.checkpoint.save_steps) == (str(tmp_path / "out"), "sft", 50), \
        "the recipe's sections still read"
    with pytest.raises(AttributeError, match="'output_dri' is neither a recipe section nor a TrainingArguments name"):
        args.output_dri
    as_dict = json.loads(args.to_json_string())
    assert as_dict["eval_strategy"] == "steps" and as_dict["train"]["learning_rate"] == 3e-4
    assert {key: value for key, value in hf.to_dict().items() if key in compared} == \
        {key: value for key, value in as_dict.items() if key in compared}
    assert all(type(value) in (bool, int, float, str) for value in args.to_sanitized_dict().values())
    EarlyStoppingCallback(2).on_train_begin(args, CallbackState(0, 1, 100), TrainerControl()), \
        "its checks of the arguments pass"


def test_a_record_enters_the_log_history_as_the_hf_trainer_logs_it():
    record = {"step": 4, "epoch": 0.5, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.7, "tokens": 96, "eval_loss": 2.1}
    assert hf_log_entries(record) == [
        {"loss": 2.0, "learning_rate": 1e-3, "grad_norm": 0.7, "tokens": 96, "epoch": 0.5, "step": 4},
        {"eval_loss": 2.1, "epoch": 0.5, "step": 4}]
    assert hf_log_entries({"step": 0, "epoch": 0.0, "eval_loss": 3.0}) == [{"eval_loss": 3.0, "epoch": 0.0, "step": 0}]
