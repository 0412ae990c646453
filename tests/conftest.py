import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from specdec.base import LAST, tiny_base
from specdec.engines import EngineConfig, build
from specdec.sampling.context import SamplingContext

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
# the tests mirror specdec/'s packages; the samplers' shared fixtures (test_sampling_decode's stub drafters,
# test_sampling_mc's exact joint) and test_configs' target check are imported by name from the other folders
sys.path[:0] = [str(Path(__file__).parent / "sampling"), str(Path(__file__).parent)]


# The suite never measures kernels (make bench does): its engines take every CPU fast path that is switched on wherever
# it runs (cpu_kernels=native), and each test that runs one checks it against the reference (or a path switched off)
TEST_ENGINE = dict(cpu_kernels="native")


def auto_engine(device: str = "cpu", **settings):
    """The engine EngineConfig(**settings) names for a base on `device` (auto on a CPU: the CPU engine, as evaluate.py
    runs it, with its fast paths forced on rather than measured unless `settings` say cpu_kernels)."""
    return build(EngineConfig(**{**TEST_ENGINE, **settings}), device)

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
if "OMP_NUM_THREADS" not in os.environ:  # tests stay on the 2 cores CI has
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny():
    return tiny_base()


def experiment_script(name: str):
    """experiments/<name>.py imported as a module (the scripts are not a package; they import their shared
    experiments/tables.py by name, as they do when run)."""
    if str(ROOT / "experiments") not in sys.path:
        sys.path.insert(0, str(ROOT / "experiments"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # where a dataclass's string annotations are resolved
    spec.loader.exec_module(module)
    return module


def fitted(drafter, base, ids: list[int], steps: int = 30):
    """`drafter` fitted by Adam for a few steps to the tokens ids (cross-entropy of every entry at its offset), then in
    eval mode: its drafts hit on those tokens and miss elsewhere, so a test sees rounds of both kinds."""
    torch.manual_seed(0)
    x = torch.tensor([ids])
    feats = base.features(x, layers=drafter.feature_layers)
    opt = torch.optim.Adam(drafter.parameters(), 1e-2)
    for _ in range(steps):  # entry j at t drafts t + 1 + offset_j
        logits = drafter.forward_train(feats, x).logits[0]  # [T, K, V]
        loss = sum(torch.nn.functional.cross_entropy(logits[: len(ids) - 1 - o, j], x[0, 1 + o :])
                   for j, o in enumerate(drafter.target_offsets))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def write_corpus(d: Path) -> Path:
    """A few small text documents (python-ish) to train on: enough for a handful of 32-token blocks."""
    d.mkdir()
    for i in range(6):
        body = "\n".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(8))
        (d / f"doc{i}.txt").write_text(body)
    return d


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


def compose_train(overrides: list[str], tmp_path: Path, config_name: str = "train"):
    """In-process Hydra compose with the run/output dirs and caches under tmp_path."""
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name, overrides=[
            f"paths.log_dir={tmp_path}/logs", f"paths.cache_dir={tmp_path}/cache",
            f"paths.output_dir={tmp_path}/run", *overrides,
        ])
    return cfg


@torch.no_grad()
def prefill_and_verify(base, prompt: list[int], tree: bool, lean: bool = True, graphs: bool = False):
    """Through a SamplingContext: the prompt's prefill, then one verify call (one chain token, or a 2-branch tree:
    the root, two children of it, a grandchild of the second) -> the verify's hidden state and features
    {0, 2, LAST}."""
    # the CPU engine's forwards: native layers where a measured_kernels block around the call attached them; with
    # graphs, the CUDA engine's static forward, run on the CPU (nothing is recorded there)
    fast = build(EngineConfig(name="cpu", lean=lean, **TEST_ENGINE), "cpu")
    if graphs:
        from specdec.engines.cuda.engine import CudaEngine
        fast = CudaEngine(EngineConfig(name="cuda", lean=lean))
    ctx = SamplingContext(base, 1, 64, fast)
    ctx.commit_layout(len(prompt))
    ctx.base_forward(torch.tensor([prompt]))
    ctx.commit(torch.tensor([len(prompt)]), [len(prompt)])
    if tree:
        visible = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        ctx.tree_layout(torch.arange(4), torch.tensor([0, 1, 1, 2]), visible)
    else:
        ctx.tree_layout(torch.arange(1), torch.arange(1), torch.ones(1, 1, dtype=torch.bool))
    tokens = torch.tensor([[7, 8, 9, 10][: 4 if tree else 1]])
    return ctx.base_forward(tokens, feature_layers=(0, 2, LAST))
