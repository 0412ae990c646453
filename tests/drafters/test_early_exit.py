"""Early-exit drafter: training-side alignment, exactness at full depth, parameter accounting, checkpoints,
and the sampling side against the shared sampler (greedy speculative == plain greedy)."""

from pathlib import Path

import pytest
import torch

from specdec.base import LAST, tiny_base
from specdec.checkpoint import load_drafter, save_drafter
from specdec.drafters.early_exit import EarlyExit

from conftest import auto_engine


def make_base(num_layers: int = 2, seed: int = 0):
    base = tiny_base(num_layers=num_layers, seed=seed)
    # A random final-norm weight: with the default all-ones weight, norm(norm(x)) ≈ norm(x) would hide a drafter
    # that re-normalises HF's already-normed last hidden state.
    with torch.no_grad():
        base.norm.weight.uniform_(0.5, 1.5)
    return base


def ids(base, B: int = 2, T: int = 9, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, base.vocab_size, (B, T), generator=g)


def train_logits(drafter, x):
    feats = drafter.base.features(x, layers=drafter.feature_layers)
    return drafter.forward_train(feats, x).logits  # [B, T, K, V]


def test_hf_last_hidden_state_is_normed():
    # Why an exit at the last layer cannot read Features.hidden[num_layers]: HF hands the normed final state there.
    base = make_base()
    x = ids(base)
    feats = base.features(x, layers=(base.num_layers, LAST))
    torch.testing.assert_close(feats.hidden[base.num_layers], feats.hidden[LAST])


def test_exit_at_last_layer_reproduces_base():
    base = make_base()
    drafter = EarlyExit(base, exit_layers=[base.num_layers])
    assert drafter.feature_layers == (base.num_layers - 1,)
    x = ids(base)
    torch.testing.assert_close(train_logits(drafter, x)[:, :, 0], base(x), rtol=1e-5, atol=1e-5)


def test_copied_blocks_reproduce_base():
    # exit 1 + a trainable copy of base layer 1 + the copied final norm + shared head is the base itself: pins the
    # causal mask and rotary positions of the teacher-forced block pass.
    base = make_base()
    drafter = EarlyExit(base, exit_layers=[1], num_extra_layers=1, extra_init="copy")
    x = ids(base)
    torch.testing.assert_close(train_logits(drafter, x)[:, :, 0], base(x), rtol=1e-5, atol=1e-5)


def test_entry_predicts_next_token_from_exit_state():
    base = make_base(num_layers=3)
    drafter = EarlyExit(base, exit_layers=[2], num_extra_layers=1)
    assert drafter.target_offsets == [0] and drafter.feature_layers == (2,)
    with torch.no_grad():  # a fresh block starts as the identity; make it do something for the causality check
        for p in drafter.exits[0].blocks.parameters():
            p.normal_(0, 0.1)
    x = ids(base)
    out = train_logits(drafter, x)[:, :, 0]  # [B, T, V]
    # position t reads only tokens <= t: changing token t+1 leaves positions <= t unchanged
    t = 4
    y = x.clone()
    y[:, t + 1] = (y[:, t + 1] + 1) % base.vocab_size
    out_y = train_logits(drafter, y)[:, :, 0]
    torch.testing.assert_close(out[:, : t + 1], out_y[:, : t + 1])
    assert not torch.allclose(out[:, t + 1], out_y[:, t + 1])
    # with no blocks the entry at t is exactly head(norm(layer-2 state at t))
    plain = EarlyExit(base, exit_layers=[2])
    h = base.features(x, layers=(2,)).hidden[2]
    torch.testing.assert_close(train_logits(plain, x)[:, :, 0], base.lm_head(base.norm(h)))


def test_multi_exit_shapes_and_names():
    base = make_base(num_layers=4)
    drafter = EarlyExit(base, exit_layers=[3, 1, 4], num_extra_layers=0, own_lm_head=True)
    assert drafter.head_names == ["exit3", "exit1", "exit4"]
    assert drafter.target_offsets == [0, 0, 0]
    assert drafter.feature_layers == (1, 3)  # exit 4 reads layer 3 (see test_hf_last_hidden_state_is_normed)
    x = ids(base, B=2, T=7)
    out = train_logits(drafter, x)
    assert out.shape == (2, 7, 3, base.vocab_size)
    torch.testing.assert_close(out[:, :, 2], base(x), rtol=1e-5, atol=1e-5)  # the full-depth exit is the base


