"""Continuous batching for plain autoregressive decoding (no drafter): throughput over many prompts, as
self-distillation needs. Fixed batches empty as their answers end at different lengths, and a step of a few rows
costs a good part of a full one on a CPU (the weights stream once a step whatever the rows); here a row
whose answer ends takes the next prompt, so the batch stays full until the queue runs dry.

Built on the sampler's own pieces: one SamplingContext holds the batch's rows of the slot cache, and a row's pointer
is its committed length. A finished row is rewound to 0, which leaves its old slots invisible (context.py); the
newcomers are prefilled together in a context of their own, as `generate` prefills, their KV copied into the free
rows' slots [0, P), and they join the next decode step. A row's tokens are those `generate` gives its prompt alone:
greedy, or sampled with one generator per prompt drawing one uniform per token, as `generate` does."""

from __future__ import annotations

from collections import deque
from typing import Iterator, Sequence

import torch

from specdec.base import Base
from specdec.sampling import verify
from specdec.sampling.checks import check_inputs, finite
from specdec.sampling.config import SamplerConfig
from specdec.sampling.context import SamplingContext
from specdec.sampling.draws import row_uniforms
from specdec.sampling.engine import REFERENCE, Engine

Answer = tuple[int, list[int]]  # (index of the prompt, its generated tokens: the EOS included when the base ended)

# Free rows wait for a refill until this many are free (or as many as prompts are left). A prefill of one prompt
# already multiplies its ~100-200 tokens' rows per weight, so prefilling several together gains little, while a free
# row rides along every step it waits, doing nothing: refill at once.
REFILL_AT = 1


@torch.no_grad()
def stream(base: Base, prompt_ids: list[list[int]], cfg: SamplerConfig = SamplerConfig(), batch_size: int = 16,
           generators: Sequence[torch.Generator] | None = None, refill_at: int = REFILL_AT,
           engine: Engine = REFERENCE) -> Iterator[Answer]:
    """Decode every prompt with up to `batch_size` rows live; yields each answer as it ends (short answers first).
    Prompts are admitted in the order given: sort them by length, since newcomers prefilled together pad to the
    longest. `generators`: one per prompt (a sampled answer then equals its prompt's alone from `generate` with that
    generator, whatever its batch) or None (the global generator). `engine`: how the forwards run (sampling/engine.py)."""
    if cfg.lookup_tokens:
        raise ValueError("stream: n-gram lookup decides rounds for the whole batch; use generate for lookup_tokens > 0")
    if generators is not None and len(generators) != len(prompt_ids):
        raise ValueError(f"stream: {len(generators)} generators for {len(prompt_ids)} prompts (one per prompt)")
    if batch_size < 1 or refill_at < 1:
        raise ValueError(f"stream: batch_size and refill_at must be >= 1, got {batch_size} and {refill_at}")
    if not prompt_ids:  # nothing left to answer (a resumed run that is complete): nothing to yield
        return
    with engine.installed(base):
        yield from _stream(base, prompt_ids, cfg, batch_size, generators, refill_at, engine)


def _stream(base: Base, prompt_ids: list[list[int]], cfg: SamplerConfig, batch_size: int,
            generators: Sequence[torch.Generator] | None, refill_at: int, engine: Engine) -> Iterator[Answer]:
    # The cache holds the longest prompt of the queue + its answer in every row: the peak memory of fixed batches,
    # whose last batch holds the longest prompts. A step reads only the keys up to its longest live row.
    max_len = check_inputs(base, prompt_ids, cfg, None)
    rows = _Rows(base, cfg, generators, min(batch_size, len(prompt_ids)), max_len, engine)
    queue = deque(range(len(prompt_ids)))
    while queue or rows.live():
        free = rows.free()
        if queue and free and (len(free) >= min(refill_at, len(queue)) or not rows.live()):
            taken = [queue.popleft() for _ in free[: len(queue)]]
            yield from rows.admit(free[: len(taken)], taken, [prompt_ids[i] for i in taken])
            continue  # a newcomer whose first token ended it frees its row again
        live = rows.live()
        if not queue and len(live) <= len(rows.held) * 3 // 4:
            # nothing left to refill with: once a quarter of the rows are free (as `generate` does), later steps
            # multiply only the rows still decoding
            rows.keep(live)
        yield from rows.step()


