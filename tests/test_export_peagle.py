"""specdec.export for P-EAGLE: speculators' peagle layout written and read back to the same drafter (weights and
logits, through the loader evaluate.py uses); the config and state dict against a fixture from speculators' source;
another base, a bad mask token, a switch or trained embeddings refused on load, each in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.base import tiny_base
from specdec.checkpoint import save_drafter
from specdec.drafters.peagle import PEagle
from specdec.export import describe, detect, export, formats_of, load
from specdec.export.common import SPECDEC, CheckpointError
from test_export import of_type, randomized, same_logits

AUX = [1, 2, 3]
FIXTURE = Path(__file__).parent / "fixtures" / "speculators_peagle.json"


@pytest.fixture(scope="module")
def base():
    return tiny_base(num_layers=4)


def drafter(base, vocab: int | None = 50, layers: int = 2) -> PEagle:
    """A P-EAGLE with random weights (and a shuffled draft vocab of `vocab` tokens; None: the whole vocabulary)."""
    return randomized(PEagle(base, num_depths=3, num_layers=layers, draft_vocab_size=vocab or base.vocab_size,
                             aux_layers=AUX, mask_token_id=7), vocab=vocab)


@pytest.mark.parametrize("vocab,layers", [(50, 2), (None, 1)])
def test_round_trip_equal_weights_and_logits(base, tmp_path, vocab, layers):
    d = drafter(base, vocab, layers)
    assert formats_of(d) == ["speculators"]
    out = export(d, "speculators", tmp_path / "s")
    assert detect(out) == "speculators" and describe(out)["target"] == "specdec.drafters.peagle.PEagle"
    back = load(out, base)
    assert isinstance(back, PEagle) and back.hparams == d.hparams
    mine, theirs = d.state_dict(), back.state_dict()
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    same_logits(d, back, base)


def test_config_and_tensors_are_what_speculators_and_vllm_read(base, tmp_path):
    """Against tests/fixtures/speculators_peagle.json (the files it names): every config key one of
    PEagleSpeculatorConfig's fields, of its type; the values ours differ from its defaults in written out; each
    tensor one of PEagleDraftModel's, of its shape and dtype, and every one it cannot do without present."""
    spec = json.loads(FIXTURE.read_text())
    d = drafter(base)
    out = export(d, "speculators", tmp_path / "s")
    cfg = json.loads((out / "config.json").read_text())
    fields = spec["config"]["fields"]
    assert set(cfg) <= set(fields), set(cfg) - set(fields)
    assert all(of_type(cfg[k], fields[k]["type"]) for k in cfg)
    assert all(cfg[k] == v for k, v in spec["config"]["values"].items())
    assert all(cfg.get(k) is not None for k in spec["config"]["required_by_vllm"])
    assert (cfg["mask_token_id"], cfg["draft_vocab_size"], cfg["eagle_aux_hidden_state_layer_ids"]) == (7, 50, AUX)
    assert cfg["norm_before_residual"] is False and cfg["embed_requires_grad"] is False  # (their defaults differ)
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] in spec["config"]["layer_model_types"] and layer["num_hidden_layers"] == 2
    assert set(spec["config"]["layer_keys"]) <= set(layer)
    sc = cfg["speculators_config"]
    assert set(sc) == set(spec["config"]["speculators_config"]) and sc["algorithm"] == spec["config"]["algorithm"]
    assert set(sc["verifier"]) == set(spec["config"]["verifier"])
    assert [set(m) for m in sc["proposal_methods"]] == [set(spec["config"]["proposal"])]
    assert all(of_type(sc["proposal_methods"][0][k], t) for k, t in spec["config"]["proposal"].items())
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3 and sc["default_proposal_method"] == "greedy"

    sizes = {"H": layer["hidden_size"], "I": layer["intermediate_size"], "V": layer["vocab_size"],
             "Vd": cfg["draft_vocab_size"], "Q": layer["num_attention_heads"] * layer["head_dim"],
             "KV": layer["num_key_value_heads"] * layer["head_dim"], "A": len(cfg["eagle_aux_hidden_state_layer_ids"])}
    flags = {"Vd != V": sizes["Vd"] != sizes["V"], "norm_before_fc": cfg["norm_before_fc"]}
    theirs = {k: t for k, t in spec["state_dict"]["tensors"].items() if flags.get(t.get("when"), True)}
    later = spec["state_dict"]["later_layers"]["tensors"]
    theirs |= {f"layers.{i}.{k}": t for i in range(1, layer["num_hidden_layers"]) for k, t in later.items()}
    ours = load_file(out / "model.safetensors")
    assert set(ours) <= set(theirs) - set(spec["state_dict"]["never_saved"]), set(ours) - set(theirs)
    assert set(theirs) - set(spec["state_dict"]["ignored_when_missing"]) <= set(ours)
    assert "mask_hidden" in ours  # (speculators loads without it; vLLM's parallel drafting refuses to)
    for name, t in ours.items():
        want = theirs[name]
        shape = [eval(dim, {}, sizes) if isinstance(dim, str) else dim for dim in want["shape"]]  # noqa: S307
        assert list(t.shape) == shape, name
        assert str(t.dtype).removeprefix("torch.") == want.get("dtype", str(t.dtype).removeprefix("torch.")), name
    assert torch.equal(ours["d2t"] + torch.arange(50), d.draft_vocab.tokens)
    whole = load_file(export(drafter(base, vocab=None), "speculators", tmp_path / "whole") / "model.safetensors")
    assert not {"d2t", "t2d"} & set(whole)  # the whole vocabulary: speculators' model has no maps then


