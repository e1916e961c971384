"""KTO's data (kto's rows): every unpaired form read to the canonical example, the label refusals, LLaMA-Factory's
kto_tag entries, the KL completions (each example's prompt with the previous example's completion, cyclic within a
window of the mixed split), the `desirable` column through packing and the collator, the refusals between kto and
the other tasks, the statistics and `llmtune data`'s view of examples.

Expected ids come from literal text (what the built-in `basic` template must render, or TRL's string form), tokenized
whole as a pair's sequences are (test_preference_data.pair_row), never from the code under test.
"""

import json
import re

import pytest

from llmtune.config import (CheckpointConfig, Config, DataConfig, KTOConfig, ModelConfig, MonitorConfig,
                            ParallelConfig, PeftConfig, TrainConfig)
from llmtune.data import unpaired
from llmtune.data.build import build_datasets, describe
from llmtune.data.collate import collate
from llmtune.data.formats import detect_format, to_canonical
from llmtune.data.packing import pack_units
from llmtune.data.manager import build_data
from llmtune.data.preference import KL_RESPONSES, PairLimits
from llmtune.data.preview import show_examples
from llmtune.errors import UserError
from llmtune.run.parallel import ParallelState
from tests.unit.test_preference_data import PROMPT, RIGHT, USER, WRONG, message, pair_row, sequences, system, \
    write_jsonl

LIMITS = PairLimits(max_length=256, max_prompt_length=None, truncation=True, section="kto", names=KL_RESPONSES)
# The basic template's rendering of an alpaca prompt with a system text and an input.
ALPACA_PROMPT = "<s>Be exact.\n\n### Instruction:\nAdd them.\n2 and 3\n\n### Response:\n"
PREFERENCE = ("preference data (chosen/rejected columns, or ranking: true) is for llmtune dpo or llmtune rm, not {task}; "
              "train it with llmtune dpo or llmtune rm, or leave it out of {key}")
KTO = ("KTO data (kto_tag, or a true/false label column) is for llmtune kto, not {task}; train it with llmtune kto, "
       "or leave it out of {key}")


def canonical(row: dict) -> tuple[str, dict, float]:
    """(the detected form, the canonical example, its desirable value) of one row given by path."""
    row_format = detect_format(list(row), "kto", "auto", "kto.jsonl")
    read = to_canonical(row, row_format, "kto.jsonl: row 1")
    assert read["where"] == "kto.jsonl: row 1"
    return row_format.form, read["example"], read["desirable"]


