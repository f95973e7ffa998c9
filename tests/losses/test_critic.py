"""§6.7 critic loss: golden conformance (loss, metrics, gradient), the unclipped path, hand case, bad input."""

import pytest
import torch

from schemas.errors import ConfigError, InvariantError
from stages.losses import critic_loss
from tests.golden import assert_close, family, load
from tests.losses.golden_adapter import golden_metrics


@pytest.mark.parametrize("name", family("roll.pipeline.base_worker.CriticWorker.loss_func"))
def test_critic_loss_golden(name):
    c = load(name)
    p = c.check_params(("value_clip",))
    output = torch.tensor(c.inputs["output_tensor"], requires_grad=True)
    values = output[:, :-1, 0]
    loss, metrics = critic_loss(values, torch.tensor(c.inputs["values"]), torch.tensor(c.inputs["returns"]),
                                torch.tensor(c.inputs["response_mask"])[:, 1:], p.get("value_clip"))
    loss.backward()
    assert_close(loss.detach(), c.outputs["vf_loss"], atol=1e-4)
    assert_close(output.grad, c.outputs["grad_output"], atol=1e-4)
    expected = golden_metrics(c)
    assert set(metrics) == set(expected)
    for key, value in expected.items():
        assert_close(metrics[key], value, atol=1e-4, what=key)


def test_hand_case_with_and_without_clip():
    values = torch.tensor([[1.0, 3.0, 9.0], [0.0, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])                  # second row empty: counts 0 in the row mean
    loss, metrics = critic_loss(values, old, returns, mask)
    assert_close(loss.detach(), 0.5 * (1.0 + 4.0) / 2 / 2)
    assert metrics["critic/error"] == pytest.approx(2.5 / 2)
    loss, metrics = critic_loss(values, old, returns, mask, value_clip=0.5)
    # token 2: V = 3 clipped to 1.5 → (1.5 − 1)² = 0.25 < 4, max keeps 4; token 1 unchanged
    assert_close(loss.detach(), 0.5 * (1.0 + 4.0) / 2 / 2)
    assert metrics["critic/clipfrac"] == pytest.approx(0.0)
    returns2 = torch.tensor([[0.0, 5.0, 0.0], [5.0, 5.0, 5.0]])  # clipped error (5 − 1.5)² = 12.25 > (5 − 3)² = 4
    loss, metrics = critic_loss(values, old, returns2, mask, value_clip=0.5)
    assert_close(loss.detach(), 0.5 * (1.0 + 12.25) / 2 / 2)
    assert metrics["critic/clipfrac"] == pytest.approx(0.5 / 2)
    loss.backward()
    assert values.grad[0, 1] == 0.0                              # the clipped branch carries no gradient to V


def test_bad_input():
    x = torch.zeros(1, 2)
    with pytest.raises(InvariantError, match="'returns'"):
        critic_loss(x, x, torch.zeros(1, 3), x)
    with pytest.raises(ConfigError, match="value_clip"):
        critic_loss(x, x, x, x, value_clip=0.0)
