"""A decoder layer in one native call (specdec/engines/cpu/layer.c via native_layer.py): the lean layer's numbers, greedy
identity whenever it runs (plain decoding, chains, trees, a drafter's own layers), attached only where measurement
picks it, and the lean layer wherever it is missing."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch

from specdec.base import LAST, load_base, tiny_base
from specdec.drafters.early_exit import EarlyExit
from specdec.engines.cpu import kernels, native, native_layer
from specdec.engines.cpu.compact import Compact
from specdec.engines.cpu.kernels import BF16, CANDIDATES, KernelTable, measured_kernels
from specdec.engines.eager.lean import lean, lean_layers
from specdec.sampling.context import SamplingContext
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine, prefill_and_verify
from specdec.engines.config import EngineConfig
from specdec.engines.cpu.engine import CpuEngine

needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
                                    reason="no C compiler on this machine")


def native_of(fast):
    """The native form attached to a lean layer for some row count, or None."""
    return next((layer for layer in native_layer.rows_of(fast) if layer is not None), None)


@pytest.fixture
def base():
    # head_dim 16 (layer.c takes multiples of the vector width); its own: lean re-points the layers' weights
    return tiny_base(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, num_layers=3)


@pytest.fixture
def forced(monkeypatch):
    """A list with an entry per native call made while decoding (a whole stack or one layer; True where it ran, False
    where layer.c refused it), not counting the checks; the tables below and the engines (cpu_kernels=native) attach
    the native layers at every row count, unmeasured."""
    calls, checking = [], []
    call, run_stack, agrees = native_layer.NativeLayer.__call__, native_layer.run_stack, native_layer.agrees

    def counted(self, *args):
        out = call(self, *args)
        if not checking:
            calls.append(out is not None)
        return out

    def counted_stack(*args, **kwargs):
        out = run_stack(*args, **kwargs)
        if out is not None:  # None also means "not every layer takes these rows": they then run one by one
            calls.append(True)
        return out

    def checked(*args, **kwargs):
        checking.append(True)
        try:
            return agrees(*args, **kwargs)
        finally:
            checking.pop()

    monkeypatch.setattr(native_layer.NativeLayer, "__call__", counted)
    monkeypatch.setattr(native_layer, "run_stack", counted_stack)
    monkeypatch.setattr(native_layer, "agrees", checked)
    return calls


def table(forced: bool = True) -> KernelTable:
    """cpu_kernels=native's table (the native kernels and layers, nothing timed), or one measured afresh; stored
    nowhere."""
    return KernelTable(None, rows=(1, 2, 4, 8, 16), forced=forced)


def run(base, native_on: bool, prompt: list[int], tree: bool):
    """conftest.prefill_and_verify with or without native layers."""
    with measured_kernels(base, table=table()) if native_on else contextlib.nullcontext():
        return prefill_and_verify(base, prompt, tree)


@needs_compiler
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("whole_stack", ["with_norm", "norm_after", False])
def test_native_layers_give_the_lean_numbers(base, forced, tree, whole_stack, monkeypatch):
    """The base's layers in one native call (run_stack; the final norm in the same call, or as the module after it
    where layer.c cannot compute it) or one call per layer: the lean numbers either way."""
    if not whole_stack:
        monkeypatch.setattr(native_layer, "run_stack", lambda *args, **kwargs: None)
    if whole_stack == "norm_after":
        monkeypatch.setattr(native_layer, "rms_form", lambda norm: None)
    prompt = list(range(20, 41))
    ref, ref_feats = run(base, False, prompt, tree)
    got, feats = run(base, True, prompt, tree)
    assert forced and all(forced)  # every layer of the prefill and the verify ran natively
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for layer in (0, 2, LAST):  # the inputs the layers were given are kept as they were (written in place: a copy)
        torch.testing.assert_close(feats[layer], ref_feats[layer], rtol=1e-5, atol=1e-5)
    assert all(native_of(fast) is None for fast in lean_layers(base))  # detached on leaving measured_kernels


@needs_compiler
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("nodes", [1, 5, 13])
@pytest.mark.parametrize("prompt_len, threads", [(21, 2), (90, 2), (90, 1), (150, 3)])
def test_a_tree_verify_gives_the_lean_numbers(forced, nodes, head_dim, prompt_len, threads):
    """A verify of a tree of several nodes through the native layers: every query under its own ancestors' mask over
    the round's slots, the lean numbers; head size 64 in its unrolled form as SmolLM2's. Over a long window, with 2 kv
    heads on 1 or 2 threads each kv head is one task, on 3 threads its keys are split in shares whose partial softmaxes
    layer.c merges (as SmolLM2's 3 kv heads on 2 threads); a short window is never split."""
    base = tiny_base(hidden_size=4 * head_dim, num_heads=4, num_kv_heads=2, intermediate_size=96, num_layers=3)
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]  # a binary tree
    visible = torch.zeros(nodes, nodes, dtype=torch.bool)
    depth = torch.zeros(nodes, dtype=torch.long)
    for i, p in enumerate(parents):
        visible[i, i] = True
        if p >= 0:
            visible[i] |= visible[p]
            depth[i] = depth[p] + 1
    prompt = (torch.arange(prompt_len) % 50 + 20)[None]
    outs = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for native_on in (False, True):
            with measured_kernels(base, table=table()) if native_on else contextlib.nullcontext(), torch.no_grad():
                ctx = SamplingContext(base, 1, prompt_len + 16, auto_engine())
                ctx.commit_layout(prompt.shape[1])
                ctx.base_forward(prompt)
                ctx.commit(torch.tensor([prompt.shape[1]]), [prompt.shape[1]])
                ctx.tree_layout(torch.arange(nodes), depth, visible)
                outs.append(ctx.base_forward(torch.arange(3, 3 + nodes)[None])[0])
    finally:
        torch.set_num_threads(before)
    assert forced and all(forced)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("kw", [dict(), dict(gamma=3),
                                dict(tree="dynamic", dynamic_depth=2, dynamic_topk=2, dynamic_budget=4)])
