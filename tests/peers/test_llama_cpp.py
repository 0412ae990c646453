"""llama.cpp as an in-run peer: refused in one line where it cannot run; where `make peers` built its tools, its
server decodes the embedded base's GGUF from our prompt token ids inside an evaluation, beside our AR loop."""

import pytest
from hydra import compose, initialize_config_dir

from conftest import CONFIGS
from specdec.base import smollm2_gguf_path
from specdec.evaluation import evaluate
from specdec.peers import llama_cpp

BUILT = llama_cpp.available()
needs_build = pytest.mark.skipif(BUILT is not None, reason=f"llama.cpp peer not built ({BUILT})")


def _cfg(tmp_path, overrides):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        return compose("evaluate", overrides=[
            f"paths.output_dir={tmp_path}/eval", f"paths.cache_dir={tmp_path}/cache", "wandb.enabled=false",
            "warmup=false", *overrides])


def test_a_base_without_a_gguf_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"peer llama_cpp needs the base as a GGUF file: llama_cpp.gguf="):
        evaluate(_cfg(tmp_path, ["base=tiny", "peers=[llama_cpp]", "prompts.limit=1"]))
    with pytest.raises(ValueError, match=r"peer llama_cpp_draft needs a drafter as GGUF: a draft_model or eagle3 "):
        evaluate(_cfg(tmp_path, ["base=tiny", "peers=[llama_cpp_draft]", "llama_cpp.gguf=base.gguf", "prompts.limit=1"]))
    with pytest.raises(ValueError, match=r"known: .*llama_cpp_lookup"):
        evaluate(_cfg(tmp_path, ["base=tiny", "peers=[llama_cpp_turbo]", "prompts.limit=1"]))


def test_missing_tools_name_the_make_target(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_PEERS", str(tmp_path / "nowhere"))
    assert "make peers" in llama_cpp.available()
    with pytest.raises(FileNotFoundError, match="make peers"):
        llama_cpp.tool("llama-server")


@needs_build
def test_server_decodes_our_token_ids_greedily_and_repeatably():
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 11173, 30, 2, 198, 1, 4093, 198, 44, 16142, 253, 11121, 30]
    with llama_cpp.LlamaServer(smollm2_gguf_path(), threads=2) as server:
        a = server.complete(prompt, 16)
        b = server.complete(prompt, 16)
    assert len(a.tokens) == 16 and all(isinstance(t, int) for t in a.tokens)
    assert a.tokens == b.tokens  # greedy, the prompt cache off: the same answer twice
    assert a.seconds > 0 and a.decode_ms > 0


@needs_build
@pytest.mark.long
def test_llama_cpp_rows_stand_beside_ours_in_one_evaluation(tmp_path):
    cfg = _cfg(tmp_path, ["prompts.limit=2", "sampler.max_new_tokens=24", "sampler.lookup_tokens=4",
                          "peers=[llama_cpp,llama_cpp_lookup]", "identity_reference=true"])
    report = evaluate(cfg)
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["ar (ours)", "lookup (ours)", "llama_cpp", "llama_cpp_lookup"]
    assert report["header"]["best_ar"] in ("ar (ours)", "llama_cpp")
    assert rows[report["header"]["best_ar"]]["speedup_vs_best_ar"] == pytest.approx(1.0)
    for name in ("llama_cpp", "llama_cpp_lookup"):
        assert rows[name]["tok_per_s"] > 0 and rows[name]["tokens"] > 0
        assert rows[name]["computes"] and "8-bit" in rows[name]["computes"]  # measured, never claimed identical
    assert rows["ar (ours)"]["greedy_identical"]  # ours against the float32 reference, not against itself
    md = (tmp_path / "eval" / "report.md").read_text()
    assert "speedup vs best AR" in md and "llama.cpp's own: 8-bit activations" in md


