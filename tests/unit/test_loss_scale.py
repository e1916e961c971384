"""fp16's loss scale alone: halved on an overflow, doubled after GROWTH_INTERVAL good steps in a row, the gradients
divided by it on each rank's rows, its state a plain pair that a resumed run takes back; off, it is 1 and stays."""

import torch

from llmtune.training.loss_scale import GROWTH_INTERVAL, INIT_SCALE, LossScale


def test_the_scale_halves_on_an_overflow_and_doubles_after_a_run_of_good_steps():
    scale = LossScale(enabled=True)
    assert scale.scale == INIT_SCALE
    scale.update(finite=False)
    assert scale.scale == INIT_SCALE / 2
    for _ in range(GROWTH_INTERVAL - 1):
        scale.update(finite=True)
    assert scale.scale == INIT_SCALE / 2
    scale.update(finite=False)
    for _ in range(GROWTH_INTERVAL):
        scale.update(finite=True)
    assert scale.scale == INIT_SCALE / 2, "an overflow restarts the count of good steps"
    resumed = LossScale(enabled=True)
    resumed.load_state_dict(scale.state_dict())
    assert (resumed.scale, resumed.good_steps) == (scale.scale, scale.good_steps) == (INIT_SCALE / 2, 0)


def test_unscale_divides_every_gradient_and_off_changes_nothing():
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(2)]
    for p in params:
        p.grad = torch.full((3,), INIT_SCALE * 3.0)
    LossScale(enabled=True).unscale(params)
    assert all(p.grad.tolist() == [3.0, 3.0, 3.0] for p in params)
    off = LossScale(enabled=False)
    off.unscale(params)
    off.update(finite=False)
    assert off.scale == 1.0 and off.state_dict() == {} and params[0].grad.tolist() == [3.0, 3.0, 3.0]
    off.load_state_dict({"scale": 8.0, "good_steps": 1})
    assert off.scale == 1.0, "an fp16 checkpoint resumed without fp16 does not scale"


def test_a_skipped_step_counts_towards_the_limit_without_fp16_and_with_it_once_the_scale_is_below_1():
    assert LossScale(enabled=False).counts_skip()
    scale = LossScale(enabled=True)
    assert not scale.counts_skip()
    while scale.scale >= 1:
        scale.update(finite=False)
    assert scale.counts_skip()
