"""The exact greedy argmax from a bfloat16 lm_head (specdec/engines/cpu/argmax.py): it is the argmax of the float32
logits on random and on adversarial hidden states (rows that bfloat16 cannot tell apart), decoding through it is
greedy-identical, and without the native library, or when it measures slower, the logits are computed."""

from __future__ import annotations

import shutil

import pytest
import torch

from specdec.base import tiny_base
from specdec.engines.config import EngineConfig
from specdec.engines.cpu import argmax, native
from specdec.engines.cpu.argmax import Shortlist
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine
from sampling_stubs import Oracle
from test_sampling_decode import TREE, reference

needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                    reason="no C compiler on this machine")


@needs_compiler
@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0])
def test_the_argmax_of_the_float32_logits(scale):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(3000, 64, generator=g) * 0.2
    h = torch.randn(400, 64, generator=g) * scale
    assert torch.equal(Shortlist(weight).argmax(h), (h @ weight.T).argmax(-1))


@needs_compiler
def test_rows_bfloat16_cannot_tell_apart():
    """Each query's winner gets a twin that is the same row in bfloat16 and a hair better in float32: the approximate
    logits tie (bfloat16 alone would pick the first of the pair), the shortlist holds both, and the exact recheck picks
    the twin."""
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(2000, 64, generator=g) * 0.2).to(torch.bfloat16).float()  # exact in bfloat16
    h = torch.randn(64, 64, generator=g)
    winner = weight[(h @ weight.T).argmax(-1)]  # [64, 64] each query's winning row
    ulp = 2.0 ** (torch.floor(torch.log2(winner.abs().clamp(min=1e-30))) - 7)  # bfloat16's spacing there
    twins = winner + ulp / 4 * torch.sign(h)  # rounds back to the winner in bfloat16
    assert torch.equal(twins.to(torch.bfloat16).float(), winner)
    weight = torch.cat([weight, twins])
    want = (h @ weight.T).argmax(-1)
    assert (want >= 2000).all()  # the twins win in float32 ...
    rounded = (h @ weight.to(torch.bfloat16).float().T).argmax(-1)
    assert (rounded < 2000).all()  # ... and tie with their originals in bfloat16, which argmax takes first
    assert torch.equal(Shortlist(weight).argmax(h), want)


@needs_compiler
def test_greedy_identical_through_the_shortlist(monkeypatch):
    base = tiny_base()
    calls = []  # (the tests' engines take it at every row count it is for: cpu_kernels=native)
    run = Shortlist.argmax
    monkeypatch.setattr(Shortlist, "argmax", lambda self, h: calls.append(1) or run(self, h))
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    for kw in (dict(), dict(gamma=3), dict(tree="static", paths=TREE)):
        drafter = Oracle(base, 2) if kw else None
        cfg = SamplerConfig(max_new_tokens=10, eos_token_id=[], **kw)
        assert generate(base, prompts, drafter, cfg,
                        engine=auto_engine()).tokens.tolist() == reference(base, prompts, 10)
    assert calls  # the verifies took it


def test_without_the_library_the_logits_are_computed(monkeypatch):
    base = tiny_base()
    monkeypatch.setattr(native, "available", lambda: False)
    assert argmax.shortlist(base.lm_head) is None
    prompts = [[5, 6, 7, 8, 9]]
    cfg = SamplerConfig(max_new_tokens=8, eos_token_id=[], gamma=2)
    assert generate(base, prompts, Oracle(base, 1), cfg,
                    engine=auto_engine()).tokens.tolist() == reference(base, prompts, 8)


@needs_compiler
def test_used_only_at_the_row_counts_where_it_wins(monkeypatch):
    monkeypatch.setattr(argmax, "_wins", lambda made, lm_head: [False, True, False] + [True] * 14)
    head = argmax.shortlist(tiny_base().lm_head)
    assert head.wins(1) and not head.wins(2) and head.wins(16) and not head.wins(17)


@needs_compiler
def test_slower_means_not_used(monkeypatch):
    monkeypatch.setattr(argmax, "_wins", lambda made, lm_head: [False] * 17)
    assert argmax.shortlist(tiny_base().lm_head) is None


@needs_compiler
def test_forced_means_every_row_count_it_is_for():
    head = argmax.shortlist(tiny_base().lm_head, forced=True)  # cpu_kernels=native: nothing measured
    assert all(head.wins(n) for n in range(1, max(argmax.ROWS) + 1)) and not head.wins(max(argmax.ROWS) + 1)


@needs_compiler
def test_off_and_sampling_mean_logits(monkeypatch):
    base = tiny_base()
    monkeypatch.setattr(Shortlist, "argmax", lambda self, h: pytest.fail("the shortlist ran"))
    prompts = [[5, 6, 7, 8, 9]]
    generate(base, prompts, None, SamplerConfig(max_new_tokens=4, eos_token_id=[]),
             engine=auto_engine(greedy_shortlist=False))
    generate(base, prompts, None, SamplerConfig(max_new_tokens=4, eos_token_id=[], temperature=1.0),
             torch.Generator().manual_seed(0), engine=auto_engine())
    assert EngineConfig().greedy_shortlist
