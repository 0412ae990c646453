"""The decode loop: prefill, then rounds of draft -> one base verify forward -> accept -> rollback by pointer.
Plain autoregressive decoding is the same loop with no drafter (a round of one node: the root)."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Sequence

import torch

from specdec.base import Base, Features
from specdec.drafters.drafter import Drafter
from specdec.sampling import cuda_kernels, draft_graph, verify
from specdec.sampling.argmax import shortlist
from specdec.sampling.context import SamplingContext
from specdec.sampling.cost import verify_costs, wall_clock
from specdec.sampling.kernels import measured_kernels
from specdec.sampling.lookup import LookupLength, fresh_counts, lookup_round, ngram_match, shared_counts
from specdec.sampling.trees import Round, chain_paths, close_paths, draft_dynamic, draft_static, sample_chain_fn


@dataclass
class SamplerConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy verification
    top_k: int = 0  # 0 = off; applied to p and q alike
    top_p: float = 1.0
    tree: str = "chain"  # chain | static | dynamic
    gamma: int = 4  # chain length
    paths: list[list[int]] | None = None  # static tree: index paths into each depth's top-k
    dynamic_depth: int = 4
    dynamic_topk: int = 4  # nodes expanded per depth, and children proposed per expanded node
    dynamic_budget: int = 16  # draft nodes verified per round (with dynamic_by_cost: at most)
    # Per round, verify the number of best nodes that maximises the expected tokens per verify cost, from the drafter's
    # path probabilities and the verify-cost curve measured on this machine (cost.verify_costs, once per process):
    # trees as large as the machine verifies cheaply, whatever its kernels (trees.cost_budget).
    dynamic_by_cost: bool = False
    acceptance: str = "rejection"  # at T > 0: rejection (lossless) | typical (lossy, Medusa §3.3.1)
    typical_eps: float = 0.3
    typical_delta: float = 0.09
    eos_token_id: int | list[int] | None = None  # None: the base config's eos; [] never stops early
    # Adaptive draft length (chains; Draft & Verify's draft-exiting): a round's chain ends after a token whose top-1
    # draft probability is below the threshold (0 = off: always gamma). With a target acceptance rate the threshold
    # adapts every round: up by adaptive_step while the recent rate (EMA, decay adaptive_decay) is below it, else down.
    adaptive_threshold: float = 0.0
    adaptive_target: float | None = None  # None: the threshold stays fixed
    adaptive_step: float = 0.01
    adaptive_decay: float = 0.9
    cpu_kernels: str = "measured"  # CPU only: measured = fastest matmul kernel per shape and rows (kernels.py); stock
    lean: bool = True  # Llama-style decoder layers through the lean forward (lean.py); False: each layer's HF forward
    # CPU, measured kernels, lean: a lean layer as one native call (native_layer.py) where that measures faster on this
    # machine, for a batch of one; False: the lean layers in PyTorch ops
    native_layers: bool = True
    # CUDA: forwards of up to 64 tokens (the base's decode steps and verifies, drafters' own layers) replayed from CUDA
    # graphs recorded on first use (graphs.py); False: launched op by op
    cuda_graphs: bool = True
    # CUDA graphs, T = 0, a chain or static tree: a drafter that declares `graph_draft` drafts a round as one recorded
    # graph (draft_graph.py), not launch by launch around its graphed layers
    cuda_graph_draft: bool = True
    # CUDA: measured = each float32 product of up to 16 rows runs the kernel measured fastest on this GPU for its shape
    # and row count (cuBLAS or a Triton small-M kernel), and each lean layer's attention the form measured fastest for
    # its query count (SDPA or matmul + softmax), measured once per GPU (cuda_kernels.py), and each layer's products
    # fused with the norms, SiLU and residual adds around them where that measured faster (cuda_fused.py); unfused =
    # the measured products and attention without the fused units; stock = PyTorch's own
    cuda_kernels: str = "measured"
    # CPU, measured kernels, T = 0: the base's argmax from a bfloat16 copy of its lm_head with the rows within the error
    # bound recomputed exactly (argmax.py: the exact argmax from half the lm_head's bytes), where that measures faster
    # than the lm_head's logits; False: always the logits
    greedy_shortlist: bool = True
    # CPU, measured kernels: a base weight whose float32 numbers have an exact compact form (compact.py: the GGUF's Q4_1
    # / Q8_0 blocks the embedded SmolLM2 was dequantised from, or bfloat16 values) is multiplied from that form where
    # it measures faster: the same numbers from a fifth to a half of the bytes, so decoding stays lossless. False: the
    # float32 copies
    compact_weights: bool = True
    # CPU, measured kernels: bf16 = the drafter's linears may multiply with bfloat16 copies of their weights where that
    # measures faster (half the bytes to stream; activations and sums stay fp32). Changes what is drafted, never what
    # is accepted: the base's products stay exact, so decoding stays lossless. fp32 = the drafter's own weights.
    # (Prophet recipe, γ = 4, Zen 4 EPYC: 15 % less drafting per round, τ unchanged; experiments/README.md.)
    # q8 (the default) = as bf16, and the drafter's linears and native layers may also multiply with its weights rounded
    # to llama.cpp's Q8_0 blocks (1.0625 bytes per weight; each moves by at most 1/254 of its block's largest), where
    # that measures faster (prophet recipe, γ = 3, 2-core Xeon: 18 % less drafting per round than bf16, τ unchanged;
    # experiments/results/ab/prophet_draft_precision_q8.md). q4 = as q8, and Q4_1 blocks too (0.625 bytes per weight;
    # each moves by at most 1/30 of its block's range). q4a8 = as q4, and Q4_1 blocks multiplied by the linear's input
    # rounded to int8 per group of 32 too (the same bytes; integer dot products: AVX-512 VNNI, or AVX2's).
    draft_precision: str = "q8"
    # N-gram lookup (lookup.py): a round whose context's last min..max_ngram tokens occurred before proposes the
    # (up to lookup_tokens) tokens that followed them instead of running the drafter; 0 = off. With no drafter, the
    # rounds without a match are plain decoding steps.
    lookup_tokens: int = 0
    lookup_min_ngram: int = 2
    lookup_max_ngram: int = 3
    # Per lookup round, verify the prefix of the proposals that maximises the expected tokens per verify cost, from
    # how far earlier proposals of the same n-gram length matched and the verify-cost curve measured on this machine
    # (lookup.LookupLength; the curve once per process): all lookup_tokens where verifying is nearly free, fewer where
    # each verified token costs about a fifth of a step (a 2-core CPU). False: every proposal whole.
    lookup_by_cost: bool = True

    def __post_init__(self) -> None:
        """One-line errors for settings that would otherwise fail deep in a decode loop (or silently)."""
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (self.tree in ("chain", "static", "dynamic"), f"tree must be chain, static or dynamic, got {self.tree!r}"),
            (self.acceptance in ("rejection", "typical"), f"acceptance must be rejection or typical, got {self.acceptance!r}"),
            (self.cpu_kernels in ("measured", "stock"), f"cpu_kernels must be measured or stock, got {self.cpu_kernels!r}"),
            (self.cuda_kernels in ("measured", "unfused", "stock"),
             f"cuda_kernels must be measured, unfused or stock, got {self.cuda_kernels!r}"),
            (self.draft_precision in ("fp32", "bf16", "q8", "q4", "q4a8"),
             f"draft_precision must be fp32, bf16, q8, q4 or q4a8, got {self.draft_precision!r}"),
            (self.tree != "chain" or self.gamma >= 1, f"gamma must be >= 1, got {self.gamma}"),
            (self.tree != "static" or bool(self.paths), "a static tree needs paths, e.g. [[0], [1], [0, 0]]"),
            (self.tree != "dynamic" or min(self.dynamic_depth, self.dynamic_topk, self.dynamic_budget) >= 1,
             "dynamic_depth, dynamic_topk and dynamic_budget must be >= 1"),
            (0 <= self.adaptive_threshold <= 1, f"adaptive_threshold must be in [0, 1], got {self.adaptive_threshold}"),
            (self.adaptive_target is None or 0 < self.adaptive_target < 1,
             f"adaptive_target must be in (0, 1) or null, got {self.adaptive_target}"),
            (self.adaptive_step > 0 and 0 <= self.adaptive_decay < 1, f"adaptive_step must be > 0 and adaptive_decay "
             f"in [0, 1), got {self.adaptive_step} and {self.adaptive_decay}"),
            (self.lookup_tokens >= 0 and 1 <= self.lookup_min_ngram <= self.lookup_max_ngram,
             f"lookup_tokens must be >= 0 and 1 <= lookup_min_ngram <= lookup_max_ngram, got {self.lookup_tokens}, "
             f"{self.lookup_min_ngram} and {self.lookup_max_ngram}"),
            (not self.adaptive or self.tree == "chain",
             f"adaptive draft length needs tree=chain (a {self.tree} tree's shape is fixed per round)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"sampler: {message}")

    @property
    def lossless(self) -> bool:
        return self.temperature == 0 or self.acceptance == "rejection"

    @property
    def adaptive(self) -> bool:
        return self.adaptive_threshold > 0 or self.adaptive_target is not None


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # [B, max_new_tokens], -1 after each row's end
    num_generated: list[int]  # per row
    accepted: list[list[int]]  # per row, per round it took part in: draft tokens accepted a_s
    drafted: list[list[int]]  # per row, per round: draft nodes verified (γ_s; N_s - 1 for trees)
    lossless: bool
    ttft_s: float  # prefill up to the first token of every row
    total_s: float
    step_draft_s: list[float] = field(default_factory=list)  # per round: drafting (expand + observe)
    step_verify_s: list[float] = field(default_factory=list)  # per round: the base verify forward
    step_overhead_s: list[float] = field(default_factory=list)  # per round: acceptance, rollback, bookkeeping
    lookup_rounds: int = 0  # rounds proposed by n-gram lookup instead of the drafter

    @property
    def decode_s(self) -> float:
        return self.total_s - self.ttft_s


def row_uniforms(generators: Sequence[torch.Generator], device: torch.device) -> torch.Tensor:
    """One U(0,1) per generator [len], each drawn on its generator's own device, then moved to `device`: a CPU
    generator seeds a CUDA decode too, and gives it the same uniforms as a CPU decode."""
    return torch.cat([torch.rand(1, generator=g, device=g.device) for g in generators]).to(device)


class RowUniform:
    """Draws one U(0,1) per row. With one generator per row, a row's stream is independent of the batch."""

    def __init__(self, generator: torch.Generator | list[torch.Generator] | None, batch: int, device: torch.device):
        self.generator, self.batch, self.device = generator, batch, device

    def keep_rows(self, keep: list[int]) -> None:
        """Only the rows at batch positions `keep` go on (with one generator per row, each keeps its own)."""
        if isinstance(self.generator, list):
            self.generator = [self.generator[i] for i in keep]
        self.batch = len(keep)

    def __call__(self) -> torch.Tensor:
        if isinstance(self.generator, list):
            return row_uniforms(self.generator, self.device)
        if self.generator is None:
            return torch.rand(self.batch, device=self.device)
        # drawn where the generator lives, as row_uniforms does
        return torch.rand(self.batch, generator=self.generator, device=self.generator.device).to(self.device)


