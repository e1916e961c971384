"""Run by torchrun (2 processes) from test_generation_ranks.py, in one launch (most of a launch is its start-up):
first the training cases of CASES.json (case_worker.py's); then the run's sharded model of RECIPE (built as the
worker builds it) generates at two completion lengths while FSDP2's all-gathers are counted, and every parameter
group is checked to be sharded again, each with the layout after a forward it had before. Rank 0 writes OUT as
JSON."""

import json
import os
import sys
from pathlib import Path

from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group

from llmtune.config import load_config
from llmtune.generation.engine import Sampling, generate
from llmtune.run.parallel import ParallelState
from llmtune.run.process_exit import run_and_exit
from llmtune.run.worker import build_trainer
from tests.dist.case_worker import run_case


def param_groups(model) -> list:
    return [group for sub in model.modules() if isinstance(sub, FSDPModule)
            for group in sub._get_fsdp_state()._fsdp_param_groups]


def main(cases: str, recipe: str, out: str) -> None:
    for case in json.loads(Path(cases).read_text()):
        run_case(case["recipe"], case["overrides"], int(os.environ["WORLD_SIZE"]), keep_process_group=True)
    state = ParallelState.initialize()
    try:
        config = load_config(recipe, [f"train.output_dir={Path(out).parent / 'gathers_run'}"], "sft", state.world_size)
        trainer, tokenizer = build_trainer(config, state)
        model, groups = trainer.model, param_groups(trainer.model)
        layouts = [group.post_forward_mesh_info for group in groups]
        prompts = [tokenizer(text)["input_ids"] for text in ("7 + 8 =", "The sum of 12 and 30 is", "Hi", "What")]
        gathers = []
        original = _fsdp_param_group.foreach_all_gather
        for tokens in (3, 9):
            count = [0]

            def counted(*args, count=count, **kwargs):
                count[0] += 1
                return original(*args, **kwargs)

            _fsdp_param_group.foreach_all_gather = counted
            try:
                made = generate(model, prompts, Sampling(max_new_tokens=tokens), eos_ids=[10**6], pad_id=0,
                                device=state.device, batch_size=2, state=state)
            finally:
                _fsdp_param_group.foreach_all_gather = original
            gathers.append({"tokens": sum(len(c.ids) for c in made), "all_gathers": count[0]})
        report = {"groups": len(groups), "gathers": gathers,
                  "resharded": not any(group.is_unsharded for group in groups),
                  "layouts_kept": [group.post_forward_mesh_info for group in groups] == layouts,
                  "training": model.training}
        if state.is_main:
            Path(out).write_text(json.dumps(report))
    finally:
        state.close()


if __name__ == "__main__":
    run_and_exit(lambda: main(*sys.argv[1:]))
