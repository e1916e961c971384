"""`llmtune score MODEL_DIR FILE` on a tiny reward model trained by `llmtune rm`: each row's score is the one
transformers' classifier gives the ids rm training renders for it (strings, messages, a conversation), and the one the
run gave the sequence (its held-out pairs' chosen and rejected sequences scored alone average to the run's
eval_rewards); printed one a line or written with each row; grpo's reward-model scorer gives the same numbers; and
the refusals, one line each, exit code 2, before the weights load. The shared rendering: one sequence of a pair."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

import llmtune
from llmtune.data.preference import RESPONSES, encode_pair, sequence_ids
from llmtune.data.templates import LabelRules
from llmtune.generation import reward_model as reward_model_module
from llmtune.generation.scorers import load_scorers
from tests.e2e.test_cli_errors import in_process
from tests.e2e.test_rm import SCORES, recipe
from tests.helpers import near, read_metrics, run_cli

TEXT_ROWS = [{"prompt": "What is 2 + 3?", "completion": " 5", "id": "text"},
             {"prompt": "Add 38 and 31, then tell me the sum twice.", "completion": " 69 and 69"}]
MESSAGES_ROWS = [{"prompt": [{"role": "user", "content": "What is 16 + 44?"}],
                  "completion": [{"role": "assistant", "content": "60"}], "score": "replaced"},
                 {"messages": [{"role": "user", "content": "What is 7 + 8?"}, {"role": "assistant", "content": "15"}]}]


@pytest.fixture(scope="module")
def trained(tiny_model, pairs_file, tmp_path_factory):
    """(the exported reward model's folder, the run's last evaluation of its pairs, the pairs)."""
    out = tmp_path_factory.mktemp("rm") / "run"
    sections = recipe(tiny_model, pairs_file, out, train={"max_steps": 4},
                      checkpoint={"export_hf": True, "export_dtype": "fp32"})
    sections["data"]["val_files"] = [str(pairs_file)]
    llmtune.train("rm", sections)
    last = [r for r in read_metrics(out) if "eval_accuracy" in r][-1]
    return out / "hf", last, [json.loads(line) for line in pairs_file.read_text().splitlines()]


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def scored(capsys, *args: str) -> list[float]:
    result = in_process(capsys, "score", *args)
    assert result.returncode == 0, result.stderr
    return [float(line) for line in result.stdout.splitlines()]


def rendered_ids(tokenizer, row: dict) -> list[int]:
    """The ids of a row as rm training renders a pair's sequence, built here with the tokenizer alone: a string prompt
    with the tokenizer's special tokens, the completion with EOS; messages by the chat template."""
    if "messages" in row:
        row = {"prompt": row["messages"][:-1], "completion": row["messages"][-1:]}
    if isinstance(row["prompt"], str):
        return tokenizer(row["prompt"])["input_ids"] + \
            tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    text = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_each_score_is_transformers_score_of_the_rendered_ids(trained, tmp_path, capsys):
    folder, _, _ = trained
    rows = TEXT_ROWS + MESSAGES_ROWS
    got = scored(capsys, str(folder), write_rows(tmp_path / "rows.jsonl", rows), "--batch", "3")
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token_id != tokenizer.pad_token_id == model.config.pad_token_id
    with torch.no_grad():
        expected = [model(torch.tensor([rendered_ids(tokenizer, row)])).logits[0, 0].item() for row in rows]
    assert got == pytest.approx(expected, abs=1e-5)
    assert len({round(score, 4) for score in got}) == len(rows)


def test_the_runs_pairs_scored_one_sequence_at_a_time_average_to_its_evaluation(trained, tmp_path, capsys):
    folder, last, pairs = trained
    rows = [{"prompt": pair["prompt"], "completion": pair[response]} for pair in pairs for response in RESPONSES]
    scores = scored(capsys, str(folder), write_rows(tmp_path / "pairs.jsonl", rows))
    chosen, rejected = scores[0::2], scores[1::2]
    assert len(chosen) == 48
    # A mean reward can be near 0 (a centred model's): absolute near's 8 x fp32's epsilon x the scores' magnitude too.
    assert sum(chosen) / 48 == near(last["eval_rewards/chosen"], SCORES)
    assert sum(rejected) / 48 == near(last["eval_rewards/rejected"], SCORES)
    assert sum((c > r) + 0.5 * (c == r) for c, r in zip(chosen, rejected)) / 48 == last["eval_accuracy"]


def test_out_holds_every_row_with_its_score(trained, tmp_path, capsys):
    folder, _, _ = trained
    rows = TEXT_ROWS + MESSAGES_ROWS
    file = write_rows(tmp_path / "rows.jsonl", rows)
    printed = scored(capsys, str(folder), file)
    out = tmp_path / "scored.jsonl"
    result = in_process(capsys, "score", str(folder), file, "--out", str(out))
    assert (result.returncode, result.stdout) == (0, "")
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == [{**row, "score": score} for row, score in zip(rows, printed)]


