"""Chat data as users have it — tool calls, tool and developer turns, reasoning, LLaMA-Factory's sharegpt and
dataset_info.json, alpaca with history, TRL's prompt/completion — read from files the tests write, through the whole
build, to the exact input_ids and labels.

The expected ids come from literal text (what the test's template must render), cut into (text, trained) segments
and tokenized one by one — not from the code under test. The tokenizer is a byte-level BPE trained here on a few
lines, so every character encodes and offsets exist, as for the tokenizers users fine-tune.
"""

import json
import re

import datasets
import pytest

from llmtune.config import DataConfig
from llmtune.data.build import build_datasets
from llmtune.errors import UserError
from llmtune.model.loss import IGNORE_INDEX
from tests.helpers import byte_level_tokenizer, segment_ids as expected

# A ChatML template in the style of Qwen2.5's: tools in the system block, tool calls after the content, tool
# results as their own turn, reasoning in <think> before the answer.
CHATML = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Like Qwen3's: the reasoning of an assistant turn is rendered only when it is the last turn, so adding a turn
# rewrites the ones before. MARKED is the same template with generation markers around the assistant's output.
REWRITING = CHATML.replace("{% if m.reasoning_content %}", "{% if m.reasoning_content and loop.last %}")
MARKED = REWRITING.replace(
    "<|im_start|>assistant\n{% if m.reasoning_content and loop.last %}",
    "<|im_start|>assistant\n{% generation %}{% if m.reasoning_content and loop.last %}").replace(
    "</tool_call>{% endfor %}<|im_end|>\n", "</tool_call>{% endfor %}<|im_end|>\n{% endgeneration %}")

ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return byte_level_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"), CHATML)


def encoded(tmp_path, tokenizer, rows, **data):
    """The first sample of `rows` written as a file and built as a run builds it (no packing)."""
    path = tmp_path / f"rows{len(list(tmp_path.iterdir()))}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = DataConfig(train_files=[str(path)], packing=False, max_seq_len=512, cache_dir=str(tmp_path / "c"), **data)
    train, _, _ = build_datasets("sft", config, tokenizer, 0)
    return train[0]["input_ids"], train[0]["labels"]


def tools_block(tools, system=""):
    return "<|im_start|>system\n" + (f"{system}\n\n" if system else "") + "# Tools\n" + \
        "".join(json.dumps(t) + "\n" for t in tools) + "<|im_end|>\n"


TOOL_TURNS = [
    ("<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n", False),
    ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>\n', True),
    ("<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n", False),
    ("It is 5.<|im_end|>\n", True),
]


@pytest.mark.parametrize("content", [None, ""])
def test_tool_calls_with_null_or_empty_content_and_a_tools_column_reach_the_template(tmp_path, chat_tokenizer,
                                                                                      content):
    row = {"messages": [{"role": "developer", "content": "Use the tools."},
                        {"role": "user", "content": "What is 2 plus 3?"},
                        {"role": "assistant", "content": content,
                         "tool_calls": [{"type": "function", "function": CALL}]},
                        {"role": "tool", "content": "5"},
                        {"role": "assistant", "content": "It is 5."}],
           "tools": [ADD]}
    want = expected(chat_tokenizer, [(tools_block([ADD]) + "<|im_start|>developer\nUse the tools.<|im_end|>\n", False),
                                     *TOOL_TURNS])
    assert encoded(tmp_path, chat_tokenizer, [row]) == want


def test_reasoning_is_rendered_and_trained_by_default_and_left_out_of_the_loss_when_asked(tmp_path, chat_tokenizer):
    row = {"messages": [{"role": "user", "content": "What is 2 plus 3?"},
                        {"role": "assistant", "content": "It is 5.", "reasoning_content": "I add them."}]}
    prompt = ("<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n", False)
    on = expected(chat_tokenizer, [prompt, ("<think>\nI add them.\n</think>\n\nIt is 5.<|im_end|>\n", True)])
    off = expected(chat_tokenizer, [prompt, ("<think>\n", True), ("I add them.", False),
                                    ("\n</think>\n\nIt is 5.<|im_end|>\n", True)])
    assert encoded(tmp_path, chat_tokenizer, [row]) == on
    assert encoded(tmp_path, chat_tokenizer, [row], train_on_reasoning=False) == off
    thinking = {"messages": [row["messages"][0],
                             {"role": "assistant", "content": "It is 5.", "thinking": "I add them."}]}
    assert encoded(tmp_path, chat_tokenizer, [thinking]) == on, "gpt-oss's name for the reasoning is read too"


