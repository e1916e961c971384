"""Preference pairs (dpo's rows): every form read to the canonical pair, LLaMA-Factory's ranking entries, the prompt
prefix check, the refusals, the truncation policy, packing whole pairs, the collator's sequence numbering, the cache
key, the statistics and `llmtune data`'s view of pairs.

Expected ids come from literal text (what the built-in `basic` template must render), tokenized whole as the pair's
sequences are, never from the code under test.
"""

import json
import re

import pytest
import torch

from llmtune.config import (CheckpointConfig, Config, DataConfig, DPOConfig, ModelConfig, MonitorConfig,
                            ParallelConfig, PeftConfig, TrainConfig, load_config)
from llmtune.data.build import build_datasets, cache_key, describe, load_or_build
from llmtune.data.collate import collate
from llmtune.data.formats import detect_format, to_canonical
from llmtune.data.packing import pack_units
from llmtune.data.manager import build_data
from llmtune.data.preference import PairLimits, fit_pair
from llmtune.data.preview import show_pairs
from llmtune.data.sft import KEPT, TRUNCATED
from llmtune.errors import UserError
from llmtune.model.loss import IGNORE_INDEX
from llmtune.run.parallel import ParallelState

LIMITS = PairLimits(max_length=256, max_prompt_length=None, truncation=True)
USER = {"role": "user", "content": "What is 2 plus 3?"}
RIGHT, WRONG = {"role": "assistant", "content": "It is 5."}, {"role": "assistant", "content": "It is 6."}
# The basic template's renderings of USER: as a prompt (add_generation_prompt), and with each answer after it.
PROMPT = "<s>### Instruction:\nWhat is 2 plus 3?\n\n### Response:\n"


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def canonical(row: dict) -> tuple[str, dict]:
    """(the detected form, the canonical pair) of one row given by path."""
    row_format = detect_format(list(row), "dpo", "auto", "pairs.jsonl")
    return row_format.form, to_canonical(row, row_format, "pairs.jsonl: row 1")["pair"]


def system(text):
    return {"role": "system", "content": text}


def message(role, text):
    return {"role": role, "content": text}


@pytest.mark.parametrize("row, form, pair", [
    ({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}, "prompt_chosen_rejected",
     {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}),
    ({"prompt": [USER], "chosen": [RIGHT], "rejected": [WRONG], "system": "Be brief."}, "prompt_chosen_rejected",
     {"prompt": [system("Be brief."), USER], "chosen": [RIGHT], "rejected": [WRONG]}),
    ({"prompt": [USER], "chosen": [RIGHT], "rejected": [WRONG], "tools": '[{"name": "add"}]'}, "prompt_chosen_rejected",
     {"prompt": [USER], "chosen": [RIGHT], "rejected": [WRONG], "tools": [{"name": "add"}]}),
    # TRL's implicit prompt: the shared beginning; a difference after a space leaves the space to the responses.
    ({"chosen": "Q: the sky? A: blue", "rejected": "Q: the sky? A: green"}, "chosen_rejected",
     {"prompt": "Q: the sky? A:", "chosen": " blue", "rejected": " green"}),
    ({"chosen": "Q: 2+3? A:5", "rejected": "Q: 2+3? A:6"}, "chosen_rejected",
     {"prompt": "Q: 2+3? A:", "chosen": "5", "rejected": "6"}),
    ({"chosen": [system("Be brief."), USER, RIGHT], "rejected": [system("Be brief."), USER, WRONG]}, "chosen_rejected",
     {"prompt": [system("Be brief."), USER], "chosen": [RIGHT], "rejected": [WRONG]}),
    # LLaMA-Factory's ranking files given by path: alpaca (instruction\ninput, history, system) and sharegpt.
    ({"instruction": "Add them.", "input": "2 and 3", "chosen": "5", "rejected": "6", "system": "Be exact.",
      "history": [["What is 1 plus 1?", "2"]]}, "alpaca_ranking",
     {"prompt": [system("Be exact."), message("user", "What is 1 plus 1?"), message("assistant", "2"),
                 message("user", "Add them.\n2 and 3")],
      "chosen": [message("assistant", "5")], "rejected": [message("assistant", "6")]}),
    ({"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is 2 plus 3?"}],
      "chosen": {"from": "gpt", "value": "It is 5."}, "rejected": {"from": "gpt", "value": "It is 6."}},
     "sharegpt_ranking", {"prompt": [system("Be brief."), USER], "chosen": [RIGHT], "rejected": [WRONG]}),
])
def test_every_form_is_read_to_the_canonical_pair(row, form, pair):
    assert canonical(row) == (form, pair)


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "Hi", "chosen": "Hello", "rejected": "Hey", "system": "Be brief."},
     r"field 'system' needs a chat template, and string pairs are trained without one"),
    ({"prompt": [USER], "chosen": "It is 5.", "rejected": [WRONG]},
     r"fields 'prompt', 'chosen' and 'rejected' must all be strings or all lists of messages"),
    ({"chosen": "It is 5.", "rejected": "It is 5. Sure."},
     r"field 'chosen' holds nothing besides the beginning it shares with the other response"),
    ({"chosen": [message("user", "A?"), RIGHT], "rejected": [message("user", "B?"), WRONG]},
     r"the pair has no prompt: chosen and rejected share no leading turn"),
    ({"prompt": [USER], "chosen": [message("user", "Well?")], "rejected": [WRONG]},
     r"field 'chosen' must begin with the assistant's answer to the prompt, not a user turn"),
    ({"conversations": [{"from": "human", "value": "Hi"}], "chosen": [{"from": "gpt", "value": "Hello"}],
      "rejected": {"from": "gpt", "value": "Hey"}}, r"field 'chosen' must be one message object"),
])
def test_a_pair_that_does_not_fit_its_form_is_refused_naming_the_field(row, problem):
    with pytest.raises(UserError, match=r"^pairs.jsonl: row 1: " + problem):
        canonical(row)


