"""`llmtune generate MODEL_DIR`: completions of a HF model folder (a run's output_dir/hf) through the engine that
generates during training (generation/engine.py), so that a completion depends on the seed, its prompt's and
sample's index and the model alone: for one prompt, printed; for a JSONL file of prompts, written with each row, on
one process or split over several (each holding the whole model); or the replies of a chat on the terminal."""

import json
import sys
from argparse import Namespace
from dataclasses import fields
from pathlib import Path

import torch
from jinja2 import TemplateError
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from llmtune.atomic import write_text
from llmtune.config import DataConfig, ParallelConfig
from llmtune.data.collate import pad_token_id
from llmtune.data import images
from llmtune.data.prompts import prompt_ids, prompt_with_images
from llmtune.errors import UserError
from llmtune.generation.engine import BATCH_SIZE, Sampling, generate
from llmtune.generation.prompts import completion_value, stop_ids
from llmtune.model.build import auto_class
from llmtune.run.launch import launched_by_torchrun
from llmtune.run.parallel import LONG_WAIT, ParallelState

END_OF_CHAT = ("", "exit")


class Completer:
    """A loaded model folder and how it samples: prompts' token ids -> the texts of their completions."""

    def __init__(self, model_dir: str, tokenizer, sampling: Sampling, device: torch.device, seed: int,
                 batch_size: int, state: ParallelState | None):
        # fp32 on the CPU, where half precision computes slowly; on a GPU the dtype the folder was saved in.
        dtype = torch.float32 if device.type == "cpu" else "auto"
        model_class = auto_class(AutoConfig.from_pretrained(model_dir))
        self.model = model_class.from_pretrained(model_dir, dtype=dtype, trust_remote_code=False).to(device)
        self.tokenizer, self.sampling, self.device = tokenizer, sampling, device
        self.seed, self.batch_size, self.state = seed, batch_size, state
        self.eos_ids = stop_ids(tokenizer, self.model.generation_config)

    def texts(self, prompts: list[list[int]], step: int = 0, images: list[dict] | None = None) -> list[tuple[int, str]]:
        """(prompt index, text) of every completion, prompt by prompt, each prompt's samples in order; the same on
        every process of a process group, which shares the prompts. `images`: each prompt's image tensors."""
        made = generate(self.model, prompts, self.sampling, eos_ids=self.eos_ids, pad_id=pad_token_id(self.tokenizer),
                        device=self.device, seed=self.seed, step=step, batch_size=self.batch_size, state=self.state,
                        images=images)
        return [(c.prompt, self.tokenizer.decode(c.ids, skip_special_tokens=True)) for c in made]


def resolved_sampling(parsed: Namespace) -> Sampling:
    """The flags given, else the folder's generation config, else the defaults, as transformers' generate decides."""
    given = {f.name: getattr(parsed, f.name) for f in fields(Sampling)}  # each key a flag of the same name
    if parsed.chat:  # one reply goes on with the conversation
        given["num_return_sequences"] = 1
    sampling = Sampling.resolve(given, folder_generation_config(Path(parsed.model_dir)))
    if not sampling.do_sample and sampling.num_return_sequences > 1:
        raise UserError(f"--num_return_sequences: greedy decoding (--do_sample false, or {parsed.model_dir}'s "
                        "generation_config.json) gives one completion per prompt, as transformers' generate; pass "
                        "--do_sample true or --num_return_sequences 1")
    return sampling


def folder_generation_config(model_dir: Path) -> GenerationConfig:
    """The generation config from_pretrained gives the folder's model, read before the weights are: a refusal of
    the sampling flags comes before the model loads."""
    if (model_dir / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(model_dir)
    return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))


def file_prompts(path: str, rows: list[dict], tokenizer) -> tuple[list[list[int]], list[dict]]:
    """(the token ids of each prompt of `rows`, read from the prompts file `path` (read_prompt_rows), and each one's
    image tensors: a row's `images` column, paths relative to the file's folder); a row the model cannot complete is
    refused by its number, before the model loads."""
    prompts, found = [], []
    for number, row in enumerate(rows, 1):
        if row.get("images"):
            where = f"{path}: row {number}"
            refs = [images.reference(image, Path(path).parent, where) for image in row["images"]]
            ids, tensors = prompt_with_images(tokenizer, row["prompt"], refs, where)
            prompts.append(ids)
            found.append(tensors)
            continue
        if isinstance(row["prompt"], list) and not tokenizer.chat_template:
            raise UserError(f"{path}: row {number}: a messages prompt needs a chat template, and the tokenizer has "
                            "none; write the prompt as a string or give the model folder a chat template")
        try:
            ids = prompt_ids(tokenizer, row["prompt"])
        except TemplateError as err:
            raise UserError(f"{path}: row {number}: the chat template refuses these messages ({err})") from None
        if not ids:
            raise UserError(f"{path}: row {number}: the prompt is empty; give the text the completion follows")
        prompts.append(ids)
        found.append({})
    return prompts, found


