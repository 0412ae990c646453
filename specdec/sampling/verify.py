"""Acceptance rules over a draft tree (a chain is a tree with one child per node), vectorised over rows.

Every rule returns `best` [B] (the deepest accepted node; 0 = the root, nothing accepted) and `bonus` [B] (the
token the base emits after it). p = the base's post-processed distribution, q = the draft's (docs/sampler.md §1-§2)."""

from __future__ import annotations

from typing import Callable

import torch

Uniform = Callable[[], torch.Tensor]  # draws one U(0,1) per row: [B]


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Raw logits [..., V] -> the probabilities we sample from: temperature, then top-k, then top-p (float32)."""
    z = logits.float() / temperature
    if top_k > 0 and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        z = z.masked_fill(_outside_top_p(z, top_p), float("-inf"))
    return z.softmax(-1)


def _outside_top_p(z: torch.Tensor, top_p: float, k: int = 256) -> torch.Tensor:
    """Where z [..., V] falls outside the nucleus: a token is dropped when the tokens ranked above it already cover
    top_p (the first one always stays). The nucleus is found among the k most likely tokens, and only rows whose k
    do not cover top_p sort their whole vocabulary: sorting 49,152 logits for every row cost sampled distillation
    at 64 rows more than the base's decode step itself."""
    p = z.softmax(-1)
    top_p_, order = p.topk(min(k, p.shape[-1]), dim=-1)  # [..., k], descending
    drop = (top_p_.cumsum(-1) - top_p_) >= top_p
    out = torch.ones_like(p, dtype=torch.bool).scatter_(-1, order, drop)
    short = top_p_.sum(-1) < top_p  # [...]: the k most likely do not cover top_p
    if bool(short.any()):
        sorted_p, full = p[short].sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        out[short] = drop.scatter(-1, full, drop)
    return out


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [B, V] (need not be normalised), u [B] in [0, 1) -> tokens [B]."""
    cdf = probs.cumsum(-1)
    x = (cdf <= u[:, None] * cdf[:, -1:]).sum(-1)  # first index whose cdf passes the threshold
    return x.clamp(max=probs.shape[-1] - 1)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim; where p == q numerically (nothing left) fall back to p."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def accept_probability(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) for p, q [B, V], x [B]."""
    px, qx = p.gather(-1, x[:, None])[:, 0], q.gather(-1, x[:, None])[:, 0]
    return (px / qx).clamp(max=1.0)


def _deepest(ok: torch.Tensor, ancestors: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """ok [B, N]: node passes its own test. A node is accepted when it and all its ancestors pass; return the
    deepest accepted node per row, ties to the lower index (the higher-ranked sibling)."""
    n = ok.shape[1]
    accepted = ~((~ok)[:, None, :] & ancestors[None]).any(-1)  # [B, N]
    key = depth[None] * (n + 1) + (n - torch.arange(n, device=ok.device))[None]  # [1, N]
    return torch.where(accepted, key, -1).argmax(-1)  # [B]


def greedy_paths(target: list[list[int]], tokens: list[list[int]], parents: list[int],
                 present: list[list[bool]] | None = None) -> list[list[int]]:
    """T = 0: a node is right when it is the base's argmax after its parent, on host lists, for every greedy round of the decode loop (the base's argmax read once from the
    device): as tensor ops it is a dozen ops a round on a CPU and a launch each on a GPU, on host lists a few µs. target, tokens [B][N], parents [N] (parents before children,
    as every round numbers them), present [B][N] or None. Returns each row's accepted path, node ids root first: its
    last node is the deepest accepted one (the lower index on a tie)."""
    out = []
    for row, (tgt, tok) in enumerate(zip(target, tokens)):
        paths: list[list[int] | None] = [[0]]  # per node: its path when it and its ancestors are accepted, else None
        best = paths[0]
        for i in range(1, len(parents)):
            up = paths[parents[i]]
            ok = up is not None and tok[i] == tgt[parents[i]] and (present is None or present[row][i])
            paths.append(up + [i] if ok else None)
            if ok and len(paths[i]) > len(best):
                best = paths[i]
        out.append(best)
    return out


def typical(p: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor,
            depth: torch.Tensor, eps: float, delta: float, uniform: Uniform,
            present: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa's typical acceptance (LOSSY): accept x after its parent when p(x) > min(eps, delta * exp(-H(p)));
    p [B, N, V] post-processed base probabilities. The bonus is sampled from p at the deepest accepted node."""
    entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)  # [B, N]
    threshold = torch.minimum(torch.full_like(entropy, eps), delta * (-entropy).exp())  # [B, N]
    par = parents.clamp(min=0)
    px = p[:, par].gather(-1, tokens[..., None])[..., 0]  # [B, N] p(token | parent)
    ok = px > threshold[:, par]
    if present is not None:
        ok &= present
    ok[:, 0] = True
    best = _deepest(ok, ancestors, depth)
    p_best = p.gather(1, best[:, None, None].expand(-1, 1, p.shape[-1]))[:, 0]
    return best, sample(p_best, uniform())


def rejection(p: torch.Tensor, tokens: torch.Tensor, children: torch.Tensor, q: torch.Tensor | None,
              max_depth: int, uniform: Uniform,
              present: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless recursive rejection (docs/sampler.md §2). p [B, N, V] post-processed base probabilities at every node;
    children [N, K] node ids in the order to try (-1 = none); q [B, N, V] the distribution each node's token was
    sampled from, or None when children are deterministic picks (then q is a point mass on the token); present
    [B, N] bool: the nodes each row proposes (None = all): a node a row does not propose is never tried, as if
    the row's tree ended before it.
    Every row draws the same number of uniforms whatever happens in other rows (no early exit), so a row's
    random stream, hence its output, does not depend on the batch it runs in."""
    b_idx = torch.arange(p.shape[0], device=p.device)
    cur = torch.zeros_like(b_idx)  # [B] current node
    p_cur = p[:, 0]  # [B, V] the (residual) target at the current node
    alive = torch.ones_like(b_idx, dtype=torch.bool)
    for _ in range(max_depth):  # one descent per depth
        moved = torch.zeros_like(alive)
        for k in range(children.shape[1]):
            child = children[cur, k]  # [B]
            c = child.clamp(min=0)
            trying = alive & ~moved & (child >= 0)
            if present is not None:
                trying &= present[b_idx, c]
            x = tokens[b_idx, c]  # [B]
            qv = torch.nn.functional.one_hot(x, p.shape[-1]).to(p.dtype) if q is None else q[b_idx, c]
            ok = trying & (uniform() < accept_probability(p_cur, qv, x))
            rejected = trying & ~ok
            p_cur = torch.where(ok[:, None], p[b_idx, c], torch.where(rejected[:, None], residual(p_cur, qv), p_cur))
            cur = torch.where(ok, c, cur)
            moved |= ok
        alive &= moved
    return cur, sample(p_cur, uniform())


def checked_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> the argmax [...] (long), -1 where that row's max is not finite (a NaN anywhere in the row,
    +inf, or a row all -inf: greedy decoding would emit garbage there). Device ops alone, so a recorded verify ends
    with it (graphs.py) and the host reads one small tensor per round, which it checks for -1 (decode.py). An eager
    decode on a CPU takes decode.finite_argmax instead: the same check read from the max itself, without this
    isfinite and where (on a CPU each op costs microseconds of dispatch)."""
    best, target = logits.max(-1)
    return torch.where(torch.isfinite(best), target, -1)
