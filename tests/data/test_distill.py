"""Self-distillation (specdec/data/distill.py) on the tiny base: the stdlib prompt source, shards that hold
exactly what the sampler generates, resuming without duplicates, refusals, and training from the result."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from specdec.base import tiny_base
from specdec.data import distill as distill_mod
from specdec.data import stream as stream_mod
from specdec.data.datamodule import TextDataModule
from specdec.data.distill import distill, distilled, load_distilled
from specdec.data.prompts import render_chat
from specdec.data.stdlib_tasks import stdlib_tasks
from specdec.data.stream import stream
from specdec.sampling.decode import SamplerConfig, generate

from conftest import ROOT, auto_engine, compose_train
from test_configs import _check_targets

COLUMNS = {"id", "messages", "prompt", "response", "response_tokens", "finished", "temperature", "top_k", "top_p",
           "max_new_tokens", "seed", "engine", "base", "base_sha256"}


@pytest.fixture(scope="module")
def prompts() -> Dataset:
    """10 prompts of varied lengths, one with a system turn and one a conversation that must be cut."""
    rows = [[{"role": "user", "content": f"question {i}: " + "why? " * (i % 4)}] for i in range(10)]
    rows[3] = [{"role": "system", "content": "be brief"}, *rows[3]]
    rows[5] = [*rows[5], {"role": "assistant", "content": "someone else's"}, {"role": "user", "content": "more"}]
    return Dataset.from_dict({"id": [f"q{i}" for i in range(10)], "messages": rows})


def run(prompts, tiny, out, **kw) -> Dataset:
    sampler = kw.pop("sampler", SamplerConfig(max_new_tokens=6))
    return distill(prompts, tiny, str(out), sampler, **{"batch_size": 3, "shard_size": 4, **kw})


def by_id(ds: Dataset) -> list[dict]:
    return sorted(ds.to_list(), key=lambda r: r["id"])


def test_stdlib_tasks_deterministic_and_unique():
    full = stdlib_tasks()
    assert len(full) > 1000 and len(set(full["id"])) == len(full)
    assert stdlib_tasks(limit=30).to_list() == full.select(range(30)).to_list()  # same order every build
    kinds = {i.rsplit(":", 1)[1] for i in full["id"][:30]}
    assert kinds == {"implement", "explain", "example"}  # shuffled: a limit is a varied sample
    row = full[0]
    assert len(row["messages"]) == 1 and row["messages"][0]["role"] == "user"
    assert "```python\n" in row["messages"][0]["content"]
    assert stdlib_tasks(limit=30, kinds=["implement", "explain", "example"]).to_list() == full.select(range(30)).to_list()


def test_stdlib_complete_kind_is_the_bare_stub_completion_format():
    from specdec.data.prompts import humaneval

    done = stdlib_tasks(kinds=["complete"])
    assert len(done) > 500 and all(i.endswith(":complete") for i in done["id"])
    text = done[0]["messages"][0]["content"]
    instruction = humaneval(1)[0]["turns"][0].split("\n\n")[0]  # the evaluation's instruction line
    assert text.startswith(instruction + "\n\ndef ") and '"""' in text and "```" not in text
    assert not any("." in i.split(":")[1] for i in done["id"])  # functions only: a method needs its class
    methods = stdlib_tasks(limit=50, kinds=["complete_method"])  # the same request for each method's stub
    assert all(i.endswith(":complete_method") and "." in i.split(":")[1] for i in methods["id"])
    assert all(m[0]["content"].startswith((instruction + "\n\ndef ", instruction + "\n\nasync def "))
               for m in methods["messages"])
    with pytest.raises(ValueError, match="unknown stdlib task kinds"):
        stdlib_tasks(kinds=["translate"])