def spoiled(src: Path, dst: Path, config: dict | None = None, tensors: dict | None = None, drop: str | None = None):
    """A copy of the export `src` with config keys replaced, tensors replaced or dropped, and no specdec.json (a
    checkpoint from elsewhere: what it declares decides)."""
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | (config or {})))
    t = load_file(src / "model.safetensors") | (tensors or {})
    save_file({k: v for k, v in t.items() if k != drop}, dst / "model.safetensors")
    return dst


def test_another_base_and_what_would_draft_otherwise_are_refused_on_load(base, tmp_path):
    out = export(drafter(base), "speculators", tmp_path / "s")
    with pytest.raises(CheckpointError, match="exported from another base"):
        load(out, tiny_base(num_layers=4, seed=1))
    assert (out / SPECDEC).exists()
    h = base.hidden_size
    cases = [
        ({"target_hidden_size": 64}, None, None, "reads hidden states of size 64, the base's are 32"),
        ({"mask_token_id": None}, None, None, "names no mask_token_id"),
        ({"mask_token_id": 259}, None, None, r"mask_token_id 259 is outside the base's vocabulary \[0, 259\)"),
        ({"norm_before_residual": True}, None, None, "norm_before_residual is set; specdec's P-EAGLE is EAGLE-3's"),
        ({"fc_norm": True}, None, None, "fc_norm is set"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, None, None, "three inner base layers"),
        (None, {"embed_tokens.weight": torch.zeros(base.vocab_size, h)}, None, "its embed_tokens are not the base's"),
        (None, {"mask_hidden": torch.zeros(1, 2 * h)}, None, r"tensor mask_hidden has shape \(1, 64\), expected"),
        (None, None, "mask_hidden", "tensor mask_hidden is missing"),
        (None, {"layers.2.mlp.up_proj.weight": torch.zeros(64, h)}, None,
         "tensor layers.2.mlp.up_proj.weight has no place in this base's 2-layer P-EAGLE"),
        (None, {"d2t": -torch.arange(50)}, None, "d2t does not map 50 draft indices onto distinct base tokens"),
    ]
    for i, (config, tensors, drop, message) in enumerate(cases):
        with pytest.raises(CheckpointError, match=message) as e:
            load(spoiled(out, tmp_path / f"x{i}", config, tensors, drop), base)
        assert "\n" not in str(e.value)
    # vLLM views mask_hidden as [1, 3H]: a checkpoint that stores it so reads the same
    hidden = load_file(out / "model.safetensors")["mask_hidden"]  # [1, 1, 3H]
    flat = spoiled(out, tmp_path / "flat", tensors={"mask_hidden": hidden[0]})
    assert torch.equal(load(flat, base).mask_hidden, load(out, base).mask_hidden)


def test_the_command_line_exports_a_trained_checkpoint(base, tmp_path, monkeypatch, capsys):
    import specdec.export.__main__ as cli

    monkeypatch.setattr(cli, "load_base", lambda name, device: base)  # (the tiny base has no name to load it by)
    d = drafter(base)
    save_drafter(d, tmp_path / "ckpt")
    assert cli.main([str(tmp_path / "ckpt"), "--to", "speculators", "--out", str(tmp_path / "out")]) == 0
    assert "vLLM" in capsys.readouterr().out
    same_logits(d, load(tmp_path / "out", base), base)
    assert cli.main([str(tmp_path / "ckpt"), "--to", "sglang", "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "specdec.export: a peagle drafter has no sglang form; its formats: speculators"
