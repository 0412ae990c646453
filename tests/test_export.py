"""specdec.export: every format written and read back to the same drafter; the names and shapes the other sides'
loaders read (fixtures from their sources); a wrong base, a malformed checkpoint and a family without a format
refused in one line; an exported drafter evaluated like ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.base import tiny_base
from specdec.checkpoint import save_drafter
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.eagle3 import Eagle3
from specdec.drafters.hydra import Hydra
from specdec.drafters.medusa import Medusa
from specdec.export import FORMATS, detect, export, load
from specdec.export.common import SPECDEC, CheckpointError

T = 8


@pytest.fixture(scope="module")
def base():
    return tiny_base(num_layers=4)


def randomized(d, seed: int = 0, vocab: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
        if vocab is not None:  # a draft vocab that is not the first ids
            d.set_draft_vocab(torch.randperm(d.base.vocab_size, generator=gen)[:vocab])
            for p in d.vocab_heads():
                p.weight.copy_(torch.randn(p.weight.shape, generator=gen))
    return d.eval()


def same_logits(a, b, base):
    ids = torch.randint(3, base.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    feats = base.features(ids, layers=a.feature_layers)
    with torch.no_grad():
        la, lb = a.forward_train(feats, ids).logits, b.forward_train(feats, ids).logits
    k = min(la.shape[2], lb.shape[2])  # (SGLang's layout records no TTT length: it reads back as EAGLE-3's 7)
    torch.testing.assert_close(a.full_vocab(la[:, :, :k]), b.full_vocab(lb[:, :, :k]))


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_eagle3_round_trips(base, tmp_path, fmt):
    d = randomized(Eagle3(base, ttt_steps=3, draft_vocab_size=50, aux_layers=[1, 2, 3]), vocab=50)
    out = export(d, fmt, tmp_path / fmt)
    assert detect(out) == fmt
    back = load(out, base)
    assert isinstance(back, Eagle3) and back.aux_layers == [1, 2, 3]
    assert torch.equal(back.draft_vocab.tokens, d.draft_vocab.tokens)
    same_logits(d, back, base)


def test_speculators_layout_is_what_vllm_and_speculators_read(base, tmp_path):
    """Fixture: config fields from speculators' Eagle3SpeculatorConfig (src/speculators/models/eagle3/config.py,
    src/speculators/config.py) and vLLM's reader (vllm/transformers_utils/configs/speculators/algos.py); tensor names
    of Eagle3DraftModel's state dict (src/speculators/models/eagle3/core.py)."""
    d = randomized(Eagle3(base, ttt_steps=3, draft_vocab_size=50, aux_layers=[1, 2, 3]), vocab=50)
    out = export(d, "speculators", tmp_path / "s")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    assert cfg["draft_vocab_size"] == 50 and cfg["target_hidden_size"] == base.hidden_size
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and cfg["norm_before_residual"] is False
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["proposal_type"] == "greedy" and set(spec["verifier"]) == {"name_or_path",
                                                                                                  "architectures"}
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    h, v = base.hidden_size, base.vocab_size
    t = load_file(out / "model.safetensors")
    assert t["fc.weight"].shape == (h, 3 * h) and t["lm_head.weight"].shape == (50, h)
    assert t["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * h and "layers.0.hidden_norm.weight" in t
    assert t["embed_tokens.weight"].shape == (v, h) and t["norm.weight"].shape == (h,)
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool and int(t["t2d"].sum()) == 50
    assert torch.equal(t["d2t"] + torch.arange(50), d.draft_vocab.tokens)


FIXTURE = Path(__file__).parent / "fixtures" / "speculators_eagle3.json"
JSON_TYPES = {"str": lambda v: isinstance(v, str), "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "bool": lambda v: isinstance(v, bool), "dict": lambda v: isinstance(v, dict), "null": lambda v: v is None,
              "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
              "list[int]": lambda v: isinstance(v, list) and all(isinstance(x, int) for x in v)}


def of_type(value, kind: str) -> bool:
    """Whether a JSON value is of the fixture's type ("int", "list[int]|null", ...)."""
    return any(JSON_TYPES[k](value) for k in kind.split("|"))


@pytest.mark.parametrize("switches", [{}, {"fc_norm": True, "norm_output": True}], ids=["eagle3", "eagle3.1"])
def test_speculators_export_is_what_its_eagle3_model_loads(base, tmp_path, switches):
    """Against tests/fixtures/speculators_eagle3.json: the config fields and types, the decoder layer's config and the
    state dict (names, shapes, dtypes) of speculators 0.9.0's Eagle3SpeculatorConfig and Eagle3DraftModel, transcribed
    from its source (the fixture names the files), the version `make interop` loads our export with. Pydantic drops
    a config key it does not know without a word, and a tensor its model lacks is only a warning: here either fails."""
    spec = json.loads(FIXTURE.read_text())
    d = randomized(Eagle3(base, ttt_steps=3, draft_vocab_size=50, aux_layers=[1, 2, 3], **switches), vocab=50)
    out = export(d, "speculators", tmp_path / "s")
    cfg = json.loads((out / "config.json").read_text())
    fields = spec["config"]["fields"]
    assert set(cfg) <= set(fields), set(cfg) - set(fields)
    assert all(of_type(cfg[k], fields[k]["type"]) for k in cfg)
    # its defaults that would be wrong for ours: a Qwen3 layer, 32000 draft tokens, its own aux layers, no verifier
    assert {"transformer_layer_config", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids",
            "speculators_config"} <= set(cfg)
    assert all(cfg[k] == v for k, v in spec["config"]["values"].items())
    layer = cfg["transformer_layer_config"]
    assert layer.get("model_type") in spec["config"]["layer_model_types"]  # (else its Qwen3Config reads the layer)
    assert set(spec["config"]["layer_keys"]) <= set(layer)
    aux = cfg["eagle_aux_hidden_state_layer_ids"]  # distinct, within [0, the verifier's layers]
    assert len(set(aux)) == len(aux) and 0 <= min(aux) and max(aux) <= base.num_layers
    sc = cfg["speculators_config"]
    assert set(sc) == set(spec["config"]["speculators_config"])
    assert set(sc["verifier"]) == set(spec["config"]["verifier"])
    assert all(of_type(sc["verifier"][k], t) for k, t in spec["config"]["verifier"].items())
    for method in sc["proposal_methods"]:
        assert set(method) == set(spec["config"]["proposal"])
        assert all(of_type(method[k], t) for k, t in spec["config"]["proposal"].items())
    assert sc["default_proposal_method"] in [m["proposal_type"] for m in sc["proposal_methods"]]

    sizes = {"H": layer["hidden_size"], "I": layer["intermediate_size"], "V": layer["vocab_size"],
             "Vd": cfg["draft_vocab_size"], "Q": layer["num_attention_heads"] * layer["head_dim"],
             "KV": layer["num_key_value_heads"] * layer["head_dim"], "A": len(aux)}
    flags = {"Vd != V": sizes["Vd"] != sizes["V"], "norm_before_fc": cfg.get("norm_before_fc", False),
             "fc_norm": cfg.get("fc_norm", False)}
    theirs = {k: t for k, t in spec["state_dict"]["tensors"].items() if flags.get(t.get("when"), True)}
    ours = load_file(out / "model.safetensors")
    assert set(ours) <= set(theirs) - set(spec["state_dict"]["never_saved"]), set(ours) - set(theirs)
    assert set(theirs) - set(spec["state_dict"]["ignored_when_missing"]) <= set(ours)  # what it cannot do without
    for name, t in ours.items():
        want = theirs[name]
        assert list(t.shape) == [eval(dim, {}, sizes) for dim in want["shape"]], name  # noqa: S307 (the fixture's)
        assert str(t.dtype).removeprefix("torch.") == want.get("dtype", str(t.dtype).removeprefix("torch.")), name


def test_eagle31_exports_its_switches_and_round_trips(base, tmp_path):
    """EAGLE-3.1 to speculators: `fc_norm` and `norm_output` true in config.json (speculators' Eagle3SpeculatorConfig
    fields, which vLLM's update_eagle3 in vllm/transformers_utils/configs/speculators/algos.py passes on by the same
    names), its norms as fc_norm.{0,1,2}.weight (Eagle3DraftModel's names, src/speculators/models/eagle3/core.py),
    and back to the same switches, weights and logits: different from the same weights read as EAGLE-3."""
    for switches in [{"fc_norm": True}, {"norm_output": True}, {"fc_norm": True, "norm_output": True}]:
        d = randomized(Eagle3(base, ttt_steps=3, draft_vocab_size=50, aux_layers=[1, 2, 3], **switches), vocab=50)
        out = export(d, "speculators", tmp_path / "_".join(switches))
        cfg = json.loads((out / "config.json").read_text())
        assert {k: cfg[k] for k in ("fc_norm", "norm_output", "norm_before_fc")} == {
            "fc_norm": "fc_norm" in switches, "norm_output": "norm_output" in switches, "norm_before_fc": False}
        t = load_file(out / "model.safetensors")
        norms = sorted(k for k in t if k.startswith("fc_norm."))
        assert norms == ([f"fc_norm.{i}.weight" for i in range(3)] if "fc_norm" in switches else [])
        assert all(torch.equal(t[k], d.state_dict()[k]) for k in norms)
        back = load(out, base)
        assert (back.fc_norm is not None, back.norm_output) == ("fc_norm" in switches, "norm_output" in switches)
        assert back.hparams["fc_norm"] == ("fc_norm" in switches) and back.hparams["norm_output"] == (
            "norm_output" in switches)
        same_logits(d, back, base)
        plain = dict(cfg, fc_norm=False, norm_output=False)  # a reader that dropped the switches
        (out / "config.json").write_text(json.dumps(plain))
        save_file({k: v for k, v in t.items() if not k.startswith("fc_norm.")}, out / "model.safetensors")
        with pytest.raises(AssertionError):
            same_logits(d, load(out, base), base)


def test_eagle31_goes_to_no_layout_that_drops_its_switches(base, tmp_path):
    """SGLang's layout and llama.cpp's converter (its conversion/llama.py reads norm_before_residual, not fc_norm or
    norm_output) would draft as EAGLE-3: refused in one line, both ways."""
    d = randomized(Eagle3(base, ttt_steps=2, draft_vocab_size=50, aux_layers=[1, 2, 3], norm_output=True), vocab=50)
    for fmt in ("sglang", "gguf"):
        with pytest.raises(CheckpointError, match=r"with norm_output \(EAGLE-3.1\) exports to speculators only"):
            export(d, fmt, tmp_path / fmt)
    out = export(randomized(Eagle3(base, ttt_steps=2, draft_vocab_size=50, aux_layers=[1, 2, 3])), "sglang",
                 tmp_path / "g")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(cfg | {"fc_norm": True}))
    with pytest.raises(CheckpointError, match="fc_norm / norm_output \\(EAGLE-3.1\\) are read from the speculators"):
        load(out, base)


