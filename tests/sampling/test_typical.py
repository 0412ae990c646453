"""Typical acceptance (Medusa §3.3.1; LOSSY) end to end: through `generate` its threshold decides what a round
accepts, what it emits follows neither the base's p nor the drafter's q, and the evaluation report marks its rows as
lossy (the plain decoders' stay lossless)."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.base import tiny_base
from specdec.checkpoint import save_drafter
from specdec.drafters.medusa import Medusa
from specdec.sampling.decode import SamplerConfig, generate

from conftest import CONFIGS, auto_engine
from sampling_stubs import Oracle, Table, micro_base
from test_sampling_decode import NEW, TREE, reference
from test_sampling_mc import N_BROKEN, PROMPT, TOKENS, chi_square_pvalue, exact_joint

PROMPTS = [[5, 17, 42, 8, 99], [61, 3, 12]]


def typical(**kw) -> SamplerConfig:
    return SamplerConfig(max_new_tokens=NEW, eos_token_id=[], temperature=1.0, acceptance="typical", **kw)


@pytest.fixture(scope="module")
def base():
    return tiny_base()


@pytest.mark.parametrize("kw", [dict(gamma=4), dict(tree="static", paths=TREE)], ids=["chain", "tree"])
def test_a_one_hot_p_accepts_exactly_the_base_argmax(base, kw):
    # top-k = 1 leaves p one-hot on the argmax (entropy 0): p(x) > min(eps, delta) holds for the argmax only, and
    # the bonus drawn from p is the argmax, so the oracle's two right drafts a round pass and its third does not
    r = generate(base, PROMPTS, Oracle(base, 2), typical(top_k=1, **kw), torch.Generator().manual_seed(0),
                 engine=auto_engine())
    assert r.lossless is False
    assert r.tokens.tolist() == reference(base, PROMPTS)
    assert all(row[:-1] == [2] * (len(row) - 1) for row in r.accepted)


@pytest.mark.parametrize("eps, delta, accepts", [(0.3, 0.09, "all"), (1.0, 1e9, "none")])
def test_the_threshold_follows_the_entropy(base, eps, delta, accepts):
    # The random tiny base's p is nearly uniform over its 259 tokens: H ≈ log 259, so delta·exp(−H) ≈ delta/259 lies
    # below every p(x) ≈ 1/259 and Medusa's defaults accept any draft, the bigram table's included. A threshold
    # of min(1, 10^9·exp(−H)) = 1 accepts none.
    r = generate(base, PROMPTS, Table(base), typical(gamma=3, typical_eps=eps, typical_delta=delta),
                 torch.Generator().manual_seed(0), engine=auto_engine())
    assert r.accepted == (r.drafted if accepts == "all" else [[0] * len(row) for row in r.drafted])
    assert all(n == NEW for n in r.num_generated)


@pytest.mark.parametrize("setup", [dict(gamma=2), dict(tree="static", paths=[[0, 0], [1, 0], [2]])],
                         ids=["chain", "tree"])
def test_what_it_emits_is_not_the_base_distribution(setup):
    # the Monte-Carlo check that rejection sampling passes (test_sampling_mc) fails for typical acceptance: the
    # micro base's peaked p and the table's q differ, and typical keeps drafts by p's threshold, not by p/q
    micro = micro_base()
    cfg = SamplerConfig(max_new_tokens=TOKENS, eos_token_id=[], temperature=1.0, acceptance="typical", **setup)
    r = generate(micro, [PROMPT] * N_BROKEN, Table(micro), cfg, torch.Generator().manual_seed(0),
                 engine=auto_engine())
    assert 0 < sum(map(sum, r.accepted)) < sum(map(sum, r.drafted))
    assert chi_square_pvalue(r.tokens, exact_joint(micro)) < 1e-6


def test_the_report_marks_typical_rows_lossy(tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [t]})
                                   for i, t in enumerate(["def add(a, b):", "a haiku"])))
    save_drafter(Medusa(tiny_base(), num_heads=4), tmp_path / "medusa")
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("evaluate", overrides=[
            "base=tiny", f"paths.output_dir={tmp_path}/eval", f"paths.cache_dir={tmp_path}/cache", "prompts=jsonl",
            f"prompts.path={questions}", "sampler=typical", "sampler.max_new_tokens=10", "sampler.eos_token_id=[]",
            "sampler.lookup_tokens=4", "sampler.lookup_min_ngram=1", f"drafters=[{tmp_path}/medusa]",
            "peers=[hf_generate]", "warmup=false", "wandb.enabled=false"])
    from specdec.evaluation import evaluate

    report = evaluate(cfg)
    rows = {r["method"]: r for r in report["rows"]}
    assert report["header"]["acceptance"] == "typical" and report["header"]["temperature"] == 0.7
    # the drafter, the drafter with lookup and lookup alone accept by typical's rule; the plain decoders sample p
    assert {m: r["lossless"] for m, r in rows.items()} == {
        "ar (ours)": True, "medusa": False, "medusa+lookup": False, "lookup (ours)": False, "hf_generate": True}
    assert rows["medusa"]["tau"] > 1  # drafts were accepted: the rows measure a typical run
    md = (tmp_path / "eval" / "report.md").read_text()
    assert "| medusa | **no (lossy)** |" in md and "| lookup (ours) | **no (lossy)** |" in md
    assert "| ar (ours) | yes |" in md and "| hf_generate | yes |" in md
    csv = [line.split(",") for line in (tmp_path / "eval" / "results.csv").read_text().splitlines()]
    csv = {cells[0]: cells[1] for cells in csv}  # method -> lossless
    assert csv["medusa"] == "False" and csv["ar (ours)"] == "True"
