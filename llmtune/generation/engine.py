"""The generation engine: prompts' token ids -> completions, from the model a run trains (the FSDP root,
CausalLMForTraining, sharded any way) or from a plain transformers model (`llmtune generate`).

- transformers' own `generate` runs the decoding: its logits processors, its stop at every EOS id.
- The sharded model is gathered once for the whole generation phase (model/build.gathered), never per token: each
  layer keeps its weights after its first forward until the phase ends. It attends with the model's own backend (the
  packed-documents and context-parallel wrappers are for training rows) and runs uncompiled (the layers were compiled
  for training's shapes).
- A prompt's keys and values are computed once for all its num_return_sequences samples: one forward over the
  distinct prompts (but their last token) fills a cache, copied for each sample into a static KV cache of the
  batch's whole length, which transformers' generate then decodes from, writing each step in place (on CUDA it
  compiles that decode step, as it does for any static cache). Left-padded batches of whole groups, sorted by
  length, so that a batch pads little. (Not for a vision-language model: each sample prefills its own prompt,
  images and all.)
- Every completion's randomness is its own: at each position one uniform number, a counter-based hash of (the
  completion's seed, drawn from seed, step, prompt index, sample index) and the position, picks its token from the
  cumulative distribution (inverse-CDF sampling), for the whole batch at once. So a completion does not depend on
  the rank that made it, the batch it rode in, or a resume. transformers' sampling draws from the global
  generator, so transformers is asked for greedy decoding and the processor hands it a distribution with one token
  left. The same processor records the chosen tokens' log-probabilities at the sampling temperature, of the
  model's logits before any filtering: what a training forward over the completion recomputes (grpo).
- Over several ranks each rank generates every world-th prompt and all of them learn every completion. Under expert
  parallelism a forward is a collective (the tokens go to their experts' ranks): every rank then runs as many
  batches and steps as the longest (transformers' synced_gpus). Under tensor parallelism it is one too, and the tp
  peers compute one model together: they generate the same prompts (each group of peers every (world / tp)-th one),
  with the logits gathered whole on each and the same uniforms, so the same tokens; the weights stay split.
"""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from transformers import (DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList, MinPLogitsWarper,
                          RepetitionPenaltyLogitsProcessor, StaticCache, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from llmtune.model.build import CausalLMForTraining, gathered
from llmtune.model.expert_parallel import split_experts
from llmtune.model.multimodal import generation_inputs, is_multimodal, set_text_attention, text_attention
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
    """The seed of one completion's stream: a hash, so that neighbouring indices draw unrelated streams."""
    digest = hashlib.sha256(f"{seed}:{step}:{prompt}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


_MASK64 = 2**64 - 1


def uniform(completion: int, position: int) -> float:
    """The uniform number in [0, 1) that picks a completion's token at a position: splitmix64 of the position's
    counter in the completion's stream, its top 53 bits. A pure function of (completion seed, position), so the
    batch draws at once without a generator per row."""
    z = (completion + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


class _Chooser(LogitsProcessor):
    """The last processor of a batch: picks each row's token (argmax, or by the row's uniform number for its
    position from the cumulative distribution) and leaves transformers only that one, recording its
    log-probability."""

    def __init__(self, rows: list[tuple[int, int]], sampling: Sampling, seed: int, step: int, prompt_length: int):
        self.prompt_length = prompt_length
        self.processors = sampling.processors()
        self.temperature = sampling.temperature if sampling.do_sample else 1.0
        self.seeds = [completion_seed(seed, step, p, s) for p, s in rows] if sampling.do_sample else None
        self.logprobs: list[torch.Tensor] = []  # by position in the completion

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tempered = scores / self.temperature if self.temperature != 1.0 else scores
        normalizer = torch.logsumexp(tempered, dim=-1)
        processed = self.processors(input_ids, scores) if self.processors else scores
        position = input_ids.shape[1] - self.prompt_length
        if self.seeds is None:
            chosen = processed.argmax(dim=-1, keepdim=True)
        else:
            # float64: the cumulative sum of a large vocabulary's probabilities keeps every token's share.
            cdf = torch.softmax(processed.double(), dim=-1).cumsum_(dim=-1)
            drawn = torch.tensor([uniform(s, position) for s in self.seeds], dtype=torch.float64,
                                 device=cdf.device)
            # The first token whose cumulative mass passes the draw: one of zero probability never is.
            chosen = torch.searchsorted(cdf, (drawn * cdf[:, -1]).unsqueeze(1), right=True)
            chosen.clamp_(max=cdf.shape[1] - 1)
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
    samples = sampling.num_return_sequences
    mine = sorted(range(group, len(prompts), groups), key=lambda p: len(prompts[p]))
    per_batch = max(1, batch_size // samples)  # whole groups: a prompt's samples share its prefill
    batches = [mine[i:i + per_batch] for i in range(0, len(mine), per_batch)]
    collective = isinstance(model, CausalLMForTraining) and (bool(split_experts(model.hf_model)) or tp > 1)
    if collective and world > 1:  # every rank runs as many batches (an idle one decodes a prompt and drops it)
        [count] = state.highest([len(batches)])
        batches += [[]] * (count - len(batches))
    made, idle = [], [prompts[0] if prompts else [pad_id]]
    with _ready(model):
        for batch in batches:
            completions = _generate_batch(model, [prompts[p] for p in batch] or idle, batch or [0], sampling,
                                          eos_ids, pad_id, device, seed, step, synced=collective and world > 1,
                                          images=[images[p] for p in batch] if images and batch else None)
            made += completions if batch else []
    if world > 1:
        # Each group of tp peers made the same completions: one peer's of each.
        made = [c for share in state.all_gather_object(made)[::tp] for c in share]
    return sorted(made, key=lambda c: (c.prompt, c.sample))


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


def _generate_batch(model, prompts: list[list[int]], indices: list[int], sampling: Sampling, eos_ids: list[int],
                    pad_id: int, device: torch.device, seed: int, step: int, synced: bool,
                    images: list[dict] | None) -> list[Completion]:
    """One batch of prompts, each with its num_return_sequences samples, left-padded, through transformers'
    generate: from their shared prefill, or (a vision-language model) each sample with its prompt's images."""
    samples = sampling.num_return_sequences
    rows = [(p, s) for p in indices for s in range(samples)]
    # One pad more than the longest prompt needs: the prefill leaves out the last column and is never empty.
    length = max(len(ids) for ids in prompts) + 1
    input_ids = torch.tensor([[pad_id] * (length - len(ids)) + ids for ids in prompts], device=device)
    attention_mask = torch.tensor([[0] * (length - len(ids)) + [1] * len(ids) for ids in prompts], device=device)
    hf_model = model.hf_model if isinstance(model, CausalLMForTraining) else model
    if not is_multimodal(hf_model.config):
        extra = {"cache": _prefilled(model, hf_model.config, input_ids, attention_mask, samples,
                                     length + sampling.max_new_tokens)}
    else:
        extra = generation_inputs(hf_model, input_ids.repeat_interleave(samples, 0),
                                  [image for image in images or [{}] * len(prompts) for _ in range(samples)])
    input_ids, attention_mask = input_ids.repeat_interleave(samples, 0), attention_mask.repeat_interleave(samples, 0)
    chooser = _Chooser(rows, sampling, seed, step, length)
    # Greedy for transformers (the chooser left one token) with no processor of its own: the repetition penalty is
    # the chooser's, after its log-probabilities are taken.
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False, num_beams=1,
                         max_new_tokens=sampling.max_new_tokens, num_return_sequences=1, repetition_penalty=1.0,
                         eos_token_id=list(eos_ids), pad_token_id=pad_id, synced_gpus=synced,
                         logits_processor=LogitsProcessorList([chooser]), **extra)
    new = out[:, length:].tolist()
    logprobs = torch.stack(chooser.logprobs, dim=1).tolist() if chooser.logprobs else [[] for _ in rows]
    eos = set(eos_ids)
    completions = []
    for (p, s), ids, row_logprobs in zip(rows, new, logprobs):
        end = next((i + 1 for i, token in enumerate(ids) if token in eos), None)
        kept = ids[:end] if end else ids[:sampling.max_new_tokens]
        completions.append(Completion(p, s, kept, row_logprobs[:len(kept)], truncated=end is None))
    return completions


def _prefilled(model, config, input_ids: torch.Tensor, attention_mask: torch.Tensor, samples: int,
               max_length: int) -> StaticCache:
    """The prompts' keys and values but for their last column (generate's first step computes it and its logits),
    computed once per prompt and copied for each of its samples into a static cache of max_length positions.
    The prefill keeps every position (a DynamicCache of plain layers): a sliding-window layer's static copy keeps
    its own window of them."""
    positions = (attention_mask.cumsum(-1) - 1).clamp_(min=0)  # as generate numbers a left-padded row
    prompts = DynamicCache()
    prefill = model.prefill if isinstance(model, CausalLMForTraining) else model.get_decoder()
    prefill(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1], position_ids=positions[:, :-1],
            cache=prompts, use_cache=True)
    cache = StaticCache(config=config, max_cache_len=max_length)
    for index, layer in enumerate(prompts.layers):
        cache.update(layer.keys.repeat_interleave(samples, 0), layer.values.repeat_interleave(samples, 0), index)
    return cache