def test_decoding_is_greedy_identical_with_native_layers(base, forced, kw):
    """Plain decoding, a chain and a tree, drafted by an early exit whose own block runs natively too: the same tokens
    and acceptances as the lean layers with PyTorch's products; for a batch of one, and a batch of two (which runs
    the lean layers while both rows decode)."""
    drafter = EarlyExit(base, exit_layers=[1], num_extra_layers=1).eval() if kw else None
    if drafter is not None:
        with torch.no_grad():
            for p in drafter.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    for prompts in ([list(range(30, 49))], [list(range(30, 39)), list(range(50, 54))]):
        cfg = SamplerConfig(max_new_tokens=12, eos_token_id=[], **kw)
        stock = generate(base, prompts, drafter, cfg, engine=auto_engine(name="eager"))
        forced.clear()
        with measured_kernels(base, *([drafter] if drafter else []), table=table()):
            fast = generate(base, prompts, drafter, cfg, engine=auto_engine())
        assert fast.tokens.tolist() == stock.tokens.tolist()
        assert fast.accepted == stock.accepted
        assert all(forced) and (forced or len(prompts) > 1)  # batch of one: ran natively
    if drafter is not None:
        assert native_of(lean(drafter.exits[0].blocks[0])) is None  # its block was attached while decoding, and detached


