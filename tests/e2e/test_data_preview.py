"""`llmtune data`: the samples it prints are the training split's documents with exactly the trained tokens marked,
it shares the training run's tokenization cache entry, and it runs on one process without a process group.

One preview runs in a process of its own (previewed), which then says what the preview left in it; the others go
through the CLI's main in pytest's process, without a process's start-up (seconds of importing torch, transformers
and datasets). bin/llmtune's end of a refused `llmtune data` is checked once (test_overrides_and_refused_nproc)."""

import itertools
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from llmtune.run.cli import main as cli_main
from tests.helpers import REPO, run_cli

HEADER = re.compile(r"^sample (\d+): (\d+) tokens, (\d+) trained.*\n", re.M)
SPAN = re.compile(r"\[\[(.*?)\]\]", re.S)


def write_recipe(folder, assets, sft_file) -> str:
    recipe = folder / "recipe.yaml"
    recipe.write_text(f"model: {{config: {assets / 'model' / 'config.json'}, tokenizer: {assets / 'tokenizer'}}}\n"
                      f"data: {{train_files: [{sft_file}], chat_template: basic, max_seq_len: 64, "
                      f"cache_dir: {folder / 'cache'}}}\n"
                      f"train: {{output_dir: {folder / 'out'}}}\n")
    return str(recipe)


pytestmark = pytest.mark.slow  # the runs these tests read are processes of their own