def test_shards_hold_what_generate_returns(prompts, tiny, tmp_path):
    # a token the base emits in prompt 0's response (not in all), made an EOS: some rows finish, some run out
    first = render_chat(tiny.tokenizer, prompts[0]["messages"])
    stop = generate(tiny, [first], cfg=SamplerConfig(max_new_tokens=6), engine=auto_engine()).tokens[0, 4].item()
    sampler = SamplerConfig(max_new_tokens=6, eos_token_id=[stop, tiny.tokenizer.eos_token_id])
    ds = run(prompts, tiny, tmp_path, sampler=sampler)
    assert set(ds.column_names) == COLUMNS and len(ds) == 10
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["00000", "00001", "00002"]
    assert json.loads((tmp_path / "meta.json").read_text())["fingerprint"] == tiny.fingerprint()
    rows = {r["id"]: r for r in ds}
    for p in prompts:
        turns = p["messages"][:1] if p["id"] == "q5" else p["messages"]  # q5 is cut before its assistant turn
        r = generate(tiny, [render_chat(tiny.tokenizer, turns)], cfg=sampler, engine=auto_engine())
        tokens = r.tokens[0, : r.num_generated[0]].tolist()
        row = rows[p["id"]]
        assert row["response"] == tiny.tokenizer.decode(tokens, skip_special_tokens=True)
        assert row["messages"] == turns + [{"role": "assistant", "content": row["response"]}]
        assert row["prompt"] == turns[-1]["content"]
        assert (row["response_tokens"], row["finished"]) == (len(tokens), tokens[-1] == stop)
    assert rows["q0"]["finished"] and not all(rows[i]["finished"] for i in rows)


@pytest.mark.parametrize("refill_at", [1, 2])
@pytest.mark.parametrize("sampler, settings", [({}, {}), ({"temperature": 1.0, "top_k": 40, "top_p": 0.9}, {}),
                                               ({}, {"name": "eager", "lean": False})],
                         ids=["greedy", "sampled", "hf_layers"])
