"""Staged drafting (sampler.stage_lookup, trees._greedy_chain): n-gram lookup proposes the drafter's next tokens and
the drafter checks them in one pass of its own. Every round's drafted chain is the one the drafter drafts alone, in
strictly fewer drafter passes where lookup is right, and the output is plain greedy decoding's; a drafter whose expand
reads more than its nodes' path tokens, or a sampled chain, is refused in one line."""

from dataclasses import replace

import pytest
import torch

from specdec.base import tiny_base
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.early_exit import EarlyExit
from specdec.drafters.layer_skip import LayerSkip
from specdec.sampling import decode
from specdec.sampling.decode import SamplerConfig, generate
from specdec.sampling.trees import draft_static

from conftest import auto_engine, experiment_script, fitted
from sampling_stubs import Oracle

# repetition in both prompts, so lookup over the context proposes; ragged on purpose
PROMPTS = [[5, 17, 42, 8, 99, 23, 5, 17, 42, 8, 99, 23, 5, 17], [61, 3, 12, 61, 3, 12, 61]]
CFG = SamplerConfig(max_new_tokens=48, eos_token_id=[], gamma=4)
STAGED = replace(CFG, stage_lookup=3)


@pytest.fixture(scope="module")
def base():
    return tiny_base(num_layers=3)


@pytest.fixture(scope="module")
def plain(base):
    return generate(base, PROMPTS, None, CFG, engine=auto_engine())


@pytest.fixture(scope="module")
def drafters(base, plain):
    """A two-layer draft model and an early exit at layer 1 fitted to the base's answers (their drafts hit more often,
    and still miss), and the base with its middle layer skipped."""
    text = [t for b, p in enumerate(PROMPTS) for t in p + plain.tokens[b, : plain.num_generated[b]].tolist()]
    return {"draft_model": fitted(DraftModel(base, num_layers=2), base, text),
            "layer_skip": LayerSkip(base, skip_layers=[1]),
            "early_exit": fitted(EarlyExit(base, exit_layers=[1], num_extra_layers=1), base, text)}


def chains_of(monkeypatch, base, drafter, cfg, engine):
    """generate's result and every round's drafted chain [B][γ + 1] (the root first), as drafted."""
    chains = []

    def spy(*args, **kwargs):
        rnd = draft_static(*args, **kwargs)
        chains.append(rnd.tokens.tolist())
        return rnd

    monkeypatch.setattr(decode, "draft_static", spy)
    return generate(base, PROMPTS, drafter, cfg, engine=engine), chains


@pytest.mark.parametrize("kind", ["draft_model", "layer_skip", "early_exit"])
def test_staged_chains_are_the_drafters_own_in_fewer_passes(monkeypatch, base, plain, drafters, kind):
    # the reference engine: one product per row count, so a pass over k + 1 nodes gives each node the logits it gets
    # alone (the measured kernels may sum another way for another row count and flip a near-tie)
    engine = auto_engine(name="eager")
    alone, chains = chains_of(monkeypatch, base, drafters[kind], CFG, engine)
    staged, staged_chains = chains_of(monkeypatch, base, drafters[kind], STAGED, engine)
    assert staged_chains == chains  # every round, every row: the same drafted chain
    assert torch.equal(staged.tokens, plain.tokens) and torch.equal(alone.tokens, plain.tokens)
    assert staged.accepted == alone.accepted and staged.drafted == alone.drafted
    total = sum(map(sum, alone.accepted))
    assert 0 < total < sum(map(sum, alone.drafted))  # drafts both hit and missed
    assert alone.draft_passes == [CFG.gamma] * len(chains)  # unstaged: one pass a depth
    assert sum(staged.draft_passes) < sum(alone.draft_passes)  # lookup was right somewhere, and saved passes
    assert all(1 <= p <= CFG.gamma for p in staged.draft_passes)


@pytest.mark.parametrize("kind", ["draft_model", "layer_skip", "early_exit"])
def test_staged_greedy_output_is_plain_decodings_on_the_fast_engine(base, plain, drafters, kind):
    out = generate(base, PROMPTS, drafters[kind], replace(STAGED, lookup_tokens=4), engine=auto_engine())
    assert torch.equal(out.tokens, plain.tokens)
    assert out.lookup_rounds > 0 and 0 in out.draft_passes  # lookup rounds and staged rounds side by side


def test_refused_in_one_line(base):
    with pytest.raises(ValueError, match="Oracle's does not") as err:
        generate(base, PROMPTS, Oracle(base), STAGED)  # its expand reads its parents' paths from its state
    assert "\n" not in str(err.value)
    for bad in (dict(temperature=0.7), dict(tree="static", paths=[[0], [1]]), dict(stage_lookup=-1),
                dict(adaptive_threshold=0.5)):
        with pytest.raises(ValueError, match="stage_lookup") as err:
            replace(STAGED, **bad)
        assert "\n" not in str(err.value)


def test_the_draft_model_tables_staged_comparison_on_the_tiny_base(tmp_path):
    # experiments/draft_model.py's staged row: the three settings interleaved, c per pass, the row and its note
    table = experiment_script("draft_model")
    result = table.staged(tmp_path, ["base=tiny", "prompts.limit=2", "sampler.max_new_tokens=8",
                                     "engine.cpu_kernels=native"], drafter="copy", passes=2)
    assert list(result["settings"]) == list(table.SETTINGS)
    assert all(s["identical"] and len(s["tok_s"]) == 2 for s in result["settings"].values())
    alone, staged = (result["settings"][name] for name in table.SETTINGS[1:])
    assert len(alone["c"]) == len(staged["c"]) == 2 and alone["passes_per_round"] == 4
    assert (tmp_path / "staged" / "L2.json").exists()
    row = table.staged_row(result)
    assert row["layers"].startswith("2, staged") and "(alone " in row["c"]
    assert "\n" not in table.staged_note(result)
