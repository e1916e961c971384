"""llmtune grpo end to end on one process: TRL's metric names in metrics.jsonl, every logged round's prompts,
completions and rewards in completions.jsonl, the reward curve drawn, an export transformers loads, a LoRA run whose
KL term is against the policy with its adapters off, `llmtune data` showing the prompts; and the refusals: a reward
function that cannot be imported, prompts without a prompt column and a round of no whole groups before any process
starts, a reward function that raises, miscounts or returns no number stopping the run with one line naming it and
the step."""

import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import llmtune
from llmtune.errors import UserError
from llmtune.run.cli import main as cli_main
from tests.helpers import read_metrics

TRL_METRICS = ["reward", "reward_std", "rewards/digits/mean", "rewards/digits/std", "rewards/numeric_match/mean",
               "rewards/numeric_match/std", "frac_reward_zero_std", "completions/mean_length",
               "completions/min_length", "completions/max_length", "completions/clipped_ratio",
               "completions/mean_terminated_length", "completions/min_terminated_length",
               "completions/max_terminated_length", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
               "clip_ratio/region_mean"]


def recipe(tiny_model, grpo_prompts_file, output_dir, **grpo) -> dict:
    return {"model": {"name_or_path": str(tiny_model)},
            "data": {"train_files": [str(grpo_prompts_file)], "chat_template": "basic", "max_seq_len": 64},
            "train": {"output_dir": str(output_dir), "max_steps": 3, "per_device_train_batch_size": 4,
                      "gradient_accumulation_steps": 2, "logging_steps": 2, "learning_rate": 1e-2},
            "checkpoint": {"export_dtype": "fp32"},
            "grpo": {"reward_funcs": ["tests.e2e.grpo_rewards:digits", "numeric_match"], "num_generations": 4,
                     "max_completion_length": 6, **grpo}}


@pytest.fixture(scope="module")
def run(tiny_model, grpo_prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = llmtune.train("grpo", recipe(tiny_model, grpo_prompts_file, out))
    return result, out, [str(warning.message) for warning in caught]


def test_no_forward_returns_a_view_to_fsdp(run):
    """FSDP2 warns of a forward method's output that is a view (an in-place op on it would skip its pre-backward
    hook); every grpo run warned of token_logps' until it returned a tensor of its own."""
    assert not [message for message in run[2] if "returned a view tensor" in message]


def test_the_records_carry_trls_metrics(run):
    _, out, _ = run
    records = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == [2, 3]
    assert all(set(TRL_METRICS) <= r.keys() for r in records)
    assert "kl" not in records[0], "beta 0: no KL term, as TRL logs none"
    assert all(r["generation/completions_per_s"] > 0 and "completions_per_s" in r for r in records)


def test_each_logged_rounds_completions_are_written_with_their_rewards(run, grpo_prompts_file):
    _, out, _ = run
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    given = [json.loads(line) for line in grpo_prompts_file.read_text().splitlines()]
    # Logged at step 1 (the first) and step 2 (logging_steps): a round of 2 prompts x 4 completions each.
    assert [row["step"] for row in rows] == [1] * 8 + [2] * 8
    assert all(row["prompt"] in [g["prompt"] for g in given] and isinstance(row["completion"], type(row["prompt"]))
               for row in rows)
    assert all(row["digits"] == sum(ch.isdigit() for ch in (row["completion"] if isinstance(row["completion"], str)
                                                           else row["completion"][0]["content"])) for row in rows)
    assert all(len(row["completion_ids"]) <= 6 and row["numeric_match"] in (0.0, 1.0) for row in rows)


def test_the_reward_curve_is_drawn_and_the_export_loads(run):
    _, out, _ = run
    assert (out / "plots" / "reward.png").is_file()
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    assert model.config.architectures == ["LlamaForCausalLM"]


def test_a_lora_run_with_the_adapters_off_as_reference_trains(tiny_model, grpo_prompts_file, tmp_path):
    given = recipe(tiny_model, grpo_prompts_file, tmp_path / "run", beta=0.1, reference="adapter_off")
    given["peft"] = {"method": "lora", "r": 4, "alpha": 8, "init_lora_weights": False}
    llmtune.train("grpo", given)
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert all(r["kl"] >= 0 for r in records) and any(r["kl"] > 0 for r in records), \
        "the adapters (initialised non-zero) make the policy differ from the reference, the base alone"
    assert any(r["grad_norm"] > 0 for r in records)


def refused(tmp_path, capsys, monkeypatch, given: dict) -> str:
    """The CLI's main asked for 2 processes: its exit status must be 2 before it would start them."""
    recipe_file = tmp_path / "recipe.json"
    recipe_file.write_text(json.dumps(given))
    monkeypatch.setattr("llmtune.run.launch.launch_local", lambda *args, **kwargs: pytest.fail("processes started"))
    assert cli_main(["grpo", str(recipe_file), "--nproc", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1]


def test_a_reward_function_that_cannot_be_imported_is_refused_before_any_process(tiny_model, grpo_prompts_file,
                                                                                  tmp_path, capsys, monkeypatch):
    given = recipe(tiny_model, grpo_prompts_file, tmp_path / "run", reward_funcs=["tests.e2e.no_such:reward"])
    assert refused(tmp_path, capsys, monkeypatch, given).startswith(
        "llmtune: error: grpo.reward_funcs: cannot import 'tests.e2e.no_such:reward' (ModuleNotFoundError")


def test_prompts_without_a_prompt_column_are_refused_before_any_process(tiny_model, tmp_path, capsys, monkeypatch):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "What is 1 + 1?", "solution": "2"}) + "\n")
    assert refused(tmp_path, capsys, monkeypatch, recipe(tiny_model, rows, tmp_path / "run")) == (
        f"llmtune: error: data.train_files: {rows}: line 1 has no 'prompt' column (columns: question, solution); grpo "
        "reads TRL's prompt-only forms: a 'prompt' string or list of messages per row, the other columns handed to "
        "the reward functions")


