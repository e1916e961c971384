"""The data pipeline: sources, pt packing, sft packing, bad input, cache, order, coverage, validation and resume."""

import json
import logging
from functools import partial
from types import SimpleNamespace

import datasets
import pytest

from llmtune.config import (CheckpointConfig, Config, DataConfig, ModelConfig, MonitorConfig, ParallelConfig,
                            PeftConfig, TrainConfig)
from llmtune.data.build import build_datasets, build_stream, load_or_build
from llmtune.data.collate import collate
from llmtune.data.manager import DataManager, StreamingDataManager, Validation, build_data
from llmtune.data.templates import apply_recipe_template
from llmtune.errors import UserError
from llmtune.model.loss import IGNORE_INDEX
from llmtune.run.parallel import ParallelState

QA = [{"prompt": f"What is {i} + {2 * i}?" + " Think." * (i % 5), "response": str(3 * i)} for i in range(40)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def config(tmp_path, files, **changes):
    return DataConfig(train_files=files, cache_dir=str(tmp_path / "cache"), **changes)


@pytest.fixture
def state():
    """A world of one process, as a one-process run has."""
    state = ParallelState.initialize()
    yield state
    state.close()


def test_pt_blocks_restart_positions_and_mask_labels_at_document_starts(tmp_path, tokenizer, state):
    # 639 tokens: 39 blocks of 16, and 15 left over.
    docs = [{"text": f"The sum of {i} and {i + 1} is {2 * i + 1}."} for i in range(39)]
    data = config(tmp_path, [write_jsonl(tmp_path / "pt.jsonl", docs)], max_seq_len=16)
    train, _, _, stats = load_or_build("pt", data, tokenizer, 0, 4, state)
    stream, starts = [], []
    for doc in tokenizer([d["text"] for d in docs])["input_ids"]:
        starts.append(len(stream))
        stream += doc + [tokenizer.eos_token_id]
    assert all(len(row) == 16 for row in train["input_ids"]), "pt_remainder drop keeps full blocks only"
    flat = [t for row in train["input_ids"] for t in row]
    assert flat == stream[:len(flat)] and 0 < len(stream) - len(flat) < 16
    assert stats.summary().startswith(f"{len(train)} rows of up to 16 tokens ({len(stream) - len(flat)} tokens of the "
                                      "last, partial rows dropped), ")
    positions = [p for row in train["position_ids"] for p in row]
    labels = [t for row in train["labels"] for t in row]
    for i in range(len(flat)):
        doc_start = max(s for s in starts if s <= i)
        # A document cut by a block boundary goes on from position 0 in the next block.
        assert positions[i] == i - max(doc_start, i - i % 16)
        assert labels[i] == (IGNORE_INDEX if i == doc_start else flat[i])
    padded, _, counts = build_datasets("pt", config(tmp_path, data.train_files, max_seq_len=16, pt_remainder="pad"),
                                       tokenizer, seed=0)
    assert [t for row in padded["input_ids"] for t in row] == stream and counts["dropped_tail_tokens"] == 0


def test_a_pt_corpus_shorter_than_one_row_is_refused_with_its_length_and_the_fixes(tmp_path, tokenizer):
    texts = [LINES[0], LINES[1]]
    tokens = sum(len(ids) + 1 for ids in tokenizer(texts)["input_ids"])  # each document ends with EOS
    files = [write_jsonl(tmp_path / "short.jsonl", [{"text": text} for text in texts])]
    with pytest.raises(UserError) as err:
        build_datasets("pt", config(tmp_path, files, max_seq_len=64), tokenizer, 0)
    assert str(err.value) == (
        f"data.train_files: the corpus holds {tokens} tokens, fewer than one row of data.max_seq_len=64, and the last, "
        f"partial row of each window is dropped (data.pt_remainder: drop); set data.max_seq_len to {tokens} or less, "
        "add text, or set data.pt_remainder: pad to train on the partial row")
    for changes in ({"max_seq_len": tokens}, {"max_seq_len": 64, "pt_remainder": "pad"}):
        train, _, counts = build_datasets("pt", config(tmp_path, files, **changes), tokenizer, 0)
        assert (len(train), counts["dropped_tail_tokens"]) == (1, 0), changes


LINES = ["The sum of 1 and 2 is 3.", "The sum of 2 and 3 is 5.", "The sum of 3 and 4 is 7."]
TEXT = f"{LINES[0]}\n{LINES[1]}\n\n{LINES[2]}\n"
PARAGRAPHS = [f"{LINES[0]}\n{LINES[1]}", f"{LINES[2]}\n"]


def test_a_txt_file_is_one_document_per_line_unless_text_sample_by_says_otherwise(tmp_path, tokenizer, state):
    path = tmp_path / "docs.txt"
    path.write_text(TEXT)
    # One cache folder for the three: each setting must build its own entry.
    for changes, documents in (({}, LINES), ({"text_sample_by": "paragraph"}, PARAGRAPHS),
                               ({"text_sample_by": "document"}, [TEXT])):
        data = config(tmp_path, [str(path)], max_seq_len=256, pt_remainder="pad", **changes)
        train, _, _, stats = load_or_build("pt", data, tokenizer, 0, 4, state)
        # The blank line is no document: it adds no token (no BOS and EOS of an empty one).
        stream = [t for ids in tokenizer(documents)["input_ids"] for t in ids + [tokenizer.eos_token_id]]
        assert [t for row in train["input_ids"] for t in row] == stream, changes
        assert (stats.samples, stats.tokens) == (len(documents), len(stream)), changes
    streamed = build_stream("pt", config(tmp_path, [str(path)], max_seq_len=256, pt_remainder="pad", streaming=True),
                            tokenizer, 0)
    line_stream = [t for ids in tokenizer(LINES)["input_ids"] for t in ids + [tokenizer.eos_token_id]]
    assert [t for row in streamed for t in row["input_ids"]] == line_stream


def test_sources_of_every_kind_and_mixing_weights(tmp_path, tokenizer):
    rows = QA[:10]
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "b.parquet"))
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "c.csv"), index=False)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    sources = [jsonl, str(tmp_path / "*.parquet"), str(tmp_path / "c.csv"), str(tmp_path / "saved")]
    data = config(tmp_path, sources, chat_template=None, packing=False)
    train, _, _ = build_datasets("sft", data, tokenizer, seed=0)
    assert len(train) == 40 and train["input_ids"][:10] == train["input_ids"][30:]
    mixed, _, _ = build_datasets("sft", config(tmp_path, sources[:2], packing=False, mix_weights=[3, 1]), tokenizer, 0)
    assert len(mixed) == 20
    first = {tuple(ids) for ids in train["input_ids"][:10]}
    assert sum(tuple(ids) in first for ids in mixed["input_ids"]) == 20, "both sources hold the same rows"
    val_data = config(tmp_path, [jsonl], packing=False, val_ratio=0.3)
    split_train, val, _ = build_datasets("sft", val_data, tokenizer, seed=0)
    assert (len(split_train), len(val)) == (7, 3)
    assert not {tuple(r) for r in split_train["input_ids"]} & {tuple(r) for r in val["input_ids"]}