STRINGS = {"prompt": "Why?", "chosen": "Because.", "rejected": "No."}
SHAREGPT = {"conversations": [{"from": "human", "value": "Why?"}], "chosen": {"from": "gpt", "value": "Because."},
            "rejected": {"from": "gpt", "value": "No."}}


@pytest.mark.parametrize("good, bad, field, what", [
    (STRINGS, {**STRINGS, "chosen": None}, "chosen", "missing"),
    (STRINGS, {**STRINGS, "rejected": ""}, "rejected", "empty"),
    (STRINGS, {"prompt": "Why?", "rejected": "No."}, "chosen", "missing"),
    (SHAREGPT, {**SHAREGPT, "rejected": {}}, "rejected", "empty"),
])
def test_a_row_without_chosen_or_rejected_is_refused_naming_file_row_and_field(tmp_path, tokenizer, good, bad, field,
                                                                              what):
    path = write_jsonl(tmp_path / "pairs.jsonl", [good, bad])
    data = DataConfig(train_files=[path], cache_dir=str(tmp_path / "c"))
    with pytest.raises(UserError) as err:
        build_datasets("dpo", data, tokenizer, 0, LIMITS)
    assert str(err.value).startswith(f"{path}: row 2: field '{field}' is {what}; every pair needs a chosen and a "
                                     "rejected response")


def pair_row(tokenizer, prompt_text: str, chosen_text: str, rejected_text: str, with_bos: bool = False) -> dict:
    """The row a pair must become, from its literal texts: each sequence tokenized whole (prompt + response), the
    prompt's tokens untrained, chosen first. with_bos: the string form, where the prompt alone is tokenized with the
    tokenizer's BOS and each response alone, then EOS."""
    if with_bos:
        prompt = tokenizer(prompt_text)["input_ids"]
        responses = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                     for text in (chosen_text, rejected_text)]
    else:
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        responses = [tokenizer(prompt_text + text, add_special_tokens=False)["input_ids"][len(prompt):]
                     for text in (chosen_text, rejected_text)]
    row = {"input_ids": [], "labels": [], "position_ids": []}
    for response in responses:
        row["input_ids"] += prompt + response
        row["labels"] += [IGNORE_INDEX] * len(prompt) + response
        row["position_ids"] += list(range(len(prompt) + len(response)))
    return row


