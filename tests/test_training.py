"""The LightningModule's loss/metric alignment, pinned with a stub base whose features encode the position:
entry j at position t must be compared with the base's distribution at t + offset_j and the data token
t + 1 + offset_j."""

import pytest
import torch
from torch import nn

from specdec.base import LAST, Features
from specdec.drafters.drafter import Drafter, TrainOutput
from specdec.training import DraftTrainer

V, T, H = 16, 10, 16


class StubBase(nn.Module):
    """input_ids[t] = t; the base's logits at t put all mass on token t+1 (it 'knows' the next position);
    the hidden state at t is one-hot(t)."""

    name, hidden_size, vocab_size = "stub", H, V

    def features(self, input_ids, layers=(LAST,)):
        B, T_ = input_ids.shape
        pos = torch.arange(T_)
        logits = 20.0 * nn.functional.one_hot((pos + 1) % V, V).float().expand(B, T_, V)
        hidden = nn.functional.one_hot(pos % H, H).float().expand(B, T_, H)
        return Features({l: hidden for l in layers}, logits)

    def to(self, *a, **k):
        return self


class PositionOracle(Drafter):
    """Reads the position from the stub's one-hot hidden state and predicts token t + 1 + offset + error."""

    def __init__(self, base, offsets, error=0):
        super().__init__(base)
        self.target_offsets, self.error = offsets, error
        self.head_names = [f"head{j}" for j in range(len(offsets))]
        self.w = nn.Parameter(torch.zeros(()))

    def forward_train(self, feats, input_ids):
        t = feats.hidden[LAST].argmax(-1)  # [B, T] the position
        cols = [nn.functional.one_hot((t + 1 + o + self.error) % V, V).float() for o in self.target_offsets]
        return TrainOutput(logits=20.0 * torch.stack(cols, dim=2) + 0 * self.w)  # [B, T, K, V]


def _metrics(offsets, error):
    base = StubBase()
    module = DraftTrainer(base, PositionOracle(base, offsets, error), optimizer=torch.optim.SGD)
    input_ids = torch.arange(T)[None].repeat(2, 1)
    feats = base.features(input_ids)
    out = module.drafter.forward_train(feats, input_ids)
    return [(loss.item(), top1.mean().item(), acc.mean().item()) for _, loss, _, top1, acc, _
            in module._entry_losses(out, feats, input_ids, metrics=True)]


@pytest.mark.parametrize("offsets", [[0], [1, 2, 3], [0, 0]])
def test_aligned_oracle_is_perfect(offsets):
    for loss, top1, accept in _metrics(offsets, error=0):
        assert top1 == 1.0 and accept == pytest.approx(1.0, abs=1e-6) and loss < 1e-6


@pytest.mark.parametrize("error", [-1, 1])
def test_off_by_one_oracle_is_always_wrong(error):
    for loss, top1, accept in _metrics([1, 2, 3], error=error):
        assert top1 == 0.0 and accept < 1e-6 and loss > 10


def test_expected_tau_chain_formula():
    base = StubBase()
    d = PositionOracle(base, [1, 2, 3])
    a = torch.tensor([0.8, 0.5, 0.5])
    assert d.expected_tau(a).item() == pytest.approx(1 + 0.8 + 0.4 + 0.2)