def test_parameter_count_distinct_and_no_base_weights():
    base = make_base(num_layers=4)
    n_extra, K = 2, 2
    drafter = EarlyExit(base, exit_layers=[1, 2], num_extra_layers=n_extra, own_lm_head=True)
    c = base.config
    H, V, I, hd = c.hidden_size, c.vocab_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    attn = H * c.num_attention_heads * hd * 2 + H * c.num_key_value_heads * hd * 2  # q, o + k, v
    block = attn + 3 * H * I + 2 * H  # + gate/up/down + two norms
    expected = K * (n_extra * block + H + V * H)  # + final norm + own lm_head per exit
    params = list(drafter.parameters())
    assert sum(p.numel() for p in params) == expected
    # no module or tensor is shared (the [Block] * n bug), and nothing of the base is registered
    modules = list(drafter.modules())
    assert len({id(m) for m in modules}) == len(modules)
    ptrs = [p.data_ptr() for p in params]
    assert len(set(ptrs)) == len(ptrs)
    base_ptrs = {p.data_ptr() for p in base.parameters()}
    assert not base_ptrs & set(ptrs)
    state = drafter.state_dict()
    assert all(k.startswith("exits.") for k in state)
    assert sum(v.numel() for v in state.values()) == expected
    assert all(p.requires_grad for p in params)


def test_fresh_blocks_start_as_identity_and_get_gradients():
    base = make_base(num_layers=3)
    drafter = EarlyExit(base, exit_layers=[1], num_extra_layers=1)
    plain = EarlyExit(base, exit_layers=[1])
    x = ids(base)
    out = train_logits(drafter, x)
    torch.testing.assert_close(out, train_logits(plain, x))
    out.logsumexp(-1).sum().backward()
    block = drafter.exits[0].blocks[0]
    for p in (block.self_attn.o_proj.weight, block.mlp.down_proj.weight, drafter.exits[0].norm.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_checkpoint_roundtrip(tmp_path):
    base = make_base(num_layers=3)
    drafter = EarlyExit(base, exit_layers=[1, 2], num_extra_layers=1, own_lm_head=True, gamma=3)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_drafter(drafter, tmp_path)
    loaded = load_drafter(tmp_path, base)
    assert loaded.hparams == drafter.hparams
    x = ids(base)
    torch.testing.assert_close(train_logits(loaded, x), train_logits(drafter, x))


def test_expected_tau_chain_formula():
    drafter = EarlyExit(make_base(), exit_layers=[1, 2], gamma=4)
    for alpha in (0.0, 0.3, 0.5, 0.9):
        want = (1 - alpha**5) / (1 - alpha)
        got = drafter.expected_tau(torch.tensor([alpha, 0.99]))  # the first exit is the one the sampler uses
        assert got.item() == pytest.approx(want, rel=1e-6)
    assert drafter.expected_tau(torch.tensor([1.0, 0.0])).item() == pytest.approx(5.0)  # limit γ+1, no 0/0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(exit_layers=[]),
        dict(exit_layers=[3]),
        dict(exit_layers=[1], extra_init="random"),
        dict(exit_layers=[1], num_extra_layers=2, extra_init="copy"),
        dict(exit_layers=[2], num_extra_layers=1),
    ],
)
def test_invalid_configs_raise(kwargs):
    with pytest.raises(ValueError):
        EarlyExit(make_base(), **kwargs)


def test_config_builds_the_drafter():
    import hydra
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(__file__).parents[2] / "configs/drafter/early_exit.yaml")
    cfg.exit_layers = [0, 1]  # the yaml's default exit is deeper than the 2-layer tiny base
    drafter = hydra.utils.instantiate(cfg)(base=make_base())
    assert isinstance(drafter, EarlyExit)
    assert drafter.hparams["exit_layers"] == [0, 1] and type(drafter.hparams["exit_layers"]) is list


# -- sampling side: the shared sampler with the early-exit drafter ------------------------------------------------

PROMPTS = [[5, 17, 42, 8, 99, 23, 7], [61, 3, 12]]  # ragged on purpose