@pytest.mark.parametrize("row, form, example, desirable", [
    # TRL's unpaired form: strings (no chat template) or lists of messages, with llmtune's optional system and tools.
    ({"prompt": "The sky is", "completion": " blue.", "label": True}, "prompt_completion_label",
     {"prompt": "The sky is", "completion": " blue."}, 1.0),
    ({"prompt": [USER], "completion": [WRONG], "label": False, "system": "Be brief.", "tools": '[{"name": "add"}]'},
     "prompt_completion_label",
     {"prompt": [system("Be brief."), USER], "completion": [WRONG], "tools": [{"name": "add"}]}, 0.0),
    # A CSV holds its labels as text.
    ({"prompt": "The sky is", "completion": " green.", "label": "FALSE"}, "prompt_completion_label",
     {"prompt": "The sky is", "completion": " green."}, 0.0),
    # LLaMA-Factory's KTO files given by path: alpaca, sharegpt, and kto_en_demo's role/content messages.
    ({"instruction": "Add them.", "input": "2 and 3", "output": "5", "label": True, "system": "Be exact.",
      "history": [["What is 1 plus 1?", "2"]]}, "alpaca_kto",
     {"prompt": [system("Be exact."), message("user", "What is 1 plus 1?"), message("assistant", "2"),
                 message("user", "Add them.\n2 and 3")], "completion": [message("assistant", "5")]}, 1.0),
    ({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is 2 plus 3?"},
                        {"from": "gpt", "value": "It is 5."}], "label": True}, "sharegpt_kto",
     {"prompt": [system("Be brief."), USER], "completion": [RIGHT]}, 1.0),
    ({"messages": [USER, WRONG], "label": False}, "messages_kto", {"prompt": [USER], "completion": [WRONG]}, 0.0),
])
def test_every_form_is_read_to_the_canonical_example_and_its_label(row, form, example, desirable):
    assert canonical(row) == (form, example, desirable)


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "Hi", "completion": " there", "label": 1},
     r"field 'label' is 1, not a boolean; label every example true \(desirable\) or false \(undesirable\)"),
    ({"prompt": "Hi", "completion": " there", "label": None}, r"field 'label' is None, not a boolean"),
    ({"prompt": "Hi", "completion": "", "label": True},
     r"field 'completion' is empty; every example needs a completion"),
    ({"prompt": "Hi", "completion": " there", "label": True, "system": "Be brief."},
     r"field 'system' needs a chat template, and string examples are trained without one; give prompt and completion "
     r"as lists of messages"),
    ({"prompt": [USER], "completion": "It is 5.", "label": True},
     r"fields 'prompt' and 'completion' must both be strings or both lists of messages"),
    ({"prompt": [USER], "completion": [USER], "label": True},
     r"field 'completion' must begin with the assistant's answer to the prompt, not a user turn"),
    ({"messages": [RIGHT, USER], "label": True},
     r"field 'messages' must end with the assistant's answer, the completion, not a user turn"),
    ({"messages": [RIGHT], "label": True}, r"the example has no prompt; give the turns before the answer"),
])
def test_an_example_that_does_not_fit_its_form_is_refused_naming_the_field(row, problem):
    with pytest.raises(UserError, match=r"^kto.jsonl: row 1: " + problem):
        canonical(row)


@pytest.mark.parametrize("labels, row, shown", [
    (["true", "yes"], 2, "'yes'"),  # text labels, read as KTO's by the first; the second is not one
    ([1, 0], 1, "1"),  # numbers are not read as KTO's labels: the form needs them
])
def test_a_label_that_is_not_a_boolean_is_refused_naming_file_and_row(tmp_path, tokenizer, labels, row, shown):
    path = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "Hi", "completion": " there", "label": label}
                                                for label in labels])
    with pytest.raises(UserError) as err:
        build_datasets("kto", DataConfig(train_files=[path]), tokenizer, 0, LIMITS)
    assert str(err.value) == (f"{path}: row {row}: field 'label' is {shown}, not a boolean; label every example true "
                              "(desirable) or false (undesirable) (data.format prompt_completion_label)")


def string_examples(count: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"Question {i}:", "completion": f" answer {i}.", "label": i % 3 == 0}
            for i in range(start, start + count)]


def example_row(tokenizer, example: dict, kl_completion: str) -> dict:
    """The row a string example must become: its prompt + its completion, then its prompt + the KL completion, and
    its label on both sequences."""
    label = float(example["label"])
    return {**pair_row(tokenizer, example["prompt"], example["completion"], kl_completion, with_bos=True),
            "desirable": [label, label]}


def test_each_example_takes_the_previous_examples_completion_cyclic_within_its_window(tmp_path, tokenizer,
                                                                                       monkeypatch):
    monkeypatch.setattr(unpaired, "PACK_WINDOW", 3)
    examples = string_examples(7)
    data = DataConfig(train_files=[write_jsonl(tmp_path / "kto.jsonl", examples)], packing=False)
    train, _, _ = build_datasets("kto", data, tokenizer, 0, LIMITS)
    # Windows [0, 1, 2], [3, 4, 5], [6]: a window's first example takes its last one's completion, a window of one
    # its own.
    previous = [2, 0, 1, 5, 3, 4, 6]
    assert [train[i] for i in range(7)] == [example_row(tokenizer, examples[i], examples[previous[i]]["completion"])
                                            for i in range(7)]
    on_two = build_datasets("kto", DataConfig(train_files=data.train_files, packing=False, num_proc=2), tokenizer, 0,
                            LIMITS)[0]
    assert on_two.to_list() == train.to_list(), "the windows do not depend on data.num_proc"