class _Rows:
    """The batch: row b of the slot cache holds prompt `held[b]`'s answer so far, or nothing (None: free)."""

    def __init__(self, base: Base, cfg: SamplerConfig, generators: Sequence[torch.Generator] | None, size: int,
                 max_len: int, engine: Engine):
        self.base, self.cfg, self.generators, self.max_len, self.engine = base, cfg, generators, max_len, engine
        eos = base.config.eos_token_id if cfg.eos_token_id is None else cfg.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        self.ctx: SamplingContext | None = None  # made by the first admission, which fills every row
        self.held: list[int | None] = [None] * size
        self.out: list[list[int]] = [[] for _ in range(size)]
        self.root = torch.zeros(size, dtype=torch.long, device=base.device)  # [B] newest token, fed at the next step

    def free(self) -> list[int]:
        return [b for b, p in enumerate(self.held) if p is None]

    def live(self) -> list[int]:
        return [b for b, p in enumerate(self.held) if p is not None]

    def admit(self, rows: list[int], prompts: list[int], ids: list[list[int]]) -> list[Answer]:
        """Prompts `prompts` (token lists `ids`) into the free rows `rows`: one prefill forward for all of them, then
        each one's first token. Returns the answers that this first token already ended."""
        if self.ctx is None:  # the first fill: every row at once, the batch's own context
            self.ctx, logits = _prefill(self.base, self.engine, ids, self.max_len)
        else:
            new, logits = _prefill(self.base, self.engine, ids, max(map(len, ids)))
            _move_in(self.ctx, new, rows)
        for b, p in zip(rows, prompts):
            self.held[b], self.out[b] = p, []
        first = self._pick(logits, rows)  # [k]
        self.root[rows] = first
        return self._emit(rows, first.tolist(), [0] * len(self.held))

    def step(self) -> list[Answer]:
        """One decode step of every row (free rows ride along, at slot 0, unread): a token for each live row."""
        ctx = self.ctx
        ctx.commit_layout(1)
        hidden, _ = ctx.base_forward(self.root[:, None])  # [B, 1, H]
        logits = finite(self.base.lm_head(hidden)[:, 0], "at a decode step")  # [B, V]
        live = self.live()
        tokens = self._pick(logits[live] if len(live) < len(self.held) else logits, live)  # [k]
        self.root[live] = tokens
        n_new = [0] * len(self.held)
        for b in live:
            n_new[b] = 1  # the token fed at this step is committed
        return self._emit(live, tokens.tolist(), n_new)

    def keep(self, rows: list[int]) -> None:
        """Only rows `rows` go on (in this order)."""
        self.ctx.keep_rows(rows)
        self.held, self.out = [self.held[b] for b in rows], [self.out[b] for b in rows]
        self.root = self.root[torch.tensor(rows, device=self.root.device)]

    def _emit(self, rows: list[int], tokens: list[int], n_new: list[int]) -> list[Answer]:
        """Append each row's new token, then move every row's pointer by n_new [B] (the committed tokens) or, for
        a row whose answer ended, back to 0: its slots are free for the next prompt. Returns the ended answers."""
        ended = []
        for b, t in zip(rows, tokens):
            self.out[b].append(t)
            if t in self.eos or len(self.out[b]) >= self.cfg.max_new_tokens:
                ended.append((self.held[b], self.out[b]))
                self.held[b] = None
                n_new[b] = -self.ctx.length_host[b]
        self.ctx.commit(torch.tensor(n_new, device=self.ctx.length.device), n_new)
        return ended

    def _pick(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """logits [k, V] of rows `rows` -> their next tokens [k]: argmax, or one draw from the processed
        distribution per row, from its prompt's generator (`generate`'s first token and plain steps alike)."""
        cfg = self.cfg
        if cfg.temperature == 0:
            return logits.argmax(-1)
        dev = logits.device
        if self.generators is None:
            u = torch.rand(len(rows), device=dev)
        else:
            u = row_uniforms([self.generators[self.held[b]] for b in rows], dev)
        return verify.sample(verify.process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p), u)


def _prefill(base: Base, engine: Engine, ids: list[list[int]],
             max_len: int) -> tuple[SamplingContext, torch.Tensor]:
    """Prompts `ids` [k] right-padded through the base, as `generate` prefills, in a context of k rows and max_len
    slots -> the context (each row's pointer past its prompt) and each prompt's last logits [k, V]."""
    dev, lens = base.device, [len(p) for p in ids]
    ctx = SamplingContext(base, len(ids), max_len, engine)
    tokens = torch.tensor([p + [0] * (max(lens) - len(p)) for p in ids], device=dev)  # [k, P]
    ctx.commit_layout(tokens.shape[1])
    hidden, _ = ctx.base_forward(tokens)  # [k, P, H]
    n = torch.tensor(lens, device=dev)
    last = hidden[torch.arange(len(ids), device=dev), n - 1]  # [k, H]
    ctx.commit(n, lens)
    return ctx, finite(base.lm_head(last), "at the prompt's last position")


def _move_in(ctx: SamplingContext, new: SamplingContext, rows: list[int]) -> None:
    """The k rows of `new` (a prefill) into rows `rows` [k] of ctx, whose pointers are at 0: the KV of their slots
    [0, P) in every store, then their pointers."""
    index = torch.tensor(rows, device=ctx.length.device)
    width = max(new.length_host)
    for name, store in new.stores.items():
        for dst, src in zip(ctx.stores[name].layers, store.layers):  # [B, kv_heads, max_len, d] <- [k, kv_heads, P, d]
            dst.keys[index, :, :width] = src.keys[:, :, :width]
            dst.values[index, :, :width] = src.values[:, :, :width]
    n_new = torch.zeros_like(ctx.length).index_copy_(0, index, new.length)
    ctx.commit(n_new, n_new.tolist())
