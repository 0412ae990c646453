"""The prophet's greedy chain and its `observe` in one native call each (specdec/engines/cpu/chain.c via native_chain.py):
the tokens, predicted features and acceptances of its PyTorch path (depth-by-depth `expand` calls, the blocks over the
committed entries), lossless decoding, that path wherever a call is not taken, and the faster way kept by measurement
(race.Race). Each test picks its path through the engine's config: cpu_kernels=native takes every native call it can,
whole_chains=false drafts depth by depth (the reference each native call is checked against)."""

from __future__ import annotations

import shutil

import pytest
import torch

from specdec.base import tiny_base
from specdec.drafters.hydra import Hydra
from specdec.drafters.prophet import Prophet
from specdec.engines import measure as race
from specdec.engines.config import EngineConfig
from specdec.engines.cpu import kernels, native, native_chain, native_layer
from specdec.engines.cpu.engine import CpuEngine
from specdec.sampling import trees
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine

needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                    reason="no C compiler on this machine")
CHAIN, DRAFT, ENTRIES = trees._greedy_chain, native_chain.draft, native_chain._native_entries  # (wrapped by `decode`)


@pytest.fixture
def base():
    # head_dim 16 (layer.c takes multiples of the vector width)
    return tiny_base(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, num_layers=3)


PROMPT = list(range(40, 61))


def plain(base, prompts=(PROMPT,), new: int = 16):
    return generate(base, list(prompts), None, SamplerConfig(max_new_tokens=new, eos_token_id=[]),
                    engine=auto_engine()).tokens.tolist()


def perturbed(base, drafter, seed: int = 0):
    """A fresh drafter (the base's own head on h_t at depth 0), perturbed so that every weight matters; its draft vocab
    (if any) random tokens and those the base writes (as one counted on the base's own text would hold them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    if drafter.draft_vocab is not None:
        written = torch.tensor(sorted(set(plain(base)[0])))
        rest = torch.randperm(base.vocab_size, generator=gen)
        rest = rest[~torch.isin(rest, written)][: drafter.draft_vocab.size - len(written)]
        drafter.set_draft_vocab(torch.cat([written, rest]))
    return drafter.eval()


def prophet(base, vocab: int | None, layers: int = 1) -> Prophet:
    return perturbed(base, Prophet(base, num_layers=layers, draft_vocab_size=vocab))


def decode(base, drafter, monkeypatch, native_on: bool, native_layers: bool = True, **kw):
    """generate() with the chain drafted and the entries observed in one native call each (native_on: the native
    layers attached for every row count, cpu_kernels=native) or by the drafter's PyTorch ops (whole_chains=false),
    recording each round's drafted tokens, the predicted features it left in the state, and whether each native call
    ran (chains, entries)."""
    rounds, ran = [], ([], [])

    def recorded(drafter_, state, ctx, root, tree, *stage):
        out = CHAIN(drafter_, state, ctx, root, tree, *stage)
        gamma = len(tree.levels)
        rounds.append((out.tokens.clone(), state["feats"].get(torch.arange(gamma), ctx).clone()))
        return out

    def counted(record, call):
        def run(*args):
            out = call(*args)
            record.append(out is not None)
            return out
        return run

    monkeypatch.setattr(trees, "_greedy_chain", recorded)
    monkeypatch.setattr(native_chain, "draft", counted(ran[0], DRAFT))
    monkeypatch.setattr(native_chain, "_native_entries", counted(ran[1], ENTRIES))
    fast = auto_engine(draft_precision=kw.pop("draft_precision", "q8"), whole_chains=native_on,
                       native_layers=native_layers)
    cfg = SamplerConfig(max_new_tokens=16, eos_token_id=[], **{"gamma": 4} | kw)
    return generate(base, [PROMPT], drafter, cfg, engine=fast), rounds, ran


@needs_compiler
@pytest.mark.parametrize("vocab, layers, precision, gamma", [(48, 1, "fp32", 4), (None, 2, "fp32", 3),
                                                            (48, 1, "q4", 4), (48, 1, "fp32", 1)])
def test_the_native_chain_drafts_what_expand_drafts(base, monkeypatch, vocab, layers, precision, gamma):
    """Round by round, the same drafted tokens and the same predicted features (to float32 rounding: sums in another
    order) as the chain's `expand` calls after `observe`'s blocks, so the same acceptances; and plain greedy decoding's
    tokens."""
    drafter = prophet(base, vocab, layers)
    whole, whole_rounds, (chains, entries) = decode(base, drafter, monkeypatch, True, gamma=gamma,
                                                    draft_precision=precision)
    assert chains and all(chains)  # the native chain drafted every round
    assert entries[1:] and all(entries[1:])  # and every observe after a verify was one call (not the prefill's)
    split, split_rounds, ran = decode(base, drafter, monkeypatch, False, gamma=gamma, draft_precision=precision)
    assert ran == ([], [])
    assert len(whole_rounds) == len(split_rounds) > 2
    for (tokens, hats), (tokens_ref, hats_ref) in zip(whole_rounds, split_rounds):
        assert tokens.tolist() == tokens_ref.tolist()
        torch.testing.assert_close(hats, hats_ref, atol=1e-4, rtol=1e-4)
    assert whole.accepted == split.accepted and sum(map(sum, whole.accepted)) > 0
    assert whole.tokens.tolist() == plain(base)


@needs_compiler
def test_an_adaptive_chain_ends_in_the_native_call_where_expand_would_end_it(base, monkeypatch):
    """Under an adaptive draft length (sampler.adaptive_threshold) the prophet's chain is one native call that stops
    after its first token of top-1 probability below the threshold: round by round the same tokens and the same
    length as the depth-by-depth loop of trees.draft_static, the same acceptances, and plain greedy decoding's
    tokens."""
    import specdec.sampling.decode as decode_module

    drafter = prophet(base, 48)
    with torch.no_grad():  # sharper draft distributions: top-1 probabilities on both sides of the thresholds
        drafter.norm.weight.mul_(10)

    def run(native_on: bool, threshold: float):
        rounds, ran = [], []
        adaptive = Prophet.adaptive_chain

        def chain(self, *args):
            out = adaptive(self, *args) if native_on else None
            ran.append(out is not None)
            return out

        def recorded(*args, **kw):
            rnd = trees.draft_static(*args, **kw)
            rounds.append((rnd.tokens.tolist(), rnd.limit.tolist()))
            return rnd

        with monkeypatch.context() as m:
            m.setattr(Prophet, "adaptive_chain", chain)
            m.setattr(decode_module, "draft_static", recorded)
            cfg = SamplerConfig(max_new_tokens=16, eos_token_id=[], gamma=4, adaptive_threshold=threshold)
            out = generate(base, [PROMPT], drafter, cfg, engine=auto_engine())
        return out, rounds, ran

    lengths = set()
    for threshold in (0.2, 0.3, 0.5):
        whole, whole_rounds, ran = run(True, threshold)
        split, split_rounds, ran_split = run(False, threshold)
        assert ran and all(ran) and not any(ran_split)
        assert whole_rounds == split_rounds
        lengths |= {limit[0] for _, limit in whole_rounds}
        assert whole.accepted == split.accepted and whole.drafted == split.drafted
        assert whole.tokens.tolist() == plain(base)
    assert 4 in lengths and lengths - {4}  # chains left whole and chains ended early


@needs_compiler
def test_the_prophet_chain_reads_weights_changed_between_decodes(base, monkeypatch):
    """The native chain is made once per decode: weights changed in place between decodes (training on: fc, the norms)
    are read by the next decode's chain and observe as by the PyTorch path."""
    drafter = prophet(base, 48)
    decode(base, drafter, monkeypatch, True)
    with torch.no_grad():
        for p in (drafter.fc.weight, drafter.emb_norm.weight, drafter.norm.weight):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    whole, whole_rounds, (chains, entries) = decode(base, drafter, monkeypatch, True)
    split, split_rounds, _ = decode(base, drafter, monkeypatch, False)
    assert chains and all(chains) and entries[1:] and all(entries[1:])
    for (tokens, hats), (tokens_ref, hats_ref) in zip(whole_rounds, split_rounds, strict=True):
        assert tokens.tolist() == tokens_ref.tolist()
        torch.testing.assert_close(hats, hats_ref, atol=1e-4, rtol=1e-4)
    assert whole.accepted == split.accepted


