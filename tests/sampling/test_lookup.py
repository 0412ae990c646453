"""N-gram lookup drafting in the sampler: what it proposes, greedy identity alone and beside every family (its
rounds interleaved with the drafter's, so a drafter's state must survive rounds it did not draft), and Monte-Carlo
losslessness at T = 1."""

from dataclasses import replace

import pytest
import torch

from specdec.base import tiny_base
from specdec.drafters.copy_hydra import CopyHydra
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.early_exit import EarlyExit
from specdec.drafters.hydra import Hydra
from specdec.drafters.layer_skip import LayerSkip
from specdec.drafters.medusa import Medusa
from specdec.drafters.prophet import Prophet
from specdec.ngram import ngram_match
from specdec.sampling import decode
from specdec.sampling.decode import SamplerConfig, generate
from specdec.sampling.lookup import LookupLength, fresh_counts, lookup_round

from conftest import auto_engine
from sampling_stubs import Table, micro_base
from test_sampling_mc import chi_square_pvalue

# prompts whose greedy answers (tiny base, seed 0) fall into cycles after a few tokens: lookup rounds come once
# both rows have a match (a batch takes a lookup round only then), drafter rounds before
PROMPTS = [[5, 17, 42, 8, 5, 17, 42, 9, 5, 17], [89, 40, 167, 53, 164, 5, 89, 40, 167]]
NEW = 24


def ngram_proposal(*args) -> list[int]:
    return ngram_match(*args)[0]


def test_proposal_follows_the_most_recent_occurrence_of_the_longest_ngram():
    h = [1, 2, 3, 9, 2, 3, 7, 8, 4, 2, 3]
    assert ngram_proposal(h, 4, 1, 3) == [7, 8, 4, 2]  # "2 3" last seen before 7; "9 2 3"/"4 2 3" never recur
    assert ngram_proposal(h, 1, 1, 3) == [7]
    assert ngram_proposal([1, 2, 3, 1, 2, 3, 5, 1, 2, 3], 3, 1, 3) == [5, 1, 2]  # 3-gram wins, most recent
    assert ngram_proposal([4, 1, 2, 5, 1, 2], 2, 2, 2) == [5, 1]
    assert ngram_proposal([4, 1, 2, 5, 6, 2], 2, 2, 3) == []  # only a 1-gram recurs, below min_ngram
    assert ngram_proposal([4, 1, 2, 5, 6, 2], 2, 1, 3) == [5, 6]
    assert ngram_proposal([7], 4, 1, 3) == [] and ngram_proposal([3, 3], 4, 1, 1) == [3]
    assert ngram_match(h, 4, 1, 3) == ([7, 8, 4, 2], 2) and ngram_match([7], 4, 1, 3) == ([], 0)


def test_round_limits_each_row_to_its_own_proposal():
    rnd = lookup_round(torch.tensor([10, 20]), [[1, 2, 3], [4]])
    assert rnd.tokens.tolist() == [[10, 1, 2, 3], [20, 4, 4, 4]]
    assert rnd.parents.tolist() == [-1, 0, 1, 2] and rnd.depth.tolist() == [0, 1, 2, 3]
    assert rnd.drafted() == [3, 1] and rnd.present().tolist() == [[True] * 4, [True, True, False, False]]


def test_lookup_length_learns_how_far_each_kind_of_match_goes():
    gentle = [0.0] + [1 + 0.2 * (n - 1) for n in range(1, 7)]  # v(n): each verified token costs a fifth of a step
    length = LookupLength(gentle, fresh_counts(5, 3))
    hits, seen = length.hits, length.seen
    whole = [1, 2, 3, 4, 5]
    assert length.cut([whole], [3], [0], [2]) == [whole]  # nothing known yet: the whole proposal, as without
    for _ in range(4):  # 3-gram proposals whose first token alone is the base's
        length.resolve([[8, 9, 1, 7]], [False])  # output row 0: the proposal began at 2; 1 matched, then 7 did not
        cut = length.cut([whole], [3], [0], [2])
    assert cut == [[1]]  # P(1) = 5/5, P(k > 1) = 1/5: (1 + 1) / 1.2 beats (1 + 1 + 0.2) / 1.4 and every longer cut
    assert length.cut([whole], [2], [0], [2]) == [whole]  # a 2-gram match's counts are its own
    length.pending = length.pending[:1]  # the cut proposal still counts every depth, from the output in hindsight
    before = seen[3][5]
    length.resolve([[8, 9, 1, 2, 3, 4, 5]], [False])
    assert seen[3][5] == before + 1 and hits[3][5] == 2 and not length.pending
    length.cut([whole], [2], [0], [2])
    length.resolve([[8, 9, 1, 2]], [False])  # all emitted so far matched: it waits for more
    assert len(length.pending) == 1 and seen[2][1] == 1
    length.resolve([[8, 9, 1, 2]], [True])  # ... unless its row ended: counted to the row's end
    assert seen[2][1:] == [2, 2, 1, 1, 1] and hits[2][1:] == [2, 2, 1, 1, 1] and not length.pending


