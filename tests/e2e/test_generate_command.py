"""`llmtune generate MODEL_DIR` on a tiny Llama folder with a chat template: greedy completions are transformers'
own generate's, for text and messages prompts; a file split over 2 processes gives the file of one, byte for byte,
sampling on; --out appears whole or not at all, a bad row refused before anything is written; --prompt prints;
--chat answers the whole conversation, turn after turn. All but the 2-process split run the CLI's main in this process
(a process's start-up spared)."""

import io
import json
import shutil
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from llmtune.generation.engine import Sampling
from llmtune.run import generate as generate_module
from llmtune.run.cli import main as cli_main
from llmtune.run.generate import Completer, chat
from tests.helpers import run_cli, run_cli_imports, save_tiny_model

NEW_TOKENS = 6
ROWS = [{"prompt": "What is 27 + 48?", "id": 1},
        {"prompt": "Add 38 and 31, then tell me the sum twice.", "id": 2},  # longer: the batch is left-padded
        {"prompt": [{"role": "user", "content": "What is 16 + 44?"}], "id": 3, "source": "messages"}]


@pytest.fixture(scope="module")
def chat_model(tokenizer, tmp_path_factory):
    """A random tiny Llama saved with the demo tokenizer and the built-in basic chat template."""
    return save_tiny_model(tmp_path_factory.mktemp("generate_model"), LlamaForCausalLM, tokenizer,
                           num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def loaded(chat_model):
    """(model, tokenizer) as transformers loads the folder, the reference the completions are held to."""
    return AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(chat_model)


@pytest.fixture
def rows_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def greedy(loaded, prompt) -> str:
    """transformers' greedy completion of a text or messages prompt, from ids built here with transformers alone."""
    model, tokenizer = loaded
    if isinstance(prompt, str):
        ids = tokenizer(prompt)["input_ids"]
    else:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def in_process(capsys, *args: str) -> subprocess.CompletedProcess:
    """`llmtune ARGS` through the CLI's main in this process: its exit code and what it printed."""
    capsys.readouterr()
    code = cli_main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_help_names_every_flag(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["generate", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    for flag in ("--prompt", "--file", "--out", "--chat", "--nproc", "--max_new_tokens", "--do_sample",
                 "--temperature", "--top_p", "--top_k", "--min_p", "--repetition_penalty", "--num_return_sequences",
                 "--seed", "--batch_size"):
        assert flag in shown, flag


def test_file_completions_are_transformers_greedy_ones(chat_model, loaded, rows_file, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    result = in_process(capsys, "generate", str(chat_model), "--file", str(rows_file), "--out", str(out),
                        "--max_new_tokens", str(NEW_TOKENS))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote 3 completions of 3 prompts to {out}\n"
    written = read_rows(out)
    expected = [greedy(loaded, row["prompt"]) for row in ROWS]
    assert all(expected) and len(set(expected)) == len(expected), "the tiny model completes each prompt its own way"
    assert written == [{**ROWS[0], "completion": expected[0]}, {**ROWS[1], "completion": expected[1]},
                       {**ROWS[2], "completion": [{"role": "assistant", "content": expected[2]}]}]


def test_temperature_0_is_greedy_decoding_token_for_token(chat_model, loaded, rows_file, tmp_path, capsys):
    """In a folder whose generation_config.json samples, --temperature 0 decodes as --do_sample false does (vLLM's
    and OpenAI-style APIs' meaning); with --do_sample true it is refused."""
    folder = tmp_path / "sampling_model"
    shutil.copytree(chat_model, folder)
    GenerationConfig(do_sample=True, temperature=0.8, top_k=0).save_pretrained(folder)
    files = {flag: tmp_path / f"{flag}.jsonl" for flag in ("greedy", "temperature_0", "sampled")}
    for name, flags in (("greedy", ["--do_sample", "false"]), ("temperature_0", ["--temperature", "0"]),
                        ("sampled", [])):
        result = in_process(capsys, "generate", str(folder), "--file", str(rows_file), "--out", str(files[name]),
                            "--max_new_tokens", str(NEW_TOKENS), *flags)
        assert result.returncode == 0, result.stderr
    assert files["temperature_0"].read_bytes() == files["greedy"].read_bytes()
    assert read_rows(files["greedy"])[0]["completion"] == greedy(loaded, ROWS[0]["prompt"])
    assert files["sampled"].read_bytes() != files["greedy"].read_bytes(), "the folder's own setting samples"
    result = in_process(capsys, "generate", str(folder), "--prompt", "hi", "--temperature", "0", "--do_sample", "true")
    assert (result.returncode, result.stderr.strip()) == (2, "llmtune: error: --temperature 0 is greedy decoding (as "
                                                             "--do_sample false); leave out --do_sample true, or "
                                                             "sample at a temperature above 0")


@pytest.mark.slow
def test_two_processes_write_the_file_of_one(chat_model, rows_file, tmp_path, capsys):
    sampling = ["--do_sample", "true", "--temperature", "0.8", "--num_return_sequences", "2", "--seed", "5",
                "--max_new_tokens", str(NEW_TOKENS)]
    files = {nproc: tmp_path / f"out{nproc}.jsonl" for nproc in (1, 2)}
    result = in_process(capsys, "generate", str(chat_model), "--file", str(rows_file), "--out", str(files[1]),
                        *sampling)
    assert result.returncode == 0, result.stderr
    result = run_cli("generate", str(chat_model), "--file", str(rows_file), "--out", str(files[2]), "--nproc", "2",
                     *sampling)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote 6 completions of 3 prompts to {files[2]}\n", "said by the process that writes"
    assert files[2].read_bytes() == files[1].read_bytes()
    written = read_rows(files[1])
    assert [row["id"] for row in written] == [1, 1, 2, 2, 3, 3], "n rows per prompt row, in order"
    assert any(written[i]["completion"] != written[i + 1]["completion"] for i in (0, 2, 4)), "samples differ"


def test_a_bad_row_is_refused_before_anything_is_written(chat_model, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"prompt": 3}) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_text("earlier\n")
    result = in_process(capsys, "generate", str(chat_model), "--file", str(prompts), "--out", str(out))
    assert result.returncode == 2
    assert result.stderr.startswith(f"llmtune: error: {prompts}: line 2: 'prompt' must be a string or a list of "
                                    "messages")
    assert out.read_text() == "earlier\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]


def test_an_empty_prompts_file_is_refused_before_torch_is_imported(chat_model, tmp_path):
    """The refusal came after torch and transformers were imported: seconds (half a minute on a cold start) for one
    line."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result, imported = run_cli_imports("generate", str(chat_model), "--file", str(empty), "--out",
                                       str(tmp_path / "out.jsonl"))
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", f"llmtune: error: {empty}: no prompts; write JSONL rows with a 'prompt' column\n")
    assert "llmtune" in imported, "the report lists the imports"
    assert "torch" not in imported
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


def test_out_appears_whole_or_not_at_all(chat_model, rows_file, tmp_path, monkeypatch):
    """A failure after the first completions are known (here while the third row is written) leaves --out as it
    was, and no partial file beside it."""
    out = tmp_path / "out.jsonl"
    out.write_text("earlier\n")
    made = []

    def fail_at_the_third(prompt, text):
        made.append(text)
        if len(made) == 3:
            raise RuntimeError("stopped while writing")
        return text

    monkeypatch.setattr(generate_module, "completion_value", fail_at_the_third)
    with pytest.raises(RuntimeError, match="stopped while writing"):
        cli_main(["generate", str(chat_model), "--file", str(rows_file), "--out", str(out),
                  "--max_new_tokens", "2"])
    assert out.read_text() == "earlier\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]


@pytest.mark.parametrize("args, message", [
    (["--file", "PROMPTS"], "--file: the completions go to a JSONL file; add --out OUT.jsonl"),
    (["--prompt", "hi", "--nproc", "2"], "--nproc: only --file's prompts are split over processes"),
    (["--prompt", "hi", "--num_return_sequences", "2"], "--num_return_sequences: greedy decoding"),
    (["--file", "PROMPTS", "--out", "MISSING/out.jsonl"], "--out: MISSING/out.jsonl is in a folder that does not"),
])
def test_bad_flags_are_refused_with_one_line(chat_model, rows_file, tmp_path, capsys, args, message):
    missing = str(tmp_path / "missing")
    args = [arg.replace("PROMPTS", str(rows_file)).replace("MISSING", missing) for arg in args]
    result = in_process(capsys, "generate", str(chat_model), *args)
    assert result.returncode == 2
    assert result.stderr.startswith(f"llmtune: error: {message.replace('MISSING', missing)}"), result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_not_a_model_folder_and_no_chat_template_are_refused(tiny_model, tmp_path, capsys):
    result = in_process(capsys, "generate", str(tmp_path), "--prompt", "hi")
    assert (result.returncode, result.stderr) == (2, f"llmtune: error: {tmp_path}: not a HF model folder (no "
                                                     "config.json); give a run's output_dir/hf or an llmtune export "
                                                     "folder\n")
    (tmp_path / "adapter_config.json").write_text("{}")
    result = in_process(capsys, "generate", str(tmp_path), "--prompt", "hi")
    assert result.returncode == 2
    assert result.stderr.startswith(f"llmtune: error: {tmp_path}: an adapter folder; generate from the merged HF "
                                    "folder")
    result = in_process(capsys, "generate", str(tiny_model), "--chat")
    assert result.returncode == 2
    assert result.stderr.startswith(f"llmtune: error: --chat: {tiny_model}'s tokenizer has no chat template")


def test_prompt_prints_each_completion(chat_model, loaded, capsys):
    result = in_process(capsys, "generate", str(chat_model), "--prompt", ROWS[0]["prompt"],
                        "--max_new_tokens", str(NEW_TOKENS))
    assert (result.returncode, result.stdout) == (0, greedy(loaded, ROWS[0]["prompt"]) + "\n")
    result = in_process(capsys, "generate", str(chat_model), "--prompt", ROWS[0]["prompt"], "--do_sample", "true",
                        "--num_return_sequences", "2", "--max_new_tokens", str(NEW_TOKENS))
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert lines[0] == "--- completion 1 of 2 ---" and "--- completion 2 of 2 ---" in lines


def test_chat_answers_the_whole_conversation(chat_model, loaded, capsys, monkeypatch):
    """Two turns through the CLI, stdin ending with an empty line: the second reply is the model's greedy completion
    of the conversation that holds the first one."""
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nhow are you\n\nnever read\n"))
    result = in_process(capsys, "generate", str(chat_model), "--chat", "--max_new_tokens", str(NEW_TOKENS))
    assert result.returncode == 0, result.stderr
    first = greedy(loaded, [{"role": "user", "content": "hi"}])
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                    {"role": "user", "content": "how are you"}]
    second = greedy(loaded, conversation)
    assert second != greedy(loaded, conversation[2:]), "the tiny model's reply depends on the first turn"
    assert result.stdout == f"{first}\n{second}\n"


@pytest.mark.parametrize("lines", [["hi", "exit", "never read"], ["hi"]])
def test_chat_ends_on_exit_or_the_end_of_input(chat_model, lines, capsys):
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    completer = Completer(str(chat_model), tokenizer, Sampling(max_new_tokens=2), torch.device("cpu"), 0, 64, None)
    conversation = chat(completer, iter(lines))
    assert [m["role"] for m in conversation] == ["user", "assistant"]
    assert capsys.readouterr().out == conversation[1]["content"] + "\n"