def test_reasoning_a_template_does_not_render_is_refused(tmp_path, chat_tokenizer):
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello",
                                                             "reasoning_content": "Greet back."}]}
    silent = CHATML.replace("{% if m.reasoning_content %}", "{% if false %}")
    tokenizer = chat_tokenizer.__class__.from_pretrained(chat_tokenizer.name_or_path, chat_template=silent)
    with pytest.raises(UserError, match=r"rows\d.jsonl: row 1: the chat template of .* does not render the "
                                        r"assistant's reasoning"):
        encoded(tmp_path, tokenizer, [row])


def test_llamafactory_sharegpt_with_function_call_and_observation(tmp_path, chat_tokenizer):
    row = {"conversations": [{"from": "human", "value": "What is 2 plus 3?"},
                              {"from": "function_call", "value": json.dumps(CALL)},
                              {"from": "observation", "value": "5"},
                              {"from": "gpt", "value": "It is 5."}],
           "system": "Use the tools.", "tools": json.dumps([ADD])}
    assert encoded(tmp_path, chat_tokenizer, [row]) == expected(chat_tokenizer, [(tools_block([ADD], "Use the tools."),
                                                                                  False), *TOOL_TURNS])


def test_alpaca_history_turns_are_used_and_instruction_and_input_join_with_a_newline(tmp_path, chat_tokenizer):
    row = {"instruction": "Add them.", "input": "2 and 3", "output": "5", "system": "Be exact.",
           "history": [["What is 1 plus 1?", "2"], ["And 2 plus 2?", "4"]]}
    want = expected(chat_tokenizer, [
        ("<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\nWhat is 1 plus 1?<|im_end|>\n"
         "<|im_start|>assistant\n", False), ("2<|im_end|>\n", True),
        ("<|im_start|>user\nAnd 2 plus 2?<|im_end|>\n<|im_start|>assistant\n", False), ("4<|im_end|>\n", True),
        ("<|im_start|>user\nAdd them.\n2 and 3<|im_end|>\n<|im_start|>assistant\n", False), ("5<|im_end|>\n", True)])
    assert encoded(tmp_path, chat_tokenizer, [row]) == want


def test_trl_prompt_completion_as_strings_trains_the_completion_without_a_template(tmp_path, chat_tokenizer):
    ids, labels = encoded(tmp_path, chat_tokenizer, [{"prompt": "What is 2 plus 3?", "completion": " It is 5."}])
    want = expected(chat_tokenizer, [("What is 2 plus 3?", False), (" It is 5.<|im_end|>", True)])
    assert (ids, labels) == want


def test_trl_prompt_completion_as_conversations_trains_the_completion_only(tmp_path, chat_tokenizer):
    row = {"prompt": [{"role": "user", "content": "What is 1 plus 1?"}, {"role": "assistant", "content": "2"},
                      {"role": "user", "content": "And 2 plus 3?"}],
           "completion": [{"role": "assistant", "content": "5"}]}
    want = expected(chat_tokenizer, [
        ("<|im_start|>user\nWhat is 1 plus 1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
         "<|im_start|>user\nAnd 2 plus 3?<|im_end|>\n<|im_start|>assistant\n", False), ("5<|im_end|>\n", True)])
    assert encoded(tmp_path, chat_tokenizer, [row]) == want
    as_messages = encoded(tmp_path, chat_tokenizer, [{"messages": row["prompt"] + row["completion"]}])
    assert as_messages[1] != want[1], "in a conversation every assistant turn trains"