def test_lookup_rounds_verify_what_the_curve_pays_for(monkeypatch):
    """With a curve that charges the square of the tokens verified, every lookup round verifies one proposed token (its
    next one costs more than it can bring); without lookup_by_cost, whole proposals. The answer is the base's."""
    base = tiny_base(num_layers=3)  # a base of its own: the counts it learns are kept per base
    monkeypatch.setattr(decode, "verify_costs", lambda b, n_max, *a, **k: [0.0] + [n * n for n in range(1, n_max + 1)])
    cfg = SamplerConfig(max_new_tokens=NEW, eos_token_id=[], lookup_tokens=4, lookup_min_ngram=1)
    plain = generate(base, PROMPTS, None, SamplerConfig(max_new_tokens=NEW, eos_token_id=[]),
                     engine=auto_engine()).tokens
    for by_cost, lengths in ((True, {0, 1}), (False, {0, 1, 2, 3, 4})):
        r = generate(base, PROMPTS, None, replace(cfg, lookup_by_cost=by_cost), engine=auto_engine())
        assert torch.equal(r.tokens, plain) and r.lookup_rounds > 0
        assert {g for row in r.drafted for g in row} <= lengths and max(map(max, r.drafted)) == max(lengths)


@pytest.fixture(scope="module")
def base():
    return tiny_base(num_layers=3)


@pytest.fixture(scope="module")
def plain(base):
    return generate(base, PROMPTS, None, SamplerConfig(max_new_tokens=NEW, eos_token_id=[]),
                    engine=auto_engine()).tokens


FAMILIES = {
    "none": lambda b: None,
    "medusa": lambda b: Medusa(b, num_heads=3),
    "hydra": lambda b: Hydra(b, num_heads=3),
    "copy_hydra": lambda b: CopyHydra(b, num_heads=3),  # reads the committed tokens: must see every round's
    "prophet": lambda b: Prophet(b, unroll_steps=3),
    "early_exit": lambda b: EarlyExit(b, exit_layers=[1], num_extra_layers=1),
    "draft_model": lambda b: DraftModel(b, num_layers=1),  # keeps its drafts' keys: must re-read after a skip
    "layer_skip": lambda b: LayerSkip(b, skip_layers=[1]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("min_ngram", [1, 2])
def test_greedy_identity_with_lookup_rounds_between_drafter_rounds(base, plain, family, min_ngram):
    torch.manual_seed(0)
    drafter = FAMILIES[family](base)
    if drafter is not None:
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(0.05 * torch.randn_like(p))
        drafter.eval()
    cfg = SamplerConfig(max_new_tokens=NEW, eos_token_id=[], gamma=3, lookup_tokens=4, lookup_min_ngram=min_ngram)
    r = generate(base, PROMPTS, drafter, cfg, engine=auto_engine())
    assert torch.equal(r.tokens, plain)
    rounds = len(r.step_verify_s)
    assert 0 < r.lookup_rounds < rounds  # both kinds of round ran
    assert all(g <= 4 for row in r.drafted for g in row)


def test_a_batch_takes_a_lookup_round_only_when_every_row_has_a_match(base):
    cfg = SamplerConfig(max_new_tokens=NEW, eos_token_id=[], gamma=2, lookup_tokens=4, lookup_min_ngram=2)
    drafter = Medusa(base, num_heads=2)
    never = [48, 129, 32, 30, 230, 4]  # its answer has no repeated 2-gram in its first 24 tokens
    assert generate(base, [never], drafter, cfg, engine=auto_engine()).lookup_rounds == 0
    assert generate(base, PROMPTS[:1], drafter, cfg, engine=auto_engine()).lookup_rounds > 0
    assert generate(base, [PROMPTS[0], never], drafter, cfg, engine=auto_engine()).lookup_rounds == 0


def test_off_by_default_and_checked():
    assert SamplerConfig().lookup_tokens == 0
    with pytest.raises(ValueError, match="lookup_min_ngram"):
        SamplerConfig(lookup_tokens=4, lookup_min_ngram=3, lookup_max_ngram=2)


# -- Monte Carlo (docs/sampler.md §6): 10^5 rows at T = 1, first three tokens against the exact joint --------------------------
N, MC_PROMPT, TOKENS = 100_000, [0, 1, 2, 3, 4, 5, 0], 3  # every token recurs: every row has a 1-gram match


def exact_joint(base) -> torch.Tensor:
    v = base.vocab_size
    seqs = torch.cartesian_prod(torch.arange(v), torch.arange(v))  # [V², 2]
    ids = torch.cat([torch.tensor(MC_PROMPT).expand(len(seqs), -1), seqs], 1)
    logp = base(ids).double().log_softmax(-1)[:, len(MC_PROMPT) - 1 :]  # [V², 3, V]
    x1, x2 = seqs[:, 0], seqs[:, 1]
    joint = logp[:, 0].gather(1, x1[:, None]) + logp[:, 1].gather(1, x2[:, None]) + logp[:, 2]  # [V², V]
    return joint.exp().view(v, v, v)


@pytest.mark.parametrize("with_drafter, cut", [(False, False), (True, True)])
def test_monte_carlo_lossless(with_drafter, cut, monkeypatch):
    """Lookup rounds at T = 1 beside plain steps, whole (10^5 rows: past the tokens a curve is timed at), and beside the
    drafter's rounds, each cut to one proposed token by a curve that charges the square of the tokens verified
    (LookupLength at T > 0, on this decode's own counts)."""
    curves = []
    if cut:
        monkeypatch.setattr(decode, "curve", lambda base, cfg, engine, b, most: curves.append(most) or
                            [0.0] + [float(n * n) for n in range(1, most + 2)])
    micro = micro_base()
    cfg = SamplerConfig(max_new_tokens=TOKENS, temperature=1.0, eos_token_id=[], lookup_tokens=2, lookup_min_ngram=1)
    r = generate(micro, [MC_PROMPT] * N, Table(micro) if with_drafter else None, cfg, torch.Generator().manual_seed(0),
                 engine=auto_engine())
    assert r.lookup_rounds >= 1 and curves == ([2] if cut else [])
    assert chi_square_pvalue(r.tokens, exact_joint(micro)) > 1e-3