def test_sglang_layout_is_what_its_loader_reads(base, tmp_path):
    """Fixture: sglang python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3.load_weights: `midlayer.*`,
    fc, norm, lm_head, d2t as offsets `hot_token_id = d2t + arange`; eagle_config ids as layer outputs, +1)."""
    d = randomized(Eagle3(base, ttt_steps=3, draft_vocab_size=50, aux_layers=[1, 2, 3]), vocab=50)
    out = export(d, "sglang", tmp_path / "g")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 50 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    t = load_file(out / "model.safetensors")
    names = {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
             "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
             "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
             "midlayer.mlp.down_proj.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert names <= set(t) and not any(k.startswith("layers.") for k in t)


def test_medusa_round_trips_and_layouts(base, tmp_path):
    """Fixtures: vLLM vllm/model_executor/models/medusa.py (blocks.{h}.layers.{l}, lm_heads.{h}, token_map,
    num_heads / num_hidden_layers / truncated_vocab_size) and FasterDecoding/Medusa medusa/model/medusa_model.py
    (medusa_lm_head.safetensors: {h}.{l}.linear, {h}.{L}.weight; medusa_num_heads / medusa_num_layers)."""
    d = randomized(Medusa(base, num_heads=3, num_layers=2, own_lm_head=True, draft_vocab_size=40), vocab=40)
    out = export(d, "vllm_medusa", tmp_path / "v")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["truncated_vocab_size"]) == (3, 2, 40)
    t = load_file(out / "model.safetensors")
    assert {"blocks.2.layers.1.weight", "blocks.2.layers.1.bias", "lm_heads.2.weight", "token_map"} <= set(t)
    same_logits(d, load(out, base), base)

    plain = randomized(Medusa(base, num_heads=2, num_layers=1))  # the base's shared lm_head, full vocab
    out = export(plain, "medusa", tmp_path / "m")
    assert json.loads((out / "config.json").read_text())["medusa_num_heads"] == 2
    assert {"0.0.linear.weight", "0.0.linear.bias", "1.1.weight"} <= set(load_file(out / "medusa_lm_head.safetensors"))
    same_logits(plain, load(out, base), base)
    with pytest.raises(CheckpointError, match="draft_vocab_size=null"):
        export(d, "medusa", tmp_path / "no")