def test_sft_packing_restarts_positions_and_keeps_every_token(tmp_path, tokenizer):
    data = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", QA)], max_seq_len=64)
    padded, _, _ = build_datasets("sft", config(tmp_path, data.train_files, max_seq_len=64, packing=False), tokenizer, 0)
    packed, _, _ = build_datasets("sft", data, tokenizer, 0)
    assert len(packed) < len(padded) and all(len(row) <= 64 for row in packed["input_ids"])
    samples = sorted(tuple(ids) for ids in padded["input_ids"])
    pieces = []
    for ids, labels, positions in zip(packed["input_ids"], packed["labels"], packed["position_ids"]):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
        for a, b in zip(starts, starts[1:]):
            pieces.append(tuple(ids[a:b]))
            assert positions[a:b] == list(range(b - a))
            assert labels[a] == IGNORE_INDEX, "no label crosses a sample boundary"
    assert sorted(pieces) == samples


def test_cache_second_run_does_no_tokenization(tmp_path, tokenizer, caplog, monkeypatch, state):
    data = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", QA)], max_seq_len=64)
    with caplog.at_level(logging.INFO, logger="llmtune"):
        first = load_or_build("sft", data, tokenizer, 0, 4, state)
        first_log = caplog.text
        caplog.clear()
        monkeypatch.setattr("llmtune.data.build.build_datasets", lambda *a: pytest.fail("tokenized again"))
        second = load_or_build("sft", data, tokenizer, 0, 4, state)
    assert "data: built" in first_log and "cache hit" not in first_log
    assert "cache hit" in caplog.text
    assert first[0]["input_ids"] == second[0]["input_ids"] and first[3].tokens == second[3].tokens
    changed = config(tmp_path, data.train_files, max_seq_len=48)
    with pytest.raises(pytest.fail.Exception, match="tokenized again"):
        load_or_build("sft", changed, tokenizer, 0, 4, state)