def checked_inputs(parsed: Namespace, rows: list[dict]) -> tuple:
    """(tokenizer, sampling, their prompts' ids and images): every refusal that needs the tokenizer or the folder's
    generation config, made before the model loads (and, under --nproc, before the processes start). rows: --file's,
    as read_prompt_rows read them (none without --file); a vision-language model's prompts (--file's images column,
    --prompt's --image) with their images' tensors."""
    tokenizer = AutoTokenizer.from_pretrained(parsed.model_dir, trust_remote_code=False)
    images.attach(tokenizer, (parsed.model_dir,), AutoConfig.from_pretrained(parsed.model_dir), DataConfig())
    sampling = resolved_sampling(parsed)
    if parsed.chat and not tokenizer.chat_template:
        raise UserError(f"--chat: {parsed.model_dir}'s tokenizer has no chat template; give the folder one "
                        "(tokenizer_config.json's chat_template) or complete text with --prompt")
    if parsed.prompt == "":
        raise UserError("--prompt: empty; give the text the completion follows")
    if parsed.image:
        refs = [images.reference(image, None, "--image") for image in parsed.image]
        ids, tensors = prompt_with_images(tokenizer, parsed.prompt, refs, "--image")
        return tokenizer, sampling, ([ids], [tensors])
    return tokenizer, sampling, file_prompts(parsed.file, rows, tokenizer)


def run(parsed: Namespace, rows: list[dict]) -> None:
    """The command on this process; under torchrun, on each of its processes, which share --file's prompts, the
    first one writing --out and saying so. rows: --file's (checked_inputs')."""
    tokenizer, sampling, (prompts, prompt_images) = checked_inputs(parsed, rows)
    # The processes wait for each other once, when the completions are shared: as long as the slowest one's share
    # takes, not the training collectives' timeout.
    state = ParallelState.initialize(ParallelConfig(timeout_minutes=LONG_WAIT.total_seconds() / 60)) \
        if launched_by_torchrun() else None
    try:
        device = state.device if state else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        completer = Completer(parsed.model_dir, tokenizer, sampling, device, parsed.seed,
                              parsed.batch_size or BATCH_SIZE, state)
        if parsed.chat:
            chat(completer, typed_lines())
        elif parsed.file or parsed.image:
            completions = completer.texts(prompts, images=prompt_images)
            if parsed.image:
                print_completions([text for _, text in completions])
                return
            if not state or state.is_main:
                write_completions(Path(parsed.out), rows, completions)
                print(f"wrote {len(completions)} completions of {len(rows)} prompts to {parsed.out}")
        else:
            print_completions([text for _, text in completer.texts([prompt_ids(tokenizer, parsed.prompt)])])
    finally:
        if state:
            state.close()


def write_completions(out: Path, rows: list[dict], completions: list[tuple[int, str]]) -> None:
    """`out` holds every row with its completion (n rows per prompt row under num_return_sequences n), whole, or
    what it held before."""
    text = "".join(json.dumps({**rows[p], "completion": completion_value(rows[p]["prompt"], completion)}) + "\n"
                   for p, completion in completions)
    try:
        write_text(out, text)
    except OSError as err:
        raise UserError(f"--out: cannot write {out} ({err.strerror}); give a path in a folder you can write to") \
            from None


def print_completions(texts: list[str]) -> None:
    if len(texts) == 1:
        print(texts[0])
        return
    for number, text in enumerate(texts, 1):
        print(f"--- completion {number} of {len(texts)} ---\n{text}")


def typed_lines():
    """The lines of stdin, a "> " before each where a person types them."""
    while True:
        try:
            yield input("> " if sys.stdin.isatty() else "")
        except EOFError:
            return


def chat(completer: Completer, lines) -> list[dict]:
    """A conversation: each line a user turn, the model's reply to the whole conversation so far printed and added
    to it, until an empty line, exit or the end of the lines. Returns the conversation."""
    messages = []
    for turn, line in enumerate(lines):
        if line.strip() in END_OF_CHAT:
            break
        messages.append({"role": "user", "content": line.strip()})
        # Each turn draws from generators of its own (step = turn) when sampling.
        [(_, reply)] = completer.texts([prompt_ids(completer.tokenizer, messages)], step=turn)
        print(reply, flush=True)
        messages.append({"role": "assistant", "content": reply})
    return messages