def test_pairs_become_rows_of_prompt_and_chosen_then_prompt_and_rejected_with_their_margin(tmp_path, tokenizer):
    """TRL's margin column is kept, one value per sequence; a pair without one has margin 0."""
    rows = [{"prompt": [USER], "chosen": [RIGHT], "rejected": [WRONG]},
            {"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "margin": 2}]
    data = DataConfig(train_files=[write_jsonl(tmp_path / "pairs.jsonl", rows)], packing=False,
                      cache_dir=str(tmp_path / "c"))
    train, _, counts = build_datasets("dpo", data, tokenizer, 0, LIMITS)
    assert train[0] == {**pair_row(tokenizer, PROMPT, "It is 5.</s>", "It is 6.</s>"), "margin": [0.0, 0.0]}
    assert train[1] == {**pair_row(tokenizer, "The sky is", " blue.", " green.", with_bos=True), "margin": [2.0, 2.0]}
    assert counts["truncated"] == 0


def test_llamafactory_ranking_entries_of_both_formattings_are_read_as_there(tmp_path, tokenizer):
    (tmp_path / "alpaca.json").write_text(json.dumps([{"question": "Add them.", "input": "2 and 3", "good": "5",
                                                       "bad": "6", "sys": "Be exact."}]))
    (tmp_path / "sharegpt.json").write_text(json.dumps([{"dialog": [{"speaker": "person", "text": "What is 2 plus 3?"}],
                                                         "better": {"speaker": "bot", "text": "It is 5."},
                                                         "worse": {"speaker": "bot", "text": "It is 6."}}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "alpaca_pairs": {"file_name": "alpaca.json", "ranking": True, "columns": {
            "prompt": "question", "query": "input", "chosen": "good", "rejected": "bad", "system": "sys"}},
        "sharegpt_pairs": {"file_name": "sharegpt.json", "ranking": True, "formatting": "sharegpt",
                           "columns": {"messages": "dialog", "chosen": "better", "rejected": "worse"},
                           "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "person",
                                    "assistant_tag": "bot"}},
        "answers": {"file_name": "alpaca.json"}}))
    data = DataConfig(dataset_info=str(tmp_path), datasets=["alpaca_pairs", "sharegpt_pairs"], packing=False,
                      shuffle=False, cache_dir=str(tmp_path / "c"))
    train, _, _ = build_datasets("dpo", data, tokenizer, 0, LIMITS)
    assert train[0] == {**pair_row(tokenizer, "<s>Be exact.\n\n### Instruction:\nAdd them.\n2 and 3\n\n"
                                              "### Response:\n", "5</s>", "6</s>"), "margin": [0.0, 0.0]}
    assert train[1] == {**pair_row(tokenizer, PROMPT, "It is 5.</s>", "It is 6.</s>"), "margin": [0.0, 0.0]}
    with pytest.raises(UserError, match=re.escape(f"data.datasets: 'answers' in {tmp_path / 'dataset_info.json'}: not "
                                                  "preference data; llmtune dpo trains pairs of a chosen and a rejected "
                                                  "response, which an entry marks with ranking: true")):
        build_datasets("dpo", DataConfig(dataset_info=str(tmp_path), datasets=["answers"]), tokenizer, 0, LIMITS)
    with pytest.raises(UserError, match=re.escape("'sharegpt_pairs' in " + str(tmp_path / "dataset_info.json") +
                                                  ": preference data (chosen/rejected columns, or ranking: true) is "
                                                  "for llmtune dpo or llmtune rm, not sft")):
        build_datasets("sft", DataConfig(dataset_info=str(tmp_path), datasets=["sharegpt_pairs"]), tokenizer, 0)


# Renders the prompt's generation cue as "### Answer:" but an assistant turn after it as "### Response:".
SHIFTING = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}### Instruction:\n{{ m['content'] }}\n\n"
            "{% else %}### Response:\n{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}### Answer:\n{% endif %}")


def with_template(tmp_path, tokenizer, text: str):
    """(the template's file, a copy of the tokenizer with it, a file of one pair, the data section reading both)."""
    template = tmp_path / "template.jinja"
    template.write_text(text)
    copy = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    copy.chat_template = text
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": [USER], "chosen": [RIGHT], "rejected": [WRONG]}])
    return template, copy, path, DataConfig(train_files=[path], chat_template=str(template),
                                            cache_dir=str(tmp_path / "c"))


