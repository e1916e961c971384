"""The generation engine (generation/engine.py) on a plain transformers model in this process: greedy completions
are transformers' generate's, batched or not; the repetition penalty and the sampling filters are transformers'; the
log-probabilities are those of a forward over the prompt and completion; a sampled completion does not depend on the
batch it rode in; EOS ends a completion; the sampling keys resolve as transformers resolves them."""

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from llmtune.generation.engine import DEFAULTS, Sampling, completion_seed, generate

PROMPTS = ["The sum of 12 and 30 is", "7 + 8 =", "What is", "Add 3 and 4 and then 5 more to get"]


@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(bare_tokenizer):
    return [bare_tokenizer(text)["input_ids"] for text in PROMPTS]


def run(model, prompts, sampling, eos=(), batch_size=64, seed=0, step=0):
    # An EOS id outside the vocabulary: no completion ends early unless the test names one.
    return generate(model, prompts, sampling, eos_ids=list(eos) or [10**6], pad_id=0, device=torch.device("cpu"),
                    seed=seed, step=step, batch_size=batch_size)


def test_defaults_are_transformers_but_the_completion_length():
    transformers_defaults = GenerationConfig._get_default_generation_params()
    assert {k: v for k, v in DEFAULTS.items() if k not in ("max_new_tokens", "min_p")} == \
        {k: transformers_defaults[k] for k in DEFAULTS if k not in ("max_new_tokens", "min_p")}
    assert "min_p" not in transformers_defaults and DEFAULTS["min_p"] is None
    assert DEFAULTS["max_new_tokens"] == 256  # TRL's max_completion_length


def test_a_given_key_wins_over_the_model_config_over_the_defaults():
    model_config = GenerationConfig(temperature=0.7, top_k=20, do_sample=True)
    sampling = Sampling.resolve({"temperature": 0.3, "top_k": None, "top_p": None}, model_config)
    assert (sampling.temperature, sampling.top_k, sampling.do_sample, sampling.top_p) == (0.3, 20, True, 1.0)
    assert Sampling.resolve({}, None) == Sampling()


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_completions_are_transformers_generate_in_any_batch(model, prompts, penalty):
    sampling = Sampling(max_new_tokens=6, repetition_penalty=penalty)
    for batch_size in (1, 3):
        made = run(model, prompts, sampling, eos=[model.generation_config.eos_token_id], batch_size=batch_size)
        assert [(c.prompt, c.sample) for c in made] == [(p, 0) for p in range(len(prompts))]
        for completion, ids in zip(made, prompts):
            expected = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6,
                                      repetition_penalty=penalty, pad_token_id=0)[0, len(ids):].tolist()
            assert completion.ids == expected
            assert completion.truncated == (len(expected) == 6 and expected[-1] != model.generation_config.eos_token_id)


def test_log_probabilities_are_a_forward_over_prompt_and_completion(model, prompts):
    temperature = 0.7
    made = run(model, prompts, Sampling(max_new_tokens=5, do_sample=True, temperature=temperature, top_k=5,
                                        num_return_sequences=2), batch_size=3)
    assert len(made) == 8
    for completion in made:
        ids = prompts[completion.prompt] + completion.ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, len(prompts[completion.prompt]) - 1:-1]
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(completion.ids)[:, None])
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected.squeeze(1), rtol=1e-5, atol=1e-5)


def test_a_sampled_completion_does_not_depend_on_its_batch(model, prompts):
    sampling = Sampling(max_new_tokens=8, do_sample=True, temperature=1.5, top_k=0, num_return_sequences=3)
    alone = run(model, prompts, sampling, batch_size=1, seed=4, step=2)
    together = run(model, prompts, sampling, batch_size=5, seed=4, step=2)
    assert [c.ids for c in alone] == [c.ids for c in together]
    # Its own stream: the samples of a prompt differ, and so do another seed's or step's.
    assert len({tuple(c.ids) for c in alone if c.prompt == 0}) > 1
    assert [c.ids for c in run(model, prompts, sampling, seed=4, step=3)] != [c.ids for c in alone]
    assert completion_seed(4, 2, 0, 1) not in {completion_seed(4, 2, 1, 0), completion_seed(4, 3, 0, 1)}


def test_the_filters_are_transformers(model, prompts):
    greedy = run(model, prompts, Sampling(max_new_tokens=6))
    one_left = run(model, prompts, Sampling(max_new_tokens=6, do_sample=True, top_k=1))
    tiny_mass = run(model, prompts, Sampling(max_new_tokens=6, do_sample=True, top_k=0, top_p=1e-6))
    assert [c.ids for c in one_left] == [c.ids for c in greedy] == [c.ids for c in tiny_mass]


def test_an_eos_ends_a_completion(model, prompts):
    greedy = run(model, prompts[:1], Sampling(max_new_tokens=6))[0]
    eos = greedy.ids[2]
    stopped = run(model, prompts[:1], Sampling(max_new_tokens=6), eos=[eos])[0]
    first = greedy.ids.index(eos)
    assert stopped.ids == greedy.ids[:first + 1] and not stopped.truncated
    assert len(stopped.logprobs) == len(stopped.ids)


def test_the_batched_draw_follows_each_rows_distribution():
    # One draw for the whole batch: 20000 completions of one distribution, at two positions.
    from llmtune.generation.engine import _Chooser
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    rows = [(0, s) for s in range(20000)]
    chooser = _Chooser(rows, Sampling(do_sample=True, top_k=0), seed=1, step=0, prompt_length=3)
    chosen = []
    for position in (0, 1):
        scores = chooser(torch.zeros(len(rows), 3 + position, dtype=torch.long), probs.log().repeat(len(rows), 1))
        chosen.append(scores.argmax(dim=-1))
    for drawn in chosen:
        counts = torch.bincount(drawn, minlength=4) / len(rows)
        torch.testing.assert_close(counts, probs, rtol=0, atol=0.015)  # 1.5%: over 5 standard deviations
    # The positions' draws are independent: the pair frequencies multiply.
    pairs = torch.bincount(chosen[0] * 4 + chosen[1], minlength=16).view(4, 4) / len(rows)
    torch.testing.assert_close(pairs, probs[:, None] * probs[None, :], rtol=0, atol=0.015)
