"""Run by torchrun from test_hub_fetch.py (python -m tests.dist.hub_fetch_worker, so that this checkout's llmtune
is imported): worker.fetch_in_turn on a recipe naming a Hub model, every fetch recorded, then on one naming a
missing model. Writes this rank's report to argv[3]/rank_<rank>.json."""

import json
import os
import sys
import time
from pathlib import Path

from llmtune.run import inputs
from llmtune.config import load_config
from llmtune.errors import UserError
from llmtune.run.parallel import ParallelState
from llmtune.run.process_exit import run_and_exit
from llmtune.run.worker import fetch_in_turn

# A download takes a while: long enough that a rank not waiting for it would be seen starting before it ends.
DOWNLOAD_SECONDS = 1.0


def recording(fetch, events: list):
    def record(repo, key, local_files_only=False):
        start = time.time()
        if not local_files_only:
            time.sleep(DOWNLOAD_SECONDS)
        folder = fetch(repo, key, local_files_only)
        events.append({"revision": repo.revision, "files": repo.files, "local_files_only": local_files_only,
                       "start": start, "end": time.time()})
        return folder
    return record


def main(good_recipe: str, missing_recipe: str, out: Path) -> None:
    state = ParallelState.initialize()
    events: list = []
    inputs.fetch = recording(inputs.fetch, events)
    try:
        local = fetch_in_turn(load_config(good_recipe, [], "sft", state.world_size), state)
        fetched = list(events)
        try:
            fetch_in_turn(load_config(missing_recipe, [], "sft", state.world_size), state)
            error = None
        except UserError as err:
            error = str(err)
        (out / f"rank_{state.rank}.json").write_text(json.dumps({
            "local_rank": state.local_rank, "hf_home": os.environ["HF_HOME"], "model": local.model.name_or_path,
            "events": fetched, "error": error}))
    finally:
        state.close()


if __name__ == "__main__":
    run_and_exit(lambda: main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
