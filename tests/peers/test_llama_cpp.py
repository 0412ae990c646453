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
