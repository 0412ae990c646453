"""The standalone draft model: a small LM built from the base's config (trained) and any HF causal LM with the base's
tokenizer (evaluate-only), against the shared sampler (greedy identity, all-accepted when it is the base, its own
store fed by observe, Monte-Carlo losslessness); what is trained and saved; train.py and evaluate.py with the
hf_assisted peer."""

import json
from dataclasses import replace

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import ByT5Tokenizer

from specdec.base import Features, tiny_base
from specdec.checkpoint import load_drafter, save_drafter
from specdec.drafters.draft_model import DraftModel
from specdec.sampling.decode import SamplerConfig, generate

from conftest import CONFIGS, auto_engine, compose_train
from sampling_stubs import micro_base
from test_sampling_mc import PROMPT, TOKENS, chi_square_pvalue, exact_joint

PROMPTS = [[5, 17, 42, 8, 99, 23, 7], [61, 3, 12]]  # ragged on purpose
CFG = SamplerConfig(max_new_tokens=20, eos_token_id=[])
TREES = [dict(tree="static", paths=[[0, 0, 0], [1, 0], [2]]),
         dict(tree="dynamic", dynamic_depth=3, dynamic_topk=2, dynamic_budget=6)]


@pytest.fixture(scope="module")
def base():
    return tiny_base(num_layers=3)


@pytest.fixture(scope="module")
def plain(base):
    return generate(base, PROMPTS, None, CFG, engine=auto_engine()).tokens


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, base):
    """A pretrained HF causal LM on disk with the base's tokenizer (another tiny Llama)."""
    d = tmp_path_factory.mktemp("hf_draft")
    tiny_base(num_layers=1, seed=7).model.save_pretrained(d)
    base.tokenizer.save_pretrained(d)
    return d


@pytest.mark.parametrize("kwargs", [dict(num_layers=1), dict(num_layers=2, init="fresh"),
                                    dict(num_layers=2, draft_vocab_size=100)])
@pytest.mark.parametrize("sampler", [dict(gamma=1), dict(gamma=4), *TREES])
def test_greedy_speculative_equals_greedy(base, plain, kwargs, sampler):
    torch.manual_seed(0)
    drafter = DraftModel(base, **kwargs)
    spec = generate(base, PROMPTS, drafter, replace(CFG, **sampler), engine=auto_engine())
    assert torch.equal(spec.tokens, plain)
    assert 0 < sum(map(sum, spec.accepted)) < sum(map(sum, spec.drafted))  # partial acceptance was exercised


@pytest.mark.parametrize("sampler", [dict(gamma=4), TREES[0]])
def test_draft_model_equal_to_base_is_always_accepted(base, plain, sampler):
    # A copy of every base layer is the base: every draft must be accepted, which pins the private store's slots,
    # positions and mask, and `observe` re-running only the tail the drafting did not cover. Bitwise-equal logits
    # need one product for every row count and the drafter's exact weights: the measured kernels may pick different
    # ones for the draft's and the verify's rows (another summation order flips near-ties), and bf16 drafting rounds.
    drafter = DraftModel(base, num_layers=3)
    spec = generate(base, PROMPTS, drafter, replace(CFG, **sampler), engine=auto_engine(name="eager"))
    assert torch.equal(spec.tokens, plain)
    deepest = 4 if sampler.get("tree", "chain") == "chain" else 3
    assert all(a == deepest for row in spec.accepted for a in row)


def test_private_store_is_fed_by_observe(base):
    # Negative control for the test above: if observe ran the prompt only, the store would miss every committed
    # token the drafting did not run (the last of a fully accepted chain), and the base-equal draft gets rejected.
    drafter = DraftModel(base, num_layers=3)
    real = drafter.observe
    drafter.observe = lambda state, *a: real(state, *a) if state.get("prefill") else None
    spec = generate(base, PROMPTS, drafter, replace(CFG, gamma=4), engine=auto_engine())
    assert sum(map(sum, spec.accepted)) < sum(map(sum, spec.drafted))