@needs_compiler
def test_without_native_layers_the_prophet_drafts_depth_by_depth(base, monkeypatch):
    """No native layer for one row (native_layers=false): the chain is not taken, the draft runs depth by depth, and
    decoding stays lossless."""
    drafter = prophet(base, 48)
    out, rounds, (chains, entries) = decode(base, drafter, monkeypatch, True, native_layers=False)
    assert chains and entries and not any(chains + entries) and out.tokens.tolist() == plain(base)


def test_the_faster_way_is_kept():
    """Each way's first ROUNDS calls alternate (the first way first), then the faster by median is kept; a step whose
    first way never runs keeps asking for it (nothing recorded)."""
    r = race.Race()
    picks = []
    for first_s, second_s in [(1.0, 2.0), (5.0, 2.0), (1.5, 2.5)]:  # the first way faster by median (1.5 vs 2.0)
        picks.append(r.first())
        r.record(True, first_s)
        picks.append(r.first())
        r.record(False, second_s)
    assert picks == [True, False] * 3 and r.winner is True and r.first()
    r.record(False, 0.1)  # decided: later calls change nothing
    assert r.first()
    slower = race.Race()
    for _ in range(race.Race.ROUNDS):
        slower.record(True, 3.0)
        slower.record(False, 2.0)
    assert slower.winner is False and not slower.first()
    assert race.Race().first()  # nothing recorded yet: the first way is asked


@needs_compiler
def test_a_prophet_on_a_batch_drafts_depth_by_depth(base):
    """Several rows: chain.c takes one; the batch drafts depth by depth, losslessly."""
    drafter = prophet(base, 48)
    prompts = [PROMPT, list(range(70, 85))]
    out = generate(base, prompts, drafter, SamplerConfig(max_new_tokens=12, eos_token_id=[], gamma=3),
                   engine=auto_engine())
    assert out.tokens.tolist() == plain(base, prompts, 12)