@pytest.fixture(scope="module")
def previewed(assets, sft_file, tmp_path_factory):
    """(recipe, the finished `llmtune data RECIPE --n 3`), which built the recipe's cache entry: the CLI's main in a
    fresh python, which then prints, last, whether it imported llmtune.run.parallel and started a process group."""
    recipe = write_recipe(tmp_path_factory.mktemp("preview"), assets, sft_file)
    code = ("import sys; from llmtune.run.cli import main; assert main(['data', sys.argv[1], '--n', '3']) == 0; "
            "torch = sys.modules.get('torch'); "
            "print('parallel', 'llmtune.run.parallel' in sys.modules); "
            "print('group', bool(torch) and torch.distributed.is_available() and torch.distributed.is_initialized())")
    result = subprocess.run([sys.executable, "-c", code, recipe], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return recipe, result


def run_inputs(recipe: str):
    """(the recipe as the run reads it, the run's tokenizer)."""
    from llmtune.config import load_config
    from llmtune.data.templates import recipe_tokenizer
    from llmtune.run.inputs import fetch_hub_inputs, local_inputs

    config = load_config(recipe, [], "sft", world_size=1)
    local = local_inputs(config, fetch_hub_inputs(config))
    return local, recipe_tokenizer("sft", local.model, config.data)


def trainer_split(recipe: str):
    """(the training split as load_or_build gives it to the run, the run's tokenizer)."""
    from llmtune.data.build import OneProcess, load_or_build

    local, tokenizer = run_inputs(recipe)
    train, _, _, _ = load_or_build("sft", local.data, tokenizer, local.train.seed,
                                   local.train.per_device_train_batch_size, OneProcess())
    return train, tokenizer


def documents(train):
    """(input_ids, labels) of each packed document, in stored order: a row split where position_ids restart."""
    for row in train:
        starts = [i for i, position in enumerate(row["position_ids"]) if position == 0] + [len(row["input_ids"])]
        for start, end in zip(starts, starts[1:]):
            yield row["input_ids"][start:end], row["labels"][start:end]


def printed_samples(stdout: str) -> list[tuple[int, int, str]]:
    """(tokens, trained, text) of each printed sample; a sample's text ends with a blank line."""
    headers = list(HEADER.finditer(stdout))
    ends = [h.start() for h in headers[1:]] + [stdout.index("\ndata: ") + 1]
    return [(int(h[2]), int(h[3]), stdout[h.end():end].removesuffix("\n\n")) for h, end in zip(headers, ends)]


def decoded(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_marked_spans_are_the_trained_tokens(previewed):
    recipe, result = previewed
    train, tokenizer = trainer_split(recipe)
    samples = printed_samples(result.stdout)
    assert list(map(int, re.findall(r"^sample (\d+):", result.stdout, re.M))) == [1, 2, 3]
    for (tokens, trained, text), (ids, labels) in zip(samples, documents(train)):
        assert (tokens, trained) == (len(ids), sum(label != -100 for label in labels))
        # Unmarked, the text is the document's whole decoded text.
        assert text.replace("[[", "").replace("]]", "") == decoded(tokenizer, ids)
        runs, position = [], 0
        for is_trained, group in itertools.groupby(label != -100 for label in labels):
            end = position + len(list(group))
            if is_trained:
                runs.append((position, end))
            position = end
        spans = SPAN.findall(text)
        assert len(spans) == len(runs) > 0, text
        for span, (start, end) in zip(spans, runs):
            # The run's text inside the sample; decoded on its own, a sentencepiece run loses its leading space.
            assert span == decoded(tokenizer, ids[:end])[len(decoded(tokenizer, ids[:start])):]
            assert span.strip() == decoded(tokenizer, ids[start:end]).strip()
    assert result.stdout.count("\ndata: ") == 1 and " tokens | " in result.stdout


def test_shares_the_training_cache_entry(previewed, assets, sft_file, tmp_path, caplog, capsys):
    """Either way round: llmtune data then the run's load_or_build, and the run's build_data then llmtune data."""
    recipe, result = previewed
    assert "data: built" in result.stderr
    caplog.set_level(logging.INFO, logger="llmtune.data.build")
    trainer_split(recipe)
    assert "data: cache hit" in caplog.text
    # One entry, whichever of the two came first (the other tests read this recipe's data too).
    assert len(list((Path(recipe).parent / "cache").iterdir())) == 1

    import torch

    from llmtune.data.manager import build_data

    fresh = write_recipe(tmp_path, assets, sft_file)
    local, tokenizer = run_inputs(fresh)
    one_rank = SimpleNamespace(local_rank=0, first_error=lambda error, group: error, wait_group=None, is_main=True,
                               dp_size=1, dp_rank=0, device=torch.device("cpu"))
    build_data(local, tokenizer, one_rank)
    caplog.clear()  # build_data's "data: built"
    # In this process the preview's log lines reach caplog, not stderr.
    assert cli_main(["data", fresh, "--n", "1"]) == 0, capsys.readouterr().err
    assert "data: cache hit" in caplog.text and "data: built" not in caplog.text


def test_no_process_group(previewed):
    _, result = previewed
    assert "sample 1:" in result.stdout
    assert result.stdout.splitlines()[-2:] == ["parallel False", "group False"]


def test_overrides_and_refused_nproc(previewed, capsys):
    recipe, result = previewed
    code, short = cli_main(["data", recipe, "--n", "3", "data.max_seq_len=32"]), capsys.readouterr()
    assert code == 0, short.err
    counts = [tokens for tokens, _, _ in printed_samples(short.out)]
    assert len(counts) == 3 and max(counts) <= 32
    assert counts != [tokens for tokens, _, _ in printed_samples(result.stdout)]
    refused = run_cli("data", recipe, "--nproc", "2")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == ["llmtune: error: --nproc: llmtune data runs on one process and "
                                                   "starts none; remove --nproc"]


def test_the_statistics_count_samples_and_packed_rows_under_their_own_names(previewed, sft_file):
    recipe, result = previewed
    train, _ = trainer_split(recipe)
    samples = len(list(documents(train)))
    assert len(train) < samples <= len(sft_file.read_text().splitlines()), "packing put several samples in a row"
    line = next(line for line in result.stdout.splitlines() if line.startswith("data: "))
    assert line.startswith(f"data: {samples} samples packed into {len(train)} rows of up to 64 tokens, "), line


def test_preference_rows_are_refused_in_one_line(assets, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "What is 2 plus 3?", "chosen": "It is 5.", "rejected": "It is 6."}\n')
    code, stderr = cli_main(["data", write_recipe(tmp_path, assets, pairs)]), capsys.readouterr().err
    # The lines before it are datasets' progress bars.
    assert code == 2 and "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        f"llmtune: error: {pairs}: preference data (chosen/rejected columns, or ranking: true) is for llmtune dpo or "
        "llmtune rm, not sft; train it with llmtune dpo or llmtune rm, or leave it out of data.train_files")


def test_a_dpo_recipe_shows_its_pairs_and_their_statistics(assets, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": [{"role": "user", "content": "What is 2 plus 3?"}], '
                     '"chosen": [{"role": "assistant", "content": "It is 5."}], '
                     '"rejected": [{"role": "assistant", "content": "It is 6."}]}\n' * 2)
    assert cli_main(["data", write_recipe(tmp_path, assets, pairs), "--task", "dpo", "--n", "1",
                     "data.max_seq_len=128"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^pair 1: prompt \d+ tokens, chosen \d+ tokens \(\d+ trained\), rejected \d+ tokens", out, re.M)
    assert "\nchosen:\n[[It is 5.</s>]]\nrejected:\n[[It is 6.</s>]]\n" in out and "pair 2:" not in out
    assert re.search(r"^data: 2 pairs, each micro-batch's packed into one row, .* 0 truncated "
                     r"\(0\.0%\), 0 dropped",
                     out, re.M)
    assert "lengths of the 2 training pairs:" in out