class DraftLength:
    """Adaptive draft length for chains (Draft & Verify's adaptive draft-exiting): each row's chain ends after its
    first draft token whose top-1 probability is < threshold; with a target, the threshold follows the recent
    acceptance rate.
    Only the drafter's own numbers and past rounds decide how many tokens are proposed, never the base's
    distribution at the proposed positions, so verification stays lossless."""

    def __init__(self, cfg: SamplerConfig):
        self.threshold, self.target = cfg.adaptive_threshold, cfg.adaptive_target
        self.step, self.decay = cfg.adaptive_step, cfg.adaptive_decay
        self.rate = cfg.adaptive_target  # EMA of the acceptance rate; starts on target: no push either way
        self.active: torch.Tensor | None = None  # [B] bool, set every round: rows still decoding (finished rows
        # ride along in the shared chain but never keep it going)

    def keep_going(self, top1: torch.Tensor) -> torch.Tensor:
        """top1 [B] -> [B] bool: the rows whose chain goes on (confident and still decoding)."""
        confident = top1 >= self.threshold
        return confident if self.active is None else confident & self.active

    def update(self, accepted: int, drafted: int) -> None:
        """After a round: accepted / drafted draft tokens summed over the active rows."""
        if self.target is None or not drafted:
            return
        self.rate = self.decay * self.rate + (1 - self.decay) * accepted / drafted
        # Draft & Verify: θ ← θ + ε while acceptance is below target (stop earlier), θ − ε otherwise
        self.threshold = min(1.0, max(0.0, self.threshold + (self.step if self.rate < self.target else -self.step)))