@pytest.mark.parametrize("content, rows, expected", [
    (b'{"prompt": "a", "response": "b"}\n{"prompt": "a" "response": "b"}\n', None, r"bad.jsonl:2: not valid JSON"),
    (b'{"prompt": "a", "response": "\xff"}\n', None, r"bad.jsonl:1: not UTF-8 text"),
    (None, [{"prompt": "a", "response": "b"}, {"prompt": "c"}],
     r"bad.jsonl: row 2: field 'response' is missing \(data.format prompt_response\)"),
    (None, [{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}],
     r"bad.jsonl: row 1: field 'messages' turn 1 has role 'robot'"),
    (None, [{"prompt": "What is 1 + 1? " * 30, "response": "2"}] * 3,
     r"every one of the 3 samples is longer than data.max_seq_len=16"),
    (None, [{"messages": [{"role": "user", "content": "hi"}]}], r"no training sample is left"),
])
def test_bad_data_is_one_clear_message(tmp_path, tokenizer, content, rows, expected):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_bytes(content)
    else:
        write_jsonl(path, rows)
    with pytest.raises(UserError, match=expected):
        build_datasets("sft", config(tmp_path, [str(path)], max_seq_len=16, truncation="drop"), tokenizer, 0)


def test_a_line_that_is_not_json_is_said_once_by_its_line_number(tmp_path, tokenizer):
    """datasets' JSON reader logged the line it failed on, counted from 0 ("in row 7"), before llmtune's message named
    it as line 8: one line of the file said twice, with two numbers."""
    lines = [json.dumps({"prompt": f"{i} + 1?", "response": str(i + 1)}) for i in range(10)]
    lines[7] = '{"prompt": "7 + 1?" "response": "8"}'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("datasets").addHandler(handler)  # the library's loggers' parent: datasets' own handler's place
    try:
        with pytest.raises(UserError) as refused:
            build_datasets("sft", config(tmp_path, [str(path)], max_seq_len=64), tokenizer, 0)
    finally:
        logging.getLogger("datasets").removeHandler(handler)
    assert str(refused.value) == f"{path}:8: not valid JSON (Expecting ',' delimiter); write one JSON object per line"
    assert [r.getMessage() for r in records if r.levelno >= logging.ERROR] == []