def test_draft_model_is_a_plain_hf_model(base, tmp_path):
    from transformers import AutoModelForCausalLM

    d = randomized(DraftModel(base, num_layers=1))
    out = export(d, "hf", tmp_path / "hf")
    lm = AutoModelForCausalLM.from_pretrained(out)  # what generate(assistant_model=) and vLLM load
    ids = torch.randint(3, base.vocab_size, (1, T))
    with torch.no_grad():
        torch.testing.assert_close(lm(ids).logits, d.lm(ids).logits)
    back = load(out, base)
    assert isinstance(back, DraftModel)
    with torch.no_grad():
        torch.testing.assert_close(back.lm(ids).logits, d.lm(ids).logits)
    with pytest.raises(CheckpointError, match="draft_vocab_size=null"):
        export(DraftModel(base, num_layers=1, draft_vocab_size=30), "hf", tmp_path / "no")
    # HF's assisted generation with it emits the base's own greedy tokens
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=16, min_new_tokens=16, do_sample=False,
              pad_token_id=0)
    plain = base.model.generate(prompt, **kw)
    assisted = base.model.generate(prompt, assistant_model=lm, **kw)
    assert torch.equal(assisted, plain)


def test_families_without_a_format_are_refused_in_one_line(base, tmp_path):
    with pytest.raises(CheckpointError, match=r"a hydra drafter has no speculators form; only .* drafters have serving "
                                              r"formats \(speculators, sglang, vllm_medusa, medusa, hf, gguf\)"):
        export(Hydra(base, num_heads=2), "speculators", tmp_path / "x")
    with pytest.raises(CheckpointError, match="a medusa drafter has no sglang form; its formats: vllm_medusa, medusa"):
        export(Medusa(base, num_heads=2), "sglang", tmp_path / "x")
    assert set(FORMATS) == {"speculators", "sglang", "vllm_medusa", "medusa", "hf", "gguf"}