def test_a_template_that_renders_the_prompt_differently_once_the_answer_follows_is_refused(tmp_path, tokenizer):
    template, shifting, path, data = with_template(tmp_path, tokenizer, SHIFTING)
    prompt = shifting("<s>### Instruction:\nWhat is 2 plus 3?\n\n### Answer:\n", add_special_tokens=False)["input_ids"]
    full = shifting("<s>### Instruction:\nWhat is 2 plus 3?\n\n### Response:\nIt is 5.</s>",
                    add_special_tokens=False)["input_ids"]
    first = next(i for i, (a, b) in enumerate(zip(prompt, full)) if a != b)
    with pytest.raises(UserError) as err:
        build_datasets("dpo", data, shifting, 0, LIMITS)
    assert str(err.value) == (
        f"{path}: row 1: data.chat_template {str(template)!r} renders the prompt differently once the chosen response "
        f"follows it: token {first} of the prompt (rendered with add_generation_prompt) is "
        f"{shifting.decode([prompt[first]])!r}, of the prompt + chosen {shifting.decode([full[first]])!r}, so the "
        "response cannot be told from the prompt; set data.chat_template to a template whose prompt rendering begins "
        "the whole conversation's")
    assert shifting.decode([prompt[first]]) != shifting.decode([full[first]])


# Ends the prompt with " ?" where the answer is still to come, not once it follows: the first token that differs is
# a lone space, which sentencepiece decodes to nothing.
SPACED = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}### Instruction: {{ m['content'] }}"
          "{% if loop.last and add_generation_prompt %} ?{% endif %} ### Response:"
          "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def test_a_differing_token_that_decodes_to_nothing_is_quoted_as_the_vocabulary_names_it(tmp_path, tokenizer):
    _, spaced, _, data = with_template(tmp_path, tokenizer, SPACED)
    prompt = spaced("<s>### Instruction: What is 2 plus 3? ? ### Response:", add_special_tokens=False)["input_ids"]
    first = len(spaced("<s>### Instruction: What is 2 plus 3?", add_special_tokens=False)["input_ids"])
    assert spaced.decode([prompt[first]]) == "" and spaced.convert_ids_to_tokens(prompt[first]) == "\u2581"
    with pytest.raises(UserError, match=re.escape(f"token {first} of the prompt (rendered with add_generation_prompt) "
                                                  "is '\u2581', of the prompt + chosen '###', so the response")):
        build_datasets("dpo", data, spaced, 0, LIMITS)


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


@pytest.mark.parametrize("lengths, limits, kept", [
    # (prompt, chosen, rejected) lengths -> (status, prompt kept from its end, chosen and rejected kept from their start)
    ((4, 3, 2), PairLimits(10, None, True), (KEPT, 4, 3, 2)),
    # prompt 8 + longer 4 > 10: the prompt keeps max(10 - 4, 5) = 6, the responses 10 - 6 = 4 each.
    ((8, 4, 2), PairLimits(10, None, True), (TRUNCATED, 6, 4, 2)),
    # prompt 8 + longer 9 > 10: the prompt keeps max(10 - 9, 5) = 5, the responses 5.
    ((8, 9, 3), PairLimits(10, None, True), (TRUNCATED, 5, 5, 3)),
    # A short prompt stays whole; the longer response is cut to what it leaves.
    ((3, 9, 2), PairLimits(10, None, True), (TRUNCATED, 3, 7, 2)),
    # max_prompt_length cuts the prompt even when the pair fits.
    ((6, 2, 2), PairLimits(20, 4, True), (TRUNCATED, 4, 2, 2)),
    ((6, 2, 2), PairLimits(20, 4, False), (TRUNCATED, 4, 2, 2)),
])
def test_the_truncation_policy_keeps_the_prompts_end_and_the_responses_beginnings(lengths, limits, kept):
    prompt, chosen, rejected = tokens(100, lengths[0]), tokens(200, lengths[1]), tokens(300, lengths[2])
    status, prompt_kept, chosen_kept, rejected_kept = fit_pair(prompt, chosen, rejected, limits, "row 1")
    assert (status, prompt_kept, chosen_kept, rejected_kept) == (kept[0], prompt[len(prompt) - kept[1]:],
                                                                 chosen[:kept[2]], rejected[:kept[3]])
    assert len(prompt_kept) + max(len(chosen_kept), len(rejected_kept)) <= limits.max_length


