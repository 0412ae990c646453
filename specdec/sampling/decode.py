"""The decode loop: prefill, then rounds of draft -> one base verify forward -> accept -> commit, with rollback by
moving each row's committed length (docs/sampler.md §1-§3). Plain autoregressive decoding is the same loop with no
drafter (a round of one node: the root). How the forwards run is the engine's (sampling/engine.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.base import Base, Features
from specdec.drafters.drafter import Drafter
from specdec.ngram import ngram_match
from specdec.sampling import verify
from specdec.sampling.adaptive import DraftLength
from specdec.sampling.checks import check_inputs, finite, finite_argmax, not_finite
from specdec.sampling.config import GenerationResult, SamplerConfig
from specdec.sampling.context import SamplingContext
from specdec.sampling.cost import PhaseClock, verify_costs, wall_clock
from specdec.sampling.draws import RowUniform
from specdec.sampling.engine import REFERENCE, Engine
from specdec.sampling.lookup import LookupLength, fresh_counts, lookup_round, shared_counts
from specdec.sampling.trees import Round, Stage, chain_paths, draft_dynamic, draft_static, sample_chain_fn

__all__ = ["GenerationResult", "SamplerConfig", "generate"]


@torch.no_grad()
def generate(base: Base, prompt_ids: list[list[int]], drafter: Drafter | None = None,
             cfg: SamplerConfig = SamplerConfig(),
             generator: torch.Generator | list[torch.Generator] | None = None,
             engine: Engine = REFERENCE, lookup_counts: list | None = None) -> GenerationResult:
    """Decode every prompt (ragged lengths) with `drafter` (None = plain autoregressive) on `engine` (the reference
    by default: each layer's own HF forward; `specdec.engines.build` makes a fast one). `generator`: one for the batch,
    or one per row (then row b's output equals its output alone, unless n-gram lookup is on: whether a round is a
    lookup round depends on every row of the batch). `lookup_counts`: the statistics lookup rounds are cut by
    (`lookup.fresh_counts`), learnt from and added to by this decode; None: the process's for this base at T = 0,
    this decode's own when sampling."""
    d = Decode(base, prompt_ids, drafter, cfg, generator, engine, lookup_counts)  # checks, and the verify-cost curves it needs
    with engine.installed(base, d.drafters):
        d.prefill()
        while not d.finished():
            rnd = d.propose()  # [B, N] tokens of a tree: a lookup round, the drafter's, or the root alone
            target, logits, feats = d.verify(rnd)  # one base forward over every node
            outcome = d.accept(rnd, target, logits)  # the accepted path and the bonus token of each row
            d.commit(rnd, outcome, feats)  # emit, move the path into place, tell the drafter, advance the pointers
    return d.result()


@dataclass
class Outcome:
    """What a verify decided: path [B, D + 1] (each row's accepted nodes, root first, padded by repeating its deepest
    one) and its tokens [B, D + 1], n_acc [B] (accepted draft tokens), bonus [B] (the token the base emits after
    them); on the host n_acc, each row's emitted block (the accepted draft tokens, then the bonus) and the paths (None
    when sampling)."""

    path: torch.Tensor
    path_tokens: torch.Tensor
    n_acc: torch.Tensor
    bonus: torch.Tensor
    n_acc_host: list[int]
    block: list[list[int]]
    paths_host: list[list[int]] | None
    logits: torch.Tensor | None = None  # [B, N, V] the verify's, where it made them (a drafter may read them)


# The most tokens a verify-cost curve is timed at (`curve`): b rows verifying n tokens each are timed as one row of b·n
# tokens, whose attention grows with its square (a Monte Carlo test's 100,000 rows would ask for 40 GB)
CURVE_TOKENS = 512


def curve(base: Base, cfg: SamplerConfig, engine: Engine, b: int, most: int) -> list[float] | None:
    """v(n) for n = 0 .. most + 1 tokens a row: a verify of n tokens per row multiplies b·n rows, so the curve at b·n;
    None past CURVE_TOKENS (the setting that asked for it then does without: a dynamic tree's fixed budget, the
    lookup's whole proposals)."""
    if b * (most + 1) > CURVE_TOKENS:
        return None
    rows = verify_costs(base, b * (most + 1), engine, greedy=cfg.temperature == 0, every=b)
    return [rows[b * n] for n in range(most + 2)]


class Decode:
    """One call of `generate`: the rows' outputs so far and the state its steps share."""

    def __init__(self, base: Base, prompt_ids: list[list[int]], drafter: Drafter | None, cfg: SamplerConfig,
                 generator: torch.Generator | list[torch.Generator] | None, engine: Engine,
                 lookup_counts: list | None = None):
        self.base, self.prompt_ids, self.drafter, self.cfg, self.engine = base, prompt_ids, drafter, cfg, engine
        self.lookup_counts = lookup_counts
        self.drafters = [drafter] if drafter is not None else []
        b = len(prompt_ids)
        self.max_len = check_inputs(base, prompt_ids, cfg, drafter)
        if cfg.stage_lookup and drafter is not None and not drafter.drafts_from_tokens:
            raise ValueError(f"sampler.stage_lookup: staged drafting needs a drafter whose expand reads only its "
                             f"nodes' path tokens (Drafter.drafts_from_tokens: a draft model, layer skip, early exit); "
                             f"{type(drafter).__name__}'s does not")
        eos = base.config.eos_token_id if cfg.eos_token_id is None else cfg.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        # verify-cost curves, measured before any timing starts: a dynamic tree's budget and the lookup's length by cost
        self.verify_cost = (curve(base, cfg, engine, b, cfg.dynamic_budget)
                            if drafter is not None and cfg.tree == "dynamic" and cfg.dynamic_by_cost else None)
        self.lookup_cost = (curve(base, cfg, engine, b, cfg.lookup_tokens)
                            if cfg.lookup_tokens and cfg.lookup_by_cost else None)
        self.out: list[list[int]] = [[] for _ in range(b)]
        self.done = [False] * b
        self.accepted: list[list[int]] = [[] for _ in range(b)]
        self.drafted: list[list[int]] = [[] for _ in range(b)]
        self.rows = list(range(b))  # batch position -> prompt row (plain decoding drops finished rows from the batch)
        self.uniform = RowUniform(generator, b, base.device)
        self.layers = tuple(drafter.feature_layers) if drafter is not None else ()
        self.length = DraftLength(cfg) if drafter is not None and cfg.adaptive else None
        self.clock, self.round_no, self.looked_up = PhaseClock(base.device), 0, False
        self.draft_passes: list[int] = []  # per round (GenerationResult.draft_passes)

    # -- prefill ---------------------------------------------------------------------------------
    def prefill(self) -> None:
        """The prompts through the base (writing its KV), the first token of each row, the drafter's first `observe`."""
        base, cfg, dev, b = self.base, self.cfg, self.base.device, len(self.prompt_ids)
        self.ctx = ctx = SamplingContext(base, b, self.max_len, self.engine)
        # T = 0: the verify's argmax without the lm_head's float32 logits, where the engine has that and it is faster
        self.head = self.engine.greedy_head(base.lm_head) if cfg.temperature == 0 else None
        # T = 0 on a GPU (or wherever the verify is recorded): the argmax as device ops after the lm_head, in the
        # verify's graph, read by the host as [B, N] ids; a drafter that reads the base's logits gets them as before
        self.device_argmax = (cfg.temperature == 0 and (dev.type != "cpu" or ctx.graphs)
                              and not (self.drafter is not None and self.drafter.reads_logits))
        self.t_start = wall_clock(dev)
        lens = [len(p) for p in self.prompt_ids]
        longest = max(lens)
        ids = torch.tensor([p + [0] * (longest - len(p)) for p in self.prompt_ids], device=dev)  # [B, P] right-padded
        n_prompt = torch.tensor(lens, device=dev)
        ctx.commit_layout(ids.shape[1])
        hidden, feats = ctx.base_forward(ids, self.layers)  # [B, P, H]
        last = hidden[torch.arange(b, device=dev), n_prompt - 1]  # [B, H]
        logits = base.lm_head(last)
        finite(logits, "at the prompt's last position")
        self.root = (logits.argmax(-1) if cfg.temperature == 0 else
                     verify.sample(verify.process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p),
                                   self.uniform()))  # [B]
        self.state = None
        if self.drafter is not None:
            self.state = self.drafter.init_state(b, ctx.max_len)
            # no prompt-long logits: [B, P, V] through the lm_head would cost a verify's time and no drafter reads them
            self.drafter.observe(self.state, ctx, Features(feats, None), ids, n_prompt, self.root)
        ctx.commit(n_prompt, lens)
        for row, t in enumerate(self.root.tolist()):
            self._emit(row, [t])
        self.lookup_length = None
        if self.lookup_cost is not None:
            # the lookup's counts: the process's at T = 0 (a greedy output never depends on them), this decode's own
            # when sampling (a seeded decode's samples then depend on its inputs alone)
            counts = (self.lookup_counts if self.lookup_counts is not None
                      else shared_counts(base, cfg.lookup_tokens, cfg.lookup_max_ngram) if cfg.temperature == 0
                      else fresh_counts(cfg.lookup_tokens, cfg.lookup_max_ngram))
            self.lookup_length = LookupLength(self.lookup_cost, counts)
        self.t_first = wall_clock(dev)
        self.lookup_rounds = 0

    def finished(self) -> bool:
        return all(self.done)

    def _emit(self, row: int, toks: list[int]) -> None:
        """Append toks to the row's output, up to its first end token or max_new_tokens."""
        for t in toks:
            self.out[row].append(t)
            if t in self.eos or len(self.out[row]) >= self.cfg.max_new_tokens:
                self.done[row] = True
                return

    # -- draft -----------------------------------------------------------------------------------
    def propose(self) -> Round:
        """This round's tree: an n-gram lookup round where every live row has a match, else the drafter's (or, with
        none, the root alone: a plain decoding step)."""
        self.clock.mark()
        rnd = self._lookup()
        self.looked_up = rnd is not None
        if self.looked_up:
            self.lookup_rounds += 1
            if self.drafter is not None:
                self.drafter.skip_round(self.state)
        elif self.drafter is None:
            rnd = Round(self.root[:, None], torch.tensor([-1]), torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool),
                        torch.tensor([0]))
        else:
            if self.length is not None:
                self.length.active = torch.tensor([not self.done[row] for row in self.rows], device=self.base.device)
            rnd = self._draft()
        self.clock.mark()
        self.round_no += 1
        self.draft_passes.append(0 if self.looked_up or self.drafter is None
                                 else rnd.passes if rnd.passes is not None else int(rnd.depth.max()))
        return rnd

    def _draft(self) -> Round:
        drafter, cfg, ctx = self.drafter, self.cfg, self.ctx
        limit = drafter.max_depth or 1 << 30
        if cfg.tree == "dynamic":
            if cfg.dynamic_depth > limit:
                raise ValueError(f"dynamic_depth {cfg.dynamic_depth} > the drafter's max_depth {limit}")
            ctx.draft_depth = cfg.dynamic_depth
            return draft_dynamic(drafter, self.state, ctx, self.root, cfg.dynamic_depth, cfg.dynamic_topk,
                                 cfg.dynamic_budget, self.verify_cost)
        paths = chain_paths(cfg.gamma) if cfg.tree == "chain" else cfg.paths  # static_tree closes them, once a shape
        if max(len(p) for p in paths) > limit:
            raise ValueError(f"draft depth {max(len(p) for p in paths)} > the drafter's max_depth {limit}")
        ctx.draft_depth = max(len(p) for p in paths)
        sampled = cfg.tree == "chain" and cfg.temperature > 0
        if not sampled and self.length is None and not cfg.stage_lookup:
            whole = self.engine.draft_round(drafter, self.state, ctx, self.root, paths)  # one recorded graph?
            if whole is not None:
                return whole
        draw = sample_chain_fn(cfg.temperature, cfg.top_k, cfg.top_p, self.uniform) if sampled else None
        return draft_static(drafter, self.state, ctx, self.root, paths, draw, self.length, self._stage())

    def _stage(self) -> Stage | None:
        """Staged drafting's cheaper stage (trees.Stage): n-gram lookup over each row's history (prompt + answer so
        far, the root last) and the chain drafted so far, up to stage_lookup tokens; a proposal only where every row
        has one, cut to the shortest (the drafter keeps a token only where every row's is its own)."""
        cfg = self.cfg
        if not cfg.stage_lookup:
            return None
        history = [self.prompt_ids[row] + self.out[row] for row in self.rows]

        def propose(chain: torch.Tensor, most: int) -> torch.Tensor | None:
            found = [ngram_match(h + c, min(most, cfg.stage_lookup), cfg.lookup_min_ngram, cfg.lookup_max_ngram)[0]
                     for h, c in zip(history, chain.tolist())]
            k = min(map(len, found))
            return torch.tensor([f[:k] for f in found], device=chain.device) if k else None  # [B, k]

        return propose

    def _lookup(self) -> Round | None:
        """An n-gram lookup round when every row still decoding has a match (history: prompt + answer so far, the
        root last), its proposals cut to the length `lookup_length` chooses (None: whole); None otherwise (the drafter,
        or a plain step, takes the round). Finished rows ride along."""
        cfg, rows, done, out = self.cfg, self.rows, self.done, self.out
        if not cfg.lookup_tokens:
            return None
        matches = [([], 0) if done[row] else ngram_match(self.prompt_ids[row] + out[row], cfg.lookup_tokens,
                                                         cfg.lookup_min_ngram, cfg.lookup_max_ngram) for row in rows]
        proposals = [toks for toks, _ in matches]
        if not all(p or done[row] for p, row in zip(proposals, rows)) or not any(proposals):
            return None
        if self.lookup_length is not None:
            proposals = self.lookup_length.cut(proposals, [n for _, n in matches], rows,
                                               [len(out[row]) for row in rows])
        return lookup_round(self.root, [p or [0] for p in proposals])

    # -- verify ----------------------------------------------------------------------------------
    def verify(self, rnd: Round) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[int, torch.Tensor]]:
        """One base forward over the round's nodes -> (the base's greedy tokens [B, N] at T = 0, else None; its logits
        [B, N, V] where they were made, else None; the drafter's features {layer: [B, N, H]})."""
        ctx, cfg, where = self.ctx, self.cfg, f"at decode round {self.round_no}"
        ctx.tree_layout(torch.arange(rnd.size), rnd.depth, rnd.ancestors)
        if self.device_argmax:
            logits, (target, feats) = None, ctx.verify_forward(rnd.tokens, self.layers)  # checked in `accept`
        else:
            hidden, feats = ctx.base_forward(rnd.tokens, self.layers)  # [B, N, H]
            if self.head is not None and self.head.wins(hidden.shape[0] * hidden.shape[1]):
                logits, target = None, self.head.argmax(hidden)  # [B, N]
            elif cfg.temperature == 0:  # the argmax, its logits checked (decided on the host)
                logits = self.base.lm_head(hidden)
                target = finite_argmax(logits, where)
            else:
                logits, target = finite(self.base.lm_head(hidden), where), None
        self.clock.mark()
        return target, logits, feats

    # -- accept ----------------------------------------------------------------------------------
    def accept(self, rnd: Round, target: torch.Tensor | None, logits: torch.Tensor | None) -> Outcome:
        """At T = 0, decided on the host (verify.greedy_paths: the same nodes without a dozen small tensor ops, each a
        launch on a GPU) from the base's argmax read once, its outcome sent back to the device as one tensor; when
        sampling, by lossless rejection (or typical acceptance) on the device."""
        if self.cfg.temperature == 0:
            outcome = self._accept_greedy(rnd, target)
            outcome.logits = logits
            return outcome
        best, bonus = self._accept_sampled(rnd, logits)  # [B], [B]
        ctx = self.ctx
        on_path = ctx.on_device(rnd.ancestors)[best]  # [B, N]
        n_acc = on_path.sum(-1) - 1  # [B] accepted draft tokens
        depth = ctx.on_device(rnd.depth)
        path = torch.where(on_path, depth[None], rnd.size).argsort(-1)[:, : int(rnd.depth.max()) + 1]
        path = torch.where(torch.arange(path.shape[1], device=path.device)[None] <= n_acc[:, None], path,
                           best[:, None])  # ancestors sorted by depth, then `best` again as padding
        path_tokens = rnd.tokens.gather(1, path)  # [B, D + 1]
        return Outcome(path, path_tokens, n_acc, bonus, n_acc.tolist(),
                       torch.cat([path_tokens[:, 1:], bonus[:, None]], 1).tolist(), None, logits)

    def _accept_greedy(self, rnd: Round, target: torch.Tensor) -> Outcome:
        tgt = target.tolist()  # [B][N] (every greedy verify gives its argmax, checked or marked)
        if min(map(min, tgt)) < 0:  # checked_argmax's mark: a query's logits were not finite
            raise not_finite(f"at decode round {self.round_no}")
        present = rnd.present()
        tokens = rnd.tokens.tolist()
        paths = verify.greedy_paths(tgt, tokens, rnd.parents.tolist(), None if present is None else present.tolist())
        width = int(rnd.depth.max()) + 1
        bonus_host = [t[p[-1]] for t, p in zip(tgt, paths)]
        block = [[tok[i] for i in p[1:]] + [b] for tok, p, b in zip(tokens, paths, bonus_host)]
        n_acc_host = [len(p) - 1 for p in paths]
        padded = [p + p[-1:] * (width - len(p)) for p in paths]
        # per row: its path, the path's tokens, n_acc and the bonus, as one copy to the device
        rows = [p + [tok[i] for i in p] + [k, b] for tok, p, k, b in zip(tokens, padded, n_acc_host, bonus_host)]
        packed = torch.tensor(rows, device=self.ctx.length.device)  # [B, 2 (D + 1) + 2]
        return Outcome(packed[:, :width], packed[:, width: 2 * width], packed[:, 2 * width],
                       packed[:, 2 * width + 1], n_acc_host, block, padded)

    def _accept_sampled(self, rnd: Round, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The deepest accepted node [B] and the bonus token [B] of a sampled round, from the base's logits
        [B, N, V]."""
        cfg, ctx = self.cfg, self.ctx
        parents, anc, depth = ctx.on_device(rnd.parents), ctx.on_device(rnd.ancestors), ctx.on_device(rnd.depth)
        present = rnd.present()  # [B, N] or None: each row's own draft length (adaptive)
        p = verify.process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)  # [B, N, V]
        if cfg.acceptance == "typical":
            return verify.typical(p, rnd.tokens, parents, anc, depth, cfg.typical_eps, cfg.typical_delta,
                                  self.uniform, present)
        return verify.rejection(p, rnd.tokens, ctx.on_device(rnd.children()), rnd.q, int(rnd.depth.max()),
                                self.uniform, present)

    # -- commit ----------------------------------------------------------------------------------
    def commit(self, rnd: Round, o: Outcome, feats: dict[int, torch.Tensor]) -> None:
        """Emit each live row's block, move the accepted path into contiguous slots where it is not already there,
        hand the drafter what the base computed on it, and advance every row's committed length (rollback of the
        rest is the pointer not moving past it: stale slots stay masked)."""
        ctx, rows, done, dev = self.ctx, self.rows, self.done, self.base.device
        active = [not done[row] for row in rows]
        proposed = rnd.drafted()  # [B] per row: γ_s (its own chain length with an adaptive draft length)
        for i, row in enumerate(rows):
            if active[i]:
                self.accepted[row].append(o.n_acc_host[i])
                self.drafted[row].append(proposed[i])
                self._emit(row, o.block[i][: o.n_acc_host[i]] + [o.block[i][-1]])
        if self.lookup_length is not None:  # the lookup's proposals whose outcome the output now shows
            self.lookup_length.resolve(self.out, done)
        if self.length is not None and not self.looked_up:  # the drafter's own acceptance steers its draft length
            self.length.update(sum(a for a, act in zip(o.n_acc_host, active) if act),
                               sum(g for g, act in zip(proposed, active) if act))
        n_new_host = [0 if done[row] else k + 1 for k, row in zip(o.n_acc_host, rows)]  # finished rows stay put
        self.clock.mark()
        if self.drafter is not None:
            self._observe(rnd, o, feats)
        ctx.commit(ctx.on_device(torch.tensor(n_new_host)), n_new_host)
        self.root = o.bonus
        keep = [i for i, row in enumerate(rows) if not done[row]]
        if self.drafter is None and keep and len(keep) <= len(rows) * 3 // 4:
            # Finished rows leave the batch once a quarter of it is done, so later steps multiply fewer rows
            # (batched distillation: answers end at very different lengths). A drafter's per-row state would
            # need the same selection, so only plain decoding does it.
            self.rows = [rows[i] for i in keep]
            self.root = self.root[torch.tensor(keep, device=dev)]
            ctx.keep_rows(keep)
            self.uniform.keep_rows(keep)

    def _observe(self, rnd: Round, o: Outcome, feats: dict[int, torch.Tensor]) -> None:
        """The drafter's `observe` of the accepted path: its first n = max accepted + 1 nodes in every row."""
        ctx, drafter = self.ctx, self.drafter
        n = max(o.n_acc_host) + 1
        chain = rnd.is_chain()
        if not chain and not in_place(o.paths_host, rnd.draft_slots, n):  # a chain's path is always in place
            ctx.move_path(o.path[:, :n], rnd.draft_slots.to(self.base.device)[o.path[:, :n]])
        if chain and len(self.rows) == 1:
            # one row's accepted chain is nodes 0 .. n-1: slices, not gathers (3 ops each, ~10 µs a round on a
            # 2-core CPU right after a verify)
            def pick(t: torch.Tensor) -> torch.Tensor:
                return t[:, :n]
        else:
            sel = o.path[:, :n]  # [B, n]

            def pick(t: torch.Tensor) -> torch.Tensor:
                return t.gather(1, sel[..., None].expand(-1, -1, t.shape[-1]))
        gathered = {l: pick(h) for l, h in feats.items()}  # [B, n, H] each
        if drafter.runs_layers:
            ctx.commit_layout(n)
        logits = o.logits
        kept = None if logits is None or not drafter.reads_logits else pick(logits)  # [B, n, V]
        drafter.observe(self.state, ctx, Features(gathered, kept), o.path_tokens[:, :n], o.n_acc + 1, o.bonus)

    # -- the result ------------------------------------------------------------------------------
    def result(self) -> GenerationResult:
        self.clock.mark()
        dev, cfg = self.base.device, self.cfg
        total = wall_clock(dev) - self.t_start
        r = GenerationResult(None, [], self.accepted, self.drafted, cfg.lossless, self.t_first - self.t_start, total)
        r.lookup_rounds = self.lookup_rounds
        r.draft_passes = self.draft_passes
        marks = self.clock.seconds()  # 4 a round and one after the last: draft | verify | accept | drafter's observe
        for i in range(0, len(marks) - 1, 4):
            t0, t1, t2, t3, t4 = marks[i: i + 5]
            r.step_draft_s.append((t1 - t0) + (t4 - t3))
            r.step_verify_s.append(t2 - t1)
            r.step_overhead_s.append(t3 - t2)
        r.tokens = torch.tensor([o + [-1] * (cfg.max_new_tokens - len(o)) for o in self.out])
        r.num_generated = [len(o) for o in self.out]
        return r


def in_place(paths: list[list[int]] | None, draft_slots: torch.Tensor, n: int) -> bool:
    """Whether every row's accepted path (its first n nodes, padded) already lies in the slots `move_path` would move it
    to: nodes 0..n-1, which sat in slots 0..n-1 while drafting too. A tree is laid out depth by depth, so that is a
    round that accepted no draft token or only the root's first-ranked child: most rounds of a shallow tree (of
    [[0], [1]], all but those that accept the second child). `move_path` then has nothing to move; it costs a gather
    and a scatter per layer's keys and values (~240 small ops a round for SmolLM2 on a CPU, 4 launches a layer on a
    GPU). False when the paths are not on the host (sampling)."""
    first = list(range(n))
    return paths is not None and all(p[:n] == first for p in paths) and draft_slots[:n].tolist() == first
