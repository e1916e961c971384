"""The generation engine's prefill, computed once per prompt and copied into a static cache for each of its samples
(generation/engine.py), on every family of the tested matrix: greedy completions are transformers' generate's of
each prompt alone, with prompts longer than the sliding window and completions that roll past it."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmtune.generation.engine import Sampling, generate
from tests.model_matrix import FAMILIES, WINDOW

VOCAB = 64
NEW_TOKENS = 2 * WINDOW
EOS = 10**6  # outside the vocabulary: every completion runs to NEW_TOKENS


@pytest.mark.parametrize("family", FAMILIES, ids=[family.model_type for family in FAMILIES])
def test_greedy_completions_from_a_shared_prefill_are_transformers_generate(family):
    torch.manual_seed(0)
    config = family.hf_config(VOCAB)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    lengths = (1, 7, WINDOW + 5, 2 * WINDOW + 3)  # one token alone, and past the window
    prompts = [torch.randint(3, VOCAB, (n,)).tolist() for n in lengths]
    made = generate(model, prompts, Sampling(max_new_tokens=NEW_TOKENS, num_return_sequences=2), eos_ids=[EOS],
                    pad_id=0, device=torch.device("cpu"), batch_size=4)
    assert [(c.prompt, c.sample) for c in made] == [(p, s) for p in range(len(prompts)) for s in range(2)]
    for completion in made:
        ids = prompts[completion.prompt]
        with torch.no_grad():
            expected = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                      eos_token_id=[EOS], pad_token_id=0)[0, len(ids):].tolist()
        assert completion.ids == expected, (completion.prompt, completion.sample)
