"""The base writes its own requests (Magpie): the template up to an open user turn, the filter's reasons, the
13-gram contamination check, resuming from the cache, and distill answering them."""

import json

import pytest
from conftest import ROOT

from specdec.base import tiny_base
from specdec.data import magpie
from specdec.data.overlap import Overlap, eval_texts, ngrams
from specdec.sampling.config import SamplerConfig


@pytest.fixture(scope="module")
def base():
    return tiny_base()


def test_the_prompt_stops_where_the_user_would_start(base):
    text = base.tokenizer.decode(magpie.open_user_turn(base.tokenizer))
    full = base.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert full.startswith(text) and full[len(text):].startswith("hi")


def test_a_follow_up_prompt_stops_where_the_next_user_turn_would_start(base):
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    text = base.tokenizer.decode(magpie.open_user_turn(base.tokenizer, talk))
    full = base.tokenizer.apply_chat_template([*talk, {"role": "user", "content": "and then?"}], tokenize=False)
    assert "hello there" in text and full.startswith(text) and full[len(text):].startswith("and then?")


def test_the_filter_says_why():
    f = magpie.Filter()
    ok = "What is the best way to prepare for a marathon in the winter?"
    assert f.why_not(ok, finished=True) is None
    assert f.why_not(ok.upper(), finished=True) == "duplicate"  # case and punctuation do not hide a copy
    assert f.why_not("What is the best way to prepare for a marathon in the summer?", True) == "near-duplicate"
    assert f.why_not("Tell me a story about a dragon who learns to fly over the sea.", False) == "unfinished"
    assert f.why_not("short?", True) == "length"
    assert f.why_not("Что такое машинное обучение и как оно работает сегодня?", True) == "language"
    assert f.why_not("How do I <|im_start|> write a poem about autumn leaves?", True) == "language"
    # a request quoting a HumanEval prompt's words (13 of them in a row) is dropped, whatever its punctuation
    humaneval_words = " ".join(ngrams(eval_texts()[0]).pop())
    assert f.why_not(f"Please explain this: {humaneval_words.upper()}!", True) == "evaluation overlap"


def test_overlap_finds_shared_13_grams_not_lines():
    check = Overlap(["one two three four five six seven eight nine ten eleven twelve thirteen fourteen"])
    assert check.hits("Zero, ONE two three four five six seven eight nine ten eleven twelve thirteen!")
    assert not check.hits("one two three four five six seven eight nine ten eleven twelve")  # 12 words


def test_the_check_fails_on_a_planted_leak_in_a_request_or_an_answer(tmp_path, capsys):
    from datasets import Dataset

    from specdec.data.overlap import main

    lines = (ROOT / "experiments" / "prompts" / "question.jsonl").read_text().splitlines()
    question = max((t for line in lines for t in json.loads(line)["turns"]), key=len)
    words = " ".join(eval_texts()[0].split()[-30:]).upper()  # half a HumanEval docstring, recased: no equal line
    rows = [{"id": "clean", "messages": [{"role": "user", "content": "Write a haiku about tea."},
                                         {"role": "assistant", "content": "Steam rises, leaves unfold."}]},
            {"id": "request", "messages": [{"role": "user", "content": f"Explain this: {words}"},
                                           {"role": "assistant", "content": "Sure."}]},
            {"id": "answer", "messages": [{"role": "user", "content": "Say something."},
                                          {"role": "assistant", "content": f"You asked: {question}"}]}]
    Dataset.from_list(rows[:1]).save_to_disk(str(tmp_path / "clean" / "shards" / "0"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "leaky" / "shards" / "0"))
    assert main([str(tmp_path / "clean")]) == 0
    assert main([str(tmp_path / "leaky")]) == 1
    assert "2 of 3 rows share a 13-gram" in capsys.readouterr().out


