"""specdec.engines.build: which engine a config names on which device, one-line refusals, and the engine yamls: auto's
settings are EngineConfig's defaults, the others state only their delta."""

import dataclasses
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specdec.engines import EngineConfig, build
from specdec.engines.cpu import native
from specdec.engines.cpu.engine import CpuEngine
from specdec.engines.cuda.engine import CudaEngine
from specdec.engines.eager.engine import EagerEngine
from specdec.sampling.engine import REFERENCE, Engine


def test_auto_picks_the_devices_engine():
    assert type(build(EngineConfig(), "cpu")) is CpuEngine
    assert type(build(EngineConfig(), "cuda")) is CudaEngine  # (built, not run: no GPU needed)
    assert type(build(EngineConfig(cpu_kernels="stock"), "cpu")) is EagerEngine
    assert type(build(EngineConfig(cpu_kernels="native"), "cpu")) is CpuEngine
    assert type(build(EngineConfig(name="eager"), "cuda")) is EagerEngine


def test_each_engine_is_the_interface_and_the_reference_takes_no_fast_path():
    for engine in (build(EngineConfig(), "cpu"), build(EngineConfig(name="eager"), "cpu"), REFERENCE):
        assert isinstance(engine, Engine)
    assert REFERENCE.fast_layer(object()) is None and REFERENCE.greedy_head(object()) is None
    assert REFERENCE.feature_entries(None, None, None, None, None, "s", 0, lambda: "theirs") == "theirs"
    assert not REFERENCE.graphs and CudaEngine().graphs and not CudaEngine(EngineConfig(cuda_graphs=False)).graphs


def test_an_engine_for_another_device_is_refused_in_one_line():
    with pytest.raises(ValueError, match="engine: cuda engine for a base on cpu; use engine=auto or engine=eager"):
        build(EngineConfig(name="cuda"), "cpu")
    with pytest.raises(ValueError, match="engine: cpu engine for a base on cuda"):
        build(EngineConfig(name="cpu"), "cuda")


@pytest.mark.parametrize("kw, message", [(dict(name="tpu"), "name must be one of auto, eager, cpu, cuda"),
                                         (dict(cpu_kernels="fast"), "cpu_kernels must be measured, native or stock"),
                                         (dict(cuda_kernels="x"), "cuda_kernels must be measured, unfused or stock"),
                                         (dict(draft_precision="q2"), "draft_precision must be fp32")])
def test_settings_are_checked(kw, message):
    with pytest.raises(ValueError, match=f"engine: {message}"):
        EngineConfig(**kw)


@pytest.mark.parametrize("name, delta", [("auto", {}), ("cpu", dict(name="cpu")), ("cuda", dict(name="cuda")),
                                         ("eager", dict(name="eager")), ("demo", dict(draft_precision="q4a8"))])
def test_engine_yamls_are_the_code_defaults_and_their_delta(name, delta):
    configs = Path(__file__).resolve().parents[2] / "configs"
    with initialize_config_dir(str(configs), version_base="1.3"):
        node = OmegaConf.to_container(compose("evaluate", overrides=[f"engine={name}"]).engine)
    assert node.pop("_target_") == "specdec.engines.config.EngineConfig"
    assert node == dataclasses.asdict(EngineConfig(**delta))


def test_whole_chains_off_never_calls_a_native_chain(monkeypatch):
    """whole_chains=false: the CPU engine declines every whole chain (the sampler drafts depth by depth) without calling
    the native one, and its entries race is decided for the PyTorch path; on: the native calls are asked, and the
    entries race is decided for them under cpu_kernels=native, timed under measured."""
    from specdec.engines.cpu import native_chain

    asked = []
    monkeypatch.setattr(native_chain, "draft", lambda *a: asked.append("chain") or "drafted")
    monkeypatch.setattr(native_chain, "head_chain", lambda *a: asked.append("heads") or "drafted")
    monkeypatch.setattr(native_chain, "entries", lambda *a: a[-1].winner)
    for whole, kernels, winner in [(False, "native", False), (True, "native", True), (True, "measured", None)]:
        asked.clear()
        engine = build(EngineConfig(whole_chains=whole, cpu_kernels=kernels), "cpu")
        drafter = torch.nn.Linear(1, 1)
        chain = engine.feature_chain(drafter, None, None, None, 2, "store", -1)
        heads = engine.head_chain(drafter, [], None, None, None, None)
        assert (chain, heads) == (("drafted", "drafted") if whole else (None, None))
        assert asked == (["chain", "heads"] if whole else [])
        assert engine.feature_entries(drafter, None, None, None, None, "store", -1, lambda: None) is winner


def test_paths_name_what_each_forward_runs():
    """The report header's engine paths: the reference engine's HF forwards, the eager engine's lean layers, and the
    CPU engine's per row count (native layers and kernels where cpu_kernels=native takes them everywhere), with a
    drafter's own entries; whole_chains=false says its chain runs depth by depth."""
    from specdec.base import tiny_base
    from specdec.drafters.hydra import Hydra

    base = tiny_base(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, num_layers=2)
    drafter = Hydra(base, num_heads=2).eval()
    assert REFERENCE.paths(base)["layers"] == "each layer's own HF forward"
    assert "lean layers" in build(EngineConfig(name="eager"), "cpu").paths(base)["layers"]
    paths = build(EngineConfig(cpu_kernels="native"), "cpu").paths(base, [drafter])
    assert {"base layers", "base products", "lm_head", "verify argmax", "hydra products", "hydra chain"} <= set(paths)
    if native.available():
        assert paths["base layers"].startswith("1-16 rows: native layer.c") and paths["hydra chain"].startswith("one native")
    off = build(EngineConfig(cpu_kernels="native", whole_chains=False), "cpu").paths(base, [drafter])
    assert off["hydra chain"] == "depth by depth"
    stock = build(EngineConfig(cpu_kernels="stock"), "cpu").paths(base, [drafter])
    assert not any("native" in path for path in stock.values())
