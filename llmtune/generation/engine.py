"""The generation engine: prompts' token ids -> completions, from the model a run trains (the FSDP root,
CausalLMForTraining, sharded any way) or from a plain transformers model (`llmtune generate`).

- transformers' own `generate` runs the decoding: its KV cache, its left-padded batches, its stop at every EOS id.
  Prompts go in batches sorted by length, so that a batch pads little.
- The sharded model is gathered once for the whole generation phase (model/build.gathered), never per token: each
  layer keeps its weights after its first forward until the phase ends. It attends with the model's own backend (the
  packed-documents and context-parallel wrappers are for training rows) and runs uncompiled (the layers were compiled
  for training's shapes).
- Every completion is chosen by its own generator, seeded from (seed, step, prompt index, sample index), in a logits
  processor that sees the model's logits: a completion does not depend on the rank that made it, the batch it rode
  in, or a resume. transformers' sampling draws from the global generator, one draw for the whole batch, so
  transformers is asked for greedy decoding and the processor hands it a distribution with one token left. The
  same processor records the chosen tokens' log-probabilities at the sampling temperature, of the model's logits
  before any filtering: what a training forward over the completion recomputes (grpo).
- Over several ranks each rank generates every world-th prompt and all of them learn every completion. Under expert
  parallelism a forward is a collective (the tokens go to their experts' ranks): every rank then runs as many
  batches and steps as the longest (transformers' synced_gpus). Under tensor parallelism it is one too, and the tp
  peers compute one model together: they generate the same prompts (each group of peers every (world / tp)-th one),
  with the logits gathered whole on each and the same generators, so the same tokens; the weights stay split.
"""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, MinPLogitsWarper,
                          RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from llmtune.model.build import CausalLMForTraining, gathered
from llmtune.model.expert_parallel import split_experts
from llmtune.model.multimodal import generation_inputs, set_text_attention, text_attention
from llmtune.model.varlen import VARLEN

# The defaults of the sampling keys where neither the caller nor the model's generation config sets one:
# transformers' (GenerationConfig._get_default_generation_params; tests/unit/test_generation.py holds them to it),
# but max_new_tokens, which transformers leaves to max_length (20 tokens with the prompt): TRL's
# max_completion_length, 256.
DEFAULTS = {"max_new_tokens": 256, "do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
            "repetition_penalty": 1.0, "num_return_sequences": 1}
BATCH_SIZE = 64  # completions decoded together


@dataclass(frozen=True)
class Sampling:
    """How completions are chosen, by transformers' and TRL's names."""
    max_new_tokens: int = DEFAULTS["max_new_tokens"]
    do_sample: bool = DEFAULTS["do_sample"]
    temperature: float = DEFAULTS["temperature"]
    top_p: float = DEFAULTS["top_p"]
    top_k: int = DEFAULTS["top_k"]
    min_p: float | None = DEFAULTS["min_p"]
    repetition_penalty: float = DEFAULTS["repetition_penalty"]
    num_return_sequences: int = DEFAULTS["num_return_sequences"]

    @classmethod
    def resolve(cls, given: dict, model_defaults: GenerationConfig | None = None) -> "Sampling":
        """As transformers' generate decides: a key given (not None) wins, then the model's generation config
        (generation_config.json), then DEFAULTS. A temperature of 0 is greedy decoding (do_sample false)."""
        values = {}
        for f in fields(cls):
            value = given.get(f.name)
            if value is None and model_defaults is not None:
                value = getattr(model_defaults, f.name, None)
            values[f.name] = DEFAULTS[f.name] if value is None else value
        if values["temperature"] == 0:  # greedy, as vLLM and OpenAI-style APIs read it (transformers refuses it)
            values.update(do_sample=False, temperature=DEFAULTS["temperature"])
        return cls(**values)

    def processors(self) -> LogitsProcessorList:
        """transformers' processors of these keys, in the order and on the conditions its generate adds them."""
        out = LogitsProcessorList()
        if self.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if self.do_sample:
            if self.temperature != 1.0:
                out.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                out.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                out.append(TopPLogitsWarper(self.top_p))
            if self.min_p is not None:
                out.append(MinPLogitsWarper(self.min_p))
        return out


@dataclass
class Completion:
    """One completion: its prompt's index, its sample index (of num_return_sequences), its token ids (up to and
    with the first EOS), the log-probability of each at the sampling temperature, and whether it ended at
    max_new_tokens without an EOS."""
    prompt: int
    sample: int
    ids: list[int]
    logprobs: list[float]
    truncated: bool