def test_requests_are_sampled_filtered_and_resumed(base, tmp_path, monkeypatch):
    cache = tmp_path / "requests.jsonl"
    loose = dict(min_chars=1, max_chars=10_000, min_ascii_letters=0.0, max_similar=1.01)
    monkeypatch.setattr(magpie.Filter, "why_not", lambda self, text, finished: None if text else "length")
    first = magpie.requests(base, count=6, max_new_tokens=8, batch_size=4, cache=str(cache),
                            filter=magpie.Filter(**loose))
    assert len(first) == 6 and first["id"][0] == "magpie:0:0"
    tried = len(cache.read_text().splitlines())
    again = magpie.requests(base, count=6, max_new_tokens=8, batch_size=4, cache=str(cache),
                            filter=magpie.Filter(**loose))
    assert again["messages"] == first["messages"] and len(cache.read_text().splitlines()) == tried  # read back
    more = magpie.requests(base, count=9, max_new_tokens=8, batch_size=4, cache=str(cache),
                           filter=magpie.Filter(**loose))
    assert more["messages"][:6] == first["messages"]  # extended, not redrawn
    assert all(json.loads(line)["i"] == i for i, line in enumerate(cache.read_text().splitlines()))


def test_a_fresh_cache_started_from_a_shipped_set_extends_it(base, tmp_path, monkeypatch):
    from specdec.data.distill import distill, ship

    loose = dict(min_chars=1, max_chars=10_000, min_ascii_letters=0.0, max_similar=1.01)
    monkeypatch.setattr(magpie.Filter, "why_not", lambda self, text, finished: None if text else "length")
    first = magpie.requests(base, count=6, max_new_tokens=8, batch_size=4, cache=str(tmp_path / "a.jsonl"),
                            filter=magpie.Filter(**loose))
    distill(first.select(range(1, 6)), base, str(tmp_path / "d"), SamplerConfig(max_new_tokens=4), batch_size=3)
    shipped = ship(tmp_path / "d", tmp_path / "ship" / "general.jsonl.gz")  # request 0 not answered: a gap
    more = magpie.requests(base, count=8, max_new_tokens=8, batch_size=4, cache=str(tmp_path / "b.jsonl"),
                           filter=magpie.Filter(**loose), start_from=str(shipped))
    assert more["messages"][:5] == first["messages"][1:]  # the shipped requests, not redrawn
    whole = magpie.requests(base, count=9, max_new_tokens=8, batch_size=4, cache=str(tmp_path / "a.jsonl"),
                            filter=magpie.Filter(**loose))
    # the new ones are drawn at the indices after the last one shipped, as the run that made the set goes on
    assert more["id"][5:] == whole["id"][6:] and more["messages"][5:] == whole["messages"][6:]
    with pytest.raises(ValueError, match="not a magpie request of seed 1"):
        magpie.requests(base, count=8, seed=1, cache=None, filter=magpie.Filter(**loose), start_from=str(shipped))


def test_follow_ups_continue_the_base_s_own_conversations(base, tmp_path, monkeypatch):
    """A second user turn after the base's answer: kept with that answer in the prompt, resumed from its cache,
    answered by distill, and restarted from a shipped set of them."""
    from specdec.data.distill import distill, load_distilled, ship

    loose = dict(min_chars=1, max_chars=10_000, min_ascii_letters=0.0, max_similar=1.01)
    monkeypatch.setattr(magpie.Filter, "why_not", lambda self, text, finished: None if text else "length")
    asked = magpie.requests(base, count=6, max_new_tokens=8, batch_size=4, filter=magpie.Filter(**loose))
    # every answer of the random tiny base ends after one token (each token ends it): finished conversations
    every = list(range(len(base.tokenizer)))
    distill(asked, base, str(tmp_path / "d"), SamplerConfig(max_new_tokens=4, eos_token_id=every), batch_size=3)
    answered = {i: m for i, m in zip(*(load_distilled(tmp_path / "d")[c] for c in ("id", "messages")))}
    cache = tmp_path / "follow_ups.jsonl"
    kw = dict(max_new_tokens=8, batch_size=3, cache=str(cache))
    first = magpie.follow_ups(base, str(tmp_path / "d"), count=4, filter=magpie.Filter(**loose), **kw)
    assert first["id"] == asked["id"][:4] and all(first["base_turns"])  # request order, the conversations' own ids
    for i, m in zip(first["id"], first["messages"]):
        assert m[:2] == answered[i] and m[2]["role"] == "user" and m[2]["content"]
    tried = cache.read_text()
    again = magpie.follow_ups(base, str(tmp_path / "d"), count=4, filter=magpie.Filter(**loose), **kw)
    assert again["messages"] == first["messages"] and cache.read_text() == tried  # read back, not sampled again
    more = magpie.follow_ups(base, str(tmp_path / "d"), count=6, filter=magpie.Filter(**loose), **kw)
    assert more["messages"][:4] == first["messages"] and len(more) == 6
    # distill keeps the base's own answer in the prompt and answers the follow-up
    distill(first, base, str(tmp_path / "f"), SamplerConfig(max_new_tokens=4), batch_size=3)
    two = load_distilled(tmp_path / "f")
    assert sorted((i, m[:3]) for i, m in zip(two["id"], two["messages"])) == sorted(zip(first["id"],
                                                                                         first["messages"]))
    assert {tuple(t["role"] for t in m) for m in two["messages"]} == {("user", "assistant", "user", "assistant")}
    shipped = ship(tmp_path / "f", tmp_path / "ship" / "follow_ups.jsonl.gz")
    fresh = magpie.follow_ups(base, str(tmp_path / "d"), count=4, filter=magpie.Filter(**loose), max_new_tokens=8,
                              cache=str(tmp_path / "fresh.jsonl"), start_from=str(shipped))
    assert fresh["messages"] == first["messages"]