def decode(base, drafter, engine=None, **cfg):
    from specdec.sampling.decode import SamplerConfig, generate

    return generate(base, PROMPTS, drafter, SamplerConfig(max_new_tokens=24, eos_token_id=[], **cfg),
                    engine=engine or auto_engine())


def perturb(drafter, std: float = 0.02):
    """Trained-looking weights: a fresh block starts as the identity, which would leave the private cache unread."""
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(std * torch.randn_like(p))
    return drafter


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(exit_layers=[1]),  # base cache only
        dict(exit_layers=[1, 2], num_extra_layers=2, extra_init="fresh"),  # + private cache; sweep: first exit drafts
        dict(exit_layers=[2], num_extra_layers=1, extra_init="copy", own_lm_head=True),
    ],
)
@pytest.mark.parametrize(
    "sampler",
    [
        dict(gamma=1),
        dict(gamma=4),
        dict(tree="static", paths=[[0, 0, 0], [1, 0], [2]]),
        dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6),
    ],
)
def test_greedy_speculative_equals_greedy(kwargs, sampler):
    base = make_base(num_layers=3)
    torch.manual_seed(0)
    drafter = perturb(EarlyExit(base, **kwargs))
    plain = decode(base, None)
    spec = decode(base, drafter, **sampler)
    assert torch.equal(spec.tokens, plain.tokens)
    assert spec.num_generated == [24, 24]
    assert 0 < sum(map(sum, spec.accepted)) < sum(map(sum, spec.drafted))  # partial acceptance was exercised


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(exit_layers=[3]),  # all of the base's layers through the shared base cache
        dict(exit_layers=[2], num_extra_layers=1, extra_init="copy"),  # + the last layer in the private cache
    ],
)
def test_drafter_equal_to_base_is_always_accepted(kwargs):
    # These drafters ARE the base, so every draft must be accepted: any slot, position or mask error in the
    # shared or private cache (expand writes, observe rewrites) would show up as a rejection.
    # Bitwise-equal logits need one product for every row count (the measured kernels may pick different ones for a
    # draft's and a verify's rows) and the drafter's exact weights: stock kernels, fp32 drafting.
    base = make_base(num_layers=3)
    drafter = EarlyExit(base, **kwargs)
    exact = dict(engine=auto_engine(name="eager"))
    spec = decode(base, drafter, gamma=4, **exact)
    assert torch.equal(spec.tokens, decode(base, None).tokens)
    assert all(a == 4 for row in spec.accepted for a in row)
    sampled = decode(base, drafter, gamma=4, temperature=1.0, **exact)  # p == q up to float rounding: accepted
    assert sum(map(sum, sampled.accepted)) >= 0.95 * sum(map(sum, sampled.drafted))


def test_private_cache_is_fed_by_observe():
    # Negative control for the test above: without `observe` the extra block never sees the prompt, and the
    # drafter that equals the base starts being rejected.
    base = make_base(num_layers=3)
    drafter = EarlyExit(base, exit_layers=[2], num_extra_layers=1, extra_init="copy")
    drafter.observe = lambda *args, **kwargs: None
    spec = decode(base, drafter, gamma=4)
    assert sum(map(sum, spec.accepted)) < sum(map(sum, spec.drafted))


@pytest.mark.slow
def test_real_base_full_exit_and_greedy_identity():
    # SmolLM2 (tied embeddings, GQA, a trained final norm): the full-depth exit is the base, and greedy
    # speculative decoding with a shallow exit plus a copied block equals plain greedy.
    from specdec.base import load_base
    from specdec.sampling.decode import SamplerConfig, generate

    base = load_base(device="cpu")
    x = torch.tensor([base.tokenizer("def fibonacci(n):\n    if n < 2:").input_ids])
    full = EarlyExit(base, exit_layers=[base.num_layers])
    torch.testing.assert_close(train_logits(full, x)[:, :, 0], base(x), rtol=1e-4, atol=1e-4)
    drafter = EarlyExit(base, exit_layers=[8], num_extra_layers=1, extra_init="copy")
    cfg = SamplerConfig(max_new_tokens=16, gamma=3)
    prompt = x[0].tolist()
    assert generate(base, [prompt], drafter, cfg, engine=auto_engine()).tokens.tolist() == generate(base, [prompt], None, cfg, engine=auto_engine()).tokens.tolist()
