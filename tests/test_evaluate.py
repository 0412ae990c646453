"""evaluate.py end to end on the tiny base with a Spec-Bench-style question.jsonl (multi-turn, 2 categories)."""

import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from conftest import CONFIGS
from specdec.base import tiny_base
from specdec.checkpoint import BaseMismatchError, save_drafter
from specdec.drafters.medusa import Medusa
from specdec.evaluation import evaluate


@pytest.fixture
def questions(tmp_path) -> Path:
    rows = [
        {"question_id": 1, "category": "coding", "turns": ["def add(a, b):", "now subtract"]},
        {"question_id": 2, "category": "coding", "turns": ["print hello"]},
        {"question_id": 3, "category": "writing", "turns": ["a haiku about CPUs"]},
    ]
    p = tmp_path / "question.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    return p


def _cfg(tmp_path, overrides):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("evaluate", overrides=[
            "base=tiny", f"paths.output_dir={tmp_path}/eval", f"paths.cache_dir={tmp_path}/cache",
            "sampler.max_new_tokens=12", "hf.early_exit_layer=1", "wandb.mode=offline", *overrides])



def test_lookup_runs_each_drafter_with_and_without_it_and_alone(tmp_path, questions):
    tiny = tiny_base()
    save_drafter(Medusa(tiny, num_heads=3), tmp_path / "medusa")
    cfg = _cfg(tmp_path, ["prompts=jsonl", f"prompts.path={questions}", f"drafters=[{tmp_path}/medusa]",
                          "sampler.gamma=3", "sampler.eos_token_id=[]", "sampler.max_new_tokens=24",
                          "sampler.lookup_tokens=4", "sampler.lookup_min_ngram=1", "peers=[]"])
    report = evaluate(cfg)
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["ar (ours)", "medusa", "medusa+lookup", "lookup (ours)"]
    assert all(r["greedy_identical"] for r in rows.values())
    assert "leviathan" in rows["medusa"] and "leviathan" not in rows["medusa+lookup"]  # mixed rounds: no γ model
    assert rows["lookup (ours)"]["tau"] > 1.0  # the tiny base's answers repeat themselves: lookup rounds were taken
    assert "lookup" in report["header"]["draft"]

def test_evaluate_end_to_end(tmp_path, questions):
    tiny = tiny_base()
    save_drafter(Medusa(tiny, num_heads=3), tmp_path / "medusa")
    cfg = _cfg(tmp_path, ["prompts=jsonl", f"prompts.path={questions}", f"drafters=[{tmp_path}/medusa]",
                          "sampler.gamma=3", "sampler.eos_token_id=[]"])
    report = evaluate(cfg)
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["ar (ours)", "medusa", "hf_generate", "hf_prompt_lookup", "hf_early_exit"]
    # T = 0: every lossless method reproduces plain greedy decoding, token for token
    assert all(r["greedy_identical"] for r in rows.values())
    assert rows["ar (ours)"]["tau"] == 1.0 and rows["ar (ours)"]["speedup_vs_ar"] == 1.0
    assert rows["medusa"]["tau"] >= 1.0 and 0.0 <= rows["medusa"]["alpha"] <= 1.0
    assert rows["medusa"]["leviathan"]["gamma"] == 3
    lev = rows["medusa"]["leviathan"]  # the time split the model leaves out is reported, in T_1
    assert lev["ar_step"] > 0 and math.isfinite(lev["overhead"])
    # and it adds up: the speedup after the first token is τ·a/(v + γc + o) (untrained heads: no round is cut short
    # by the token limit, so τ is the tokens per round)
    assert lev["measured_speedup_decode"] == pytest.approx(
        rows["medusa"]["tau"] * lev["ar_step"] / (lev["break_even_tau"] + lev["overhead"]), rel=0.05)
    assert set(rows["medusa"]["per_category_speedup"]) == {"coding", "writing"}
    # 4 turns in all, 12 tokens each (EOS disabled)
    assert rows["hf_generate"]["tokens"] == rows["ar (ours)"]["tokens"] == 4 * 12
    out = tmp_path / "eval"
    for name in ["report.md", "results.csv", "results.json", "acceptance_by_position.png", "speedup.png"]:
        assert (out / name).stat().st_size > 0
    md = (out / "report.md").read_text()
    assert "```yaml" in md and "| medusa | yes |" in md and "speedup vs HF generate" in md
    # which path each forward took: the engine's name and one line per forward kind, the drafter's included
    engine = report["header"]["engine"]
    assert engine["name"] == "cpu" and {"base layers", "lm_head", "verify argmax"} <= set(engine)
    assert f"- **engine**: {engine['name']}" in md and f"  - verify argmax: {engine['verify argmax']}" in md
    # nothing overwritten silently: the same config returns the earlier report, another config is refused
    before = (out / "results.json").stat().st_mtime_ns
    assert evaluate(cfg)["header"] == json.loads((out / "results.json").read_text())["header"]
    assert (out / "results.json").stat().st_mtime_ns == before
    cfg.sampler.gamma = 2
    with pytest.raises(FileExistsError, match="another config"):
        evaluate(cfg)


