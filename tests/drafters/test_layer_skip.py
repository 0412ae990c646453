"""Layer-skip self-speculation: the drafter against the shared sampler (greedy identity, all-accepted at no skip,
Monte-Carlo losslessness), nothing registered or trained, checkpoints, and the skip-set search (exhaustive on a
planted problem, TPE's bookkeeping, train.py drafter=layer_skip end to end)."""

from dataclasses import replace

import pytest
import torch

from specdec.base import tiny_base
from specdec.checkpoint import load_drafter, read_meta, save_drafter
from specdec.calibration import SamplerProbe
from specdec.drafters.layer_skip import LayerSkip, SkipSearch, uniform_skip
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine, compose_train
from sampling_stubs import micro_base
from test_sampling_mc import PROMPT, TOKENS, chi_square_pvalue, exact_joint

PROMPTS = [[5, 17, 42, 8, 99, 23, 7], [61, 3, 12]]  # ragged on purpose
CFG = SamplerConfig(max_new_tokens=20, eos_token_id=[])


@pytest.fixture(scope="module")
def base():
    return tiny_base(num_layers=4)


@pytest.fixture(scope="module")
def plain(base):
    return generate(base, PROMPTS, None, CFG, engine=auto_engine()).tokens


@pytest.mark.parametrize("skip", [[1], [0, 2], [1, 2, 3]])
@pytest.mark.parametrize("sampler", [dict(gamma=1), dict(gamma=4), dict(gamma=8),
                                     dict(tree="static", paths=[[0, 0, 0], [1, 0], [2]]),
                                     dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6)])
def test_greedy_speculative_equals_greedy(base, plain, skip, sampler):
    spec = generate(base, PROMPTS, LayerSkip(base, skip_layers=skip), replace(CFG, **sampler), engine=auto_engine())
    assert torch.equal(spec.tokens, plain)
    assert 0 < sum(map(sum, spec.accepted)) < sum(map(sum, spec.drafted))  # partial acceptance was exercised


def test_no_skip_is_the_base_and_always_accepted(base, plain):
    # Every layer through the base's own store: any slot, position or mask error in the shared store (draft writes,
    # verify overwrites) would show up as a rejection.
    # (Stock kernels: the measured ones may pick different products for a draft's 1 row and a verify's 5, whose other
    # summation order can flip a near-tie.)
    drafter = LayerSkip(base, skip_layers=[])
    exact, stock = replace(CFG, gamma=4), auto_engine(name="eager")
    spec = generate(base, PROMPTS, drafter, exact, engine=stock)
    assert torch.equal(spec.tokens, plain)
    assert all(a == 4 for row in spec.accepted for a in row[:-1])
    sampled = generate(base, PROMPTS, drafter, replace(exact, temperature=1.0), torch.Generator().manual_seed(0),
                       engine=stock)
    assert sum(map(sum, sampled.accepted)) >= 0.95 * sum(map(sum, sampled.drafted))


def test_monte_carlo_lossless():
    # docs/sampler.md §6.3 with the real sampler loop: the one-layer micro base drafting with its only layer skipped (its
    # own embeddings -> final norm -> lm_head) against the base's exact joint of the first three tokens.
    micro = micro_base()
    cfg = SamplerConfig(max_new_tokens=TOKENS, temperature=1.0, eos_token_id=[], gamma=2)
    r = generate(micro, [PROMPT] * 100_000, LayerSkip(micro, skip_layers=[0], gamma=2), cfg,
                 torch.Generator().manual_seed(0), engine=auto_engine())
    assert 0 < sum(map(sum, r.accepted)) < sum(map(sum, r.drafted))  # q differs from p: rejections happen
    assert chi_square_pvalue(r.tokens, exact_joint(micro)) > 1e-3