def test_continuous_batch_rows_equal_each_prompt_alone(tiny, sampler, settings, refill_at, monkeypatch):
    """11 prompts through 3 rows: rows end at many different steps (EOS tokens, one at a first token, and
    max_new_tokens), their rows are refilled, and every answer equals `generate` on its prompt alone with the same
    generator, greedy or sampled."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (4, 7, 2, 5, 6, 3, 8, 5, 9, 1, 12)]
    gens = lambda: [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]  # noqa: E731
    cfg, fast = SamplerConfig(max_new_tokens=16, eos_token_id=[], **sampler), auto_engine(**settings)
    free = [generate(tiny, [p], None, cfg, [g], engine=fast).tokens[0].tolist() for p, g in zip(prompts, gens())]
    cfg = replace(cfg, eos_token_id=sorted({row[k] for k, row in zip((0, 1, 3, 5, 9), free)}))
    alone = [generate(tiny, [p], None, cfg, [g], engine=fast) for p, g in zip(prompts, gens())]
    alone = [r.tokens[0, : r.num_generated[0]].tolist() for r in alone]
    prefills, prefill = [], stream_mod._prefill
    monkeypatch.setattr(stream_mod, "_prefill", lambda base, c, ids, n: prefills.append(len(ids)) or prefill(
        base, c, ids, n))
    answers = list(stream(tiny, prompts, cfg, batch_size=3, generators=gens(), refill_at=refill_at, engine=fast))
    assert sorted(i for i, _ in answers) == list(range(len(prompts)))
    assert {i: t for i, t in answers} == dict(enumerate(alone))
    assert len({len(t) for t in alone}) > 3  # rows ended at many different steps
    # the first fill, then refills: with refill_at = 2 the newcomers of rows freed together share one prefill
    assert prefills[0] == 3 and sum(prefills) == len(prompts) and len(prefills) > 3
    assert all(k >= refill_at for k in prefills[1:-1])


def test_hf_engine_matches_ours_when_greedy(prompts, tiny, tmp_path):
    ours = run(prompts, tiny, tmp_path / "ours")
    hf = run(prompts, tiny, tmp_path / "hf", engine="hf")
    strip = lambda rows: [{k: v for k, v in r.items() if k != "engine"} for r in rows]  # noqa: E731
    assert strip(by_id(hf)) == strip(by_id(ours))


def test_resume_after_an_interruption(prompts, tiny, tmp_path, monkeypatch):
    sampled = SamplerConfig(max_new_tokens=6, temperature=1.0)
    whole = run(prompts, tiny, tmp_path / "whole", sampler=sampled)
    save = distill_mod._save_atomic

    def dies_after_one(path, ds):
        save(path, ds)
        raise KeyboardInterrupt

    monkeypatch.setattr(distill_mod, "_save_atomic", dies_after_one)
    with pytest.raises(KeyboardInterrupt):
        run(prompts, tiny, tmp_path / "resumed", sampler=sampled)
    assert len(load_distilled(tmp_path / "resumed")) == 4
    monkeypatch.setattr(distill_mod, "_save_atomic", save)
    resumed = run(prompts, tiny, tmp_path / "resumed", sampler=sampled)
    # one generator per row, seeded by its id: sampled responses do not depend on how the run was cut
    assert by_id(resumed) == by_id(whole)
    other_seed = run(prompts, tiny, tmp_path / "seed1", sampler=sampled, seed=1)
    assert [r["response"] for r in by_id(other_seed)] != [r["response"] for r in by_id(whole)]


def test_max_shards_bounds_a_run_and_a_larger_bound_extends_it(prompts, tiny, tmp_path):
    whole = run(prompts, tiny, tmp_path / "whole")
    first = run(prompts, tiny, tmp_path / "bounded", max_shards=1)
    assert len(first) == 4  # one shard of the 4 shortest prompts
    assert len(run(prompts, tiny, tmp_path / "bounded", max_shards=1)) == 4  # a rerun at the bound adds nothing
    assert by_id(run(prompts, tiny, tmp_path / "bounded", max_shards=3)) == by_id(whole)


def test_a_larger_limit_extends_without_duplicates(prompts, tiny, tmp_path):
    whole = run(prompts, tiny, tmp_path / "whole")
    half = run(prompts, tiny, tmp_path / "grown", limit=5)
    assert sorted(half["id"]) == [f"q{i}" for i in range(5)]
    grown = run(prompts, tiny, tmp_path / "grown")
    assert len(set(grown["id"])) == len(grown) == 10 and by_id(grown) == by_id(whole)


def test_other_settings_or_base_are_refused(prompts, tiny, tmp_path):
    run(prompts, tiny, tmp_path, limit=2)
    with pytest.raises(ValueError, match="other settings.*max_new_tokens"):
        run(prompts, tiny, tmp_path, sampler=SamplerConfig(max_new_tokens=7))
    with pytest.raises(ValueError, match="other settings.*base"):
        run(prompts, tiny_base(seed=1), tmp_path)
    with pytest.raises(ValueError, match="engine"):
        run(prompts, tiny, tmp_path / "x", engine="vllm")


def test_distilled_source_trains_through_the_data_module(prompts, tiny, tmp_path):
    run(prompts, tiny, tmp_path / "d")
    assert distilled(str(tmp_path / "d")).column_names == ["messages", "group"]
    dm = TextDataModule(lambda: distilled(str(tmp_path / "d")), tiny.tokenizer, block_size=16, batch_size=2,
                        val_fraction=0.2, cache_dir=None)
    dm.setup()
    assert len(dm.blocks["train"]) > 5 and next(iter(dm.train_dataloader()))["input_ids"].shape == (2, 16)


def test_distilled_source_keeps_only_the_kinds_asked_for(prompts, tiny, tmp_path):
    kinds = prompts.map(lambda r, i: {"id": f"f.py:fn{i}:{'complete' if i % 3 else 'explain'}"}, with_indices=True)
    run(kinds, tiny, tmp_path / "d")
    assert len(distilled(str(tmp_path / "d"))) == 10
    done = distilled(str(tmp_path / "d"), kinds=["complete"])
    assert len(done) == 6 and done.column_names == ["messages", "group"]
    with pytest.raises(ValueError, match="no distilled rows of kinds"):
        distilled(str(tmp_path / "d"), kinds=["example"])


def test_answers_about_one_function_stay_on_one_side_of_the_split(prompts, tiny, tmp_path):
    """Greedy and sampled answers to one prompt, and the other kinds of request about the same function, share a
    group: a validation answer never has a sibling in training (it did for 92 of 118 in the shipped completion data,
    which a drafter may memorise)."""
    from specdec.data.stdlib_tasks import task_group

    assert task_group("json/decoder.py:JSONDecoder.decode:implement") == "json/decoder.py:JSONDecoder.decode"
    assert task_group("q:7") == "q:7" and task_group("q7") == "q7"  # not a stdlib task id: its own group
    ids = prompts.map(lambda r, i: {"id": f"m{i % 5}.py:fn:{'complete' if i < 5 else 'implement'}"},
                      with_indices=True)  # 5 functions, two kinds of request each
    run(ids, tiny, tmp_path / "g")
    run(ids, tiny, tmp_path / "s", sampler=SamplerConfig(max_new_tokens=6, temperature=0.7))
    ds = distilled([str(tmp_path / "g"), str(tmp_path / "s")])
    assert sorted(set(ds["group"])) == [f"m{i}.py:fn" for i in range(5)] and len(ds) == 20
    dm = TextDataModule(lambda: ds, tiny.tokenizer, block_size=8, val_fraction=0.2, cache_dir=None)
    val, train = dm._split(len(ds), ds["group"])
    assert len(val) == 4 and len(val) + len(train) == 20  # one whole group of 4 answers: 20 % of the documents
    assert not {ds["group"][i] for i in val} & {ds["group"][i] for i in train}


def test_distill_config_composes_and_runs_on_chat_rows(tiny, tmp_path):
    cfg = compose_train([], tmp_path, config_name="distill")
    assert cfg.prompts._target_ == "specdec.data.stdlib_tasks.stdlib_tasks"
    assert _check_targets(cfg, "distill") == 4  # base, prompts, sampler, decode_engine
    # another prompt source: a ShareGPT jsonl through sources.chat, end to end on the tiny base
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"conversations": [{"from": "human", "value": f"hi {i}"},
                                                              {"from": "gpt", "value": "hello"}]}) for i in range(3)))
    cfg = compose_train(["base=tiny", "prompts._target_=specdec.data.sources.chat", f"+prompts.path={chat}",
                         "+prompts.field=conversations", "limit=2", "sampler.max_new_tokens=3", "batch_size=2"],
                        tmp_path, config_name="distill")
    _check_targets(cfg, "distill")
    distill_mod.main.__wrapped__(cfg)
    ds = load_distilled(cfg.out_dir)
    assert len(ds) == 2 and [m[0]["content"] for m in ds["messages"]] == ["hi 0", "hi 1"]
    assert all(len(m) == 2 and m[1]["role"] == "assistant" for m in ds["messages"])


def test_shipped_text_round_trips_and_refuses_another_base(prompts, tiny, tmp_path):
    from specdec.data.distill import check_base, ship

    rows = run(prompts, tiny, tmp_path / "d")
    target = ship(tmp_path / "d", tmp_path / "ship" / "set.jsonl.gz", command="python -m specdec.data.distill x=1")
    manifest = json.loads((tmp_path / "ship" / "set.manifest.json").read_text())
    assert manifest["rows"] == len(rows) and manifest["command"].endswith("x=1")
    assert manifest["response_tokens"] == sum(rows["response_tokens"]) and manifest["fingerprint"] == tiny.fingerprint()
    again = ship(tmp_path / "d", tmp_path / "ship2" / "set.jsonl.gz")  # deterministic bytes: reproducible by make
    assert again.read_bytes() == target.read_bytes()
    shipped = distilled(str(target))
    cols = ["id", "messages", "response_tokens", "finished"]
    assert by_id(load_distilled(target)) == by_id(rows.select_columns(cols))
    assert sorted(map(json.dumps, shipped["messages"])) == sorted(map(json.dumps, rows["messages"]))
    check_base(tiny, str(target))
    with pytest.raises(ValueError, match="generated by base"):
        check_base(tiny_base(seed=1), str(target))
    dm = TextDataModule(lambda: distilled(str(target)), tiny.tokenizer, block_size=16, cache_dir=None,
                        base_check=lambda base: check_base(base, str(target)))
    with pytest.raises(ValueError, match="generated by base"):
        dm.check(tiny_base(seed=1))
    target.write_bytes(target.read_bytes()[:-4] + b"\0\0\0\0")  # a damaged file is refused, not half-read
    with pytest.raises(ValueError, match="manifest"):
        load_distilled(target)


def test_a_shipped_set_restored_is_extended_without_generating_it_again(prompts, tiny, tmp_path, monkeypatch):
    from specdec.data.distill import restore, ship

    run(prompts, tiny, tmp_path / "d", limit=6)
    target = ship(tmp_path / "d", tmp_path / "ship" / "set.jsonl.gz")
    restore(target, tmp_path / "again", shard_size=4)
    assert by_id(load_distilled(tmp_path / "again")) == by_id(load_distilled(tmp_path / "d"))
    restore(target, tmp_path / "again")  # resuming: it already holds every shipped row, nothing happens
    asked = []
    monkeypatch.setattr(distill_mod, "stream", lambda base, ids, *a, **k: asked.extend(ids) or stream(
        base, ids, *a, **k))
    grown = run(prompts, tiny, tmp_path / "again")  # only the 4 prompts the shipped set lacks are generated
    assert len(asked) == 4 and by_id(grown) == by_id(run(prompts, tiny, tmp_path / "whole"))
    assert ship(tmp_path / "again", tmp_path / "ship2" / "set.jsonl.gz").read_bytes() != target.read_bytes()
    with pytest.raises(ValueError, match="restore into an empty out_dir"):
        restore(tmp_path / "ship2" / "set.jsonl.gz", tmp_path / "d")
    run(prompts, tiny, tmp_path / "other", sampler=SamplerConfig(max_new_tokens=7), limit=1)
    with pytest.raises(ValueError, match="restore into an empty out_dir"):
        restore(target, tmp_path / "other")


def test_several_sets_join_as_one_source_and_each_is_checked(prompts, tiny, tmp_path):
    from specdec.data.distill import check_base, ship

    run(prompts, tiny, tmp_path / "g", limit=4)
    greedy = ship(tmp_path / "g", tmp_path / "ship" / "g.jsonl.gz")
    sampled = SamplerConfig(max_new_tokens=6, temperature=0.7, top_p=0.95)
    run(prompts, tiny, tmp_path / "s", sampler=sampled)  # the same prompts sampled: a second set, its own meta
    both = distilled([str(greedy), str(tmp_path / "s")])
    assert len(both) == 4 + 10 and both.column_names == ["messages", "group"]
    check_base(tiny, [str(greedy), str(tmp_path / "s")])
    run(prompts, tiny_base(seed=1), tmp_path / "other", limit=1)
    with pytest.raises(ValueError, match="other.*generated by base"):
        check_base(tiny, [str(greedy), str(tmp_path / "other")])


def test_data_completions_names_the_shipped_completion_answers_greedy_and_sampled(tmp_path, monkeypatch):
    """configs/data/completions.yaml names shipped files by bare name: they resolve inside the package wherever the
    run starts, while a file of that name in the working directory is still read as given."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from specdec.data.distill import _paths
    from specdec.data.stdlib_tasks import task_kind

    cfg = OmegaConf.load(ROOT / "configs" / "data" / "completions.yaml").source
    monkeypatch.chdir(tmp_path)
    assert _paths(list(cfg.path)) == [distill_mod.SHIPPED, distill_mod.SHIPPED_SAMPLED]
    ds = instantiate({"_target_": "specdec.data.distill.distilled", "path": list(cfg.path), "kinds": list(cfg.kinds)})
    ids = [i for p in (distill_mod.SHIPPED, distill_mod.SHIPPED_SAMPLED) for i in load_distilled(p)["id"]
           if task_kind(i) in ("complete", "complete_method")]
    assert len(ds) == len(ids) > 5000
    (tmp_path / "stdlib_tasks.jsonl.gz").write_bytes(b"")  # a local file of that name wins
    assert _paths(["stdlib_tasks.jsonl.gz"]) == [Path("stdlib_tasks.jsonl.gz")]