def test_another_base_and_malformed_checkpoints_are_refused(base, tmp_path):
    d = randomized(Eagle3(base, ttt_steps=2, draft_vocab_size=50, aux_layers=[1, 2, 3]), vocab=50)
    out = export(d, "speculators", tmp_path / "s")
    with pytest.raises(CheckpointError, match="exported from another base"):
        load(out, tiny_base(num_layers=4, seed=1))
    # a checkpoint from elsewhere (no specdec.json): its declared verifier, hidden size and tensors decide
    (out / SPECDEC).unlink()
    cfg = json.loads((out / "config.json").read_text())
    for change, message in [({"speculators_config": {**cfg["speculators_config"], "verifier": {
                                 "name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "architectures": []}}},
                              "drafts for verifier 'meta-llama/Llama-3.1-8B-Instruct'"),
                            ({"target_hidden_size": 4096}, "reads hidden states of size 4096")]:
        (out / "config.json").write_text(json.dumps(cfg | change))
        with pytest.raises(CheckpointError, match=message):
            load(out, base)
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(out / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "fc.weight"}, out / "model.safetensors")
    with pytest.raises(CheckpointError, match="tensor fc.weight is missing"):
        load(out, base)
    save_file(tensors | {"norm.weight": torch.ones(7)}, out / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor norm.weight has shape \(7,\), expected"):
        load(out, base)
    with pytest.raises(CheckpointError, match="of no drafter format"):
        (tmp_path / "junk").mkdir()
        (tmp_path / "junk" / "config.json").write_text("{}")
        load(tmp_path / "junk", base)


def test_an_exported_drafter_is_evaluated_beside_ours(base, tmp_path):
    from hydra import compose, initialize_config_dir

    from conftest import CONFIGS
    from specdec.evaluation import evaluate

    tiny = tiny_base()
    d = randomized(Medusa(tiny, num_heads=2))
    save_drafter(d, tmp_path / "ours")
    export(d, "vllm_medusa", tmp_path / "theirs")
    (tmp_path / "q.jsonl").write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["def add(a, b):"]}))
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("evaluate", overrides=[
            "base=tiny", f"paths.output_dir={tmp_path}/eval", "prompts=jsonl", f"prompts.path={tmp_path}/q.jsonl",
            f"drafters=[{tmp_path}/ours,{tmp_path}/theirs]", "peers=[]", "sampler.max_new_tokens=12",
            "sampler.eos_token_id=[]", "wandb.enabled=false", "sampler.gamma=2"])
    rows = {r["method"]: r for r in evaluate(cfg)["rows"]}
    assert set(rows) == {"ar (ours)", "medusa", "medusa (vllm_medusa)"}
    assert rows["medusa"]["tau"] == rows["medusa (vllm_medusa)"]["tau"]  # the same drafter, read back
    assert all(r["greedy_identical"] for r in rows.values())


