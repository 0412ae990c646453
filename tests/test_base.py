import inspect

import pytest
import torch
from torch import nn

from specdec.base import LAST, cache_arg, load_base, smollm2_gguf_path, tiny_base


def test_tiny_base_is_frozen_and_deterministic():
    a, b = tiny_base(seed=3), tiny_base(seed=3)
    assert not any(p.requires_grad for p in a.model.parameters())
    assert not a.model.training
    assert a.fingerprint() == b.fingerprint() != tiny_base(seed=4).fingerprint()


def test_features_expose_layers_and_logits(tiny):
    x = torch.randint(0, tiny.vocab_size, (2, 7))
    f = tiny.features(x, layers=(0, 1, tiny.num_layers, LAST))
    assert f.logits.shape == (2, 7, tiny.vocab_size)
    torch.testing.assert_close(f.hidden[0], tiny.embed_tokens(x))
    torch.testing.assert_close(tiny.lm_head(f.hidden[LAST]), f.logits)  # LAST is the normed final state
    # block outputs via the adapter's own parts equal HF's hidden states
    h = tiny.embed_tokens(x)
    pos = torch.arange(7)[None]
    cos_sin = tiny.rotary_emb(h, pos)
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    h = tiny.layers[0](h, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    torch.testing.assert_close(h, f.hidden[1], atol=1e-5, rtol=1e-5)


def test_fingerprint_ignores_precision(tiny):
    bf16 = tiny_base(dtype="bfloat16")
    assert bf16.fingerprint()["weights_sha256"] == tiny.fingerprint()["weights_sha256"]


@pytest.mark.slow
def test_smollm2_loads_from_package_and_continues_coherently():
    assert smollm2_gguf_path().name.endswith(".gguf")
    base = load_base(device="cpu")  # first call dequantises the GGUF into ~/.cache/specdec, later calls read it
    fp = base.fingerprint()
    assert (fp["architecture"], fp["num_layers"], fp["hidden_size"], fp["vocab_size"]) == ("LlamaForCausalLM", 30, 576, 49152)
    tok = base.tokenizer
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    # greedy continuation through the HF cache ...
    out = base.model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    # ... equals greedy continuation by full no-cache forwards
    seq = ids
    for _ in range(8):
        nxt = base(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert seq[0, ids.shape[1]:].tolist() == out.tolist()
    assert "Paris" in tok.decode(out)


def test_cache_arg_follows_each_forwards_own_name(tiny):
    """The KV cache goes in under the name the installed transformers gives it (`cache` in 5.x, `past_key_values`
    before), read per class: the tiny base's layers take theirs, a module that still says past_key_values gets that."""
    class Old(nn.Module):
        def forward(self, x, past_key_values=None):
            return x

    layer = tiny.layers[0]
    (name,) = cache_arg(layer, "c")
    assert name in inspect.signature(type(layer).forward).parameters
    assert cache_arg(Old(), "c") == {"past_key_values": "c"}
