"""Copy-aware Hydra heads: the proposals they read in training are lookup's, and sampling drafts what training
computes."""

from __future__ import annotations

import torch

from specdec.base import tiny_base
from specdec.drafters.copy_hydra import CopyHydra
from specdec.ngram import lookup_proposals, ngram_match
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine, experiment_script, fitted


def test_the_training_proposals_are_lookup_s():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (3, 40), generator=gen)  # a 4-token vocab: many repeated 2- and 3-grams
    tokens, n = lookup_proposals(ids)
    for b in range(ids.shape[0]):
        for p in range(ids.shape[1]):
            want, m = ngram_match(ids[b, : p + 1].tolist(), 1, 2, 3)
            assert (n[b, p].item(), tokens[b, p].item() if m else 0) == (m, want[0] if want else 0), (b, p)
    assert (n == 3).any() and (n == 2).any() and (n == 0).any()


def test_a_head_reads_the_proposal():
    base = tiny_base()
    drafter = CopyHydra(base, num_heads=2)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    feats = base.features(ids)
    logits = drafter.forward_train(feats, ids).logits  # [1, T, 2, V]
    h = feats.hidden[-1]
    emb = base.embed_tokens(ids)
    # head 1 at t = 4 reads x_5 = 6 and lookup's proposal for x_6: "8 5 6" occurs nowhere earlier, "5 6" did, followed
    # by 7: so 7, n = 2; without the proposal the head's output differs
    k, t = 0, 4
    with_it = drafter.head_logits(drafter._head(k, h[:, t], emb[:, t + 1 : t + 2], torch.tensor([7]),
                                                torch.tensor([2])), k)
    without = drafter.head_logits(drafter._head(k, h[:, t], emb[:, t + 1 : t + 2], torch.tensor([0]),
                                                torch.tensor([0])), k)
    torch.testing.assert_close(logits[:, t, k], with_it)
    assert not torch.allclose(with_it, without)


def test_a_chain_of_one_drafts_what_training_computes_and_stays_lossless():
    base = tiny_base()
    prompt = [5, 6, 7, 8, 5, 6, 7]
    cfg = SamplerConfig(max_new_tokens=24, gamma=1, eos_token_id=[])
    eager = auto_engine(name="eager")
    answer = generate(base, [prompt], None, cfg, engine=eager).tokens[0].tolist()
    drafter = fitted(CopyHydra(base, num_heads=1), base, prompt + answer[:12])
    run = generate(base, [prompt], drafter, cfg, engine=eager)
    assert run.tokens[0].tolist() == answer and 0 < sum(run.accepted[0]) < len(run.accepted[0])
    # the rounds' accepted drafts are the teacher-forced drafts at the positions the rounds reach
    ids = prompt + answer
    drafts = experiment_script("where_drafts_miss").first_drafts(drafter, base, ids)
    hits, p = 0, len(prompt) + 1
    while p < len(ids):
        hit = drafts[p] == ids[p]
        hits, p = hits + hit, p + (2 if hit else 1)
    assert hits == sum(run.accepted[0])