def test_dataset_info_registry_with_column_and_tag_mappings(tmp_path, chat_tokenizer):
    (tmp_path / "qa.json").write_text(json.dumps([{"question": "Add them.", "numbers": "2 and 3", "answer": "5",
                                                   "hist": [["What is 1 plus 1?", "2"]], "sys": "Be exact."}]))
    (tmp_path / "calls.jsonl").write_text(json.dumps({
        "dialog": [{"speaker": "person", "text": "What is 2 plus 3?"}, {"speaker": "call", "text": json.dumps(CALL)},
                   {"speaker": "result", "text": "5"}, {"speaker": "bot", "text": "It is 5."}],
        "functions": json.dumps([ADD])}) + "\n")
    registry = {
        "qa": {"file_name": "qa.json",
               "columns": {"prompt": "question", "query": "numbers", "response": "answer", "history": "hist",
                           "system": "sys"}},
        "calls": {"file_name": "calls.jsonl", "formatting": "sharegpt",
                  "columns": {"messages": "dialog", "tools": "functions"},
                  "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "person", "assistant_tag": "bot",
                           "observation_tag": "result", "function_tag": "call"}},
        "pairs": {"file_name": "qa.json", "ranking": True},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(registry))
    config = DataConfig(dataset_info=str(tmp_path), datasets=["qa", "calls"], packing=False, shuffle=False,
                        cache_dir=str(tmp_path / "c"))
    train, _, _ = build_datasets("sft", config, chat_tokenizer, 0)
    assert (train[0]["input_ids"], train[0]["labels"]) == expected(chat_tokenizer, [
        ("<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\nWhat is 1 plus 1?<|im_end|>\n"
         "<|im_start|>assistant\n", False), ("2<|im_end|>\n", True),
        ("<|im_start|>user\nAdd them.\n2 and 3<|im_end|>\n<|im_start|>assistant\n", False), ("5<|im_end|>\n", True)])
    assert (train[1]["input_ids"], train[1]["labels"]) == expected(chat_tokenizer, [(tools_block([ADD]), False),
                                                                                    *TOOL_TURNS])
    with pytest.raises(UserError, match=r"data.datasets: 'pairs' in .*dataset_info.json: preference data "
                                        r"\(chosen/rejected columns, or ranking: true\) is for llmtune dpo or llmtune rm, not sft; "
                                        r"train it with llmtune dpo or llmtune rm, or leave it out of data.datasets"):
        build_datasets("sft", DataConfig(dataset_info=str(tmp_path), datasets=["pairs"]), chat_tokenizer, 0)
    with pytest.raises(UserError, match=r"no dataset 'cals' in .*dataset_info.json; did you mean calls"):
        build_datasets("sft", DataConfig(dataset_info=str(tmp_path), datasets=["cals"]), chat_tokenizer, 0)