def test_the_kl_completions_are_drawn_from_the_mixed_split_across_sources(tmp_path, tokenizer):
    first, second = string_examples(3), string_examples(2, start=3)
    data = DataConfig(train_files=[write_jsonl(tmp_path / "a.jsonl", first), write_jsonl(tmp_path / "b.jsonl", second)],
                      packing=False)
    train, _, _ = build_datasets("kto", data, tokenizer, 0, LIMITS)
    examples = first + second
    assert train.to_list() == [example_row(tokenizer, examples[i], examples[i - 1]["completion"]) for i in range(5)]


def test_string_and_conversational_examples_in_one_split_are_refused_naming_both_rows(tmp_path, tokenizer):
    strings = write_jsonl(tmp_path / "strings.jsonl", string_examples(2))
    conversations = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [USER], "completion": [RIGHT], "label": True}])
    with pytest.raises(UserError) as err:
        build_datasets("kto", DataConfig(train_files=[strings, conversations]), tokenizer, 0, LIMITS)
    assert str(err.value) == (f"{strings}: row 1: the example is given as strings, and its KL completion, the "
                              f"completion of {conversations}: row 1, as lists of messages; give every KTO example of "
                              "a split in one form, strings or lists of messages")


def test_the_limits_bound_the_kl_sequence_too_and_name_the_kto_keys(tmp_path, tokenizer):
    examples = [{"prompt": "Q:", "completion": " yes", "label": True},
                {"prompt": "Q:", "completion": " no" * 20, "label": False}]
    path = write_jsonl(tmp_path / "kto.jsonl", examples)
    prompt = len(tokenizer("Q:")["input_ids"])
    own, kl = (len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1 for text in (" yes", " no" * 20))
    limits = PairLimits(prompt + own, None, False, "kto", KL_RESPONSES)
    with pytest.raises(UserError) as err:
        build_datasets("kto", DataConfig(train_files=[path]), tokenizer, 0, limits)
    assert str(err.value) == (
        f"{path}: row 1: the prompt ({prompt} tokens) and the longer response ({kl} tokens; example's {own}, KL {kl}) "
        f"make a sequence of {prompt + kl} tokens, over the {prompt + own} of kto.max_length (default data.max_seq_len "
        "/ 2); raise kto.max_length (and data.max_seq_len, which holds two), set kto.max_prompt_length, or set "
        "kto.truncation: true to cut it")


def test_pair_limits_are_read_from_the_kto_section():
    run = Config("kto", ModelConfig(), DataConfig(max_seq_len=512), TrainConfig(), ParallelConfig(), PeftConfig(),
                 CheckpointConfig(), MonitorConfig(), kto=KTOConfig(max_prompt_length=100, truncation=False))
    assert PairLimits.of(run) == PairLimits(256, 100, False, "kto", KL_RESPONSES)


def varied_examples(count: int) -> list[dict]:
    return [{"prompt": f"Question {i}:" + " more" * (i % 7), "completion": " yes" * (1 + i % 3), "label": i % 4 == 0}
            for i in range(count)]


