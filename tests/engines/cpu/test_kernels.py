"""Matmul kernels chosen by measurement (specdec/engines/cpu/kernels.py): a missing or wrong kernel is left out, the
choice is cached per machine, and every kernel path decodes the same greedy tokens as the stock forward."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from specdec.engines.cpu.kernels import CANDIDATES, Candidate, KernelTable, measured_kernels
from specdec.sampling.decode import SamplerConfig, generate

from conftest import auto_engine

ROWS = (1, 2, 5, 8)


def _missing(x, w):
    raise RuntimeError("kernel not in this build")


def test_missing_or_wrong_kernels_fall_back(tmp_path):
    cands = {"linear": CANDIDATES["linear"], "missing": Candidate(_missing),
             "wrong": Candidate(lambda x, w: torch.zeros(x.shape[0], w.shape[0]))}
    table = KernelTable(tmp_path / "k.json", candidates=cands, rows=ROWS)
    w = torch.randn(48, 16)
    table.prepare([w, w.clone()])
    assert set(table.choice["48x16:float32"].values()) == {"linear"}
    assert set(table.timings["48x16:float32"][1]) == {"linear"}  # the other two were never timed
    assert table.plan(w) == [None] * (max(ROWS) + 1)  # linear = the stock path, no extra call


def test_nothing_usable_means_stock(tmp_path):
    table = KernelTable(tmp_path / "k.json", candidates={"missing": Candidate(_missing)}, rows=ROWS)
    lin = torch.nn.Linear(16, 48, bias=True)
    table.prepare([lin.weight])
    with measured_kernels(lin, table=table):
        assert "forward" not in lin.__dict__  # nothing patched
    x = torch.randn(3, 16)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def _slow(x, w):
    # 20 ms: far beyond what a preempted pass of the tiny `linear` can take on a loaded 2-core machine (a 2 ms sleep
    # once lost a re-check to such a pass while another job shared the cores)
    time.sleep(0.02)
    return F.linear(x, w)


# two candidates whose order no timing noise can flip
CLEAR = {"linear": CANDIDATES["linear"], "slow": Candidate(_slow)}


def test_choice_is_cached_per_machine(tmp_path):
    path = tmp_path / "k.json"
    first = KernelTable(path, candidates=CLEAR, rows=ROWS)
    first.prepare([torch.randn(64, 32)])
    assert first.measure_s > 0 and set(first.choice["64x32:float32"].values()) == {"linear"}
    again = KernelTable(path, candidates=CLEAR, rows=ROWS)
    again.prepare([torch.randn(64, 32)])
    assert again.measure_s == 0 and again.choice == first.choice
    assert again.check_s > 0 and again.remeasured == []  # re-checked, and it holds


@pytest.mark.parametrize("stored", ["slow", "gone"])
def test_a_choice_measured_on_a_busy_machine_is_measured_again(tmp_path, stored):
    """A table measured while another job ran (here: it says the slow kernel won), or naming a kernel this process
    lacks, fails the once-per-process re-check and is measured again and saved."""
    path = tmp_path / "k.json"
    busy = KernelTable(path, candidates=CLEAR, rows=ROWS)
    busy.choice = {"64x32:float32": {r: stored for r in ROWS}}
    busy.timings = {"64x32:float32": {r: {stored: 1e-6, "linear": 1.0} for r in ROWS}}
    busy.save()
    table = KernelTable(path, candidates=CLEAR, rows=ROWS)
    table.prepare([torch.randn(64, 32)])
    assert table.remeasured == ["64x32:float32"] and table.measure_s > 0
    assert set(table.choice["64x32:float32"].values()) == {"linear"}
    assert KernelTable(path, candidates=CLEAR, rows=ROWS).choice == table.choice


def test_a_table_measured_among_other_candidates_is_measured_again(tmp_path):
    """A stored table that never saw a candidate (one added since, or another native source) is not re-checked shape
    by shape but measured again: a per-shape re-check only catches a choice that became 1.5x slower."""
    path = tmp_path / "k.json"
    KernelTable(path, candidates={"linear": CANDIDATES["linear"]}, rows=ROWS).prepare([torch.randn(64, 32)])
    table = KernelTable(path, candidates=CLEAR, rows=ROWS)
    assert table.choice == {}
    table.prepare([torch.randn(64, 32)])
    assert table.measure_s > 0 and set(table.timings["64x32:float32"][1]) == {"linear", "slow"}


@pytest.mark.parametrize("name", [n for n in CANDIDATES if n != "linear"])
def test_every_kernel_path_is_greedy_identical(tiny, name):
    """Force one kernel everywhere it runs (rows it cannot take stay on F.linear) and decode: same tokens."""
    table = KernelTable(None, candidates={name: CANDIDATES[name]}, rows=(1, 2, 4, 8, 16))
    prompts = [[5, 9, 12, 40, 7], [3, 4], [100, 101, 102]]
    cfg = SamplerConfig(max_new_tokens=10, eos_token_id=[])
    stock = generate(tiny, prompts, None, cfg, engine=auto_engine(name="eager")).tokens
    with measured_kernels(tiny, table=table):
        used = {k for c in table.choice.values() for k in c.values()}
        fast = generate(tiny, prompts, None, cfg, engine=auto_engine()).tokens
    assert torch.equal(fast, stock)
    # the kernel really ran somewhere unless this build lacks it
    x = torch.randn(1, tiny.hidden_size)  # one row: every candidate takes it (mv takes only one)
    try:
        CANDIDATES[name].run(x, (CANDIDATES[name].pack or (lambda w: w))(tiny.lm_head.weight))
    except Exception:  # noqa: BLE001
        return
    assert name in used


def test_patch_is_undone(tiny):
    table = KernelTable(None, candidates={"mm_nn": CANDIDATES["mm_nn"]}, rows=(1, 2))
    with measured_kernels(tiny, table=table):
        assert "forward" in tiny.lm_head.__dict__
    assert "forward" not in tiny.lm_head.__dict__


def test_one_kernel_for_the_whole_model_when_it_wins(tmp_path, monkeypatch):
    """arbitrate: per-shape choices that lose over a pass of the model's products to one kernel for all are overridden
    at those row counts; the outcome is cached per machine and model (the shapes in call order)."""
    path = tmp_path / "k.json"
    table = KernelTable(path, candidates=CLEAR, rows=ROWS)
    ws = [torch.randn(64, 32), torch.randn(32, 64)]
    for w in ws:  # per-shape choices as a table measured on a busy machine might hold them
        table.choice[f"{w.shape[0]}x{w.shape[1]}:float32"] = {r: "slow" for r in ROWS}
    uniform = table.arbitrate(ws)
    assert uniform == {r: "linear" for r in ROWS}  # every row count of ROWS is among WHOLE_ROWS
    assert table.plan(ws[0], uniform) == [None] * (max(ROWS) + 1)  # linear everywhere: the stock path
    assert table.plan(ws[0])[2] is not None  # the shape's own choice is unchanged
    monkeypatch.setattr(KernelTable, "_pass_time", lambda *a: pytest.fail("cached: not timed again"))
    assert KernelTable(path, candidates=CLEAR, rows=ROWS).arbitrate(ws) == uniform
    monkeypatch.undo()
    table.choice = {k: {r: "linear" for r in ROWS} for k in table.choice}
    assert "slow" not in table.arbitrate(ws[::-1]).values()  # another model (order): measured; never the slow one


def test_bf16_weights_only_for_the_drafter(tiny):
    """draft_precision=bf16: the drafter's own linears may take a BF16 candidate (chosen by measurement, under shape
    keys of their own); the base's never do, nor a linear the drafter shares with the base; and decoding stays greedy
    identical to plain decoding, since only what is drafted changes."""
    from specdec.drafters.medusa import Medusa

    drafter = Medusa(tiny, num_heads=2)  # its heads' blocks are its own; it projects with the base's lm_head
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    # every exact kernel slow, the BF16 one fast: wherever BF16 is offered, measurement picks it
    table = KernelTable(None, candidates={"slow": Candidate(_slow)}, rows=(1,),
                        bf16={"bf16": Candidate(lambda x, w: F.linear(x, w.float()), lambda w: w.bfloat16())})
    with measured_kernels(tiny, drafter, table=table, bf16=[drafter]):
        chosen = {k: set(c.values()) for k, c in table.choice.items()}
        own = [m for m in drafter.modules() if type(m) is torch.nn.Linear]
        assert own and all(chosen[f"{m.weight.shape[0]}x{m.weight.shape[1]}:float32~bf16"] == {"bf16"} for m in own)
        assert all(kernels == {"slow"} for k, kernels in chosen.items() if not k.endswith("~bf16"))
        lm_head = tiny.lm_head.weight.shape
        assert f"{lm_head[0]}x{lm_head[1]}:float32~bf16" not in chosen  # shared with the base: exact
    prompts = [[5, 9, 12, 40, 7], [3, 4]]
    cfg, fast = SamplerConfig(max_new_tokens=10, gamma=2, eos_token_id=[]), auto_engine(draft_precision="bf16")
    ar = generate(tiny, prompts, None, cfg, engine=fast).tokens
    assert torch.equal(generate(tiny, prompts, drafter, cfg, engine=fast).tokens, ar)


def test_a_drafter_sized_weight_is_timed_from_memory(tmp_path, monkeypatch):
    """A shape whose weights fit a large cache (a drafter's single 8192x576-like weight) is timed with each candidate's
    operands evicted before its pass: timed warm, the candidates that share the weight warmed it for each other. Small
    weights (tests' tiny models) are timed as they lie, and so is every shape where the library is missing."""
    from specdec.engines.cpu import kernels, native

    if not native.available():
        pytest.skip("no native library (no C compiler)")
    evicted: list[int] = []
    monkeypatch.setattr(native, "evict", lambda t: evicted.append(t.data_ptr()))
    packed = Candidate(CANDIDATES["linear"].run, lambda w: w.clone())  # an operand of its own, like a packed copy
    table = KernelTable(tmp_path / "k.json", candidates={"linear": CANDIDATES["linear"], "copy": packed}, rows=(1,))
    big = torch.randn(kernels.COLD_BYTES // 4 // 256 + 1, 256)  # just over COLD_BYTES
    table._time([big], 1, 3, table.candidates)
    assert evicted.count(big.data_ptr()) == 3  # `linear` reads the weight itself: evicted before each of its passes
    assert len(evicted) == 6  # and the copy's operand as often
    evicted.clear()
    table._time([torch.randn(64, 32)], 1, 3, table.candidates)
    assert evicted == []
    monkeypatch.setattr(native, "available", lambda: False)
    table._time([big], 1, 3, table.candidates)
    assert evicted == []


def test_eviction_keeps_the_data():
    from specdec.engines.cpu import native

    if not native.available():
        pytest.skip("no native library (no C compiler)")
    t = torch.randn(1000, 33)  # not a whole number of cache lines
    before = t.clone()
    native.evict(t)
    native.evict(t[1:, 1:].contiguous())
    torch.testing.assert_close(t, before, rtol=0, atol=0)


def test_prefill_buckets_time_few_weights_and_cover_their_rows(tmp_path):
    """Row buckets past LARGE_ROWS (a prompt's prefill) are measured on at most LARGE_WEIGHTS weights (compute-bound:
    the first-run measurement stays short), and a product of any row count up to the largest bucket takes the kernel
    measured for the bucket at or above it; past the largest, the stock product."""
    from specdec.engines.cpu import kernels

    seen = []

    def counting(x, w):
        seen.append(x.shape[0])
        return F.linear(x, w)

    cands = {"linear": CANDIDATES["linear"], "counted": Candidate(counting)}
    table = KernelTable(tmp_path / "k.json", candidates=cands, rows=(1, 2, kernels.LARGE_ROWS + 1))
    ws = [torch.randn(48, 16) for _ in range(8)]
    table.prepare(ws)
    big = kernels.LARGE_ROWS + 1
    assert seen.count(big) <= 1 + 3 * kernels.LARGE_WEIGHTS  # the correctness check, then 3 passes over 4 weights
    assert seen.count(1) > 3 * kernels.LARGE_WEIGHTS  # small row counts stream every weight
    table.choice["48x16:float32"] = {1: "linear", 2: "linear", big: "counted"}
    table._by_rows.clear()
    plan = table.plan(ws[0])
    assert len(plan) == big + 1 and plan[3] is not None and plan[big] is not None and plan[2] is None
    assert kernels.ROWS[-1] >= 256  # a HumanEval chat prompt's prefill (100-300 tokens) is measured, not assumed


@torch.no_grad()
def test_a_drafters_norm_may_be_one_native_call_within_float32_rounding():
    """SmolLM2's width: exact, a form bitwise the norm's own (F.rms_norm here: the native sum's order differs); for a
    drafter whose products may round (exact=False), the native call, within float32 rounding; float64 stays exact."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from specdec.engines.cpu import native
    from specdec.engines.cpu.kernels import norm_form

    if not native.available():
        pytest.skip("no native library here")
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(2))
    exact, drafting = norm_form(norm), norm_form(norm, exact=False)
    assert exact is not norm and torch.equal(exact(x), norm(x))
    assert drafting.__name__ == "native_norm"
    torch.testing.assert_close(drafting(x), norm(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(drafting(x.view(3, 1, 576)), norm(x).view(3, 1, 576), rtol=1e-5, atol=1e-6)
    assert norm_form(norm.double(), exact=False) is norm


@pytest.mark.parametrize("precision", ["fp32", "q8"])
def test_cpu_kernels_native_measures_nothing_and_decodes_as_the_reference(tiny, monkeypatch, precision):
    """cpu_kernels=native (what the test suite runs): every shape takes its first native kernel that passes the check,
    the native layers attach at every row count, nothing is timed or stored; greedy decoding, plain and speculative,
    gives the eager engine's tokens."""
    from specdec.drafters.medusa import Medusa
    from specdec.engines.cpu import native, native_layer

    monkeypatch.setattr(KernelTable, "_time", lambda *a, **k: pytest.fail("a forced table timed a kernel"))
    monkeypatch.setattr(native_layer, "measure", lambda *a, **k: pytest.fail("a forced table timed a layer"))
    drafter = Medusa(tiny, num_heads=2)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.2)
    prompts = [[5, 9, 12, 40, 7], [3, 4]]
    cfg = SamplerConfig(max_new_tokens=10, gamma=2, eos_token_id=[])
    want = generate(tiny, prompts, drafter, cfg, engine=auto_engine(name="eager")).tokens
    table = KernelTable(None, forced=True)
    with measured_kernels(tiny, drafter, table=table, bf16=[drafter] if precision != "fp32" else (),
                          quant="" if precision == "fp32" else precision):
        kinds = {k for c in table.choice.values() for k in c.values()}
        if native.available():
            assert kinds <= {"native_packed", "native_packed_bf16", "native_q8"} and "native_packed" in kinds
        got = generate(tiny, prompts, drafter, cfg, engine=auto_engine(draft_precision=precision)).tokens
    assert table.measure_s == 0 and table.timings == {} and table.path is None
    assert torch.equal(got, want)
