"""Every config composes, and every `_target_` node's keys bind to its callable's signature (torchtune-style
airtight configs) without building anything."""

import importlib
import inspect
import shlex
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf

from conftest import CONFIGS

GLOBAL_GROUPS = {"experiment", "debug", "hparams_search", "cluster"}  # `# @package _global_` options
GROUP_FILES = sorted(p for p in CONFIGS.glob("*/*.yaml") if p.parent.name not in {"hydra", "paths", *GLOBAL_GROUPS})
GLOBAL_FILES = sorted(p for p in CONFIGS.glob("*/**/*.yaml") if p.parent.relative_to(CONFIGS).parts[0] in GLOBAL_GROUPS)


def _locate(path: str):
    module, _, name = path.rpartition(".")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _check_targets(node, where: str) -> int:
    """Recursively bind each _target_ node's keys to the callable's parameters; returns nodes checked."""
    n = 0
    if isinstance(node, DictConfig) and node._is_none():
        return 0
    if isinstance(node, DictConfig):
        if "_target_" in node:
            fn = _locate(node._target_)
            sig = inspect.signature(fn.__init__ if inspect.isclass(fn) else fn)
            params = sig.parameters
            accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
            keys = [k for k in node.keys() if not str(k).startswith("_")]
            unknown = [k for k in keys if k not in params]
            assert accepts_kwargs or not unknown, f"{where}: {node._target_} has no parameter(s) {unknown}"
            n += 1
        for k, v in node.items_ex(resolve=False):
            n += _check_targets(v, f"{where}.{k}")
    elif isinstance(node, ListConfig):
        for i, v in enumerate(node):
            n += _check_targets(v, f"{where}[{i}]")
    return n


@pytest.mark.parametrize("path", GROUP_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_group_option_composes_and_binds(path: Path, tmp_path):
    group, option = path.parent.name, path.stem
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        # groups that train.yaml does not list (sampler/, prompts/ belong to evaluate.yaml) are appended
        base = compose("train", overrides=[f"paths.output_dir={tmp_path}"])
        prefix = "" if group in base else "+"
        cfg = compose("train", overrides=[f"{prefix}{group}={option}", f"paths.output_dir={tmp_path}"])
    node = cfg[group]
    assert _check_targets(node, f"{group}/{option}") >= 1 or group in {"callbacks", "logger"}


@pytest.mark.parametrize("path", GLOBAL_FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_global_configs_compose(path: Path, tmp_path):
    """Each global option composes with its entry point (a table's eval*.yaml and tune*.yaml with evaluate.yaml),
    and its targets bind, the Hydra sweeper and launcher it picks included."""
    group, *option = path.relative_to(CONFIGS).with_suffix("").parts  # experiment/drafters/eval -> experiment=drafters/eval
    primary = "evaluate" if path.stem.startswith(("eval", "tune")) else "train"
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose(primary, overrides=[f"{group}={'/'.join(option)}", f"paths.output_dir={tmp_path}"],
                      return_hydra_config=True)
    OMEGA = OmegaConf.to_container(cfg, resolve=False)
    assert OMEGA["base"]["_target_"]
    for key in cfg:
        if key != "hydra":
            _check_targets(cfg[key], f"{group}: {key}")
    for node in ("launcher", "sweeper"):  # the Hydra plugins it picks
        _check_targets(cfg.hydra[node], f"{group}: hydra.{node}")


def test_default_train_config_resolves(tmp_path):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.output_dir={tmp_path}"])
    cfg.paths.cache_dir = str(tmp_path)
    OmegaConf.resolve(cfg)
    assert cfg.optimized_metric == "val/expected_tau"
    assert _check_targets(cfg, "train") >= 6


@pytest.mark.parametrize("target", ["distill", "distill-general"])
def test_makefile_distill_commands_compose(target: str):
    """The overrides each `make distill*` recipe passes compose with distill.yaml, the openai backend's included
    (a key named like a config group cannot be overridden from the command line: Hydra reads it as the group)."""
    root = CONFIGS.parent
    dry = subprocess.run(["make", "-n", "-B", target, "DISTILL_ENGINE=openai"], cwd=root, capture_output=True,
                         text=True, check=True).stdout.replace("\\\n", " ")  # a recipe's continued lines as one
    commands = [shlex.split(line) for line in dry.splitlines() if "-m specdec.data.distill" in line]
    assert commands, dry
    for argv in commands:
        overrides = [a for a in argv[argv.index("specdec.data.distill") + 1 :] if not a.startswith("hydra.")]
        with initialize_config_dir(str(CONFIGS), version_base="1.3"):
            cfg = compose("distill", overrides=overrides)
        assert cfg.backend in ("specdec", "openai")
        _check_targets(cfg.decode_engine, f"{target}: decode_engine")
        if target == "distill-general":  # requests, their answers, then the follow-ups to the answered ones
            assert cfg.backend == "openai" and cfg.prompts._target_ in ("specdec.data.magpie.requests",
                                                                        "specdec.data.magpie.follow_ups")
    if target == "distill-general":
        assert cfg.prompts._target_ == "specdec.data.magpie.follow_ups" and len(commands) == 3