def test_an_overlong_pair_without_truncation_is_refused_naming_row_lengths_and_keys():
    with pytest.raises(UserError) as err:
        fit_pair(tokens(100, 8), tokens(200, 4), tokens(300, 2), PairLimits(10, None, False), "pairs.jsonl: row 3")
    assert str(err.value) == (
        "pairs.jsonl: row 3: the prompt (8 tokens) and the longer response (4 tokens; chosen 4, rejected 2) make a "
        "sequence of 12 tokens, over the 10 of dpo.max_length (default data.max_seq_len / 2); raise dpo.max_length (and "
        "data.max_seq_len, which holds two), set dpo.max_prompt_length, or set dpo.truncation: true to cut it")


def varied_pairs(count: int) -> list[dict]:
    return [{"prompt": f"Question {i}:" + " more" * (i % 7), "chosen": " yes" * (1 + i % 3), "rejected": " no" * (1 + i % 5)}
            for i in range(count)]


def sequences(row) -> list[tuple]:
    """(input_ids, labels, position_ids) of each sequence of a row, split where position_ids restart."""
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
    return [tuple(row[c][a:b] for c in ("input_ids", "labels", "position_ids")) for a, b in zip(starts, starts[1:])]


def test_a_micro_batchs_pairs_are_packed_whole_with_their_positions(tmp_path, tokenizer):
    """The data holds one pair a row, whether data.packing is on or off; packing.pack_units packs pairs whole into
    rows, and the collator a micro-batch's pairs into one row."""
    path = write_jsonl(tmp_path / "pairs.jsonl", varied_pairs(30))
    one_per_row, _, _ = build_datasets("dpo", DataConfig(train_files=[path], packing=True, max_seq_len=96,
                                                         cache_dir=str(tmp_path / "c")), tokenizer, 0, LIMITS)
    packed = pack_units(list(one_per_row), 96)
    assert len(packed) < len(one_per_row) and all(len(row["input_ids"]) <= 96 for row in packed)
    batch = collate(list(one_per_row), pad_id=0, two_sequences=True, pack=True)
    assert len(batch.inputs["input_ids"]) == 1 and len(batch.sequences["length"]) == 60
    assert batch.num_tokens == sum(len(row["input_ids"]) for row in one_per_row)
    alone = sorted(tuple(map(tuple, seq)) for row in one_per_row for seq in [sum(sequences(row), ())])
    in_rows = []
    for row in packed:
        pieces = sequences(row)
        assert len(pieces) % 2 == 0, "a row holds whole pairs"
        in_rows += [tuple(map(tuple, chosen + rejected)) for chosen, rejected in zip(pieces[::2], pieces[1::2])]
    assert sorted(in_rows) == alone, "every pair once, chosen then rejected, positions and labels as alone"


def test_collate_numbers_the_sequences_and_gives_their_lengths_and_reference_logps():
    rows = [{"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, 3, -100, 5], "position_ids": [0, 1, 2, 0, 1],
             "ref_logps": [-1.5, -2.25]},
            {"input_ids": [6, 7, 8, 9, 10, 11, 12, 13, 14], "labels": [-100, 7, -100, 9, 10, -100, 12, -100, 14],
             "position_ids": [0, 1, 0, 1, 2, 0, 1, 0, 1], "ref_logps": [-0.5, -3.0, -4.125, -1.0]}]
    batch = collate(rows, pad_id=0, two_sequences=True)
    assert batch.inputs["sequence_ids"].tolist() == [[0, 0, 0, 1, 1, -1, -1, -1, -1], [2, 2, 3, 3, 3, 4, 4, 5, 5]]
    assert batch.sequences["length"].tolist() == [3, 2, 2, 3, 2, 2]
    assert batch.sequences["ref_logps"].dtype == torch.float64
    assert batch.sequences["ref_logps"].tolist() == [-1.5, -2.25, -0.5, -3.0, -4.125, -1.0]
    moved = batch.to(torch.device("meta"))
    assert {t.device.type for t in (*moved.inputs.values(), *moved.sequences.values())} == {"meta"}
    assert "sequence_ids" not in collate(rows, pad_id=0).inputs and not collate(rows, pad_id=0).sequences