@pytest.mark.parametrize("name", ["SHIPPED", "SHIPPED_SAMPLED"])
def test_shipped_sets_match_their_manifests_and_hold_no_evaluation_prompt(name):
    from specdec.data.distill import _manifest_path
    from specdec.data.prompts import humaneval, question_jsonl

    path = getattr(distill_mod, name)
    rows = load_distilled(path)  # refuses a file that does not match its manifest's sha256
    manifest = json.loads(_manifest_path(path).read_text())
    assert len(rows) == manifest["rows"] == len(set(rows["id"]))
    assert sum(rows["response_tokens"]) == manifest["response_tokens"] and manifest["base"] == "smollm2_135m"
    assert (manifest["temperature"] > 0) == (name == "SHIPPED_SAMPLED")
    asked = "\n".join(t["content"] for m in rows["messages"] for t in m if t["role"] != "assistant")
    # no evaluation prompt reached the base as a distillation request: no line of a HumanEval problem long enough
    # to be its own (signatures, docstrings, examples), no question of experiments/prompts/question.jsonl
    lines = {line.strip() for item in humaneval(instruction="") for line in item["turns"][0].splitlines()}
    assert not [line for line in lines if len(line) > 40 and line in asked]
    assert not [t for q in question_jsonl(str(ROOT / "experiments" / "prompts" / "question.jsonl")) for t in q["turns"]
                if t in asked]