def test_nothing_registered_or_trained(base, tmp_path):
    drafter = LayerSkip(base, skip_layers=[0, 3])
    assert list(drafter.parameters()) == [] and drafter.state_dict() == {}
    assert len(list(drafter.modules())) == 1  # the base's layers are used, never registered
    with_vocab = LayerSkip(base, skip_layers=[1], draft_vocab_size=64)
    assert list(with_vocab.state_dict()) == ["draft_vocab.tokens"]  # the draft vocab's ids, nothing else
    save_drafter(drafter, tmp_path / "ckpt")
    loaded = load_drafter(tmp_path / "ckpt", base)
    assert loaded.skip_layers == [0, 3] and loaded.hparams == drafter.hparams
    assert torch.equal(generate(base, PROMPTS, loaded, CFG, engine=auto_engine()).tokens, generate(base, PROMPTS, drafter, CFG, engine=auto_engine()).tokens)


def test_invalid_skip_layers_raise(base):
    with pytest.raises(ValueError, match="skip_layers"):
        LayerSkip(base, skip_layers=[4])


def test_uniform_skip_spreads_evenly():
    assert uniform_skip(30, 10) == (1, 4, 7, 10, 13, 16, 19, 22, 25, 28)
    assert uniform_skip(4, 2) == (1, 3) and uniform_skip(5, 0) == () and uniform_skip(3, 3) == (0, 1, 2)


def test_uniform_is_a_fixed_evenly_spaced_set(base, tmp_path):
    # drafter.uniform=k is Draft & Verify's baseline: k evenly spaced layers, measured by train.py, not searched; the
    # checkpoint keeps the layers themselves
    drafter = LayerSkip(base, uniform=2)
    assert drafter.fixed and drafter.skip_layers == list(uniform_skip(4, 2))
    save_drafter(drafter, tmp_path / "d")
    assert read_meta(tmp_path / "d")["hparams"]["skip_layers"] == [1, 3]
    assert load_drafter(tmp_path / "d", base).skip_layers == [1, 3]
    with pytest.raises(ValueError, match="not both"):
        LayerSkip(base, skip_layers=[1], uniform=1)
    with pytest.raises(ValueError, match="0..4"):
        LayerSkip(base, uniform=5)


# -- the search ---------------------------------------------------------------------------------------------------

def planted_base(num_layers: int, identity: list[int]) -> torch.nn.Module:
    """A tiny base whose `identity` layers are exactly the identity (zeroed residual outputs): skipping them changes
    nothing, skipping any other layer changes the draft."""
    base = tiny_base(num_layers=num_layers, seed=3)
    with torch.no_grad():
        for i in identity:
            base.layers[i].self_attn.o_proj.weight.zero_()
            base.layers[i].mlp.down_proj.weight.zero_()
    return base


def fixed_costs(monkeypatch, base, verify: float = 1.5) -> SamplerProbe:
    """The probe calibration measures through, with analytic costs instead of timings (a unit test never passes or
    fails on a timing): v(γ+1) = verify, c(k) = 0.05 + 0.2·k; α is decoded for real."""
    probe = SamplerProbe(base, auto_engine())
    monkeypatch.setattr(probe, "verify_times", lambda ns, prompt_len, reps: {n: 1.0 if n == 1 else verify for n in ns})
    monkeypatch.setattr(LayerSkip, "draft_costs",
                        lambda self, probe, prompt, t1: {k: 0.05 + 0.2 * k for k in range(self.base.num_layers + 1)})
    return probe


def blocks(n: int = 4, length: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n, length), generator=g)]


SEARCH = dict(prompts=4, prompt_len=10, max_new_tokens=16, cost_reps=1)


def test_exhaustive_search_finds_the_planted_skip_set(monkeypatch):
    base = planted_base(4, identity=[1, 2])
    probe = fixed_costs(monkeypatch, base)
    drafter = LayerSkip(base, gamma=3, search=SkipSearch(trials=16, **SEARCH))  # 2^4 sets <= 16: exhaustive
    logged = []
    metrics, detail = drafter.calibrate(blocks(), lambda m, step: logged.append(step), probe)
    assert len(detail["trials"]) == 16 and logged == list(range(16))
    # skipping exactly the identity layers keeps α = 1 at the lowest cost; any other layer skipped costs α
    assert drafter.skip_layers == [1, 2] and detail["best"]["skip_layers"] == [1, 2]
    assert metrics["val/alpha"] == 1.0 and metrics["val/expected_tau"] == 4.0
    # the objective is the predicted speedup τ(α)/(v(γ+1) + γc) from the measured α and costs
    for t in detail["trials"]:
        assert t["expected_tau"] == pytest.approx(sum(t["alpha"] ** i for i in range(4)))
        assert t["draft_cost"] == pytest.approx(0.05 + 0.2 * (4 - len(t["skip_layers"])))
        assert t["predicted_speedup"] == pytest.approx(t["expected_tau"] / (1.5 + 3 * t["draft_cost"]))
    assert metrics["val/predicted_speedup"] == max(t["predicted_speedup"] for t in detail["trials"])
    assert detail["uniform"]["skip_layers"] == list(uniform_skip(4, 2))
    assert metrics["val/uniform_predicted_speedup"] < metrics["val/predicted_speedup"]  # (1, 3): layer 3 is real