def _draft(drafter: Drafter, state, ctx: SamplingContext, root: torch.Tensor, cfg: SamplerConfig,
           uniform: RowUniform, length: DraftLength | None = None, verify_cost: list[float] | None = None) -> Round:
    limit = drafter.max_depth or 1 << 30
    if cfg.tree == "dynamic":
        if cfg.dynamic_depth > limit:
            raise ValueError(f"dynamic_depth {cfg.dynamic_depth} > the drafter's max_depth {limit}")
        return draft_dynamic(drafter, state, ctx, root, cfg.dynamic_depth, cfg.dynamic_topk, cfg.dynamic_budget,
                             verify_cost)
    paths = chain_paths(cfg.gamma) if cfg.tree == "chain" else cfg.paths  # static_tree closes them, once per shape
    if max(len(p) for p in paths) > limit:
        raise ValueError(f"draft depth {max(len(p) for p in paths)} > the drafter's max_depth {limit}")
    sampled = cfg.tree == "chain" and cfg.temperature > 0
    if ctx.graphs and cfg.cuda_graph_draft and drafter.graph_draft and not sampled and length is None:
        return draft_graph.draft(drafter, state, ctx, root, paths)  # the whole draft replayed from one graph
    draw = sample_chain_fn(cfg.temperature, cfg.top_k, cfg.top_p, uniform) if sampled else None
    return draft_static(drafter, state, ctx, root, paths, draw, length.keep_going if length is not None else None)