@pytest.fixture
def letter_a_tokenizer(tmp_path):
    """A tokenizer that knows only the letter a: it turns other text into no tokens at all."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(vocab={"<s>": 0, "</s>": 1, "a": 2}, merges=[]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>").save_pretrained(tmp_path / "a_tok")
    return AutoTokenizer.from_pretrained(tmp_path / "a_tok")


def test_a_pt_source_the_tokenizer_turns_into_nothing_is_named_with_the_tokenizer(tmp_path, letter_a_tokenizer):
    fits = write_jsonl(tmp_path / "fits.jsonl", [{"text": "a" * (i + 3)} for i in range(20)])
    words = write_jsonl(tmp_path / "words.jsonl", [{"text": f"hello world {i}"} for i in range(20)])
    with pytest.raises(UserError, match=f"data.train_files: the tokenizer in {tmp_path / 'a_tok'} produced no tokens "
                                        f"for the documents of {words}"):
        build_datasets("pt", config(tmp_path, [fits, words], max_seq_len=8), letter_a_tokenizer, 0)


def test_a_training_split_without_a_label_token_is_refused(tmp_path, letter_a_tokenizer, state):
    # Blocks of 2 tokens, each the EOS of one document (a label, but the first of its row: it has no
    # token before it to predict it from) and the first token of the next (no label).
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": ""}] + [{"text": "a"}] * 20)
    with pytest.raises(UserError, match="data.train_files: the 20 training rows hold no label token"):
        load_or_build("pt", config(tmp_path, [docs], max_seq_len=2), letter_a_tokenizer, 0, 4, state)


def test_tokenizer_without_chat_template_needs_one_in_the_recipe(assets):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(assets / "tokenizer")
    with pytest.raises(UserError, match="the tokenizer has no chat template; set data.chat_template"):
        apply_recipe_template(bare, None)


def test_collate_pads_right_and_shifts_labels():
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9]}], pad_id=0)
    assert batch.inputs["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert batch.inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.inputs["shift_labels"].tolist() == [[6, 7, -100], [9, -100, -100]]
    assert batch.num_tokens == 5
    packed = collate([{"input_ids": [5, 6, 7], "labels": [5, 6, 7], "position_ids": [0, 0, 1]}, {"input_ids": [8],
                      "labels": [8], "position_ids": [0]}], pad_id=0)
    assert "attention_mask" not in packed.inputs
    assert packed.inputs["position_ids"].tolist() == [[0, 0, 1], [0, 0, 1]]


def evaluation(eval_steps=0, eval_epochs=0, max_eval_steps=0):
    return SimpleNamespace(eval_steps=eval_steps, eval_epochs=eval_epochs, max_eval_steps=max_eval_steps)


def test_validation_gives_every_row_once_in_equal_batch_counts_and_is_due_every_eval_steps_and_at_the_end():
    dataset = datasets.Dataset.from_list([{"input_ids": [i, i], "labels": [i, i]} for i in range(1, 11)])
    per_rank = [list(Validation(dataset, 2, partial(collate, pad_id=0), DataConfig(), 4, rank, evaluation(4)).batches()) for rank in range(4)]
    assert [len(batches) for batches in per_rank] == [2, 2, 2, 2], "ranks 2 and 3 hold 2 rows, 0 and 1 hold 3"
    labels = [t for batches in per_rank for b in batches for t in b.inputs["shift_labels"].flatten().tolist()]
    assert sorted(t for t in labels if t != IGNORE_INDEX) == list(range(1, 11))
    assert per_rank[3][1].num_tokens == 0, "a rank whose share has run out adds nothing"
    every_4 = Validation(dataset, 2, partial(collate, pad_id=0), DataConfig(), 1, 0, evaluation(4))
    assert [step for step in range(1, 11) if every_4.due(step, last=step == 10)] == [4, 8, 10]
    assert [step for step in range(1, 11) if every_4.due(step, last=False)] == [4, 8]
    assert not Validation(None, 2, partial(collate, pad_id=0), DataConfig(), 1, 0, evaluation(4)).due(8, last=True), "no validation data"


def test_validation_is_due_at_every_eval_epochs_th_epoch_end_and_max_eval_steps_caps_every_rank_alike():
    dataset = datasets.Dataset.from_list([{"input_ids": [i, i], "labels": [i, i]} for i in range(1, 11)])
    every_2nd_epoch = Validation(dataset, 2, partial(collate, pad_id=0), DataConfig(), 1, 0, evaluation(eval_epochs=2))
    ends = [every_2nd_epoch.due(step, last=False, finished_epoch=epoch) for step, epoch in ((3, 0), (6, 1), (9, 2),
                                                                                             (12, 3))]
    assert ends == [False, True, False, True]
    assert not every_2nd_epoch.due(5, last=False), "not inside an epoch"
    capped = [list(Validation(dataset, 2, partial(collate, pad_id=0), DataConfig(), 2, rank, evaluation(max_eval_steps=2)).batches())
              for rank in (0, 1)]
    assert [len(batches) for batches in capped] == [2, 2]
    rows = [t for b in capped[0] for t in b.inputs["input_ids"][:, 0].tolist()]
    assert rows == [1, 3, 5, 7], "the first micro-batches of rank 0's share (every 2nd row)"


def test_a_streaming_run_validates_on_the_whole_of_val_files_at_the_eval_steps(tmp_path, tokenizer, state):
    val_file = write_jsonl(tmp_path / "val.jsonl", QA[:10])
    data = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", QA)], max_seq_len=64, streaming=True,
                  val_files=[val_file])
    train = TrainConfig(max_steps=6, eval_steps=2, per_device_train_batch_size=2, per_device_eval_batch_size=1)
    run = Config("sft", ModelConfig(), data, train, ParallelConfig(), PeftConfig(), CheckpointConfig(), MonitorConfig())
    stream, validation, _ = build_data(run, tokenizer, state)
    assert isinstance(stream, StreamingDataManager)
    assert [step for step in range(1, 7) if validation.due(step, last=step == 6)] == [2, 4, 6]
    split, _, _ = build_datasets("sft", config(tmp_path, [val_file], max_seq_len=64), tokenizer, 0)
    expected = [t for labels in split["labels"] for t in labels[1:] if t != IGNORE_INDEX]
    reached = [t for batch in validation.batches() for t in batch.inputs["shift_labels"].flatten().tolist()
               if t != IGNORE_INDEX]
    assert sorted(reached) == sorted(expected), "every label token of the validation split, once"


def label_tokens(batches) -> list[int]:
    return sorted(t for batch in batches for t in batch.inputs["shift_labels"].flatten().tolist() if t != IGNORE_INDEX)


@pytest.mark.parametrize("streaming", [False, True])
def test_the_test_split_is_built_and_cached_beside_validation_and_read_whole(tmp_path, tokenizer, state, streaming):
    val_file, test_file = (write_jsonl(tmp_path / f"{name}.jsonl", rows)
                           for name, rows in (("val", QA[:10]), ("test", QA[10:22])))
    data = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", QA)], max_seq_len=64, streaming=streaming,
                  packing=False, val_files=[val_file], test_files=[test_file])
    train = TrainConfig(max_steps=6, per_device_train_batch_size=2, per_device_eval_batch_size=2, max_eval_steps=1)
    run = Config("sft", ModelConfig(), data, train, ParallelConfig(), PeftConfig(), CheckpointConfig(), MonitorConfig())
    _, validation, test = build_data(run, tokenizer, state)
    assert len(list(validation.batches())) == 1, "max_eval_steps caps the validation"
    split, _, _ = build_datasets("sft", config(tmp_path, [test_file], max_seq_len=64, packing=False), tokenizer, 0)
    assert len(test.dataset) == 12
    assert label_tokens(test.batches()) == sorted(t for labels in split["labels"] for t in labels[1:]
                                                  if t != IGNORE_INDEX), "every label token of data.test_files, once"
    entry = next(p for p in (tmp_path / "cache").iterdir() if (p / "counts.json").is_file())
    assert sorted(p.name for p in entry.iterdir() if p.is_dir()) == (["test", "val"] if streaming else
                                                                     ["test", "train", "val"])


def rows_collate(rows):
    return collate(rows, pad_id=0)


def steps_of(dataset, dp, micro, acc, count, shuffle=True, state=None):
    managers = [DataManager(dataset, DataConfig(shuffle=shuffle), micro, acc, dp, rank, 1, rows_collate)
                for rank in range(dp)]
    if state:
        for m in managers:
            m.load_state_dict(state)
    per_rank = [list(m.steps(count)) for m in managers]
    return [sorted(int(t) for r in per_rank for b in r[k][1] for t in b.inputs["input_ids"].flatten())
            for k in range(count)], managers


@pytest.mark.parametrize("dp_size, per_device, accumulation", [(2, 4, 1), (1, 1, 8), (2, 2, 2), (4, 1, 2)])
def test_each_step_consumes_the_same_samples_whatever_the_layout(dp_size, per_device, accumulation):
    dataset = [{"input_ids": [i]} for i in range(37)]
    reference, _ = steps_of(dataset, 1, 8, 1, 9)
    assert steps_of(dataset, dp_size, per_device, accumulation, 9)[0] == reference
    assert reference[0] != reference[4], "a new epoch must reshuffle"
    epoch = [t for step in reference[:4] for t in step]
    assert len(epoch) == len(set(epoch)) == 32, "one epoch sees each sample at most once (37 = 4 steps of 8 + 5)"


def test_a_micro_batch_holds_the_same_samples_on_one_rank_or_spread_over_ranks():
    """One rank's G micro-batches of a step are the micro-batches G ranks take one each (so their gradients are
    summed in the same additions); also when resumed part-way through an epoch."""
    dataset = [{"input_ids": [i]} for i in range(37)]

    def micro_batches(dp, acc, state=None):
        managers = [DataManager(dataset, DataConfig(), 2, acc, dp, rank, 1, rows_collate) for rank in range(dp)]
        for manager in managers:
            if state:
                manager.load_state_dict(state)
        steps = [list(manager.steps(6)) for manager in managers]
        return [[b.inputs["input_ids"].flatten().tolist() for rank in steps for b in rank[k][1]] for k in range(6)]

    one_rank = micro_batches(1, 2)
    assert one_rank == micro_batches(2, 1)
    assert one_rank[0] != [[0, 1], [2, 3]], "shuffled"
    resumed = {"epoch": 1, "samples_in_epoch": 8}
    assert micro_batches(1, 2, resumed) == micro_batches(2, 1, resumed)


def test_one_epoch_on_two_ranks_sees_every_sample_once_and_no_shuffle_keeps_file_order():
    dataset = [{"input_ids": [i]} for i in range(32)]
    steps, _ = steps_of(dataset, 2, 2, 2, 4)
    assert sorted(t for step in steps for t in step) == list(range(32))
    ordered, _ = steps_of(dataset, 2, 2, 2, 4, shuffle=False)
    assert ordered == [list(range(8 * k, 8 * k + 8)) for k in range(4)]


def test_resume_continues_at_the_exact_next_sample_on_any_data_parallel_size():
    dataset = [{"input_ids": [i]} for i in range(37)]
    straight, _ = steps_of(dataset, 2, 2, 2, 10)
    _, managers = steps_of(dataset, 2, 2, 2, 6)
    state = managers[0].state_dict()
    assert state == {"epoch": 1, "samples_in_epoch": 16} and managers[1].state_dict() == state
    assert steps_of(dataset, 2, 2, 2, 4, state=state)[0] == straight[6:]
    assert steps_of(dataset, 1, 1, 8, 4, state=state)[0] == straight[6:], "resume on another data-parallel size"


def test_streaming_resume_gives_the_next_batches_of_an_uninterrupted_run(tmp_path, tokenizer, state):
    data = config(tmp_path, [write_jsonl(tmp_path / "qa.jsonl", QA)], max_seq_len=64, streaming=True,
                  shuffle_buffer=8, packing=False)
    train = TrainConfig(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=12, seed=3)

    def manager():
        return StreamingDataManager(build_stream("sft", data, tokenizer, 3), data, train, 0, state)

    def ids(steps):
        return [[b.inputs["input_ids"].tolist() for b in micro] for _, micro in steps]

    straight = ids(manager().steps(14))
    first = manager()
    assert ids(first.steps(6)) == straight[:6]
    saved = first.state_dict()
    resumed = manager()
    resumed.load_state_dict(saved)
    assert ids(resumed.steps(8)) == straight[6:], "crosses into the next epoch too (40 samples = 10 steps)"


def test_tokenization_takes_no_more_processes_than_the_cpus_it_may_run_on(monkeypatch):
    """LLaMA-Factory's examples ask preprocessing_num_workers 16: on 2 CPUs, 2 processes; 1 CPU, none of its own."""
    from llmtune.data import build

    rows = datasets.Dataset.from_list([{"text": "a"}] * 40)
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert build.map_options(rows, 16, "tokenize") == {"num_proc": 2, "desc": "tokenize"}
    assert build.map_options(rows, 1, "tokenize")["num_proc"] is None
    monkeypatch.setattr(build.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert build.map_options(rows, 16, "tokenize")["num_proc"] is None