def test_an_rm_pairs_rejected_sequence_leaves_out_the_beginning_it_shares_with_the_chosen_one():
    """share_prefixes (rm, with an attention that keeps branches): the rejected sequence keeps its tokens from the
    first that differs (its last token at least) at their own positions, its first kept one unlabelled; the
    sequences are numbered where the positions jump and scored at their last tokens; a pair with nothing in common
    is packed whole; the per-sequence values are kept."""
    shared = {"input_ids": [1, 2, 3, 4, 5, 1, 2, 3, 7], "labels": [-100, -100, -100, 4, 5, -100, -100, -100, 7],
              "position_ids": [0, 1, 2, 3, 4, 0, 1, 2, 3], "margin": [0.5, 0.5]}
    prefix = {"input_ids": [1, 2, 3, 1, 2, 3, 4], "labels": [-100, 2, 3, -100, 2, 3, 4],
              "position_ids": [0, 1, 2, 0, 1, 2, 3], "margin": [0.0, 0.0]}
    apart = {"input_ids": [8, 9, 6, 9], "labels": [-100, 9, -100, 9], "position_ids": [0, 1, 0, 1],
             "margin": [1.0, 1.0]}
    batch = collate([shared, prefix, apart], pad_id=0, two_sequences=True, scored=True, pack=True,
                    share_prefixes=True)
    # The second pair's rejected sequence begins with all of the chosen one: it keeps the chosen's last token, so that
    # its positions jump back (a branch, not the chosen's continuation).
    assert batch.inputs["input_ids"].tolist() == [[1, 2, 3, 4, 5, 7, 1, 2, 3, 3, 4, 8, 9, 6, 9]]
    assert batch.inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2, 2, 3, 0, 1, 0, 1]]
    assert batch.inputs["sequence_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 2, 2, 2, 3, 3, 4, 4, 5, 5]]
    assert batch.inputs["scored"].nonzero()[:, 1].tolist() == [4, 5, 8, 10, 12, 14]
    # The row's labels, shifted: each token's is its successor's; the branches' first tokens are unlabelled.
    assert batch.inputs["shift_labels"].tolist() == [[-100, -100, 4, 5, -100, -100, 2, 3, -100, 4, -100, 9, -100, 9,
                                                      -100]]
    assert batch.num_tokens == 15 and batch.sequences["margin"].tolist() == [0.5, 0.5, 0.0, 0.0, 1.0, 1.0]
    whole = collate([shared, prefix, apart], pad_id=0, two_sequences=True, scored=True, pack=True)
    assert whole.num_tokens == 20 and whole.inputs["sequence_ids"].max() == 5


def test_sft_and_pt_keep_their_batches_without_sequence_ids():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 2]}]
    batch = collate(rows, pad_id=0)
    assert set(batch.inputs) == {"input_ids", "shift_labels", "position_ids"} and batch.sequences == {}


def test_the_cache_key_of_pairs_follows_their_limits(tmp_path, tokenizer):
    data = DataConfig(train_files=[write_jsonl(tmp_path / "pairs.jsonl", varied_pairs(2))])
    keys = {cache_key("dpo", data, tokenizer, 0, limits) for limits in (
        PairLimits(64, None, True), PairLimits(32, None, True), PairLimits(64, 16, True), PairLimits(64, None, False))}
    assert len(keys) == 4
    assert cache_key("sft", data, tokenizer, 0) == cache_key("sft", data, tokenizer, 0)


def test_pair_limits_are_read_from_the_dpo_section_only_for_a_task_of_pairs():
    run = Config("dpo", ModelConfig(), DataConfig(max_seq_len=512), TrainConfig(), ParallelConfig(), PeftConfig(),
                 CheckpointConfig(), MonitorConfig(), DPOConfig(max_prompt_length=100, truncation=False))
    assert PairLimits.of(run) == PairLimits(256, 100, False), "max_length defaults to half a row"
    run.dpo.max_length = 200
    assert PairLimits.of(run).max_length == 200
    run.task = "sft"
    assert PairLimits.of(run) is None