def _max_nodes(cfg: SamplerConfig, drafter: Drafter | None) -> int:
    if drafter is None:
        drafted = 0
    elif cfg.tree == "dynamic":
        drafted = cfg.dynamic_depth * cfg.dynamic_topk * cfg.dynamic_topk
    else:
        drafted = cfg.gamma if cfg.tree == "chain" else len(close_paths(cfg.paths or []))
    return 1 + max(drafted, cfg.lookup_tokens)


def _lookup(cfg: SamplerConfig, prompt_ids: list[list[int]], out: list[list[int]], rows: list[int],
            done: list[bool], root: torch.Tensor, length: LookupLength | None) -> Round | None:
    """An n-gram lookup round when every row still decoding has a match (history: prompt + answer so far, the
    root last), its proposals cut to the length `length` chooses (None: whole); None otherwise (the drafter, or a
    plain step, takes the round). Finished rows ride along."""
    if not cfg.lookup_tokens:
        return None
    matches = [([], 0) if done[row] else ngram_match(prompt_ids[row] + out[row], cfg.lookup_tokens,
                                                     cfg.lookup_min_ngram, cfg.lookup_max_ngram) for row in rows]
    proposals = [toks for toks, _ in matches]
    if not all(p or done[row] for p, row in zip(proposals, rows)) or not any(proposals):
        return None
    if length is not None:
        proposals = length.cut(proposals, [n for _, n in matches], rows, [len(out[row]) for row in rows])
    return lookup_round(root, [p or [0] for p in proposals])


def _accept(cfg: SamplerConfig, rnd: Round, logits: torch.Tensor, uniform: RowUniform, ctx: SamplingContext):
    """A sampled round (T > 0: a greedy one is decided on the host, `_outcome`) from the base's logits [B, N, V]."""
    parents, anc, depth = ctx.on_device(rnd.parents), ctx.on_device(rnd.ancestors), ctx.on_device(rnd.depth)
    present = rnd.present()  # [B, N] or None: each row's own draft length (adaptive)
    p = verify.process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p)  # [B, N, V]
    if cfg.acceptance == "typical":
        return verify.typical(p, rnd.tokens, parents, anc, depth, cfg.typical_eps, cfg.typical_delta, uniform,
                              present)
    max_depth = int(rnd.depth.max())
    return verify.rejection(p, rnd.tokens, ctx.on_device(rnd.children()), rnd.q, max_depth, uniform, present)


