import torch

from specdec.base import LAST
from specdec.drafters.drafter import newest
from specdec.drafters.medusa import Medusa

from conftest import auto_engine


def test_parameter_count_distinct_blocks(tiny):
    h = tiny.hidden_size
    m = Medusa(tiny, num_heads=3, num_layers=2)
    assert sum(p.numel() for p in m.parameters()) == 3 * 2 * (h * h + h)
    blocks = [blk for head in m.heads for blk in head]
    assert len({id(b) for b in blocks}) == 6  # no module reused (the [ResBlock(h)] * n bug)
    assert len({p.data_ptr() for p in m.parameters()}) == 12


def test_own_lm_head_is_a_trainable_copy(tiny):
    m = Medusa(tiny, num_heads=2, own_lm_head=True)
    assert sum(p.numel() for p in m.parameters()) == 2 * (tiny.hidden_size**2 + tiny.hidden_size) + 2 * tiny.vocab_size * tiny.hidden_size
    assert torch.equal(m.lm_heads[0].weight, tiny.lm_head.weight)
    assert m.lm_heads[0].weight.data_ptr() != m.lm_heads[1].weight.data_ptr() != tiny.lm_head.weight.data_ptr()


def test_state_dict_holds_no_base_weights(tiny):
    keys = Medusa(tiny, num_heads=2).state_dict().keys()
    assert all(k.startswith("heads.") for k in keys)


def test_fresh_heads_are_the_base_head(tiny):
    """Zero-initialised residual blocks: each head starts as the base's own next-token head."""
    x = torch.randint(0, tiny.vocab_size, (2, 9))
    feats = tiny.features(x)
    out = Medusa(tiny, num_heads=3, num_layers=2).forward_train(feats, x).logits  # [B, T, K, V]
    for k in range(3):
        torch.testing.assert_close(out[:, :, k], feats.logits)


def test_head_reads_only_its_own_position(tiny):
    m = Medusa(tiny, num_heads=2)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randint(0, tiny.vocab_size, (1, 6))
    feats = tiny.features(x)
    before = m.forward_train(feats, x).logits
    feats.hidden[LAST] = feats.hidden[LAST].clone()
    feats.hidden[LAST][:, 3] += 1.0
    after = m.forward_train(feats, x).logits
    changed = (before - after).abs().amax(dim=(0, 2, 3)) > 0
    assert changed.tolist() == [False, False, False, True, False, False]


def test_offsets_and_names(tiny):
    m = Medusa(tiny, num_heads=4)
    assert m.target_offsets == [1, 2, 3, 4]  # head k predicts token t+k+1
    assert m.head_names == ["head1", "head2", "head3", "head4"] and m.max_depth == 4


def test_the_sampler_lays_out_no_queries_for_heads_that_run_no_layers(tiny, monkeypatch):
    """Medusa (runs_layers = False) reads features and tokens only: a decode lays out the prefill and each round's
    verify, and nothing for the drafter's observe or expand; its drafts are the same either way."""
    from specdec.sampling.context import SamplingContext
    from specdec.sampling.decode import SamplerConfig, generate

    medusa = Medusa(tiny, num_heads=2)
    cfg = SamplerConfig(max_new_tokens=12, gamma=2, eos_token_id=[])
    laid = []
    for name in ("tree_layout", "commit_layout"):
        real = getattr(SamplingContext, name)
        monkeypatch.setattr(SamplingContext, name, lambda self, *a, real=real, name=name: (laid.append(name),
                                                                                           real(self, *a))[1])
    out = generate(tiny, [[3, 4, 5, 6]], medusa, cfg, engine=auto_engine())
    rounds = len(out.step_verify_s)
    assert laid == ["commit_layout"] + ["tree_layout"] * rounds  # the prefill, then one verify per round
    monkeypatch.setattr(Medusa, "runs_layers", True)
    laid.clear()
    again = generate(tiny, [[3, 4, 5, 6]], medusa, cfg, engine=auto_engine())
    assert torch.equal(again.tokens, out.tokens) and len(laid) > 1 + rounds


def test_newest_reads_each_rows_newest_committed_position():
    """drafter.newest: per row h[n_new - 1]; one row (never padded) its last position, as a view."""
    h = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    assert torch.equal(newest(h, torch.tensor([3, 1])), torch.stack([h[0, 2], h[1, 0]]))
    one = newest(h[:1], torch.tensor([3]))
    assert torch.equal(one, h[:1, 2]) and one.data_ptr() == h[0, 2].data_ptr()
