"""The installed `llmtune` script (pip's console script, not bin/llmtune's `python -m`) run as a TRL user runs it:
from a folder that holds the recipe and the user's own modules beside it. The reward function, the scorer and the
callback those modules define are imported from the working directory, and a callback that leaves a thread pool open
does not keep the process from ending."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import read_metrics

SCRIPT = Path(sys.executable).parent / "llmtune"

USER_MODULES = {
    "my_rewards.py": '''
def sum_reward(prompts, completions, completion_ids, **columns):
    return [float(len(ids)) for ids in completion_ids]
''',
    "my_scorers.py": '''
def short(prompts, completions, completion_ids, **columns):
    return [float(len(ids) < 4) for ids in completion_ids]
''',
    # A pool left open, as torch.compile's and other libraries' are: its workers stop only when threading's exit
    # hook tells them to.
    "my_callbacks.py": '''
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


class OpenPool:
    def on_train_begin(self, args, state, control, **kwargs):
        self.pool = ThreadPoolExecutor(max_workers=2)

    def on_step_end(self, args, state, control, **kwargs):
        self.pool.submit(Path("steps.txt").open("a").write, f"{state.global_step}\\n").result()
''',
}


@pytest.mark.slow
def test_the_installed_script_imports_the_users_modules_and_ends(tiny_model, grpo_prompts_file, tmp_path):
    assert SCRIPT.is_file(), f"{SCRIPT}: the README's setup installs the llmtune script into the environment"
    work = tmp_path / "work"
    work.mkdir()
    for name, text in USER_MODULES.items():
        (work / name).write_text(text)
    (work / "r.yaml").write_text(yaml.safe_dump({
        "model": {"name_or_path": str(tiny_model)},
        "data": {"train_files": [str(grpo_prompts_file)], "chat_template": "basic", "max_seq_len": 64},
        "train": {"output_dir": "out", "max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1,
                  "eval_steps": 2, "callbacks": ["my_callbacks:OpenPool"]},
        "grpo": {"reward_funcs": ["my_rewards:sum_reward"], "num_generations": 4, "max_completion_length": 6},
        "eval_generation": {"files": [str(grpo_prompts_file)], "answer_column": "solution", "scorers":
                            ["my_scorers:short"], "max_new_tokens": 6, "max_samples": 2},
        "monitor": {"plots": False},
    }))
    done = subprocess.run([str(SCRIPT), "grpo", "r.yaml"], cwd=work, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(work / "out")
    assert all("rewards/sum_reward/mean" in r for r in records if "loss" in r)
    assert any("eval_gen/short" in r for r in records)
    assert (work / "steps.txt").read_text().split() == ["1", "2"]
