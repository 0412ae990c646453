"""experiments/where_drafts_miss.py: teacher-forced first drafts are what a chain of one drafts, and lookup's class
of each position."""

from conftest import auto_engine, experiment_script, fitted
from specdec.base import tiny_base
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.hydra import Hydra
from specdec.sampling.decode import SamplerConfig, generate


def chain_of_one_hits(drafts: dict[int, int], ids: list[int], start: int) -> int:
    """The drafts a chain of one accepts over ids's answer (from start): after the prefill's token each round drafts
    the next position; an accepted draft also emits the bonus, so the next round drafts two positions on."""
    hits, p = 0, start + 1
    while p < len(ids):
        hit = drafts[p] == ids[p]
        hits += hit
        p += 2 if hit else 1
    return hits


def test_teacher_forced_first_drafts_are_what_a_chain_of_one_accepts():
    base = tiny_base()
    ab = experiment_script("where_drafts_miss")
    prompt = [5, 6, 7, 8, 5, 6, 7]
    cfg = SamplerConfig(max_new_tokens=24, gamma=1, eos_token_id=[])
    eager = auto_engine(name="eager")
    answer = generate(base, [prompt], None, cfg, engine=eager).tokens[0].tolist()
    # drafting the token after the root (Hydra, offset 1) and the root's own successor (a draft model, offset 0);
    # each with rounds that accept and rounds that do not, so the positions the rounds reach are what is checked
    fit = fitted(Hydra(base, num_heads=1), base, prompt + answer[:12])
    for drafter in (fit, DraftModel(base, num_layers=1).eval()):
        drafts = ab.first_drafts(drafter, base, prompt + answer)
        run = generate(base, [prompt], drafter, cfg, engine=eager)
        assert run.tokens[0].tolist() == answer and 0 < sum(run.accepted[0]) < len(run.accepted[0])
        assert chain_of_one_hits(drafts, prompt + answer, len(prompt)) == sum(run.accepted[0])
    # a copy of every base layer drafts the base's own tokens: every answer position right
    drafts = ab.first_drafts(DraftModel(base, num_layers=base.num_layers).eval(), base, prompt + answer)
    assert all(drafts[p] == t for p, t in enumerate(prompt + answer) if p > len(prompt))


def test_each_position_is_classed_by_what_lookup_proposes_there():
    ab = experiment_script("where_drafts_miss")
    prompt, answer = [1, 2, 3, 4], [9, 1, 2, 3, 7, 1, 2, 5]
    ids = prompt + answer
    drafts = {p: ids[p] if p % 2 else -1 for p in range(len(ids))}  # right at odd positions only
    rows = ab.classify(prompt, answer, drafts, ["code"] * 4 + ["prose"] * 4)
    # p = 5, 6: no earlier "4 9" / "9 1"; 7: "1 2" was followed by 3 (right); 8: "1 2 3" by 4, the answer writes 7;
    # 9, 10: "3 7", "7 1" never seen; 11: the latest "1 2" (p = 5) was followed by 3, the answer writes 5
    assert [r["class"] for r in rows] == ["no match", "no match", "lookup right", "lookup wrong", "no match",
                                          "no match", "lookup wrong"]
    assert [r["region"] for r in rows] == ["code"] * 3 + ["prose"] * 4
    assert [r["drafter"] for r in rows] == [p % 2 == 1 for p in range(5, 12)]
    s = ab.summary(rows)
    assert s["all"]["positions"] == len(answer) - 1 == len(rows)
    assert abs(sum(s[f"all/{k}"]["share"] for k in ab.CLASSES) - 1) < 1e-9
    assert abs(s["code"]["share"] + s["prose"]["share"] - 1) < 1e-9
    assert s["all"]["drafter"] == sum(r["drafter"] for r in rows) / len(rows)
    assert s["all/lookup wrong"]["lookup"] == 0 and s["all/lookup right"]["lookup"] == 1
    assert all(r["either"] is None or r["either"] >= max(r["drafter"], r["lookup"]) for r in s.values())


def test_the_command_writes_its_table_and_json(tmp_path, monkeypatch):
    import json
    import sys

    from specdec.checkpoint import save_drafter

    base = tiny_base()
    ab = experiment_script("where_drafts_miss")
    save_drafter(DraftModel(base, num_layers=base.num_layers), tmp_path / "same")
    monkeypatch.setattr(ab, "load_base", lambda name: base)
    monkeypatch.setattr(sys, "argv", ["where_drafts_miss.py", f"itself={tmp_path / 'same'}", "--limit", "2", "--new", "8",
                                      "--out", str(tmp_path / "out")])
    ab.main()
    result = json.loads((tmp_path / "out" / "where_drafts_miss.json").read_text())
    assert list(result["results"]) == ["itself"] and result["results"]["itself"]["all"]["drafter"] == 1.0
    assert (tmp_path / "out" / "where_drafts_miss.md").read_text().count("| itself |") == 12