def test_the_desirable_values_stay_with_their_sequences_through_packing_and_collate(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "kto.jsonl", varied_examples(30))
    one_per_row, _, _ = build_datasets("kto", DataConfig(train_files=[path], max_seq_len=96), tokenizer, 0, LIMITS)
    packed = pack_units(list(one_per_row), 96)  # as the collator packs a micro-batch's examples
    assert len(packed) < len(one_per_row)
    label_of = {tuple(row["input_ids"]): row["desirable"][0] for row in one_per_row}
    assert sorted(label_of.values()) == sorted(float(i % 4 == 0) for i in range(30))
    for row in packed:
        pieces = sequences(row)
        assert len(row["desirable"]) == len(pieces), "one value per sequence"
        for k in range(0, len(pieces), 2):
            whole = tuple(pieces[k][0] + pieces[k + 1][0])
            assert row["desirable"][k:k + 2] == [label_of[whole]] * 2
    batch = collate([packed[0], packed[1]], pad_id=0, two_sequences=True)
    assert batch.sequences["desirable"].tolist() == packed[0]["desirable"] + packed[1]["desirable"]
    assert len(batch.sequences["desirable"]) == len(batch.sequences["length"]) == \
        batch.inputs["sequence_ids"].max().item() + 1


@pytest.fixture
def state():
    state = ParallelState.initialize()
    yield state
    state.close()


def test_build_data_numbers_kto_sequences_and_gives_their_labels(tmp_path, tokenizer, state):
    data = DataConfig(train_files=[write_jsonl(tmp_path / "kto.jsonl", varied_examples(8))], max_seq_len=64,
                      packing=False, shuffle=False, cache_dir=str(tmp_path / "c"))
    run = Config("kto", ModelConfig(), data, TrainConfig(per_device_train_batch_size=2, max_steps=1), ParallelConfig(),
                 PeftConfig(), CheckpointConfig(), MonitorConfig(), kto=KTOConfig())
    manager, _, _ = build_data(run, tokenizer, state)
    [(_, [batch])] = list(manager.steps(1))
    assert batch.inputs["sequence_ids"].max().item() == 3
    assert batch.sequences["desirable"].tolist() == [1.0, 1.0, 0.0, 0.0], "examples 0 and 1: desirable, undesirable"


def test_llamafactory_kto_entries_of_both_formattings_are_read_as_there(tmp_path, tokenizer):
    (tmp_path / "alpaca.json").write_text(json.dumps([{"question": "Add them.", "input": "2 and 3", "answer": "5",
                                                       "good": True, "sys": "Be exact."}]))
    (tmp_path / "sharegpt.json").write_text(json.dumps([{"messages": [USER, WRONG], "label": False}]))
    (tmp_path / "pairs.json").write_text(json.dumps([{"instruction": "Add them.", "chosen": "5", "rejected": "6"}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "alpaca_kto": {"file_name": "alpaca.json", "columns": {
            "prompt": "question", "query": "input", "response": "answer", "kto_tag": "good", "system": "sys"}},
        # kto_en_demo's entry.
        "sharegpt_kto": {"file_name": "sharegpt.json", "formatting": "sharegpt",
                         "columns": {"messages": "messages", "kto_tag": "label"},
                         "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                  "assistant_tag": "assistant"}},
        "answers": {"file_name": "alpaca.json", "columns": {"prompt": "question", "response": "answer"}},
        "pairs": {"file_name": "pairs.json", "ranking": True}}))
    data = DataConfig(dataset_info=str(tmp_path), datasets=["alpaca_kto", "sharegpt_kto"], packing=False)
    train, _, _ = build_datasets("kto", data, tokenizer, 0, LIMITS)
    # Two examples: each one's KL completion is the other's, rendered after its own prompt.
    assert train.to_list() == [
        {**pair_row(tokenizer, ALPACA_PROMPT, "5</s>", "It is 6.</s>"), "desirable": [1.0, 1.0]},
        {**pair_row(tokenizer, PROMPT, "It is 6.</s>", "5</s>"), "desirable": [0.0, 0.0]}]
    registry = tmp_path / "dataset_info.json"
    with pytest.raises(UserError, match=re.escape(f"data.datasets: 'answers' in {registry}: not KTO data; llmtune kto "
                                                  "trains responses labelled desirable or undesirable, which an entry "
                                                  "marks with its label column as columns.kto_tag")):
        build_datasets("kto", DataConfig(dataset_info=str(tmp_path), datasets=["answers"]), tokenizer, 0, LIMITS)
    with pytest.raises(UserError, match=re.escape(f"'pairs' in {registry}: " +
                                                  PREFERENCE.format(task="kto", key="data.datasets"))):
        build_datasets("kto", DataConfig(dataset_info=str(tmp_path), datasets=["pairs"]), tokenizer, 0, LIMITS)
    for task in ("sft", "dpo"):
        with pytest.raises(UserError, match=re.escape(f"'sharegpt_kto' in {registry}: " +
                                                      KTO.format(task=task, key="data.datasets"))):
            build_datasets(task, DataConfig(dataset_info=str(tmp_path), datasets=["sharegpt_kto"]), tokenizer, 0)


@pytest.mark.parametrize("rows", [
    [{"prompt": "What is 2 plus 3?", "chosen": "It is 5.", "rejected": "It is 6."}],
    [{"chosen": [USER, RIGHT], "rejected": [USER, WRONG]}],
])
def test_kto_refuses_preference_pairs_given_by_path(tmp_path, tokenizer, rows):
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(UserError) as err:
        build_datasets("kto", DataConfig(train_files=[path]), tokenizer, 0, LIMITS)
    assert str(err.value) == f"{path}: {PREFERENCE.format(task='kto', key='data.train_files')}"


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_sft_and_dpo_refuse_kto_rows_given_by_path(tmp_path, tokenizer, task):
    path = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "What is 2 plus 3?", "completion": "It is 5.",
                                                 "label": True}])
    with pytest.raises(UserError) as err:
        build_datasets(task, DataConfig(train_files=[path]), tokenizer, 0)
    assert str(err.value) == f"{path}: {KTO.format(task=task, key='data.train_files')}"