def _outcome(cfg: SamplerConfig, rnd: Round, logits: torch.Tensor | None, uniform: RowUniform, ctx: SamplingContext,
             target: torch.Tensor | None, round_no: int):
    """What the verify decided: path [B, D + 1] (each row's accepted nodes, root first, padded by repeating its deepest
    one) and its tokens [B, D + 1], n_acc [B] (accepted draft tokens), bonus [B] (the token the base emits after them),
    and on the host n_acc, each row's emitted block (the accepted draft tokens, then the bonus) and the paths (None
    when sampling). A greedy round is decided on the host (verify.greedy_paths: the same nodes, without a dozen small
    tensor ops, each a launch on a GPU) from the base's argmax read once, and its outcome goes back to the device as
    one tensor."""
    if cfg.temperature == 0:
        tgt = target.tolist()  # [B][N] (every greedy verify gives its argmax, checked or marked)
        if min(map(min, tgt)) < 0:  # checked_argmax's mark: a query's logits were not finite
            raise FloatingPointError(f"NaN/inf in the base's logits at decode round {round_no}: the base's weights "
                                     f"or dtype are broken (try dtype=float32)")
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
        packed = torch.tensor(rows, device=ctx.length.device)  # [B, 2 (D + 1) + 2]
        return (packed[:, :width], packed[:, width: 2 * width], packed[:, 2 * width], packed[:, 2 * width + 1],
                n_acc_host, block, padded)
    best, bonus = _accept(cfg, rnd, logits, uniform, ctx)  # [B], [B]
    on_path = ctx.on_device(rnd.ancestors)[best]  # [B, N]
    n_acc = on_path.sum(-1) - 1  # [B] accepted draft tokens
    depth = ctx.on_device(rnd.depth)
    path = torch.where(on_path, depth[None], rnd.size).argsort(-1)[:, : int(rnd.depth.max()) + 1]
    path = torch.where(torch.arange(path.shape[1], device=path.device)[None] <= n_acc[:, None], path,
                       best[:, None])  # ancestors sorted by depth, then `best` again as padding
    path_tokens = rnd.tokens.gather(1, path)  # [B, D + 1]
    return (path, path_tokens, n_acc, bonus, n_acc.tolist(),
            torch.cat([path_tokens[:, 1:], bonus[:, None]], 1).tolist(), None)


def in_place(paths: list[list[int]] | None, draft_slots: torch.Tensor, n: int) -> bool:
    """Whether every row's accepted path (its first n nodes, padded) already lies in the slots `move_path` would move it
    to: nodes 0..n-1, which sat in slots 0..n-1 while drafting too. A tree is laid out depth by depth, so that is a
    round that accepted no draft token or only the root's first-ranked child: most rounds of a shallow tree (of
    [[0], [1]], all but those that accept the second child). `move_path` then has nothing to move; it costs a gather
    and a scatter per layer's keys and values (~240 small ops a round for SmolLM2 on a CPU, 4 launches a layer on a
    GPU). False when the paths are not on the host (sampling)."""
    first = list(range(n))
    return paths is not None and all(p[:n] == first for p in paths) and draft_slots[:n].tolist() == first


def finite(logits: torch.Tensor, where: str) -> torch.Tensor:
    """Fail on NaN/inf in the base's logits instead of emitting tokens drawn from garbage. Their sum is finite when
    every logit is (a few times cheaper to check than each: ~0.3 ms a verify of 5 rows on a 2-core CPU); only a sum
    that is not (an overflow, or a real NaN) looks at each logit."""
    if not bool(torch.isfinite(logits.sum())) and not bool(torch.isfinite(logits).all()):
        raise FloatingPointError(f"NaN/inf in the base's logits {where}: the base's weights or dtype are broken "
                                 f"(try dtype=float32)")
    return logits


def finite_argmax(logits: torch.Tensor, where: str) -> torch.Tensor:
    """logits [..., V].argmax(-1), failing as `finite` does where greedy decoding would emit garbage: a NaN anywhere in
    a row is its max (PyTorch orders NaN above every number, as argmax does, the first on a tie), so is +inf, and a row
    all -inf has no finite max. One op where `finite` and the argmax took four, each ~20 µs on a 2-core CPU right after
    a forward. Unlike `finite`, an -inf logit below a finite max passes: it changes no greedy token."""
    best, target = logits.max(-1)
    if not all(map(math.isfinite, best.flatten().tolist())):
        raise FloatingPointError(f"NaN/inf in the base's logits {where}: the base's weights or dtype are broken "
                                 f"(try dtype=float32)")
    return target


class PhaseClock:
    """A decode's phase boundaries, read after it: `perf_counter` on a CPU; on CUDA an event recorded on the stream at
    each mark, so timing a round's phases costs no synchronize (five a round held the host until the GPU had drained
    at every boundary, where it could have queued the next work)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Each mark in seconds after the first."""
        if not self.cuda:
            return [t - self.marks[0] for t in self.marks]
        torch.cuda.synchronize()
        return [self.marks[0].elapsed_time(e) / 1e3 for e in self.marks]