def test_tpe_search_bookkeeping(monkeypatch):
    base = planted_base(6, identity=[1, 4])
    probe = fixed_costs(monkeypatch, base)
    drafter = LayerSkip(base, gamma=2, search=SkipSearch(trials=12, startup_trials=4, **SEARCH))  # 64 sets > 12
    metrics, detail = drafter.calibrate(blocks(), lambda m, step: None, probe)
    assert len(detail["trials"]) == 12
    # TPE starts from uniform sets at a few skip ratios (1/16, 1/8, 1/4, 1/2 of 6 layers: 1, 1, 2, 3 skipped)
    assert [t["skip_layers"] for t in detail["trials"][:3]] == [list(uniform_skip(6, k)) for k in (1, 2, 3)]
    best = max(detail["trials"], key=lambda t: t["predicted_speedup"])
    assert drafter.skip_layers == best["skip_layers"] and metrics["val/predicted_speedup"] == best["predicted_speedup"]
    assert set(metrics) == set(LayerSkip.calibration_metrics)


def test_a_given_skip_set_is_measured_not_searched(monkeypatch):
    base = planted_base(4, identity=[1])
    probe = fixed_costs(monkeypatch, base)
    drafter = LayerSkip(base, skip_layers=[1], gamma=2, search=SkipSearch(**SEARCH))
    metrics, detail = drafter.calibrate(blocks(), lambda m, step: None, probe)
    assert [t["skip_layers"] for t in detail["trials"]] == [[1]] and drafter.skip_layers == [1]
    assert metrics["val/alpha"] == 1.0


def test_draft_costs_are_measured_per_executed_layer_count(base):
    drafter = LayerSkip(base, skip_layers=[2], gamma=2, search=SkipSearch(cost_reps=1))
    costs = drafter.draft_costs(SamplerProbe(base, auto_engine()), PROMPTS[0], t1=1e-3)
    assert sorted(costs) == [0, 1, 2, 3, 4] and all(c > 0 for c in costs.values())
    assert drafter.skip_layers == [2]  # the measurement leaves the drafter's own set in place


def test_train_py_runs_the_search_and_writes_a_checkpoint(corpus, tmp_path):
    from specdec.training import train

    cfg = compose_train(["base=tiny", "data=text", f"data.source.path={corpus}/*.txt", "data.block_size=32",
                         "data.batch_size=2", "data.val_fraction=0.2", "drafter=layer_skip", "logger=csv",
                         "drafter.search.prompts=2", "drafter.search.max_new_tokens=12",
                         "drafter.search.prompt_len=16", "drafter.search.cost_reps=1"], tmp_path)
    metrics = train(cfg)
    run = tmp_path / "run"
    meta = read_meta(run / "drafter")
    # the search's pick is what the checkpoint records (a search that left its measurement behind would differ)
    assert meta["metrics"]["val/expected_tau"] == pytest.approx(metrics["val/expected_tau"])
    assert meta["target"].endswith("LayerSkip") and meta["metrics"]["val/predicted_speedup"] > 0
    drafter = load_drafter(run / "drafter", tiny_base())
    assert drafter.skip_layers == meta["hparams"]["skip_layers"]
    assert (run / "calibration.json").exists() and (run / "result.json").exists()
    assert "search/predicted_speedup" in next(run.glob("csv/**/metrics.csv")).read_text()
    assert train(cfg) == metrics  # a finished run is read back, not searched again