def test_refuses_drafter_of_another_base(tmp_path, questions):
    save_drafter(Medusa(tiny_base(seed=1), num_heads=1), tmp_path / "other")
    cfg = _cfg(tmp_path, ["prompts=jsonl", f"prompts.path={questions}", f"drafters=[{tmp_path}/other]", "peers=[]"])
    with pytest.raises(BaseMismatchError):
        evaluate(cfg)


def test_methods_take_turns_and_a_killed_evaluation_resumes_where_it_stopped(tmp_path, questions, monkeypatch):
    import specdec.evaluation.run as ev

    tiny = tiny_base()
    save_drafter(Medusa(tiny, num_heads=2), tmp_path / "medusa")
    cfg = _cfg(tmp_path, ["prompts=jsonl", f"prompts.path={questions}", f"drafters=[{tmp_path}/medusa]",
                          "peers=[hf_generate]", "sampler.gamma=2", "sampler.eos_token_id=[]", "warmup=false"])
    real = ev._answer_turn_by_turn
    prompt_no = {"def add(a, b):": 1, "print hello": 2, "a haiku about CPUs": 3}  # by first turn
    calls, killed = [], [True]  # calls: (method, prompt) in the order they ran

    def record(base, m, chunk):  # the first process is killed when hf_generate starts its second prompt
        if killed[0] and m.name == "hf_generate" and ("hf_generate", 1) in calls:
            raise KeyboardInterrupt
        calls.append((m.name, prompt_no[chunk[0]["turns"][0]]))
        return real(base, m, chunk)

    monkeypatch.setattr(ev, "_answer_turn_by_turn", record)
    with pytest.raises(KeyboardInterrupt):
        evaluate(cfg)
    # every method answered prompt 1 before any answered prompt 2, our methods' order rotating from turn to turn and
    # the HF peer last in each
    assert calls == [("ar (ours)", 1), ("medusa", 1), ("hf_generate", 1), ("medusa", 2), ("ar (ours)", 2)]
    assert not (tmp_path / "eval" / "results.json").exists()

    killed[0] = False
    report = evaluate(cfg)
    # each answered prompt was kept as it finished and read back: no (method, prompt) ran twice, none is missing
    assert sorted(calls) == sorted((m, q) for m in ("ar (ours)", "medusa", "hf_generate") for q in (1, 2, 3))
    assert set(report["header"]["resumed"]) == {"ar (ours)", "medusa", "hf_generate"}
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["medusa"]["greedy_identical"] and rows["hf_generate"]["greedy_identical"]
    assert rows["ar (ours)"]["tokens"] == rows["hf_generate"]["tokens"] == 4 * 12  # all 4 turns of the 3 prompts


def test_leviathan_charges_adaptive_rounds_their_own_verify_cost(tmp_path, questions, monkeypatch):
    """With an adaptive draft length a round verifies γ_s + 1 tokens: the check measures every block size up to γ + 1
    and charges the mean of the rounds' own costs, with the mean draft length (not v(γ+1) and γ for every round)."""
    asked = []

    def linear_times(base, ns, **kwargs):  # T_n = n seconds: then the mean v over rounds is the mean γ_s + 1
        asked.append(list(ns))
        return {n: [float(n)] * kwargs["reps"] for n in ns}

    monkeypatch.setattr("specdec.evaluation.run.forward_times", linear_times)
    tiny = tiny_base()
    save_drafter(Medusa(tiny, num_heads=3), tmp_path / "medusa")
    cfg = _cfg(tmp_path, ["prompts=jsonl", f"prompts.path={questions}", f"drafters=[{tmp_path}/medusa]",
                          "sampler.gamma=3", "sampler.eos_token_id=[]", "sampler.adaptive_threshold=0.5", "peers=[]"])
    report = evaluate(cfg)
    row = {r["method"]: r for r in report["rows"]}["medusa"]
    lev = row["leviathan"]
    assert asked[0] == [1, 2, 3, 4] and len(asked) == 1 + 3  # timed before the methods and after each of 3 turns
    assert all(ns == asked[0] for ns in asked)
    assert row["draft_len"] < 3  # the untrained heads are unconfident: chains end early
    assert lev["verify_cost"] == pytest.approx(row["draft_len"] + 1)
    assert lev["break_even_tau"] == pytest.approx(lev["verify_cost"] + row["draft_len"] * lev["c"])
    assert lev["predicted_speedup_measured_tau"] == pytest.approx(row["tau"] / lev["break_even_tau"])