@pytest.fixture
def state():
    state = ParallelState.initialize()
    yield state
    state.close()


def test_build_data_gives_pairs_batches_and_the_statistics_count_pairs(tmp_path, tokenizer, state, caplog):
    path = write_jsonl(tmp_path / "pairs.jsonl", varied_pairs(24))
    data = DataConfig(train_files=[path], max_seq_len=32, packing=False, shuffle=False, cache_dir=str(tmp_path / "c"))
    run = Config("dpo", ModelConfig(), data, TrainConfig(per_device_train_batch_size=2, max_steps=1), ParallelConfig(),
                 PeftConfig(), CheckpointConfig(), MonitorConfig(), DPOConfig(max_length=12))
    manager, _, _ = build_data(run, tokenizer, state)
    [(_, [batch])] = list(manager.steps(1))
    assert batch.inputs["sequence_ids"].max().item() == 3 and len(batch.sequences["length"]) == 4
    assert batch.sequences["length"].tolist() == [len(seq[0]) for i in range(2) for seq in
                                                   sequences(manager.loader.dataset[i])]
    train, _, _, stats = load_or_build("dpo", data, tokenizer, 0, 2, state, PairLimits.of(run))
    assert max(len(seq[0]) for row in train for seq in sequences(row)) == 12, "dpo.max_length bounds each sequence"
    assert stats.truncated > 0
    assert stats.summary().startswith(f"24 pairs, one per row, {stats.tokens} tokens, label tokens ")
    assert f", {stats.truncated} truncated ({stats.truncated / 24:.1%}), 0 dropped (0.0%), efficiency " in \
        stats.summary()
    assert stats.summary().endswith("0 validation pairs")


def test_pairs_are_counted_as_pairs_and_packed_per_micro_batch(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", varied_pairs(24))
    data = DataConfig(train_files=[path], max_seq_len=96, cache_dir=str(tmp_path / "c"))
    train, val, counts = build_datasets("dpo", data, tokenizer, 0, LIMITS)
    stats = describe("dpo", train, val, None, counts, data, 4, 0, None)
    assert stats.samples == stats.rows == len(train) == 24
    assert stats.summary().startswith("24 pairs, each micro-batch's packed into one row, ")
    assert stats.efficiency == 1.0  # one row a micro-batch: nothing to pad


def test_the_preview_shows_the_prompt_once_and_marks_each_responses_trained_tokens(tmp_path, tokenizer, capsys):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": [USER], "chosen": [RIGHT], "rejected": [WRONG]}])
    train, _, _ = build_datasets("dpo", DataConfig(train_files=[path], cache_dir=str(tmp_path / "c")), tokenizer, 0,
                                 LIMITS)
    show_pairs(tokenizer, train, 1, color=False)
    prompt = len(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    chosen, rejected = (len(tokenizer(PROMPT + text, add_special_tokens=False)["input_ids"]) - prompt
                        for text in ("It is 5.</s>", "It is 6.</s>"))
    assert capsys.readouterr().out == (
        f"pair 1: prompt {prompt} tokens, chosen {chosen} tokens ({chosen} trained), rejected {rejected} tokens "
        f"({rejected} trained)\n"
        f"prompt:\n{PROMPT}\nchosen:\n[[It is 5.</s>]]\nrejected:\n[[It is 6.</s>]]\n\n")


def test_a_dpo_recipe_that_would_let_a_rejected_response_attend_to_its_chosen_one_is_refused(tmp_path):
    recipe = {"model": {"config": str(tmp_path), "tokenizer": str(tmp_path)},
              "data": {"train_files": ["pairs.jsonl"], "document_mask": False},
              "train": {"output_dir": str(tmp_path / "out")}}
    with pytest.raises(UserError, match=r"data.document_mask: false would let a row's second sequence attend to its "
                                        r"first"):
        load_config(recipe, [], "dpo", world_size=1)
    assert not load_config(recipe, [], "sft", world_size=1).data.document_mask