def test_the_shared_rendering_is_a_pairs_sequence(tokenizer):
    rules = LabelRules()
    for pair in ({"prompt": "What is 2 + 3?", "chosen": " 5", "rejected": " 6"},
                 {"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
                  "chosen": [{"role": "assistant", "content": "5"}],
                  "rejected": [{"role": "assistant", "content": "6"}]}):
        prompt, *responses = encode_pair(tokenizer, pair, rules, "row 1", RESPONSES)
        for key, response in zip(RESPONSES, responses):
            assert sequence_ids(tokenizer, pair["prompt"], pair[key], rules, "row 1") == prompt + response


def test_grpos_reward_model_scores_as_the_command(trained, grpo_prompts_file, tmp_path, capsys):
    folder, _, _ = trained
    prompts = [json.loads(line)["prompt"] for line in grpo_prompts_file.read_text().splitlines()[:6]]
    texts = ["42", " The sum is 12", "7", "", " 3 + 4 = 7", "no idea"]
    completions = [text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]
                   for prompt, text in zip(prompts, texts)]
    assert {type(prompt) for prompt in prompts} == {str, list}, "both of TRL's forms"
    [scorer] = load_scorers([str(folder)], "solution", None, "grpo.reward_funcs")
    rewards = scorer.function(prompts=prompts, completions=completions, completion_ids=[[1]] * len(prompts))
    rows = [{"prompt": prompt, "completion": completion} for prompt, completion in zip(prompts, completions)]
    assert rewards == scored(capsys, str(folder), write_rows(tmp_path / "rows.jsonl", rows))


@pytest.fixture
def no_weights_read(monkeypatch):
    """Fails the test if a reward model's weights are read."""
    monkeypatch.setattr(reward_model_module.AutoModelForSequenceClassification, "from_pretrained",
                        lambda *a, **k: pytest.fail("the weights were read"))


def test_bad_input_is_refused_in_one_line_before_the_weights_load(trained, tiny_model, tmp_path, capsys,
                                                                   no_weights_read):
    folder, _, _ = trained
    rows = write_rows(tmp_path / "rows.jsonl", TEXT_ROWS)
    no_completion = write_rows(tmp_path / "no_completion.jsonl", [TEXT_ROWS[0], {"prompt": "What is 1 + 1?"}])
    no_prompt = write_rows(tmp_path / "no_prompt.jsonl", [{"text": "What is 1 + 1? 2"}])
    mixed = write_rows(tmp_path / "mixed.jsonl", [{**MESSAGES_ROWS[0], "completion": "60"}])
    three_labels = tmp_path / "three_labels"
    AutoConfig.from_pretrained(folder, num_labels=3).save_pretrained(three_labels)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    out = tmp_path / "out.jsonl"
    out.write_text("earlier\n")
    cases = [
        ([str(tmp_path / "missing"), rows], f"{tmp_path / 'missing'}: no such folder; give a HF model folder"),
        ([str(tiny_model), rows], f"{tiny_model}: a LlamaForCausalLM, not a reward model; give a sequence "
                                  "classifier of one label (AutoModelForSequenceClassification, num_labels 1), e.g. "
                                  "the output_dir/hf of an llmtune rm run"),
        ([str(three_labels), rows], f"{three_labels}: a LlamaForSequenceClassification of 3 labels; a reward model "
                                    "has one"),
        ([str(adapter), rows], f"{adapter}: an adapter folder; score with the merged HF folder"),
        ([str(folder), str(tmp_path / "none.jsonl")], f"FILE: {tmp_path / 'none.jsonl'} is not a file"),
        ([str(folder), no_completion, "--out", str(out)],
         f"{no_completion}: line 2: a 'prompt' but no 'completion'; write each row as {{\"prompt\": ..., "
         "\"completion\": ...}"),
        ([str(folder), no_prompt], f"{no_prompt}: line 1: no 'prompt' and 'completion' (nor 'messages'); write each "
                                   "row as"),
        ([str(folder), mixed], f"{mixed}: line 1: 'prompt' is a list of messages and 'completion' is not"),
        ([str(folder), rows, "--out", str(tmp_path)], f"--out: {tmp_path} is a folder; give a file path"),
    ]
    for args, expected in cases:
        result = in_process(capsys, "score", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith(f"llmtune: error: {expected}"), result.stderr
        assert len(result.stderr.splitlines()) == 1, result.stderr
    assert out.read_text() == "earlier\n"


def test_a_causal_lm_is_refused_by_the_command_as_a_user_runs_it(tiny_model, tmp_path):
    result = run_cli("score", str(tiny_model), write_rows(tmp_path / "rows.jsonl", TEXT_ROWS))
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"llmtune: error: {tiny_model}: a LlamaForCausalLM, not a reward model; give a sequence " \
                            "classifier of one label (AutoModelForSequenceClassification, num_labels 1), e.g. the " \
                            "output_dir/hf of an llmtune rm run\n"