@needs_compiler
def test_a_drafter_with_rounded_products_gets_its_native_layer(base, forced):
    """A drafter's lean block may multiply with bfloat16 copies of its weights (draft_precision=bf16); so does its
    native form (half the bytes to stream), checked against the exact lean forward to the bf16 tolerance, while the
    base's layers that the early exit runs too stay exact; decoding stays lossless."""
    drafter = EarlyExit(base, exit_layers=[1], num_extra_layers=1).eval()
    rounded = KernelTable(None, candidates={"linear": CANDIDATES["linear"]},
                          bf16={"linear_bf16": BF16["linear_bf16"]}, rows=(1, 2, 4, 8, 16))
    rounded.prepare = lambda weights, bf16=False, **kw: None  # no measuring: pick bf16 for the drafter's products below
    rounded.plan = lambda w, uniform=None, bf16=False, **kw: (
        [None] + [(BF16["linear_bf16"].run, w.to(torch.bfloat16))] * 16 if bf16 else [None] * 17)
    rounded.arbitrate = lambda weights, bf16=False, **kw: {}
    block = lean(drafter.exits[0].blocks[0])
    with measured_kernels(base, drafter, table=rounded, bf16=[drafter]):
        assert "forward" in block.qkv.__dict__  # its products are the rounded ones ...
        assert native_of(block) is not None and native_of(block).form == "bf16"  # ... and so are its native layer's
        assert all(not native_of(lean(layer)).rounded for layer in base.layers)  # the base's own: exact
        prompts = [list(range(30, 49))]
        fast = generate(base, prompts, drafter, SamplerConfig(max_new_tokens=12, eos_token_id=[], gamma=3),
                        engine=auto_engine())
    stock = generate(base, prompts, drafter, SamplerConfig(max_new_tokens=12, eos_token_id=[], gamma=3),
                     engine=auto_engine(name="eager"))
    assert fast.tokens.tolist() == stock.tokens.tolist()


@needs_compiler
def test_chosen_by_measurement_and_stored(base, monkeypatch):
    """The lean layers stay where the native ones measure slower; the timings are stored with the kernel table, and a
    later process re-checks them once (at one row) instead of measuring every row count again."""
    verdict = {"lean": 1.0, "native": 2.0}
    measured = []

    def fake(ways, reps=3, counts=native_layer.ROWS):
        measured.append(counts)
        return {r: dict(verdict) for r in counts}

    monkeypatch.setattr(native_layer, "measure", fake)
    t = table(forced=False)
    assert native_layer.attach(base, t) == [] and all(native_of(f) is None for f in lean_layers(base))
    assert measured == [native_layer.ROWS] and len(t.layers) == 1
    verdict.update(native=0.5)  # now faster: the stored choice loses its re-check by more than RECHECK_FACTOR
    monkeypatch.setattr(native_layer, "_CHECKED", set())  # a new process
    attached = native_layer.attach(base, t)
    assert measured[1] == (1,) and measured[2] == native_layer.ROWS  # re-checked, then measured again
    assert len(attached) == base.num_layers and all(native_layer.rows_of(f)[1] for f in attached)
    native_layer.detach(attached)
    assert native_layer.attach(base, t) and len(measured) == 3  # checked once per process: no more measuring
    native_layer.detach(lean_layers(base))


def test_without_the_native_library_the_lean_layers_run(base, monkeypatch, tmp_path):
    monkeypatch.setattr(native, "CACHE", tmp_path / "native")
    monkeypatch.setenv("SPECDEC_NATIVE", "0")
    native._load.cache_clear()
    try:
        assert native_layer.attach(base, table()) == []
        prompts = [list(range(30, 49))]
        cfg = SamplerConfig(max_new_tokens=8, eos_token_id=[])
        stock = generate(base, prompts, None, cfg, engine=auto_engine(name="eager"))
        plain = KernelTable(None, candidates={"linear": CANDIDATES["linear"]})
        with measured_kernels(base, table=plain):
            assert all(native_of(f) is None for f in lean_layers(base))
            # the CPU engine on that table, without the shortlist: both need the library this test takes away
            fast = CpuEngine(EngineConfig(greedy_shortlist=False), table=plain)
            assert generate(base, prompts, None, cfg, engine=fast).tokens.tolist() == stock.tokens.tolist()
    finally:
        native._load.cache_clear()


@needs_compiler
def test_layers_it_does_not_compute_are_refused(base):
    fast = lean(base.layers[0])
    assert native_layer.build(fast, native.pack) is not None
    odd = tiny_base(num_layers=1)  # head_dim 8: not a multiple of the vector width
    assert native_layer.build(lean(odd.layers[0]), native.pack) is None
    wrong = native_layer.NativeLayer(fast, native.pack)
    wrong.struct.eps = 0.5  # a layer whose numbers differ from its lean layer's is not used
    assert not native_layer.agrees(wrong)
    rounded = native_layer.build(fast, lambda w: native.pack(w.to(torch.bfloat16)), "bf16")
    assert rounded is not None and rounded.rounded  # bfloat16 weights: within the bf16 tolerance of the exact layer
    wrong = native_layer.NativeLayer(fast, lambda w: native.pack(w.to(torch.bfloat16)), "bf16")
    wrong.struct.eps = 0.5
    assert not native_layer.agrees(wrong)