def check_inputs(base: Base, prompt_ids: list[list[int]], cfg: SamplerConfig, drafter: Drafter | None) -> int:
    """One-line errors before any work: empty prompts, and a prompt + answer + draft tree beyond the base's
    context (the KV cache is sized to exactly that). Returns the cache length."""
    if not prompt_ids:
        raise ValueError("no prompts to decode")
    empty = [i for i, p in enumerate(prompt_ids) if len(p) == 0]
    if empty:
        raise ValueError(f"prompt(s) {empty} are empty: every prompt needs at least one token")
    longest, nodes = max(len(p) for p in prompt_ids), _max_nodes(cfg, drafter)
    need = longest + cfg.max_new_tokens + nodes + 1
    context = getattr(base.config, "max_position_embeddings", None)
    if context is not None and need > context:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens {cfg.max_new_tokens} + a draft of {nodes} "
                         f"nodes = {need} positions, beyond the base's context of {context}")
    return need


def use_graphs(cfg: SamplerConfig, device: torch.device) -> bool:
    """Whether a decode records CUDA graphs: on CUDA where the config asks (elsewhere nothing is recorded)."""
    return cfg.cuda_graphs and device.type == "cuda"


def _first_token(cfg: SamplerConfig, logits: torch.Tensor, uniform: RowUniform) -> torch.Tensor:
    finite(logits, "at the prompt's last position")
    if cfg.temperature == 0:
        return logits.argmax(-1)
    return verify.sample(verify.process_logits(logits, cfg.temperature, cfg.top_k, cfg.top_p), uniform())


@torch.no_grad()
def generate(base: Base, prompt_ids: list[list[int]], drafter: Drafter | None = None,
             cfg: SamplerConfig = SamplerConfig(),
             generator: torch.Generator | list[torch.Generator] | None = None) -> GenerationResult:
    """Decode every prompt (ragged lengths) with `drafter` (None = plain autoregressive). `generator`: one for
    the batch, or one per row (then row b's output equals its output alone, unless n-gram lookup is on: whether a
    round is a lookup round depends on every row of the batch)."""
    fast = cfg.cpu_kernels == "measured" and base.device.type == "cpu"
    drafters = [drafter] if drafter is not None else []
    bf16 = drafters if cfg.draft_precision != "fp32" else []  # the drafter's weights may be rounded
    quant = cfg.draft_precision if cfg.draft_precision in ("q8", "q4", "q4a8") else ""  # ... to these blocks too
    # verify-cost curves, measured before any timing starts: a dynamic tree's budget and the lookup's length by cost
    curve = (_curve(base, cfg, len(prompt_ids), cfg.dynamic_budget)
             if drafter is not None and cfg.tree == "dynamic" and cfg.dynamic_by_cost else None)
    lookup = _curve(base, cfg, len(prompt_ids), cfg.lookup_tokens) if cfg.lookup_tokens and cfg.lookup_by_cost else None
    gpu = cfg.cuda_kernels != "stock" and base.device.type == "cuda"
    with (measured_kernels(base, *drafters, lean=cfg.lean, bf16=bf16, native_layers=cfg.native_layers,
                           compact=cfg.compact_weights, quant=quant) if fast
          else cuda_kernels.measured(base, *drafters, fused=cfg.cuda_kernels == "measured") if gpu
          else nullcontext()):
        return _generate(base, prompt_ids, drafter, cfg, generator, curve, lookup)


# The most tokens a verify-cost curve is timed at (`_curve`): b rows verifying n tokens each are timed as one row of b·n
# tokens, whose attention grows with its square (a Monte Carlo test's 100,000 rows would ask for 40 GB)
CURVE_TOKENS = 512


def _curve(base: Base, cfg: SamplerConfig, b: int, most: int) -> list[float] | None:
    """v(n) for n = 0 .. most + 1 tokens a row: a verify of n tokens per row multiplies b·n rows, so the curve at b·n;
    None past CURVE_TOKENS (the setting that asked for it then does without: a dynamic tree's fixed budget, the
    lookup's whole proposals)."""
    if b * (most + 1) > CURVE_TOKENS:
        return None
    rows = verify_costs(base, b * (most + 1), cfg.cpu_kernels, cfg.lean, cfg.native_layers, cfg.cuda_graphs,
                        cfg.temperature == 0 and cfg.greedy_shortlist, cfg.compact_weights, cfg.cuda_kernels, every=b)
    return [rows[b * n] for n in range(most + 2)]


