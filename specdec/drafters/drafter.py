"""The one interface every drafter family implements: towards training (logits from base features) and
towards the sampler (logits for the children of draft-tree nodes). A new family is one file that
subclasses `Drafter` plus one yaml; the LightningModule and the sampler never special-case a family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
from torch import nn

from specdec.base import LAST, Base, Features


@dataclass
class TrainOutput:
    # [B, T, K, V]: entry j at position t predicts token t + 1 + target_offsets[j]; its target distribution is
    # the base's next-token distribution at position t + target_offsets[j] (teacher-forced on the data).
    logits: torch.Tensor
    aux_loss: torch.Tensor | None = None  # family-specific extra term (e.g. feature regression), already weighted
    aux_metrics: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class ChainParts:
    """What a feature drafter's depth is made of: the token embeddings [V, H], the embedding's RMSNorm, fc [H, 2H]
    over [ĥ; norm(emb)], the decoder layers, the final RMSNorm (-> ĥ), the vocab head [V_d, H] and the draft vocab's
    base token ids [V_d] (None without one)."""

    embed: torch.Tensor
    emb_norm: nn.Module
    fc: nn.Linear
    blocks: nn.ModuleList
    norm: nn.Module
    head: nn.Linear
    vocab: torch.Tensor | None


@dataclass(frozen=True)
class HeadParts:
    """One Hydra head as chain.c runs it: the norm of its path's embeddings, in_proj over [h; the normed embeddings],
    the linears of its residual blocks (x + SiLU(W x + b)) and its vocab head [V_d, H]."""

    emb_norm: nn.Module
    in_proj: nn.Linear
    blocks: list[nn.Linear]
    head: nn.Linear


class DraftContext(Protocol):
    """Handed by the sampler to `observe` and `expand`. It owns every KV cache, attention mask and rotary
    position, so drafters with attention (early exit, prophet) only compose decoder layers.

    A round = the base's newest token (the root, node 0) plus the draft nodes registered by successive
    `expand` calls; node i sits at position L_b + depth(i) of row b, where L_b is the row's committed length.
    """

    # The deepest depth a round's draft reaches (the sampler's chain length or tree depth, the same every round): what
    # a block drafter sizes its one pass by, whichever way the round is drafted.
    draft_depth: int

    def run_layers(
        self, layers: Sequence[nn.Module], hidden: torch.Tensor, store: str = "base", position_offset: int = 0
    ) -> torch.Tensor:
        """Run HF decoder layers (the base's own, or the drafter's built from the base config) over `hidden`
        [B, n, H] for the query layout of the current call, and return [B, n, H]:
        - in `observe`: the n newly committed positions of each row (slots = positions; rows past n_new are
          padding and write nothing that is ever attended);
        - in `expand`: the N frontier nodes (slot L_b + node index, position L_b + depth), attending to the
          committed prefix of `store` and to their own ancestors (themselves included) in the round.
        `store="base"` is the base's own cache (keyed by each layer's `self_attn.layer_idx`), which the
        sampler's verify forward also writes; any other name is a drafter-private cache of the same layout.
        `position_offset` shifts the rotary positions (a drafter whose entry for token t+1 sits at t uses -1)."""
        ...

    def write_keys(self, layers: Sequence[nn.Module], hidden: torch.Tensor, store: str,
                   position_offset: int = 0) -> None:
        """Write each layer's attention keys and values of hidden [B, n, H] (its k_proj / v_proj over hidden as it is,
        no input norm; keys rotated at the layout's positions) into `store` at the current layout's slots, without
        running a query: context that later queries of the store attend to (a block drafter's base features)."""
        ...

    def block_layout(self, n: int) -> None:
        """In `expand`: lay the call out over the round's first n slots (the root's, then n − 1
        after it, at depths 0 .. n − 1), each query seeing the committed prefix and all n: a block in one pass."""
        ...

    def commit_layout(self, n: int) -> None:
        """In `observe`: lay the call out over n positions after each row's committed prefix, causal (the sampler
        lays out the newly committed ones before calling `observe`). A drafter that also writes the entry of the
        next round's root, in the same pass, asks for one more: slot L_b + n_new_b is then index n_new_b of row b."""
        ...

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small host tensor (a tree's node indices) on the sampler's device, copied once per distinct value: a
        copy from host memory makes the host wait for the GPU's queue, and cannot be recorded in a CUDA graph."""
        ...

    def run_model(self, model: nn.Module, input_ids: torch.Tensor, store: str) -> torch.Tensor:
        """Run a whole HF decoder stack (e.g. a `LlamaModel`: its own embeddings, rotary and final norm, so any
        architecture works) over input_ids [B, m] on the drafter-private `store`, and return its last hidden state
        [B, m, H']. The m tokens are the LAST m queries of the current layout (see `run_layers`); the earlier ones
        are already in the store (a draft model skips committed tokens it ran while drafting)."""
        ...

    def feature_chain(self, drafter: nn.Module, parts: ChainParts, root: torch.Tensor, gamma: int, store: str,
                      position_offset: int, stop: float = 0.0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A feature drafter's greedy chain of γ tokens from its root entry's layer output root [1, 1, H], as its
        `expand` calls would draft it depth by depth, in one call where the sampler's engine has one -> (tokens
        [1, γ] base ids, each depth's ĥ [1, γ, H]); None: draft it depth by depth. With stop > 0 (an adaptive draft
        length) the chain ends after its first token whose top-1 probability is < stop: [1, d] and [1, d, H], d ≤ γ."""
        ...

    def feature_entries(self, drafter: nn.Module, parts: ChainParts, features: torch.Tensor, tokens: torch.Tensor,
                        store: str, position_offset: int, otherwise: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A feature drafter's real entries in the current layout: otherwise() (its run_layers over its step inputs)
        -> [1, n, H], or the same in one call where the engine has one and that measures faster."""
        ...

    def head_chain(self, drafter: nn.Module, heads: list[HeadParts], embed: torch.Tensor, vocab: torch.Tensor | None,
                   h: torch.Tensor, root: torch.Tensor, top: int = 1) -> torch.Tensor | None:
        """Hydra's greedy chain of len(heads) tokens from its newest base feature h [1, H] and the root [1], in one
        call where the engine has one -> tokens [1, γ − 1 + top]; None: draft it head by head."""
        ...


class Drafter(nn.Module):
    """Base class. Subclasses set `target_offsets`, `head_names`, and implement the methods below.

    Parameters of the frozen base are never registered inside a drafter (keep references with `_frozen`),
    so `state_dict()` holds only what was trained.
    """

    feature_layers: tuple[int, ...] = (LAST,)  # keys of Features.hidden the drafter reads
    target_offsets: list[int]
    head_names: list[str]  # one metric name per training entry, e.g. ["head1", "head2"]
    aux_metric_names: tuple[str, ...] = ()  # keys of TrainOutput.aux_metrics (logged as train/<name>, val/<name>)
    max_depth: int | None = None  # deepest draft depth it supports (Medusa: num_heads); None = unbounded
    # Its `expand` is device ops alone for a given tree: no host reads of device values, host tensors reach the device
    # only through ctx.on_device, and its round state is tensors and NodeTables. Then a greedy static-tree draft may be
    # recorded whole as one CUDA graph (specdec/engines/cuda/draft_graph.py).
    graph_draft: bool = False
    # Its `observe` and `expand` run layers through the context (run_layers / run_model), so the sampler lays out their
    # queries first (commit_layout, tree_layout). False: they only read features and tokens (Medusa, Hydra), and the
    # sampler skips the layouts (~50 µs a round on a 2-core CPU, where each small op after a forward runs cold).
    runs_layers: bool = True
    # Whether `observe` reads feats.logits, the base's logits at the committed positions. False (every family here):
    # the sampler does not gather them (~40 µs a round on a 2-core CPU) and passes None, as after a greedy verify that
    # took the argmax without logits.
    reads_logits: bool = False
    # Whether `expand` at a node is a function of the node's path tokens alone (given what `observe` committed): its
    # stores at a node's ancestors hold only what expanding those ancestors' tokens wrote, and it reads no per-node
    # state of its parent's expand (a NodeTable) and no per-depth part (a head per depth). Then a node and the nodes
    # after it may be expanded in one call as a chain of any depths, and staged drafting (sampler.stage_lookup,
    # trees._greedy_chain) checks proposed tokens in one pass of it.
    drafts_from_tokens: bool = False

    def __init__(self, base: Base, **hparams: Any):
        super().__init__()
        self.hparams = hparams  # constructor kwargs, saved with checkpoints to rebuild the drafter
        self._frozen = {"base": base}  # a dict is not an nn.Module attribute: nothing of the base is registered
        self.draft_vocab: DraftVocab | None = None  # families with a reduced draft vocabulary set one

    @property
    def base(self) -> Base:
        return self._frozen["base"]

    def set_draft_vocab(self, tokens: torch.Tensor) -> None:
        """Called by train() with the most frequent tokens of the data (families with a draft vocab); trainable
        vocab projections (`vocab_heads`) restart from the base lm_head's rows of those tokens."""
        self.draft_vocab.set(tokens)
        for lm in self.vocab_heads():
            lm.weight.data.copy_(self.draft_vocab.rows(self.base.lm_head.weight.detach()))

    def vocab_heads(self) -> list[nn.Linear]:
        """The drafter's own trainable vocab projections (own_lm_head), if any."""
        return []

    def project(self, z: torch.Tensor, own: nn.Linear | None = None) -> torch.Tensor:
        """Features [..., H] -> draft logits [..., V_d]: through `own` (a trainable projection) when given, else the
        base's frozen lm_head, restricted to the draft vocab when there is one (V_d = V without)."""
        if own is not None:
            return own(z)
        return self.base.lm_head(z) if self.draft_vocab is None else self.draft_vocab.head(z)

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_d] -> [..., V] (−inf off the draft vocab): what the sampler samples from."""
        return logits if self.draft_vocab is None else self.draft_vocab.to_base(logits)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the draft logits [...] -> base token ids [...] (the same without a draft vocab)."""
        return index if self.draft_vocab is None else self.draft_vocab.tokens[index]

    # -- training ----------------------------------------------------------------------------
    def forward_train(self, feats: Features, input_ids: torch.Tensor) -> TrainOutput:
        """feats: frozen base features of input_ids [B, T]; returns draft logits for every training entry."""
        raise NotImplementedError

    def expected_tau(self, accept: torch.Tensor) -> torch.Tensor:
        """Predicted mean accepted length (bonus included) from per-entry expected acceptance `accept` [K],
        for a chain that drafts entry k at depth k: τ = 1 + Σ_k Π_{j≤k} α_j (docs/sampler.md §4)."""
        return 1 + torch.cumprod(accept, 0).sum()

    # -- sampling ----------------------------------------------------------------------------
    def init_state(self, batch_size: int, max_len: int) -> Any:
        """Per-generation scratch state (e.g. the last base feature of each row)."""
        return {}

    def skip_round(self, state: Any) -> None:
        """The sampler proposed this round without the drafter (n-gram lookup): `expand` did not run, so the next
        `observe` may not rely on anything expand writes (a drafter that keeps its drafts' keys re-reads them)."""

    def observe(
        self, state: Any, ctx: DraftContext, feats: Features, tokens: torch.Tensor, n_new: torch.Tensor,
        next_token: torch.Tensor,
    ) -> None:
        """Called after the prefill and after every verify with the base features of the newly committed
        positions: feats.hidden[l] [B, n, H] for l in feature_layers, feats.logits [B, n, V] the base's logits
        there after a verify for a drafter that sets `reads_logits` (None otherwise, after the prefill, where a
        prompt-long lm_head is not paid for, and after a greedy verify that took the base's argmax without its logits:
        the engine's argmax shortlist), tokens [B, n] at those positions, n_new [B] how many of the n are valid per
        row (ragged acceptance; the rest is padding; the longest row's are all n: one row has no padding), and
        next_token [B] the base's newly emitted token that follows them (the next round's root)."""
        raise NotImplementedError

    def expand(
        self, state: Any, ctx: DraftContext, tokens: torch.Tensor, parents: torch.Tensor, depth: int,
        nodes: torch.Tensor,
    ) -> torch.Tensor:
        """Draft logits [B, N, V_d] for the children of N frontier nodes at `depth` (0 = the root), over the
        drafter's draft vocab (V_d = V without one). tokens [B, N] are the nodes' tokens, nodes [N] their node
        indices in the round (root = 0; the sampler numbers every node, unexpanded leaves included), parents [N]
        their parents' node indices (-1 for the root); the tree shape is shared by all rows. Raw logits: the
        sampler picks top-k among them and maps the picks with `token_ids` (a top-k over V_d, not over V with −inf
        almost everywhere), or samples from `full_vocab` of them after temperature/top-k/top-p, so the reported q
        and the drafted token always agree."""
        raise NotImplementedError

    def greedy_chain(self, state: Any, ctx: DraftContext, root: torch.Tensor, gamma: int,
                     top: int = 1) -> torch.Tensor | None:
        """A greedy chain's γ drafted tokens [B, γ] (base ids) from the round's root tokens root [B], in one go, each
        the top-1 of what `expand` would give at that depth, its stores left as those `expand` calls would leave them
        and its state as the next `observe` needs it (what only a later `expand` of the round would read may be left
        out: none follows), for a drafter whose engine runs its whole chain in one native call (the prophet, Hydra:
        specdec/engines/cpu/native_chain.py). With top > 1, the tree of a chain that fans out at its end
        (trees.StaticTree.fan): [B, γ − 1 + top], the last depth's `top` best tokens, best first, in place of its
        top-1. None (the default, or where the engine does not take it this round): the sampler expands the chain
        depth by depth, `expand` being the one statement of the drafter's math."""
        return None

    def adaptive_chain(self, state: Any, ctx: DraftContext, root: torch.Tensor, gamma: int,
                       stop: float) -> torch.Tensor | None:
        """`greedy_chain` under an adaptive draft length (sampling/adaptive.py): the chain ends after its first token
        whose top-1 probability is < stop, as trees.draft_static's depth-by-depth loop would end it -> tokens [B, d],
        d ≤ γ, the deeper depths never run. None (the default, or where it cannot this round): the sampler drafts it
        depth by depth."""
        return None

    # -- drafters with nothing to train by gradient ---------------------------------------------
    calibration_metrics: tuple[str, ...] = ()  # the metric names `calibrate` returns (what a sweep may optimise)

    def calibrate(self, blocks: Iterable[torch.Tensor], log: Callable[[dict[str, float], int], None],
                  probe: Any = None) -> tuple[dict[str, float], dict[str, Any]]:
        """train.py calls this instead of gradient training when the drafter has no trainable parameters: fit its
        discrete settings (the layer-skip set) on validation token blocks [T] of the data, reporting progress with
        log(metrics, step) and measuring through `probe` (specdec.calibration.SamplerProbe: verify times, acceptance,
        draft times on the sampler and engine evaluate.py runs). Returns the final metrics (val/...) and a JSON-able
        record of how they were found."""
        raise NotImplementedError(f"{type(self).__name__} has no trainable parameters and nothing to calibrate")

    def hf_assistant(self) -> nn.Module | None:
        """The drafter as an HF `PreTrainedModel` for `generate(assistant_model=...)` (the hf_assisted peer), when
        it is one (a standalone draft model); None otherwise."""
        return None


class DraftVocab(nn.Module):
    """EAGLE-3's reduced draft vocabulary: a drafter scores only `size` base tokens (the most frequent of its
    training data), a [size, H] projection instead of [V, H]. The sampler still gets full-vocab logits, −inf off
    the subset: q is 0 there, so verification stays lossless. `tokens` is set from the data by train() and is
    saved with the drafter."""

    def __init__(self, base: Base, size: int):
        super().__init__()
        if not 0 < size <= base.vocab_size:
            raise ValueError(f"draft_vocab_size must be in (0, {base.vocab_size}], got {size}")
        self.size, self.vocab_size = size, base.vocab_size
        self._frozen = {"lm_head": base.lm_head}
        self.register_buffer("tokens", torch.arange(size, device=base.device))  # [size] base token ids, sorted
        # The base lm_head's rows of the draft vocab as a frozen nn.Linear [size, H]: a module (so the sampler's
        # measured CPU kernels apply to it) whose weight is a non-persistent buffer (nothing trained, nothing
        # saved); rebuilt whenever `tokens` changes (set() or a checkpoint load).
        self.head = nn.Linear(base.hidden_size, size, bias=False, device=base.device, dtype=base.dtype)
        del self.head.weight
        self.head.register_buffer("weight", self.rows(base.lm_head.weight.detach()), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, _keys: module._refresh_head())

    def set(self, tokens: torch.Tensor) -> None:
        self.tokens.copy_(tokens.sort().values)
        self._refresh_head()

    @torch.no_grad()
    def _refresh_head(self) -> None:
        self.head.weight.copy_(self.rows(self._frozen["lm_head"].weight.detach()))

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        """A full-vocab matrix [V, ...] -> its draft-vocab rows [size, ...]."""
        return weight[self.tokens.to(weight.device)]

    def to_base(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., size] -> [..., V] with −inf off the draft vocab."""
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.tokens, logits)

    def from_base(self, ids: torch.Tensor) -> torch.Tensor:
        """Base token ids [...] -> draft indices [...], −1 for tokens outside the draft vocab."""
        table = torch.full((self.vocab_size,), -1, dtype=torch.long, device=ids.device)
        table[self.tokens] = torch.arange(self.size, device=ids.device)
        return table[ids]


class NodeTable:
    """Per-node tensors of one draft round ([B, C, ...], row i = node i), for drafters whose `expand` needs
    what was computed for a node's parent (Hydra's token paths, the prophet's predicted features)."""

    def __init__(self):
        self.rows: torch.Tensor | None = None
        self.count = 0  # highest node index stored + 1

    @classmethod
    def of(cls, rows: torch.Tensor) -> NodeTable:
        """A table holding rows [B, N, ...] at nodes 0 .. N-1 (a chain's, drafted in one go)."""
        table = cls()
        table.rows, table.count = rows, rows.shape[1]
        return table

    def get(self, index: torch.Tensor, ctx: DraftContext) -> torch.Tensor:
        """Rows at node indices index [N] (host) -> [B, N, ...]."""
        if self.rows is None or int(index.max()) >= self.count:
            raise IndexError(f"node {int(index.max())} was never expanded in this round ({self.count} known)")
        return self.rows[:, ctx.on_device(index)]

    def put(self, rows: torch.Tensor, nodes: torch.Tensor, ctx: DraftContext) -> None:
        """Store rows [B, N, ...] at node indices nodes [N] (host)."""
        need = int(nodes.max()) + 1
        if self.rows is None or self.rows.shape[1] < need:
            grown = rows.new_zeros(rows.shape[0], need, *rows.shape[2:])
            if self.rows is not None:
                grown[:, : self.rows.shape[1]] = self.rows
            self.rows = grown
        self.rows[:, ctx.on_device(nodes)] = rows
        self.count = max(self.count, need)


def unroll_mask(t: int, step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The additive attention mask of a feature drafter's training unroll over T positions (the prophet's, EAGLE-3's
    training-time test), keys laid out as [sink + step 0's T entries | step 1's T | … | step `step`'s T]:
    step 0 is causal over the sink and the real entries -> [T+1, T+1]; at step j ≥ 1 the chain at t sees step 0's
    slots 0..t+1 (the sink and the real entries ≤ t) and its own key in each of the steps 1..j -> [T, T+1 + j·T]."""
    if step == 0:
        allowed = torch.ones(t + 1, t + 1, dtype=torch.bool, device=device).tril()
    else:
        real = torch.ones(t, t + 1, dtype=torch.bool, device=device).tril(diagonal=1)  # [T, T+1]
        own = torch.eye(t, dtype=torch.bool, device=device)  # [T, T]: one key per chain per step
        allowed = torch.cat([real] + [own] * step, dim=1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)


def newest(h: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
    """h [B, n, ...] (an `observe`'s features) at each row's newest committed position n_new - 1 -> [B, ...]. One row
    has no padding (`observe`'s contract): its last, a view, where the index is three ops (~15 µs a round on a 2-core
    CPU right after a verify has streamed the base through the caches)."""
    if h.shape[0] == 1:
        return h[:, -1]
    return h[torch.arange(h.shape[0], device=h.device), n_new - 1]


def copy_lm_head(base: Base, rows: int | None = None) -> nn.Linear:
    """A trainable vocab projection initialised from the base lm_head (for drafters with `own_lm_head`); with
    `rows`, a draft-vocab projection whose weights `DraftVocab`'s owner copies in once the tokens are known."""
    head = nn.Linear(base.hidden_size, rows or base.vocab_size, bias=False, device=base.device, dtype=base.dtype)
    head.weight.data.copy_(base.lm_head.weight.detach()[: head.out_features])
    return head
