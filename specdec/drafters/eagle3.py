"""EAGLE-3 (Li et al. 2025), as the serving engines load it: one decoder layer over the fusion of three base layers,
a reduced draft vocabulary, trained by training-time test (TTT) with no feature loss.

- Real entry for base position t: g_t = fc([a^{low}_t; a^{mid}_t; a^{high}_t]) (3H -> H, no bias), a^l the input of
  base layer l (HF hidden_states[l]; layers 2, L//2 and L-3 by default, as EAGLE, vLLM, speculators and llama.cpp take
  them), paired with the embedding of x_{t+1}.
- The layer: residual g; attention over cat(input_layernorm(emb(x)), hidden_norm(g)) (q, k, v read 2H); then g' =
  g + attn, out = g' + mlp(post_attention_layernorm(g')). `out` (before any norm) is the next step's g; the logits are
  lm_head(norm(out)) over the draft vocab (its d2t / t2d maps are the DraftVocab's tokens).
- EAGLE-3.1's two switches (speculators' `fc_norm` and `norm_output`, which vLLM reads under the same names; both off
  is EAGLE-3): `fc_norm` puts an RMSNorm of its own on each fused layer before fc, g_t = fc([n_1(a^{low}_t);
  n_2(a^{mid}_t); n_3(a^{high}_t)]); `norm_output` makes norm(out), the logits' input, the next step's g in place of
  `out`, so that the magnitude a step reads does not drift with depth.
- TTT: k unrolled steps (FeatureDrafter.unroll); step j at t reads its own step j-1 output at t with the token
  x_{t+j+1} (the data's, teacher forced), attends to the real entries ≤ t and to its chain's earlier steps (one key
  per step: the diagonal), and is scored against the base's distribution of x_{t+j+2}, weighted 0.8^j (the trainer's
  head_decay).

Layout, sink entry and sampling: the prophet's (specdec/drafters/feature.py). The token embeddings are the base's,
frozen; the draft lm_head is the drafter's own, starting from the base's rows, and the layer starts as a copy of the
base layer whose input is the highest fused one (`_init_from_base`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specdec.base import Base, Features, cache_arg
from specdec.drafters.drafter import DraftVocab, TrainOutput, copy_lm_head
from specdec.drafters.feature import FeatureDrafter

STORE = "eagle3"  # the drafter-private KV store in the sampler's DraftContext


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers: the inputs of layers 2, L//2 and L-3 (SmolLM2-135M: 2, 15, 27), each
    kept inside (0, L) for a base of fewer than six layers (a tiny test model)."""
    return sorted(min(max(l, 1), num_layers - 1) for l in (2, num_layers // 2, num_layers - 3))


class Eagle3Layer(nn.Module):
    """One EAGLE-3 decoder layer, assembled from the base's own decoder-layer modules (attention, MLP, norms) with
    q/k/v widened to read 2H. Its forward takes x = cat(emb(x), g) [B, n, 2H] raw: how the layer normalises each half
    and which half is the residual is its own, so the sampler's `run_layers` can run it like any layer."""

    def __init__(self, base: Base, layer_idx: int = 0):
        super().__init__()
        config, h = base.config, base.hidden_size
        layer = type(base.layers[0])(config, layer_idx=layer_idx)
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.input_layernorm = type(base.norm)(h, eps=config.rms_norm_eps)  # on the token embedding
        self.hidden_norm = type(base.norm)(h, eps=config.rms_norm_eps)  # on the feature g
        self.post_attention_layernorm = type(base.norm)(h, eps=config.rms_norm_eps)
        self.hidden_size = h

    def forward(self, x: torch.Tensor, attention_mask=None, position_ids=None, position_embeddings=None,
                cache=None, past_key_values=None, use_cache: bool = True, **_: Any) -> torch.Tensor:
        emb, g = x[..., : self.hidden_size], x[..., self.hidden_size:]  # [B, n, H] each
        a = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)  # [B, n, 2H]
        attn = self.self_attn(hidden_states=a, attention_mask=attention_mask, position_ids=position_ids,
                              position_embeddings=position_embeddings,
                              **cache_arg(self.self_attn, cache if cache is not None else past_key_values))
        g = g + (attn[0] if isinstance(attn, tuple) else attn)
        return g + self.mlp(self.post_attention_layernorm(g))  # [B, n, H], before the final norm


class Eagle3(FeatureDrafter):
    store = STORE

    def __init__(self, base: Base, ttt_steps: int = 7, draft_vocab_size: int | None = 8192,
                 aux_layers: list[int] | None = None, fc_norm: bool = False, norm_output: bool = False):
        aux_layers = [int(l) for l in aux_layers] if aux_layers else default_aux_layers(base.num_layers)
        draft_vocab_size = min(draft_vocab_size or base.vocab_size, base.vocab_size)
        super().__init__(base, ttt_steps=ttt_steps, draft_vocab_size=draft_vocab_size, aux_layers=aux_layers,
                         fc_norm=bool(fc_norm), norm_output=bool(norm_output))
        if len(aux_layers) != 3 or any(not 0 < l < base.num_layers for l in aux_layers):
            raise ValueError(f"eagle3 fuses three inner base layers in (0, {base.num_layers}), got {aux_layers}")
        h = base.hidden_size
        self.aux_layers = aux_layers
        self.feature_layers = tuple(aux_layers)
        self.fc = nn.Linear(3 * h, h, bias=False)
        # one norm per fused layer, low to high (state-dict names fc_norm.{0,1,2}.weight, as speculators and vLLM
        # name them); None: EAGLE-3
        self.fc_norm = (nn.ModuleList(type(base.norm)(h, eps=base.config.rms_norm_eps) for _ in aux_layers)
                        if fc_norm else None)
        self.norm_output = bool(norm_output)
        self.layers = nn.ModuleList([Eagle3Layer(base)])
        self.norm = type(base.norm)(h, eps=base.config.rms_norm_eps)
        self.draft_vocab = DraftVocab(base, draft_vocab_size)
        self.lm_head = copy_lm_head(base, draft_vocab_size)  # rows set from the base's with the vocab (set_draft_vocab)
        self.norm.weight.data.copy_(base.norm.weight.detach())
        self._init_from_base()
        self.to(device=base.device, dtype=base.dtype)
        self.ttt_steps = ttt_steps
        self.target_offsets = list(range(1, ttt_steps + 1))
        self.head_names = [f"step{j}" for j in range(1, ttt_steps + 1)]
        self.max_depth = None

    @torch.no_grad()
    def _init_from_base(self) -> None:
        """A fresh drafter starts as the base's own layer `aux_layers[-1]` run on the highest fused layer: fc passes
        a^{high} through (its third of the input), the layer's g-half of q/k/v, o_proj, MLP and norms are that base
        layer's, and the token half of q/k/v starts at zero. Step 0 then computes about what the base computes next
        from a^{high} (its attention reads the drafter's own keys, one per committed position, as the base layer
        does, plus the zero sink), so with a^{high} the input of the base's last layer its logits start near the
        base's own next-token distribution: the starting point of the prophet's identity initialisation, and of
        the draft model's copied layers. From random weights a short run leaves EAGLE-3 well behind the prophet;
        from this start it ties the prophet at 600 steps (experiments/pages/eagle3_vs_prophet.md).
        Only the starting point: the architecture and what an engine loads are EAGLE-3's. With `fc_norm` (its
        weights start at one) fc passes a^{high} scaled to unit RMS, so the start is only near the base's."""
        h = self.fc.out_features
        src = self.base.layers[self.aux_layers[-1]]
        layer = self.layers[0]
        self.fc.weight.zero_()
        self.fc.weight[:, 2 * h :].copy_(torch.eye(h))
        for name in ("q_proj", "k_proj", "v_proj"):
            mine, theirs = getattr(layer.self_attn, name), getattr(src.self_attn, name)
            mine.weight.zero_()
            mine.weight[:, h:].copy_(theirs.weight)  # [out, 2H]: the emb half, then the g half
            if mine.bias is not None:
                mine.bias.copy_(theirs.bias)
        layer.self_attn.o_proj.load_state_dict(src.self_attn.o_proj.state_dict())
        layer.mlp.load_state_dict(src.mlp.state_dict())
        layer.hidden_norm.load_state_dict(src.input_layernorm.state_dict())
        layer.post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())

    # -- pieces shared by training and sampling ----------------------------------------------------------------
    def real_feature(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The base's hidden states {layer: [..., H]} -> g [..., H], fc over the three layers, low to high (each
        through its own fc_norm first where there is one)."""
        parts = [hidden[l] for l in self.aux_layers]
        if self.fc_norm is not None:
            parts = [norm(a) for norm, a in zip(self.fc_norm, parts)]
        return self.fc(torch.cat(parts, dim=-1))

    def step_input(self, g: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """g [..., H] of position t (real or the layer's own output) and emb(x_{t+1}) [..., H] -> [..., 2H]."""
        return torch.cat([token_emb, g], dim=-1)

    def vocab_heads(self) -> list[nn.Linear]:
        return [self.lm_head]

    def readout(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output [..., H] -> (the next step's g [..., H], draft logits [..., V_d]). g is `out` itself, or
        with `norm_output` norm(out), the logits' own input."""
        normed = self.norm(out)
        return (normed if self.norm_output else out), self.lm_head(normed)

    # -- training ----------------------------------------------------------------------------------------------
    def forward_train(self, feats: Features, input_ids: torch.Tensor) -> TrainOutput:
        return TrainOutput(logits=self.unroll(self.real_feature(feats.hidden), input_ids, self.ttt_steps))

    def unroll(self, g: torch.Tensor, input_ids: torch.Tensor, steps: int) -> torch.Tensor:
        """Training-time test: g [B, T, H] real features, input_ids [B, T] -> logits [B, T, steps, V_d] (step j at t
        predicts x_{t+j+2}), every step after the first on the layer's own previous output."""
        return super().unroll(g, input_ids, steps)[0]

    # -- the maps serving engines read ---------------------------------------------------------------------------
    def d2t(self) -> torch.Tensor:
        """[V_d] int64 offsets: base id of draft index i = i + d2t[i] (EAGLE-3's convention)."""
        tokens = self.draft_vocab.tokens
        return tokens - torch.arange(len(tokens), device=tokens.device)

    def t2d(self) -> torch.Tensor:
        """[V] bool: which base tokens the draft vocab holds."""
        mask = torch.zeros(self.base.vocab_size, dtype=torch.bool, device=self.draft_vocab.tokens.device)
        mask[self.draft_vocab.tokens] = True
        return mask