def write_rows(path, rows):
    """`rows` as a data file of path's kind: a JSON array, JSON lines, Parquet or CSV (as pandas writes it)."""
    if path.suffix in (".json", ".jsonl"):
        path.write_text(json.dumps(rows) if path.suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        datasets.Dataset.from_list(rows).to_csv(str(path), index=False)
    return str(path)


USER = {"role": "user", "content": "What is 2 plus 3?"}
RIGHT, WRONG = {"role": "assistant", "content": "It is 5."}, {"role": "assistant", "content": "It is 6."}
PAIR = {"prompt": "What is 2 plus 3?", "chosen": "It is 5.", "rejected": "It is 6."}
KTO_ROWS = [{"prompt": "What is 2 plus 3?", "completion": "It is 5.", "label": True},
            {"prompt": "What is 2 plus 3?", "completion": "It is 6.", "label": False}]
# The refusals of a task's rows given to another task: {task}, and {key} naming the sources.
PREFERENCE = ("preference data (chosen/rejected columns, or ranking: true) is for llmtune dpo or llmtune rm, not {task}; "
              "train it with llmtune dpo or llmtune rm, or leave it out of {key}")
KTO = ("KTO data (kto_tag, or a true/false label column) is for llmtune kto, not {task}; train it with llmtune kto, "
       "or leave it out of {key}")


@pytest.mark.parametrize("task, name, rows, data_format, reason", [
    ("sft", "trl_explicit_prompt.jsonl", [PAIR], "auto", PREFERENCE),
    ("sft", "trl_implicit_prompt.json", [{"chosen": [USER, RIGHT], "rejected": [USER, WRONG]}], "auto", PREFERENCE),
    ("sft", "dpo_en_demo.json", [{"conversations": [{"from": "human", "value": "What is 2 plus 3?"}],
                                  "chosen": {"from": "gpt", "value": "It is 5."},
                                  "rejected": {"from": "gpt", "value": "It is 6."}}], "sharegpt", PREFERENCE),
    ("sft", "v1_dpo_demo.jsonl", [{"chosen_messages": [USER, RIGHT], "rejected_messages": [USER, WRONG]}], "auto",
     PREFERENCE),
    ("sft", "pairs.csv", [PAIR], "auto", PREFERENCE),
    ("sft", "trl_kto.parquet", KTO_ROWS, "auto", KTO),
    ("sft", "trl_kto.csv", KTO_ROWS, "prompt_completion", KTO),
    ("sft", "kto_en_demo.json", [{"messages": [USER, RIGHT], "label": True},
                                 {"messages": [USER, WRONG], "label": False}], "messages", KTO),
    ("pt", "trl_kto.jsonl", KTO_ROWS, "auto", KTO),
    ("pt", "pairs.jsonl", [PAIR], "auto", PREFERENCE),
    ("dpo", "trl_kto.jsonl", KTO_ROWS, "auto", KTO),
])
def test_preference_and_kto_rows_given_by_path_are_refused_with_the_reason(tmp_path, chat_tokenizer, task, name,
                                                                          rows, data_format, reason):
    path = write_rows(tmp_path / name, rows)
    config = DataConfig(train_files=[path], format=data_format, cache_dir=str(tmp_path / "c"))
    with pytest.raises(UserError) as err:
        build_datasets(task, config, chat_tokenizer, 0)
    assert str(err.value) == f"{path}: {reason.format(task=task, key='data.train_files')}"


def test_a_validation_source_and_a_dataset_info_entry_of_kto_rows_give_the_same_reason(tmp_path, chat_tokenizer):
    train = write_rows(tmp_path / "qa.jsonl", [{"messages": [USER, RIGHT]}] * 4)
    kto = write_rows(tmp_path / "kto.json", [{"messages": [USER, RIGHT], "label": True}])
    with pytest.raises(UserError, match=re.escape(f"{kto}: {KTO.format(task='sft', key='data.val_files')}")):
        build_datasets("sft", DataConfig(train_files=[train], val_files=[kto], cache_dir=str(tmp_path / "c")),
                       chat_tokenizer, 0)
    (tmp_path / "dataset_info.json").write_text(json.dumps({"kto": {
        "file_name": "kto.json", "formatting": "sharegpt", "columns": {"messages": "messages", "kto_tag": "label"}}}))
    with pytest.raises(UserError, match=re.escape(f"'kto' in {tmp_path / 'dataset_info.json'}: "
                                                  f"{KTO.format(task='sft', key='data.datasets')}")):
        build_datasets("sft", DataConfig(dataset_info=str(tmp_path), datasets=["kto"]), chat_tokenizer, 0)


@pytest.mark.parametrize("task, name, rows", [
    ("pt", "topics.jsonl", [{"text": "What is 2 plus 3? It is 5.", "label": "sums"}] * 4),
    ("pt", "topics.csv", [{"text": "What is 2 plus 3? It is 5.", "label": "true story"}] * 4),
    ("sft", "graded.parquet", [{"prompt": "What is 2 plus 3?", "completion": "It is 5.", "label": 1}] * 4),
])
def test_a_label_column_that_is_not_true_or_false_is_not_read_as_kto(tmp_path, chat_tokenizer, task, name, rows):
    config = DataConfig(train_files=[write_rows(tmp_path / name, rows)], pt_remainder="pad",
                        cache_dir=str(tmp_path / "c"))
    train, _, _ = build_datasets(task, config, chat_tokenizer, 0)
    assert len(train)


def rewritten_conversation(reasoning):
    return {"messages": [{"role": "user", "content": "What is 1 plus 1?"},
                         {"role": "assistant", "content": "2", "reasoning_content": "One and one."},
                         {"role": "user", "content": "And 2 plus 3?"},
                         {"role": "assistant", "content": "5", "reasoning_content": reasoning}]}


def test_a_template_that_rewrites_earlier_turns_is_refused_without_generation_markers(tmp_path, chat_tokenizer):
    tokenizer = chat_tokenizer.__class__.from_pretrained(chat_tokenizer.name_or_path, chat_template=REWRITING)
    with pytest.raises(UserError, match=r"row 1: the chat template of .* renders earlier turns differently once later "
                                        r"turns are added .* set data.chat_template to a template that marks each "
                                        r"assistant output with \{% generation %\}"):
        encoded(tmp_path, tokenizer, [rewritten_conversation("I add them.")])


@pytest.mark.parametrize("train_on_reasoning", [True, False])
def test_a_template_that_rewrites_earlier_turns_is_labelled_by_its_generation_markers(tmp_path, chat_tokenizer,
                                                                                      train_on_reasoning):
    template = tmp_path / "marked.jinja"
    template.write_text(MARKED)
    tokenizer = chat_tokenizer.__class__.from_pretrained(chat_tokenizer.name_or_path)
    tokenizer.chat_template = MARKED
    # One rendering, tokenized whole; a token is trained when a character of it lies in an assistant's output.
    pieces = [("<|im_start|>user\nWhat is 1 plus 1?<|im_end|>\n<|im_start|>assistant\n", False),
              ("2<|im_end|>\n", True),
              ("<|im_start|>user\nAnd 2 plus 3?<|im_end|>\n<|im_start|>assistant\n", False),
              ("<think>\n", True), ("I add them.", train_on_reasoning), ("\n</think>\n\n5<|im_end|>\n", True)]
    text = "".join(piece for piece, _ in pieces)
    trained_chars, start = set(), 0
    for piece, trained in pieces:
        if trained:
            trained_chars.update(range(start, start + len(piece)))
        start += len(piece)
    whole = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    want_labels = [t if trained_chars & set(range(a, b)) else IGNORE_INDEX
                   for t, (a, b) in zip(whole["input_ids"], whole["offset_mapping"])]
    ids, labels = encoded(tmp_path, tokenizer, [rewritten_conversation("I add them.")],
                          chat_template=str(template), train_on_reasoning=train_on_reasoning)
    assert ids == whole["input_ids"] and labels == want_labels
    assert "One and one." not in tokenizer.decode(ids), "the template dropped the earlier turn's reasoning"


@pytest.mark.parametrize("rows, message", [
    ([{"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "5"},
                    {"role": "assistant", "content": "Ok"}]}],
     r"row 1: message 1 is a tool result after a user turn with no tool call before it"),
    ([{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
      {"conversations": [{"from": "human", "value": "Hi"}, {"from": "robot", "value": "Hello"}]}],
     r"row 2: field 'conversations' turn 1 has from 'robot'; expected one of .*human, gpt, observation, function_call"),
    ([{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]}],
     r"row 1: field 'messages' turn 1 needs a string 'content' \(null only beside tool_calls\)"),
    ([{"conversations": [{"from": "human", "value": "Hi"}, {"from": "function_call", "value": "add(2, 3)"}]}],
     r"row 1: field 'conversations' turn 1: a function_call turn holds JSON of a tool call"),
    ([{"prompt": "Hi", "completion": [{"role": "assistant", "content": "Hello"}]}],
     r"row 1: fields 'prompt' and 'completion' must both be strings or both lists"),
])
def test_bad_rows_name_the_file_row_and_field(tmp_path, chat_tokenizer, rows, message):
    with pytest.raises(UserError, match=message):
        encoded(tmp_path, chat_tokenizer, rows)


def test_every_token_labelled_is_counted_and_refused_when_it_is_every_sample_unless_train_on_prompt(tmp_path,
                                                                                                     chat_tokenizer):
    rows = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10, 11]}]
    with pytest.raises(UserError, match="every token of all 2 training samples is labelled"):
        encoded(tmp_path, chat_tokenizer, rows)
    assert encoded(tmp_path, chat_tokenizer, rows, train_on_prompt=True) == ([5, 6, 7, 8], [5, 6, 7, 8])
    # A sample dropped as too long leaves an empty row in the split's table: it is not counted as labelled.
    mixed = rows + [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": list(range(9))}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    config = DataConfig(train_files=[str(path)], packing=False, max_seq_len=8, truncation="drop",
                        cache_dir=str(tmp_path / "c"))
    _, _, counts = build_datasets("sft", config, chat_tokenizer, 0)
    assert counts == {"truncated": 0, "dropped_too_long": 1, "dropped_no_labels": 0, "fully_labelled": 2,
                      "dropped_tail_tokens": 0}