def test_the_statistics_count_examples_desirable_and_undesirable(tmp_path, tokenizer):
    data = DataConfig(train_files=[write_jsonl(tmp_path / "kto.jsonl", varied_examples(24))], max_seq_len=96)
    train, val, counts = build_datasets("kto", data, tokenizer, 0, LIMITS)
    stats = describe("kto", train, val, None, counts, data, 4, 0, None)
    assert stats.samples == 24 and stats.desirable == 6 and stats.rows == len(train) == 24
    assert stats.summary().startswith("24 examples (6 desirable, 18 undesirable), each micro-batch's packed into one "
                                      "row, ")
    assert ", 0 truncated (0.0%), 0 dropped (0.0%), efficiency " in stats.summary()
    assert stats.summary().endswith("0 validation examples")


def test_the_preview_shows_each_examples_prompt_completion_and_label_not_its_kl_sequence(tmp_path, tokenizer, capsys):
    path = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": [USER], "completion": [RIGHT], "label": True},
                                                {"prompt": [USER], "completion": [WRONG], "label": False}])
    train, _, _ = build_datasets("kto", DataConfig(train_files=[path], packing=False), tokenizer, 0, LIMITS)
    show_examples(tokenizer, train, 2, color=False)
    prompt = len(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    right, wrong = (len(tokenizer(PROMPT + text, add_special_tokens=False)["input_ids"]) - prompt
                    for text in ("It is 5.</s>", "It is 6.</s>"))
    assert capsys.readouterr().out == (
        "(each example's KL sequence, its prompt with the previous example's completion, is not shown)\n\n"
        f"example 1: desirable, prompt {prompt} tokens, completion {right} tokens ({right} trained)\n"
        f"prompt:\n{PROMPT}\ncompletion:\n[[It is 5.</s>]]\n\n"
        f"example 2: undesirable, prompt {prompt} tokens, completion {wrong} tokens ({wrong} trained)\n"
        f"prompt:\n{PROMPT}\ncompletion:\n[[It is 6.</s>]]\n\n")
