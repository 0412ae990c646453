"""EngineConfig: how the sampler's forwards run (the Hydra group `engine`), apart from what the algorithm decides
(SamplerConfig). Each switch turns one fast path off; `cpu_kernels` says whether the CPU paths left on are taken where
measurement picks them (measured) or wherever they can run (native: nothing measured). None changes what the base
accepts. The yamls under configs/engine/ state these defaults once (auto.yaml) and their own deltas."""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("auto", "eager", "cpu", "cuda")
CPU_KERNELS = ("measured", "native", "stock")


@dataclass
class EngineConfig:
    # auto = cpu on a CPU device, cuda on a CUDA device; eager = PyTorch ops only (the lean layers where `lean`);
    # cpu / cuda = that engine (refused on another device)
    name: str = "auto"
    # Llama-style decoder layers through the lean forward (eager/lean.py); False: each layer's own HF forward
    lean: bool = True
    # CPU: measured = each product runs the kernel measured fastest on this machine for its shape and rows
    # (cpu/kernels.py), and each path below runs where it measured faster (measured once per machine, kept under
    # $SPECDEC_CACHE, or once per process); native = each path below that is on runs wherever it can, nothing measured:
    # the native products (from the compact or rounded copies the switches allow), the layers as native calls, the
    # shortlist's argmax and whole chains at every row count they take; stock = PyTorch's own (the eager engine)
    cpu_kernels: str = "measured"
    # CPU, lean: a lean layer as one native call (cpu/native_layer.py) where that measures faster for a batch of one
    # (every row count it takes, under cpu_kernels=native); False: the lean layers in PyTorch ops
    native_layers: bool = True
    # CPU, measured kernels: a base weight whose float32 numbers have an exact compact form (cpu/compact.py: the
    # GGUF's Q4_1 / Q8_0 blocks the embedded SmolLM2 was dequantised from, or bfloat16 values) is multiplied from that
    # form where it measures faster: the same weights in a fifth to a half of the bytes. Their products sum in another
    # order, so the outputs equal float32's to rounding (docs/engines.md)
    compact_weights: bool = True
    # CPU, measured kernels, T = 0: the verify's argmax from a bfloat16 copy of the lm_head with the rows within its
    # error bound recomputed in float32 (cpu/argmax.py), where that measures faster than the logits
    greedy_shortlist: bool = True
    # CPU, measured kernels: the drafter's linears may multiply with rounded copies of their weights where that
    # measures faster: fp32 = never; bf16; q8 = bf16 or llama.cpp's Q8_0 blocks; q4 = those or Q4_1 blocks; q4a8 = as
    # q4, with the input rounded to int8 per group of 32 too. Changes what is drafted, never what is accepted
    draft_precision: str = "q8"
    # CPU, T = 0: a drafter's whole greedy chain (drafter.greedy_chain, adaptive_chain: the prophet's and Hydra's) as
    # one native call wherever it can run, and a feature drafter's real entries as one where that measures faster
    # (always under cpu_kernels=native); False: depth by depth through `expand`, the entries through run_layers
    whole_chains: bool = True
    # CUDA: forwards of up to 64 tokens replayed from CUDA graphs recorded on first use (cuda/graphs.py)
    cuda_graphs: bool = True
    # CUDA graphs, T = 0, a chain or static tree: a drafter that declares `graph_draft` drafts a round as one
    # recorded graph (cuda/draft_graph.py)
    cuda_graph_draft: bool = True
    # CUDA: measured = small products, attention forms and fused units chosen by measurement on this GPU
    # (cuda/kernels.py, cuda/fused.py); unfused = the same without the fused units; stock = PyTorch's own
    cuda_kernels: str = "measured"

    def __post_init__(self) -> None:
        checks = [
            (self.name in ENGINES, f"name must be one of {', '.join(ENGINES)}, got {self.name!r}"),
            (self.cpu_kernels in CPU_KERNELS,
             f"cpu_kernels must be measured, native or stock, got {self.cpu_kernels!r}"),
            (self.cuda_kernels in ("measured", "unfused", "stock"),
             f"cuda_kernels must be measured, unfused or stock, got {self.cuda_kernels!r}"),
            (self.draft_precision in ("fp32", "bf16", "q8", "q4", "q4a8"),
             f"draft_precision must be fp32, bf16, q8, q4 or q4a8, got {self.draft_precision!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"engine: {message}")