def test_a_conversation_is_cut_before_someone_else_s_answer_but_not_before_the_base_s_own():
    from datasets import Dataset

    from specdec.data.distill import _prompt_rows

    talk = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d"}]
    rows = Dataset.from_dict({"id": ["x", "y"], "messages": [talk, talk], "base_turns": [False, True]})
    assert _prompt_rows(rows, None) == [("x", talk[:1]), ("y", talk[:3])]


def test_the_shipped_text_shares_no_13_gram_with_an_evaluation_prompt(capsys):
    from specdec.data.distill import SHIPPED
    from specdec.data.overlap import main

    shipped = sorted(str(p) for p in SHIPPED.parent.glob("*.jsonl.gz"))
    assert len(shipped) >= 2 and main(shipped) == 0, capsys.readouterr().out


def test_the_shipped_general_sets_match_their_manifests_and_share_their_requests():
    """general_magpie (greedy answers), general_magpie_sampled (sampled answers to its first requests) and
    general_magpie_followups (its first conversations, a second request and its answer added), the three files
    configs/data/general.yaml reads."""
    from omegaconf import OmegaConf

    from conftest import ROOT
    from specdec.data.distill import SHIPPED, _manifest_path, _paths, load_distilled

    greedy, sampled, two = (SHIPPED.with_name(f"general_magpie{tail}.jsonl.gz")
                            for tail in ("", "_sampled", "_followups"))
    paths = _paths(list(OmegaConf.load(ROOT / "configs" / "data" / "general.yaml").source.path))
    assert paths == [greedy, sampled, two]
    sets = {path: load_distilled(path) for path in paths}  # each refused unless its sha256 matches
    for path, rows in sets.items():
        manifest = json.loads(_manifest_path(path).read_text())
        assert len(rows) == manifest["rows"] == len(set(rows["id"]))
        assert sum(rows["response_tokens"]) == manifest["response_tokens"]
        assert (manifest["temperature"] > 0) == (path == sampled)
    request = {i: m[0]["content"] for i, m in zip(sets[greedy]["id"], sets[greedy]["messages"])}
    # the sampled answers are to the greedy set's own requests, under the same ids (one side of the split)
    assert all(request[i] == m[0]["content"] for i, m in zip(sets[sampled]["id"], sets[sampled]["messages"]))
    # a two-turn conversation goes on from the greedy set's own request and answer, under its id
    first = dict(zip(sets[greedy]["id"], sets[greedy]["messages"]))
    assert all(m[:2] == first[i] and [t["role"] for t in m[2:]] == ["user", "assistant"]
               for i, m in zip(sets[two]["id"], sets[two]["messages"]))