@needs_compiler
@pytest.mark.parametrize("vocab, layers, own, precision, gamma, fan", [
    (48, 1, False, "fp32", 4, 1), (None, 2, False, "q4", 3, 1), (48, 1, True, "fp32", 2, 1), (48, 1, False, "q4", 1, 1),
    (48, 1, False, "fp32", 1, 2), (48, 1, True, "q4", 2, 3)])
def test_hydra_heads_in_one_call_draft_what_expand_drafts(base, monkeypatch, vocab, layers, own, precision, gamma,
                                                           fan):
    """Hydra's chain of heads as one native call: the tokens of its depth-by-depth `expand` calls, so the same
    acceptances and plain greedy decoding's tokens; with a shared or own vocab head, one or two blocks, fp32 or q4; and
    for a chain that fans out at its end (the last head's top 2 or 3: paths [[0], [1]], [[0, 0], [0, 1], [0, 2]])."""
    drafter = perturbed(base, Hydra(base, num_heads=4, num_layers=layers, own_lm_head=own, draft_vocab_size=vocab))
    ran, rounds = [], []
    call = native_chain.head_chain

    def counted(*args):
        out = call(*args)
        ran.append(out is not None)
        return out

    def recorded(drafter_, state, ctx, root, tree, *stage):
        out = CHAIN(drafter_, state, ctx, root, tree, *stage)
        rounds.append(out.tokens.clone())
        return out

    monkeypatch.setattr(native_chain, "head_chain", counted)
    monkeypatch.setattr(trees, "_greedy_chain", recorded)
    shape = dict(gamma=gamma) if fan == 1 else dict(tree="static", paths=[[0] * (gamma - 1) + [k] for k in range(fan)])
    cfg = SamplerConfig(max_new_tokens=16, eos_token_id=[], **shape)

    def both_ways():
        """(native, PyTorch ops) results, each round's tokens the same"""
        rounds.clear()
        results = []
        for native_on in (True, False):
            fast = auto_engine(draft_precision=precision, whole_chains=native_on)
            results.append(generate(base, [PROMPT], drafter, cfg, engine=fast))
        half = len(rounds) // 2
        assert len(rounds) == 2 * half and [t.tolist() for t in rounds[:half]] == [t.tolist() for t in rounds[half:]]
        assert results[0].accepted == results[1].accepted
        return results

    native_run, _ = both_ways()
    assert ran and all(ran) and sum(map(sum, native_run.accepted)) > 0
    assert {t.shape[1] for t in rounds} == {gamma + fan}  # the root, the chain, the fan
    assert native_run.tokens.tolist() == plain(base)
    with torch.no_grad():  # weights changed in place between decodes (training on): the next decode's chain reads them
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    both_ways()


@needs_compiler
def test_hydra_heads_under_q4a8_multiply_int8_inputs_in_the_native_call(base, monkeypatch):
    """draft_precision=q4a8 where the kernel table picks its kernel for every linear of the heads (cpu_kernels=native:
    the most rounded copy offered): chain.c multiplies from those q4a8 copies (its Q4A8 form), drafting what the
    PyTorch ops on the same copies draft, losslessly."""
    table = kernels.KernelTable(None, rows=(1, 2, 4), quant=kernels.QUANT, forced=True)  # (q4a8's even without VNNI)
    drafter = perturbed(base, Hydra(base, num_heads=2, draft_vocab_size=48))
    cfg = SamplerConfig(max_new_tokens=16, eos_token_id=[], gamma=2)
    runs = []
    for native_on in (True, False):
        fast = CpuEngine(EngineConfig(cpu_kernels="native", draft_precision="q4a8", whole_chains=native_on), table)
        runs.append(generate(base, [PROMPT], drafter, cfg, engine=fast))
    chain = native_chain._HEADS[drafter][2]
    linears = [l for s in chain.structs for l in (s.in_proj, s.head)]
    assert {l.form for l in linears} == {native_layer.FORMATS["q4a8"]}
    assert runs[0].accepted == runs[1].accepted and sum(map(sum, runs[0].accepted)) > 0
    assert runs[0].tokens.tolist() == runs[1].tokens.tolist() == plain(base)


@needs_compiler
def test_hydra_under_stock_kernels_drafts_with_pytorch_ops(base, monkeypatch):
    """The eager engine (PyTorch's own ops, the A/B baseline) never offers the native chain."""
    drafter = Hydra(base, num_heads=3).eval()
    ran = []
    call = native_chain.head_chain
    monkeypatch.setattr(native_chain, "head_chain", lambda *args: ran.append(call(*args)) or ran[-1])
    out = generate(base, [PROMPT], drafter, SamplerConfig(max_new_tokens=8, eos_token_id=[], gamma=3),
                   engine=auto_engine(name="eager"))
    assert not ran and out.tokens.tolist() == plain(base, new=8)