def _generate(base: Base, prompt_ids: list[list[int]], drafter: Drafter | None, cfg: SamplerConfig,
              generator: torch.Generator | list[torch.Generator] | None,
              verify_cost: list[float] | None = None, lookup_cost: list[float] | None = None) -> GenerationResult:
    dev, b = base.device, len(prompt_ids)
    eos = base.config.eos_token_id if cfg.eos_token_id is None else cfg.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    max_len = check_inputs(base, prompt_ids, cfg, drafter)
    lens = [len(p) for p in prompt_ids]
    longest = max(lens)
    ctx = SamplingContext(base, b, max_len, lean=cfg.lean, graphs=use_graphs(cfg, dev))
    uniform = RowUniform(generator, b, dev)
    layers = tuple(drafter.feature_layers) if drafter is not None else ()
    # T = 0 on the CPU: the verify's argmax without the lm_head's float32 logits, where that measures faster
    head = shortlist(base.lm_head) if (cfg.temperature == 0 and cfg.greedy_shortlist and dev.type == "cpu"
                                       and cfg.cpu_kernels == "measured") else None
    # T = 0 on a GPU (or wherever the verify is recorded): the argmax as device ops after the lm_head, in the verify's
    # graph, read by the host as [B, N] ids; a drafter that reads the base's logits gets them as before
    device_argmax = (cfg.temperature == 0 and (dev.type != "cpu" or ctx.graphs)
                     and not (drafter is not None and drafter.reads_logits))

    # -- prefill --------------------------------------------------------------------------------
    t_start = wall_clock(dev)
    ids = torch.tensor([p + [0] * (longest - len(p)) for p in prompt_ids], device=dev)  # [B, P] right-padded
    n_prompt = torch.tensor(lens, device=dev)
    ctx.commit_layout(ids.shape[1])
    hidden, feats = ctx.base_forward(ids, layers)  # [B, P, H]
    last = hidden[torch.arange(b, device=dev), n_prompt - 1]  # [B, H]
    root = _first_token(cfg, base.lm_head(last), uniform)  # [B]
    state = None
    if drafter is not None:
        state = drafter.init_state(b, ctx.max_len)
        # no prompt-long logits: [B, P, V] through the lm_head would cost a verify's time and no drafter reads them
        drafter.observe(state, ctx, Features(feats, None), ids, n_prompt, root)
    ctx.commit(n_prompt, lens)

    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    accepted: list[list[int]] = [[] for _ in range(b)]
    drafted: list[list[int]] = [[] for _ in range(b)]

    def emit(row: int, toks: list[int]) -> None:
        for t in toks:
            out[row].append(t)
            if t in eos or len(out[row]) >= cfg.max_new_tokens:
                done[row] = True
                return

    for row, t in enumerate(root.tolist()):
        emit(row, [t])
    rows = list(range(b))  # batch position -> prompt row (plain decoding drops finished rows from the batch)
    length = DraftLength(cfg) if drafter is not None and cfg.adaptive else None
    lookup_length = None
    if lookup_cost is not None:
        # the lookup's counts: the process's at T = 0 (a greedy output never depends on them), this decode's own when
        # sampling (a seeded decode's samples then depend on its inputs alone, not on what the process decoded before)
        counts = (shared_counts(base, cfg.lookup_tokens, cfg.lookup_max_ngram) if cfg.temperature == 0
                  else fresh_counts(cfg.lookup_tokens, cfg.lookup_max_ngram))
        lookup_length = LookupLength(lookup_cost, counts)
    t_first = wall_clock(dev)
    result = GenerationResult(None, [], accepted, drafted, cfg.lossless, t_first - t_start, 0.0)
    clock, round_no = PhaseClock(dev), 0

    # -- rounds ---------------------------------------------------------------------------------
    while not all(done):
        clock.mark()
        rnd = _lookup(cfg, prompt_ids, out, rows, done, root, lookup_length)
        looked_up = rnd is not None
        if looked_up:
            result.lookup_rounds += 1
            if drafter is not None:
                drafter.skip_round(state)
        elif drafter is None:
            rnd = Round(root[:, None], torch.tensor([-1]), torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool),
                        torch.tensor([0]))
        else:
            if length is not None:
                length.active = torch.tensor([not done[row] for row in rows], device=dev)
            rnd = _draft(drafter, state, ctx, root, cfg, uniform, length, verify_cost)
        clock.mark()
        round_no += 1
        ctx.tree_layout(torch.arange(rnd.size), rnd.depth, rnd.ancestors)
        if device_argmax:
            logits, (target, feats) = None, ctx.verify_forward(rnd.tokens, layers)  # [B, N] checked in _outcome
        else:
            hidden, feats = ctx.base_forward(rnd.tokens, layers)  # [B, N, H]
            if head is not None and head.wins(hidden.shape[0] * hidden.shape[1]):
                logits, target = None, head.argmax(hidden)  # [B, N]
            elif cfg.temperature == 0:  # the argmax, its logits checked (decided on the host)
                logits = base.lm_head(hidden)
                target = finite_argmax(logits, f"at decode round {round_no}")
            else:
                logits, target = finite(base.lm_head(hidden), f"at decode round {round_no}"), None
        clock.mark()
        path, path_tokens, n_acc, bonus, n_acc_host, block, paths_host = _outcome(cfg, rnd, logits, uniform, ctx,
                                                                                  target, round_no)
        active = [not done[row] for row in rows]
        proposed = rnd.drafted()  # [B] per row: γ_s (its own chain length with an adaptive draft length)
        for i, row in enumerate(rows):
            if active[i]:
                accepted[row].append(n_acc_host[i])
                drafted[row].append(proposed[i])
                emit(row, block[i][: n_acc_host[i]] + [block[i][-1]])
        if lookup_length is not None:  # the lookup's proposals whose outcome the output now shows
            lookup_length.resolve(out, done)
        if length is not None and not looked_up:  # the drafter's own acceptance rate steers its draft length
            length.update(sum(a for a, act in zip(n_acc_host, active) if act),
                          sum(g for g, act in zip(proposed, active) if act))
        n_new_host = [0 if done[row] else k + 1 for k, row in zip(n_acc_host, rows)]  # finished rows stay put
        clock.mark()
        if drafter is not None:
            n = max(n_acc_host) + 1
            chain = rnd.is_chain()
            if not chain and not in_place(paths_host, rnd.draft_slots, n):  # a chain's path is always in place
                ctx.move_path(path[:, :n], rnd.draft_slots.to(dev)[path[:, :n]])
            if chain and len(rows) == 1:
                # one row's accepted chain is nodes 0 .. n-1: slices, not gathers (3 ops each, ~10 µs a round on a
                # 2-core CPU right after a verify)
                def pick(t: torch.Tensor) -> torch.Tensor:
                    return t[:, :n]
            else:
                sel = path[:, :n]  # [B, n]

                def pick(t: torch.Tensor) -> torch.Tensor:
                    return t.gather(1, sel[..., None].expand(-1, -1, t.shape[-1]))
            gathered = {l: pick(h) for l, h in feats.items()}  # [B, n, H] each
            if drafter.runs_layers:
                ctx.commit_layout(n)
            kept = None if logits is None or not drafter.reads_logits else pick(logits)  # [B, n, V]
            drafter.observe(state, ctx, Features(gathered, kept), path_tokens[:, :n], n_acc + 1, bonus)
        ctx.commit(ctx.on_device(torch.tensor(n_new_host)), n_new_host)
        root = bonus
        keep = [i for i, row in enumerate(rows) if not done[row]]
        if drafter is None and keep and len(keep) <= len(rows) * 3 // 4:
            # Finished rows leave the batch once a quarter of it is done, so later steps multiply fewer rows
            # (batched distillation: answers end at very different lengths). A drafter's per-row state would
            # need the same selection, so only plain decoding does it.
            rows = [rows[i] for i in keep]
            root = root[torch.tensor(keep, device=dev)]
            ctx.keep_rows(keep)
            uniform.keep_rows(keep)

    clock.mark()
    result.total_s = wall_clock(dev) - t_start
    marks = clock.seconds()  # 4 a round and one after the last: draft | verify | accept | drafter's observe
    for i in range(0, len(marks) - 1, 4):
        t0, t1, t2, t3, t4 = marks[i: i + 5]
        result.step_draft_s.append((t1 - t0) + (t4 - t3))
        result.step_verify_s.append(t2 - t1)
        result.step_overhead_s.append(t3 - t2)
    result.tokens = torch.tensor([o + [-1] * (cfg.max_new_tokens - len(o)) for o in out])
    result.num_generated = [len(o) for o in out]
    return result