def test_monte_carlo_lossless():
    # docs/sampler.md §6.3: a one-layer draft model on the micro base, the real sampler loop, 10^5 rows. Its layer is
    # redrawn at std 0.1 so that q differs from p (about 60% of the drafts are accepted).
    micro = micro_base()
    torch.manual_seed(0)
    drafter = DraftModel(micro, num_layers=1, init="fresh", gamma=2)
    with torch.no_grad():
        for p in drafter.lm.model.layers.parameters():
            p.normal_(0, 0.1)
    cfg = SamplerConfig(max_new_tokens=TOKENS, temperature=1.0, eos_token_id=[], gamma=2)
    r = generate(micro, [PROMPT] * 100_000, drafter, cfg, torch.Generator().manual_seed(0), engine=auto_engine())
    assert 0 < sum(map(sum, r.accepted)) < sum(map(sum, r.drafted))
    assert chi_square_pvalue(r.tokens, exact_joint(micro)) > 1e-3


def test_trains_only_its_layers_and_saves_no_base_weights(base, tmp_path):
    drafter = DraftModel(base, num_layers=2, draft_vocab_size=100)
    c = base.config
    H, I, hd = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    block = H * c.num_attention_heads * hd * 2 + H * c.num_key_value_heads * hd * 2 + 3 * H * I + 2 * H
    params = list(drafter.parameters())
    assert sum(p.numel() for p in params) == 2 * block + H  # two layers + the final norm
    assert all(p.requires_grad for p in params)
    assert not {p.data_ptr() for p in base.parameters()} & {p.data_ptr() for p in params}
    # the embeddings are the base's own tensor, used but neither a parameter nor saved
    assert drafter.lm.get_input_embeddings().weight.data_ptr() == base.embed_tokens.weight.data_ptr()
    assert set(drafter.state_dict()) == {k for k, _ in drafter.named_parameters()} | {"draft_vocab.tokens"}
    x = torch.randint(3, 250, (2, 9))
    out = drafter.forward_train(Features({}, None), x)
    assert out.logits.shape == (2, 9, 1, 100)
    out.logits.logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in params)
    with torch.no_grad():
        for p in params:
            p.add_(0.01 * torch.randn_like(p))
    drafter.set_draft_vocab(torch.arange(50, 150))
    save_drafter(drafter, tmp_path / "ckpt")
    loaded = load_drafter(tmp_path / "ckpt", base)
    torch.testing.assert_close(loaded.forward_train(Features({}, None), x).logits,
                               drafter.forward_train(Features({}, None), x).logits)


def test_copy_init_is_the_base_when_it_keeps_every_layer(base):
    x = torch.randint(3, 250, (2, 9))
    full = DraftModel(base, num_layers=3)
    torch.testing.assert_close(full.forward_train(Features({}, None), x).logits[:, :, 0], base(x))


def test_pretrained_hf_model_drafts_losslessly_and_is_frozen(base, plain, hf_dir):
    drafter = DraftModel(base, model=str(hf_dir))
    assert not any(p.requires_grad for p in drafter.parameters())
    for sampler in (dict(gamma=4), TREES[1]):
        spec = generate(base, PROMPTS, drafter, replace(CFG, **sampler), engine=auto_engine())
        assert torch.equal(spec.tokens, plain)
    with pytest.raises(ValueError, match="evaluate-only"):  # what train.py reports for it
        drafter.calibrate((), lambda m, s: None)


def test_pretrained_model_with_another_tokenizer_is_refused_in_one_line(base, tmp_path):
    tiny_base(num_layers=1).model.save_pretrained(tmp_path)
    ByT5Tokenizer(extra_ids=8).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tokenizer differs from the base's") as err:
        DraftModel(base, model=str(tmp_path))
    assert "\n" not in str(err.value)


