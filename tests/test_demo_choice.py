"""`make demo` trains and drafts what experiments/demo_choice.py chose on HumanEval's tuning split: the committed
choice's training overrides compose to the demo's drafter, module, data and steps, and configs/sampler/demo.yaml
drafts the chosen chain length."""

import json

from omegaconf import OmegaConf

from conftest import ROOT, compose_train, experiment_script


def test_the_demo_config_is_the_committed_choice(tmp_path):
    # one machine's choice, the one the demo states
    (path,) = ROOT.glob("experiments/results/demo_choice/*/choice.json")
    choice = json.loads(path.read_text())
    # the script's candidate list states the same overrides the choice recorded
    assert experiment_script("demo_choice").CANDIDATES[choice["family"]][0] == choice["train_overrides"]
    demo = compose_train(["experiment=demo", "data.path=cache"], tmp_path)
    chosen = compose_train([*choice["train_overrides"], "data.path=cache"], tmp_path)
    for key in ("drafter", "module", "data"):  # (the schedule names trainer.max_time unresolved: the demo's budget)
        assert OmegaConf.to_container(demo[key]) == OmegaConf.to_container(chosen[key]), key
    assert demo.trainer.max_steps == chosen.trainer.max_steps
    sampler = compose_train(["sampler=demo"], tmp_path, config_name="evaluate").sampler
    assert sampler.gamma == choice["gamma"]