def test_passes_give_a_spread_and_identity_is_against_an_independent_reference(tmp_path, questions, monkeypatch):
    """passes=2: every method answers every prompt twice, the passes taking turns; each speedup has a per-pass ratio
    and a standard deviation. greedy-identical compares with HF generate in float32, run apart (untimed) when the
    hf_generate peer is not in the run; a method that does not reproduce it reads NO; without a reference, n/a."""
    cfg = _cfg(tmp_path, ["prompts=jsonl", f"prompts.path={questions}", "sampler.eos_token_id=[]", "peers=[]",
                          "passes=2"])
    report = evaluate(cfg)
    rows = {r["method"]: r for r in report["rows"]}
    ar = rows["ar (ours)"]
    assert ar["greedy_identical"] is True and report["header"]["identity_reference"].startswith("HF generate")
    assert len(ar["speedup_vs_ar_passes"]) == 2 and ar["speedup_vs_ar_sd"] == 0.0
    assert ar["tokens"] == 2 * 4 * 12 and len(ar["per_prompt_speedup_vs_ar"]) == 2 * 3
    assert (tmp_path / "eval" / "reference.json").exists()
    assert "× 2 passes" in report["header"]["prompts"]
    # a reference the AR loop does not reproduce (every answer's last token changed): NO
    from specdec.evaluation import run, runs

    hf = run.hf

    def changed(*args):
        run = hf(*args)
        return lambda prompts: [runs.Run(r.tokens[:-1] + [r.tokens[-1] + 1], r.seconds) for r in run(prompts)]

    monkeypatch.setattr(run, "hf", changed)
    again = evaluate(_cfg(tmp_path, ["prompts=jsonl", f"prompts.path={questions}", "sampler.eos_token_id=[]",
                                     "peers=[]", "passes=2", "overwrite=true"]))
    assert {r["method"]: r for r in again["rows"]}["ar (ours)"]["greedy_identical"] is False
    off = evaluate(_cfg(tmp_path / "off", ["prompts=jsonl", f"prompts.path={questions}", "peers=[]",
                                           "identity_reference=false"]))
    assert off["rows"][0]["greedy_identical"] is None and "n/a" in (tmp_path / "off" / "eval" / "report.md").read_text()


def test_humaneval_splits_are_disjoint_halves():
    from specdec.data.prompts import humaneval

    report, tune = humaneval(split="report"), humaneval(split="tune")
    assert len(report) == len(tune) == 82 and not {p["id"] for p in report} & {p["id"] for p in tune}
    assert report[0]["id"] == "HumanEval/0" and tune[0]["id"] == "HumanEval/82"
    with pytest.raises(ValueError, match="split must be report, tune or null"):
        humaneval(split="test")


def test_llama_cpp_speculation_rows_claim_no_losslessness(tmp_path, monkeypatch):
    """llama.cpp's plain decode is a plain decoder (lossless: yes); its own speculation (lookup, a draft model) is its
    code, whose acceptance rule nothing here checks, so its row reads "not checked", never yes. Typical acceptance
    reads lossy."""
    from contextlib import ExitStack

    import hydra

    from specdec.evaluation import methods, report
    from specdec.sampling.engine import REFERENCE

    class Server:  # stands in for llama-server: started by build_methods, never asked for an answer here
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(methods.llama_cpp, "LlamaServer", Server)
    cfg = _cfg(tmp_path, ["peers=[llama_cpp,llama_cpp_lookup]", f"llama_cpp.gguf={tmp_path}/base.gguf"])
    with ExitStack() as servers:
        built = methods.build_methods(cfg, tiny_base(), {}, hydra.utils.instantiate(cfg.sampler), REFERENCE, servers)
    lossless = {m.name: m.lossless for m in built}
    assert lossless == {"ar (ours)": True, "llama_cpp": True, "llama_cpp_lookup": None}
    cells = {name: report.lossless_cell({"lossless": v}) for name, v in lossless.items()}
    assert cells == {"ar (ours)": "yes", "llama_cpp": "yes", "llama_cpp_lookup": "not checked"}
    typical = _cfg(tmp_path, ["sampler=typical", "sampler.temperature=1.0"])
    assert report.lossless_cell({"lossless": hydra.utils.instantiate(typical.sampler).lossless}) == "**no (lossy)**"
