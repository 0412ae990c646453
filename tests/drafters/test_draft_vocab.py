"""Reduced draft vocabulary (EAGLE-3 style) for every family: the projection covers only the chosen tokens, the sampler
stays lossless, train() picks the most frequent tokens of the data, and the checkpoint keeps them."""

import pytest
import torch

from specdec.base import LAST
from specdec.checkpoint import load_drafter
from specdec.drafters.medusa import Medusa
from specdec.sampling.decode import SamplerConfig, generate
from specdec.training import DraftTrainer

from conftest import auto_engine
from test_train import trained_and_untrained

TINY_DATA = ["base=tiny", "data=text", "data.block_size=32", "data.batch_size=2", "data.val_fraction=0.2"]


def medusa_with_vocab(tiny, tokens, **kw) -> Medusa:
    m = Medusa(tiny, num_heads=3, draft_vocab_size=len(tokens), **kw)
    m.set_draft_vocab(torch.as_tensor(tokens))
    return m


@pytest.mark.parametrize("own", [False, True])
def test_logits_are_the_base_rows_and_minus_inf_elsewhere(tiny, own):
    tokens = list(range(0, tiny.vocab_size, 3))
    m = medusa_with_vocab(tiny, tokens, own_lm_head=own)
    x = torch.randint(0, tiny.vocab_size, (2, 7))
    feats = tiny.features(x)
    out = m.forward_train(feats, x).logits  # [B, T, K, V_d], fresh heads = the base's own head
    assert out.shape == (2, 7, 3, len(tokens))
    torch.testing.assert_close(out[:, :, 0], feats.logits[..., tokens])
    full = m.draft_vocab.to_base(out)
    assert torch.isinf(full[..., 1]).all() and torch.equal(full[..., tokens], out)
    assert m.draft_vocab.from_base(torch.tensor([0, 1, 3])).tolist() == [0, -1, 1]
    if own:  # trainable copies of just those rows
        assert m.lm_heads[0].weight.shape == (len(tokens), tiny.hidden_size)


def test_sampler_stays_greedy_lossless(tiny):
    m = medusa_with_vocab(tiny, list(range(0, tiny.vocab_size, 2)))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompts = [[5, 9, 33, 120], [7, 8]]
    cfg = SamplerConfig(max_new_tokens=10, eos_token_id=[], gamma=3)
    ref = generate(tiny, prompts, None, cfg, engine=auto_engine()).tokens
    assert torch.equal(generate(tiny, prompts, m.eval(), cfg, engine=auto_engine()).tokens, ref)
    tree = SamplerConfig(max_new_tokens=10, eos_token_id=[], tree="static", paths=[[0, 0, 0], [1], [0, 1]])
    assert torch.equal(generate(tiny, prompts, m, tree, engine=auto_engine()).tokens, ref)


def test_full_draft_vocab_trains_like_no_draft_vocab(tiny):
    """A draft vocab of every token is the plain top-k objective; a smaller one moves mass to the rest bucket."""
    x = torch.randint(0, tiny.vocab_size, (2, 16))
    opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    torch.manual_seed(0)
    plain = Medusa(tiny, num_heads=2)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.3 * torch.randn_like(p))
    full = Medusa(tiny, num_heads=2, draft_vocab_size=tiny.vocab_size)
    full.load_state_dict(plain.state_dict() | {"draft_vocab.tokens": torch.arange(tiny.vocab_size)})
    losses = []
    for drafter in (plain, full):
        module = DraftTrainer(tiny, drafter, optimizer=opt, target_topk=32)
        module.log = lambda *a, **k: None
        losses.append(module._step({"input_ids": x}, "val"))
    torch.testing.assert_close(losses[0], losses[1])