def test_a_round_of_no_whole_groups_is_refused_before_any_process(tiny_model, grpo_prompts_file, tmp_path, capsys,
                                                                  monkeypatch):
    given = recipe(tiny_model, grpo_prompts_file, tmp_path / "run", num_generations=3)
    assert refused(tmp_path, capsys, monkeypatch, given) == (
        "llmtune: error: grpo.generation_batch_size: a round of 16 completions is not a whole number of groups of "
        "num_generations=3; choose a multiple of 3")


@pytest.mark.parametrize("reward, said", [
    ("raises", "grpo.reward_funcs: raises raised ValueError: no answer key (scoring the completions of step 1)"),
    ("one_short", "grpo.reward_funcs: one_short returned 7 values for 8 completions (scoring the completions of step "
                  "1); return one float (or None) per completion"),
    ("words", "grpo.reward_funcs: words returned 'many', a str, for 8 completions (scoring the completions of step "
              "1); return one float (or None) per completion")])
def test_a_reward_function_that_fails_stops_the_run_naming_it(tiny_model, grpo_prompts_file, tmp_path, reward, said):
    given = recipe(tiny_model, grpo_prompts_file, tmp_path / "run",
                   reward_funcs=[f"tests.e2e.grpo_rewards:{reward}"])
    with pytest.raises(UserError) as raised:
        llmtune.train("grpo", given)
    assert str(raised.value) == said


def test_llmtune_data_shows_the_prompts_as_rendered_with_their_columns(tiny_model, grpo_prompts_file, tmp_path,
                                                                       capsys):
    recipe_file = tmp_path / "recipe.json"
    recipe_file.write_text(json.dumps(recipe(tiny_model, grpo_prompts_file, tmp_path / "run")))
    assert cli_main(["data", str(recipe_file), "--task", "grpo", "--n", "2"]) == 0
    shown = capsys.readouterr().out
    first = json.loads(grpo_prompts_file.read_text().splitlines()[0])
    assert "prompt 1: " in shown and f"reward functions also get: {{'solution': {first['solution']!r}}}" in shown
    assert first["prompt"][0]["content"] in shown and "prompt 3:" not in shown
    assert "data: 16 prompts" in shown


def test_a_reward_model_folder_scores_the_completions_as_transformers_does(tiny_model, grpo_prompts_file,
                                                                           bare_tokenizer, tmp_path):
    """A sequence classifier's folder among grpo.reward_funcs: each completion's reward is the model's first logit of
    the prompt + completion, rendered as llmtune rm renders a pair's sequence (messages by the folder's chat
    template; a text prompt with the tokenizer's special tokens, the completion with EOS), as transformers computes
    it here."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig, \
        LlamaForSequenceClassification

    from llmtune.data.templates import apply_recipe_template

    folder = tmp_path / "reward_model"
    torch.manual_seed(0)
    LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(bare_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=bare_tokenizer.pad_token_id,
    )).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    apply_recipe_template(tokenizer, "basic")
    tokenizer.save_pretrained(folder)
    given = recipe(tiny_model, grpo_prompts_file, tmp_path / "run", reward_funcs=[str(folder), "numeric_match"])
    given["train"]["max_steps"] = 1
    llmtune.train("grpo", given)
    rows = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    for row in rows:
        if isinstance(row["prompt"], list):
            text = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(row["prompt"])["input_ids"] + \
                tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            expected = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert row["reward_model"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert "rewards/reward_model/mean" in records[-1]