@needs_build
@pytest.mark.long
@pytest.mark.parametrize("family", ["draft_model", "eagle3"])
def test_our_drafters_run_as_llama_cpp_draft_models(tmp_path, family):
    """Exported to GGUF by llama.cpp's own converter, a draft model (`--model-draft`) and an EAGLE-3 drafter
    (`--spec-type draft-eagle3`) draft inside llama.cpp's server on the embedded base's GGUF."""
    import torch

    from specdec.base import load_base
    from specdec.drafters.draft_model import DraftModel
    from specdec.drafters.eagle3 import Eagle3
    from specdec.export import export, gguf

    base = load_base(device="cpu")
    if family == "draft_model":
        d = DraftModel(base, num_layers=2)  # the base's first and last layers: it drafts plausible tokens
    else:
        d = Eagle3(base, ttt_steps=2, draft_vocab_size=4096)
        d.set_draft_vocab(torch.arange(4096))
    out = export(d, "gguf", tmp_path / family)
    assert (out / gguf.FILE).stat().st_size > 1e6
    prompt = base.tokenizer(base.tokenizer.apply_chat_template([{"role": "user", "content": "Count to ten."}],
                                                               tokenize=False, add_generation_prompt=True))["input_ids"]
    with llama_cpp.LlamaServer(smollm2_gguf_path(), threads=2, args=gguf.server_args(out)) as server:
        c = server.complete(prompt, 24)
    assert len(c.tokens) > 0 and c.drafted > 0


@needs_build
@pytest.mark.long
def test_the_evaluated_draft_model_drafts_in_llama_cpp_too(tmp_path):
    """peers=[llama_cpp_draft] without a GGUF: the evaluated draft model is exported into the run's folder, so that
    llama.cpp drafts with the very model our sampler runs, and reports what it accepted."""
    from specdec.base import load_base
    from specdec.checkpoint import save_drafter
    from specdec.drafters.draft_model import DraftModel

    save_drafter(DraftModel(load_base(device="cpu"), num_layers=2), tmp_path / "dm")
    report = evaluate(_cfg(tmp_path, [f"drafters=[{tmp_path}/dm]", "peers=[llama_cpp_draft]", "prompts.limit=1",
                                      "sampler.max_new_tokens=24", "identity_reference=false"]))
    rows = {r["method"]: r for r in report["rows"]}
    assert (tmp_path / "eval" / "draft_gguf" / "drafter.gguf").exists()
    assert 0 <= rows["llama_cpp_draft"]["alpha"] <= 1  # (nan had it drafted nothing)


@needs_build
def test_distillation_through_an_openai_compatible_server(tmp_path):
    """engine=openai: the base's answers from llama.cpp's server (/v1/completions, the prompts as token ids), stored
    as our own engine's are; a rerun generates nothing more."""
    from datasets import Dataset

    from specdec.base import load_base
    from specdec.data.distill import distill
    from specdec.sampling.config import SamplerConfig

    base = load_base(device="cpu")
    prompts = Dataset.from_list([{"id": f"q{i}", "messages": [{"role": "user", "content": q}]}
                                 for i, q in enumerate(["Name a prime number.", "Say hello.", "What is 2 + 2?"])])
    with llama_cpp.LlamaServer(smollm2_gguf_path(), threads=2) as server:
        rows = distill(prompts, base, str(tmp_path / "d"), SamplerConfig(max_new_tokens=24), batch_size=2,
                       shard_size=2, engine="openai", server={"base_url": server.url})
        assert sorted(rows["id"]) == ["q0", "q1", "q2"] and all(len(r) > 0 for r in rows["response"])
        assert all(0 < n <= 25 for n in rows["response_tokens"])
        again = distill(prompts, base, str(tmp_path / "d"), SamplerConfig(max_new_tokens=24), batch_size=2,
                        shard_size=2, engine="openai", server={"base_url": server.url})
    assert again["response"] == rows["response"]
    with pytest.raises(ValueError, match="needs server.base_url"):
        distill(prompts, base, str(tmp_path / "e"), SamplerConfig(max_new_tokens=4), engine="openai")