def test_train_picks_frequent_tokens_and_checkpoint_keeps_them(corpus, tmp_path, tiny):
    trained, untrained = trained_and_untrained([*TINY_DATA, f"data.source.path={corpus}/*.txt", "drafter=medusa",
                                                "drafter.num_heads=2", "drafter.draft_vocab_size=24"], tmp_path)
    # The heads over 24 tokens learn. Not seen in val/expected_tau here: the random tiny base spreads its mass almost
    # evenly, so the 24 tokens hold ~3% of it and Σ min(p, q) over them is that mass whatever the heads put there.
    assert trained["val/loss"] < untrained["val/loss"] - 0.005
    drafter = load_drafter(tmp_path / "trained" / "run" / "drafter", tiny)
    tokens = set(drafter.draft_vocab.tokens.tolist())
    text = "".join(p.read_text() for p in corpus.glob("*.txt"))
    frequent = {t for t, _ in __import__("collections").Counter(tiny.tokenizer(text)["input_ids"]).most_common(10)}
    assert len(tokens) == 24 and frequent <= tokens
    x = torch.tensor([sorted(tokens)[:5]])
    assert drafter.forward_train(tiny.features(x, (LAST,)), x).logits.shape[-1] == 24


def test_cross_entropy_on_data_tokens_skips_tokens_outside_the_draft_vocab(tiny):
    m = medusa_with_vocab(tiny, list(range(0, tiny.vocab_size, 2)))
    module = DraftTrainer(tiny, m, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), kl_weight=0.0, ce_weight=1.0)
    module.log = lambda *a, **k: None
    even = torch.arange(0, 64, 2)[None]  # every label inside the draft vocab
    odd = even.clone()
    odd[:, 1::2] += 1  # half the labels outside it: skipped, not an index error
    for x in (even, odd):
        loss = module._step({"input_ids": x}, "train")
        assert torch.isfinite(loss) and loss > 0


# -- every family with a draft vocab: the same contract ------------------------------------------------------------
def _families():
    from specdec.drafters.early_exit import EarlyExit
    from specdec.drafters.hydra import Hydra
    from specdec.drafters.prophet import Prophet
    return {"medusa": lambda b, **kw: Medusa(b, num_heads=3, **kw),
            "hydra": lambda b, **kw: Hydra(b, num_heads=3, **kw),
            "prophet": lambda b, **kw: Prophet(b, unroll_steps=3, **kw),
            "early_exit": lambda b, **kw: EarlyExit(b, exit_layers=[1], num_extra_layers=1, **kw)}


@pytest.mark.parametrize("family", list(_families()))
@pytest.mark.parametrize("own", [False, True])
def test_family_draft_vocab_greedy_identity_and_checkpoint(tiny, tmp_path, family, own):
    from specdec.checkpoint import save_drafter

    tokens = torch.arange(0, tiny.vocab_size, 2)
    make = _families()[family]
    d = make(tiny, draft_vocab_size=len(tokens), own_lm_head=own)
    d.set_draft_vocab(tokens)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x = torch.randint(0, tiny.vocab_size, (1, 9))
    out = d.forward_train(tiny.features(x, d.feature_layers), x).logits
    assert out.shape[-1] == len(tokens)
    if own:  # the trainable projection covers the draft vocab only
        assert all(lm.weight.shape[0] == len(tokens) for lm in d.vocab_heads())
    prompts = [[5, 9, 33, 120], [7, 8]]
    widths = []  # expand's draft logits cover the draft vocab only; the sampler maps its picks to base ids
    expand = d.expand

    def recording(*args, **kwargs):
        logits = expand(*args, **kwargs)
        widths.append(logits.shape[-1])
        return logits

    d.expand = recording
    for cfg in (SamplerConfig(max_new_tokens=10, eos_token_id=[], gamma=3),
                SamplerConfig(max_new_tokens=10, eos_token_id=[], tree="dynamic", dynamic_depth=3)):
        ref = generate(tiny, prompts, None, cfg, engine=auto_engine()).tokens
        assert torch.equal(generate(tiny, prompts, d.eval(), cfg, engine=auto_engine()).tokens, ref)
    assert widths and set(widths) == {len(tokens)}
    assert d.token_ids(torch.tensor([[0, 3]])).tolist() == [[0, 6]]  # draft index i is the base's token 2i here
    del d.expand
    # the frozen draft-vocab projection is rebuilt from the saved tokens on load, never saved itself
    save_drafter(d, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", tiny)
    assert not any(k.endswith("draft_vocab.head.weight") for k in d.state_dict())
    torch.testing.assert_close(loaded.forward_train(tiny.features(x, d.feature_layers), x).logits, out)