def test_the_command_line_exports_a_checkpoint_and_refuses_in_one_line(base, tmp_path, monkeypatch, capsys):
    import specdec.export.__main__ as cli

    monkeypatch.setattr(cli, "load_base", lambda name, device: base)  # (the tiny base has no name to load it by)
    save_drafter(randomized(Eagle3(base, ttt_steps=2, draft_vocab_size=50, aux_layers=[1, 2, 3]), vocab=50),
                 tmp_path / "ckpt")
    assert cli.main([str(tmp_path / "ckpt"), "--to", "speculators", "--out", str(tmp_path / "out")]) == 0
    assert detect(tmp_path / "out") == "speculators" and "vLLM" in capsys.readouterr().out
    assert cli.main([str(tmp_path / "ckpt"), "--to", "medusa", "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has no medusa form; its formats: speculators, sglang, gguf" in err


def test_a_base_that_cannot_be_loaded_is_refused_in_one_line_naming_base(base, tmp_path, monkeypatch, capsys):
    """Offline, the tiny base a checkpoint names (it has no hub name) and a --base directory that is not there end in
    one line that says to pass --base, not in the hub client's traceback."""
    import huggingface_hub

    import specdec.export.__main__ as cli

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    save_drafter(Eagle3(base, ttt_steps=2, draft_vocab_size=50, aux_layers=[1, 2, 3]), tmp_path / "ckpt")
    for extra, names in [([], f"{base.name!r} (its checkpoint names it)"),
                         (["--base", str(tmp_path / "nowhere")], f"{str(tmp_path / 'nowhere')!r} (--base names it)")]:
        assert cli.main([str(tmp_path / "ckpt"), "--to", "speculators", "--out", str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"cannot load the base {names}" in err
        assert err.endswith("pass the base the drafter was trained on as --base <hub name or model directory>")
    assert not (tmp_path / "out").exists()