def test_train_py_trains_it(corpus, tmp_path):
    from specdec.training import train

    cfg = compose_train(["base=tiny", "data=text", f"data.source.path={corpus}/*.txt", "data.block_size=32",
                         "data.batch_size=2", "data.val_fraction=0.2", "drafter=draft_model", "drafter.num_layers=1",
                         "debug=fdr"],
                        tmp_path)
    metrics = train(cfg)
    # one entry drafted γ = 4 times in a chain: τ = Σ_{i≤4} α^i, not the heads' 1 + α
    alpha, top1 = metrics["val/draft_accept"], metrics["val/draft_top1"]
    assert 0 < alpha < 1 and metrics["val/expected_tau"] == pytest.approx(sum(alpha**i for i in range(5)))
    assert metrics["val/expected_tau_greedy"] == pytest.approx(sum(top1**i for i in range(5)))
    drafter = load_drafter(tmp_path / "run" / "drafter", tiny_base())
    assert isinstance(drafter, DraftModel) and len(drafter.lm.model.layers) == 1


def test_train_py_refuses_a_pretrained_one(corpus, tmp_path, hf_dir):
    from specdec.training import train

    cfg = compose_train(["base=tiny", "data=text", f"data.source.path={corpus}/*.txt", "drafter=draft_model",
                         f"drafter.model={hf_dir}"], tmp_path)
    with pytest.raises(ValueError, match="evaluate-only"):
        train(cfg)


def _eval_cfg(tmp_path, questions, overrides):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("evaluate", overrides=[
            "base=tiny", f"paths.output_dir={tmp_path}/eval", f"paths.cache_dir={tmp_path}/cache", "prompts=jsonl",
            f"prompts.path={questions}", "sampler.max_new_tokens=10", "sampler.eos_token_id=[]", "warmup=false",
            "wandb.enabled=false", *overrides])


def test_evaluate_with_hf_assisted_beside_the_same_draft_model(tmp_path, hf_dir):
    from specdec.evaluation import evaluate

    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps({"question_id": i, "category": "c", "turns": [t]})
                                   for i, t in enumerate(["def add(a, b):", "a haiku"])))
    base = tiny_base()
    torch.manual_seed(0)
    save_drafter(DraftModel(base, num_layers=1), tmp_path / "dm")
    report = evaluate(_eval_cfg(tmp_path, questions, [f"drafters=[{tmp_path}/dm]", f"draft_models=[{hf_dir}]",
                                                      "peers=[hf_assisted]", "sampler.gamma=3",
                                                      "hf.assisted_tokens=3"]))
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["ar (ours)", "draftmodel", f"draft_model:{hf_dir.name}", "hf_assisted"]
    assert all(r["greedy_identical"] for r in rows.values())  # T = 0: every lossless method is plain greedy
    # the base's own first layer, norm and head draft most of its tokens (3.5 of 4 a round); an unrelated random LM
    # of that size drafts garbage (1.0)
    assert rows["draftmodel"]["draft_len"] == 3.0
    assert rows["draftmodel"]["tau"] > 2 * rows[f"draft_model:{hf_dir.name}"]["tau"]
    # HF's τ: its tokens per base forward, counted by a hook; 10 tokens, at most 3 drafts + 1 a forward
    assert 10 / 10 <= rows["hf_assisted"]["tau"] <= 10 / 3
    assert "| draft len |" in (tmp_path / "eval" / "report.md").read_text()
    with pytest.raises(ValueError, match="hf_assisted needs a draft model"):
        evaluate(_eval_cfg(tmp_path, questions, ["peers=[hf_assisted]", "overwrite=true"]))


def test_tied_embeddings_base():
    # SmolLM2 ties its lm_head to its embeddings (the tiny base does not): the draft model shares the one tensor
    # and saves neither.
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.base import Base

    tok = tiny_base().tokenizer
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    tied = Base(LlamaForCausalLM(config), tok, "tiny-tied")
    assert tied.lm_head.weight is tied.embed_tokens.weight
    drafter = DraftModel(tied, num_layers=1)
    shared = {drafter.lm.get_input_embeddings().weight.data_ptr(), drafter.lm.get_output_embeddings().weight.data_ptr()}
    assert shared == {tied.embed_tokens.weight.data_ptr()}
    assert not any("embed" in k or "lm_head" in k for k in drafter.state_dict())
    plain = generate(tied, PROMPTS, None, CFG, engine=auto_engine()).tokens
    assert torch.equal(generate(tied, PROMPTS, drafter, replace(CFG, gamma=3), engine=auto_engine()).tokens, plain)