@needs_compiler
def test_a_layer_binds_again_only_when_its_cache_buffers_change(base, monkeypatch):
    """bind() reads the cache's key and value addresses once per cache and buffer change (SlotCache.version): not on
    every forward, and again after the rows were cut (new buffers) or for another cache."""
    from specdec.sampling.cache import SlotCache

    layer = native_layer.NativeLayer(lean(base.layers[0]), native.pack)
    cache, like = SlotCache(16), torch.zeros(2, 1, base.hidden_size)
    assert layer.bind(cache, like) and layer.struct.keys == cache.layers[0].keys.data_ptr()
    with monkeypatch.context() as m:
        m.setattr(SlotCache, "buffers", lambda *a: pytest.fail("bound again with nothing changed"))
        assert layer.bind(cache, like)
    cache.keep_rows(torch.tensor([1]))  # new buffers: their addresses are read again
    assert layer.bind(cache, like[1:]) and layer.struct.keys == cache.layers[0].keys.data_ptr()
    other = SlotCache(16)
    assert layer.bind(other, like[1:]) and layer.struct.keys == other.layers[0].keys.data_ptr()


@pytest.mark.slow
@pytest.mark.long  # (20-40 s: HF generate in float32 beside ours on the real base)
@needs_compiler
def test_smollm2_greedy_identical_to_hf_with_native_layers(forced):
    base = load_base(device="cpu")
    ids = base.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                         return_tensors="pt").input_ids
    hf = base.model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
    with measured_kernels(base, table=table()):
        ours = generate(base, ids.tolist(), None, SamplerConfig(max_new_tokens=24, eos_token_id=[]),
                        engine=auto_engine())
    assert forced and all(forced)
    assert ours.tokens[0].tolist() == hf.tolist()


@needs_compiler
@pytest.mark.parametrize("kind", ["q8", "q4", "q4a8"])
def test_a_drafter_under_block_rounding_gets_its_native_layer_in_blocks(base, forced, kind):
    """draft_precision=q8 / q4 / q4a8: the drafter's block may also run natively from Q8_0 / Q4_1 blocks of its weights
    (layer.c's q8 / q4 form, checked to float32 rounding against its lean forward on the rounded numbers; q4a8's, whose
    products also round their inputs to int8, to that rounding) where that way is chosen; the base's layers stay
    exact, and decoding stays lossless."""
    drafter = EarlyExit(base, exit_layers=[1], num_extra_layers=1).eval()
    block = lean(drafter.exits[0].blocks[0])
    prompts = [list(range(30, 49))]
    cfg = SamplerConfig(max_new_tokens=12, eos_token_id=[], gamma=3)
    # (q4a8's offered even without VNNI; forced: each stack's way the most rounded it has, the kind's)
    every = KernelTable(None, rows=(1, 2, 4, 8, 16), quant=kernels.QUANT, forced=True)
    with measured_kernels(base, drafter, table=every, bf16=[drafter], quant=kind):
        assert native_of(block) is not None and native_of(block).form == kind and native_of(block).rounded
        assert all(isinstance(p, Compact) and p.kind == kind for p in native_of(block).packed)
        assert all(not native_of(lean(layer)).rounded for layer in base.layers)  # the base's own: exact
        fast = generate(base, prompts, drafter, cfg, engine=auto_engine(draft_precision=kind))
    stock = generate(base, prompts, drafter, cfg, engine=auto_engine(name="eager"))
    assert fast.tokens.tolist() == stock.tokens.tolist()
    odd = native_layer._operand(table(), kind)(torch.randn(64, 40))  # rows that are not whole groups of 32 ...
    assert isinstance(odd, native.Packed) and odd.blocks.dtype == torch.bfloat16  # ... keep their bfloat16 copy