def completion_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The seed of one completion's generator: a hash, so that neighbouring indices draw unrelated streams."""
    digest = hashlib.sha256(f"{seed}:{step}:{prompt}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class _Chooser(LogitsProcessor):
    """The last processor of a batch: picks each row's token (argmax, or drawn by the row's own generator) and
    leaves transformers only that one, recording its log-probability."""

    def __init__(self, rows: list[tuple[int, int]], sampling: Sampling, seed: int, step: int, prompt_length: int,
                 device: torch.device):
        self.prompt_length = prompt_length
        self.processors = sampling.processors()
        self.temperature = sampling.temperature if sampling.do_sample else 1.0
        self.generators = [torch.Generator(device).manual_seed(completion_seed(seed, step, p, s)) for p, s in rows] \
            if sampling.do_sample else None
        self.logprobs: list[torch.Tensor] = []  # by position in the completion

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tempered = scores / self.temperature if self.temperature != 1.0 else scores
        normalizer = torch.logsumexp(tempered, dim=-1)
        processed = self.processors(input_ids, scores) if self.processors else scores
        if self.generators is None:
            chosen = processed.argmax(dim=-1, keepdim=True)
        else:
            probs = torch.softmax(processed, dim=-1)
            chosen = torch.stack([torch.multinomial(row, 1, generator=generator)
                                  for row, generator in zip(probs, self.generators)])
        position = input_ids.shape[1] - self.prompt_length
        # transformers may decode a step past the end and take it back (its deferred stop check): kept by position.
        del self.logprobs[position:]
        self.logprobs.append(tempered.gather(1, chosen).squeeze(1) - normalizer)
        # In place: the scores are transformers' copy of the step's logits, which it keeps for nobody here.
        return scores.fill_(-math.inf).scatter_(1, chosen, 0.0)


def generate(model, prompts: list[list[int]], sampling: Sampling, *, eos_ids: list[int], pad_id: int,
             device: torch.device, seed: int = 0, step: int = 0, batch_size: int = BATCH_SIZE,
             state=None, images: list[dict] | None = None) -> list[Completion]:
    """Every prompt's num_return_sequences completions, in prompt order then sample order, on every rank.

    `model`: a CausalLMForTraining (the run's, every rank calling) or a transformers causal LM (on each process of
    its own). `state`: the processes' ParallelState, over which they share the prompts (None: one process). `seed`
    and `step` seed the completions with the prompts' indices in `prompts`. `images`: a vision-language model's,
    each prompt's image tensors (data/images.py's; empty for a prompt without), whose tokens its ids hold."""
    world, tp = (state.world_size, state.tp_size) if state else (1, 1)
    groups, group = world // tp, (state.rank // tp if state else 0)
    rows = [(p, s) for p in range(group, len(prompts), groups) for s in range(sampling.num_return_sequences)]
    rows.sort(key=lambda row: len(prompts[row[0]]))
    batches = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    collective = isinstance(model, CausalLMForTraining) and (bool(split_experts(model.hf_model)) or tp > 1)
    if collective and world > 1:  # every rank runs as many batches (an idle one decodes a prompt and drops it)
        [count] = state.highest([len(batches)])
        batches += [[]] * (count - len(batches))
    mine, idle = [], [prompts[0] if prompts else [pad_id]]
    with _ready(model):
        for batch in batches:
            made = _generate_batch(model, [prompts[p] for p, _ in batch] or idle, batch or [(0, 0)], sampling,
                                   eos_ids, pad_id, device, seed, step, synced=collective and world > 1,
                                   images=[images[p] for p, _ in batch] if images and batch else [])
            mine += made if batch else []
    if world > 1:
        # Each group of tp peers made the same completions: one peer's of each.
        mine = [c for share in state.all_gather_object(mine)[::tp] for c in share]
    return sorted(mine, key=lambda c: (c.prompt, c.sample))


@contextmanager
def _ready(model):
    """The run's model as it generates: in eval mode, with its own attention backend, uncompiled, gathered once;
    afterwards as it was, its weights sharded again. A transformers model: in eval mode."""
    training = model.training
    model.eval()
    try:
        if not isinstance(model, CausalLMForTraining):
            yield
            return
        hf_model = model.hf_model
        wrapped = text_attention(hf_model)
        # torch's varlen kernels take no padding mask, which a left-padded batch with a KV cache needs: sdpa
        # generates for them (the same attention, another kernel).
        own = "sdpa" if model.attention == VARLEN else model.attention
        if own and wrapped != own:
            set_text_attention(hf_model, own)
        try:
            with torch.compiler.set_stance("force_eager"), gathered(model):
                yield
        finally:
            if text_attention(hf_model) != wrapped:
                set_text_attention(hf_model, wrapped)
    finally:
        model.train(training)


def _generate_batch(model, prompts: list[list[int]], rows: list[tuple[int, int]], sampling: Sampling,
                    eos_ids: list[int], pad_id: int, device: torch.device, seed: int, step: int,
                    synced: bool, images: list[dict]) -> list[Completion]:
    """One left-padded batch through transformers' generate (with each row's images, where it has any)."""
    length = max(len(ids) for ids in prompts)
    input_ids = torch.tensor([[pad_id] * (length - len(ids)) + ids for ids in prompts], device=device)
    attention_mask = torch.tensor([[0] * (length - len(ids)) + [1] * len(ids) for ids in prompts], device=device)
    chooser = _Chooser(rows, sampling, seed, step, length, device)
    # Greedy for transformers (the chooser left one token) with no processor of its own: the repetition penalty is
    # the chooser's, after its log-probabilities are taken.
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, num_beams=1,
                         max_new_tokens=sampling.max_new_tokens, num_return_sequences=1, repetition_penalty=1.0,
                         eos_token_id=list(eos_ids), pad_token_id=pad_id, logits_processor=LogitsProcessorList([chooser]),
                         synced_gpus=synced,
                         **generation_inputs(model.hf_model if isinstance(model, CausalLMForTraining) else model,
                                             input_ids, images))
    new = out[:, length:].tolist()
    logprobs = torch.stack(chooser.logprobs, dim=1).tolist() if chooser.logprobs else [[] for _ in rows]
    eos = set(eos_ids)
    completions = []
    for (p, s), ids, row_logprobs in zip(rows, new, logprobs):
        end = next((i + 1 for i, token in enumerate(ids) if token in eos), None)
        kept = ids[:end] if end else ids[:sampling.max_new_tokens]
        completions.append(Completion(p, s, kept, row_logprobs[:len(kept)], truncated=end is None))
    return completions
