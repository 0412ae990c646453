"""General-domain requests the base writes itself (Magpie, Xu et al. 2024): given its chat template up to an open
user turn and nothing else, an instruct model samples what a user would ask. SmolLM2-135M-Instruct at T = 1 writes
e.g. "What's the best way to prepare before a marathon?". Filtered here (finished, length, language, exact and near
duplicates, 13-gram overlap with every evaluation prompt), they are prompts for `specdec.data.distill`, which has the
base answer them like any other source:

    python -m specdec.data.distill prompts._target_=specdec.data.magpie.requests +prompts._partial_=true \\
        +prompts.count=2000 'out_dir=${paths.cache_dir}/distill/general'

Resumable: every sampled request (kept or not, and why) is kept in `cache` (a jsonl file), and a rerun continues
from the next index; request i is sampled with its own generator seeded by (seed, i), so a set is reproducible.
`start_from` (a shipped set, e.g. specdec/data/shipped/general_magpie.jsonl.gz) starts an empty cache from the
requests that set kept, so a fresh machine extends the shipped set instead of sampling it again.

`follow_ups` makes two-turn conversations the same way: the template over a request and the base's own answer, up to
the next open user turn, gives the base's second request, which distill then answers with the whole conversation as
its prompt (`make distill-general` does all three: requests, their answers, follow-ups)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from datasets import Dataset

from specdec.base import Base
from specdec.data.distill import load_distilled
from specdec.data.overlap import Overlap, eval_texts
from specdec.data.stream import stream
from specdec.engines import build
from specdec.sampling.config import SamplerConfig

CHUNK = 256  # tries sampled between two appends to the cache
SENTINEL = "\ue000"  # a private-use character no template contains: where the user's words would go


def open_user_turn(tokenizer, conversation: list[dict] = ()) -> list[int]:
    """The chat template rendered over `conversation` (none: the template's system turn alone) up to where the user's
    next message would start."""
    text = tokenizer.apply_chat_template([*conversation, {"role": "user", "content": SENTINEL}], tokenize=False)
    return tokenizer(text[: text.index(SENTINEL)], add_special_tokens=False)["input_ids"]


@dataclass
class Filter:
    """Which sampled requests to keep: finished (the base closed its turn), of a plausible length, in English
    letters, no template markup, not a near copy of one kept before (word 5-gram Jaccard), and sharing no 13-gram
    with an evaluation prompt."""

    min_chars: int = 20
    max_chars: int = 600
    min_ascii_letters: float = 0.95  # of the letters: a cheap "English" test for this base, which writes English
    near_ngram: int = 5
    max_similar: float = 0.5

    def __post_init__(self) -> None:
        self.seen: set[str] = set()
        self.index: dict[tuple[str, ...], list[int]] = {}  # word n-gram -> kept requests holding it
        self.kept: list[set[tuple[str, ...]]] = []
        self.eval = Overlap(eval_texts())

    def why_not(self, text: str, finished: bool) -> str | None:
        """None to keep the request, else the reason it is dropped."""
        letters = [c for c in text if c.isalpha()]
        if not finished:
            return "unfinished"
        if not self.min_chars <= len(text) <= self.max_chars:
            return "length"
        if "<|" in text or not letters or sum(c.isascii() for c in letters) < self.min_ascii_letters * len(letters):
            return "language"
        norm = " ".join(re.findall(r"\w+", text.lower()))
        if norm in self.seen:
            return "duplicate"
        words = norm.split()
        grams = {tuple(words[i : i + self.near_ngram]) for i in range(max(1, len(words) - self.near_ngram + 1))}
        for j in {j for g in grams for j in self.index.get(g, ())}:
            if len(grams & self.kept[j]) / len(grams | self.kept[j]) >= self.max_similar:
                return "near-duplicate"
        if self.eval.hits(text):
            return "evaluation overlap"
        self.seen.add(norm)
        for g in grams:
            self.index.setdefault(g, []).append(len(self.kept))
        self.kept.append(grams)
        return None


def requests(base: Base, count: int = 2000, seed: int = 0, temperature: float = 1.0, top_p: float = 1.0,
             max_new_tokens: int = 96, batch_size: int = 32, cache: str | None = None,
             filter: Filter | None = None, start_from: str | None = None) -> Dataset:
    """`count` filtered requests {id: "magpie:<seed>:<i>", messages: [one user turn]}, sampled from `base` until
    that many are kept (at most 8·count tries). `cache`: the jsonl file every try is kept in (None: none).
    `start_from`: a shipped set of answers to requests of this `seed`, whose requests start an empty cache."""
    rule = filter or Filter()
    tries: list[dict] = []
    path = Path(cache).expanduser() if cache else None
    if path is not None and path.exists():
        tries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not tries and start_from:
        tries = shipped_requests(start_from, seed)
        if path is not None:
            _append(path, tries)
    for t in tries:  # replayed through the filter: its duplicate index is rebuilt in the same order
        t["why"] = rule.why_not(t["text"], t["finished"])
    prefix = open_user_turn(base.tokenizer)
    write = _writer(base, max_new_tokens, temperature, top_p, batch_size)
    while sum(t["why"] is None for t in tries) < count and len(tries) < 8 * count:
        # the next index: after the last one tried (a cache started from a shipped set holds only its kept ones)
        start = 1 + max((t["i"] for t in tries), default=-1)
        # in chunks, each appended to the cache as it ends: an interrupted run loses one chunk at most
        n = min(max(batch_size, count - sum(t["why"] is None for t in tries)), CHUNK)
        new = [{"i": start + k, **w} for k, w in enumerate(write([prefix] * n, [_seed(seed, start + k)
                                                                             for k in range(n)]))]
        for t in new:
            t["why"] = rule.why_not(t["text"], t["finished"])
        tries += new
        if path is not None:
            _append(path, new)
        print(f"[specdec] magpie: {sum(t['why'] is None for t in tries)}/{count} requests kept of {len(tries)} "
              "tried", flush=True)
    print(f"[specdec] magpie: {len(tries)} requests sampled: " + ", ".join(f"{k if k != 'None' else 'kept'} {v}"
                                                                      for k, v in reasons(tries).items()))
    kept = [t for t in tries if t["why"] is None][:count]
    return Dataset.from_dict({"id": [f"magpie:{seed}:{t['i']}" for t in kept],
                              "messages": [[{"role": "user", "content": t["text"]}] for t in kept]})


def follow_ups(base: Base, answered: str, count: int = 500, seed: int = 0, temperature: float = 1.0,
               top_p: float = 1.0, max_new_tokens: int = 96, batch_size: int = 32, cache: str | None = None,
               filter: Filter | None = None, start_from: str | None = None) -> Dataset:
    """Second user turns the base writes after its own answers: for each of the first `count` finished conversations
    of `answered` (a distilled set of answers to `requests`, e.g. the shipped general_magpie.jsonl.gz, in request
    order), the template over [request, answer] up to an open user turn, sampled once with a generator seeded by
    (seed, request index), and filtered as requests are. Returns those kept as {id: the conversation's own (so a
    conversation and its follow-up share a side of the split), messages: [request, answer, follow-up], base_turns:
    True (distill keeps the base's own answer in the prompt)}. `cache` and `start_from` as for `requests`."""
    rule = filter or Filter()
    rows = load_distilled(answered)
    first = sorted(((_index(i, seed, answered), m) for i, m, done in zip(rows["id"], rows["messages"], rows["finished"])
                    if done), key=lambda r: r[0])[:count]
    path = Path(cache).expanduser() if cache else None
    tries = {}
    if path is not None and path.exists():
        tries = {t["i"]: t for t in map(json.loads, path.read_text().splitlines())}
    if not tries and start_from:
        tries = {t["i"]: t for t in shipped_requests(start_from, seed, turn=2)}
        if path is not None:
            _append(path, list(tries.values()))
    todo = [(i, m) for i, m in first if i not in tries]
    write = _writer(base, max_new_tokens, temperature, top_p, batch_size)
    for lo in range(0, len(todo), CHUNK):  # in chunks appended to the cache, as `requests`
        chunk = todo[lo : lo + CHUNK]
        new = [{"i": i, **w} for (i, _), w in zip(chunk, write([open_user_turn(base.tokenizer, m) for _, m in chunk],
                                                                [_seed(seed, f"{i}:2") for i, _ in chunk]))]
        tries.update((t["i"], t) for t in new)
        if path is not None:
            _append(path, new)
        print(f"[specdec] magpie: {lo + len(chunk)}/{len(todo)} follow-ups sampled", flush=True)
    kept = []
    for i, m in first:  # the filter in conversation order, as a run that never stopped
        t = tries[i]
        t["why"] = rule.why_not(t["text"], t["finished"])
        if t["why"] is None:
            kept.append((i, [*m, {"role": "user", "content": t["text"]}]))
    print(f"[specdec] magpie: {len(first)} follow-ups: " + ", ".join(
        f"{k if k != 'None' else 'kept'} {v}" for k, v in reasons([tries[i] for i, _ in first]).items()))
    return Dataset.from_dict({"id": [f"magpie:{seed}:{i}" for i, _ in kept], "messages": [m for _, m in kept],
                              "base_turns": [True] * len(kept)})


def _writer(base: Base, max_new_tokens: int, temperature: float, top_p: float, batch_size: int):
    """prefixes [n token-id lists], seeds [n] -> [{text, finished}] in order: what the base writes after each prefix
    (its own generator per row), up to its end of turn."""
    eos = base.config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    cfg = SamplerConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, eos_token_id=eos)
    engine = build(device=base.device)

    def write(prefixes: list[list[int]], seeds: list[int]) -> list[dict]:
        gens = [torch.Generator(device=base.device).manual_seed(s) for s in seeds]
        out = [None] * len(prefixes)
        for k, tokens in stream(base, prefixes, cfg, batch_size, gens, engine=engine):
            out[k] = {"text": base.tokenizer.decode(tokens, skip_special_tokens=True).strip(),
                      "finished": bool(tokens) and tokens[-1] in eos}
        return out

    return write


def shipped_requests(shipped: str | Path, seed: int = 0, turn: int = 1) -> list[dict]:
    """The tries a shipped set of answers stands for: its requests (turn 1; 2: a `follow_ups` set's second user
    turns), each kept, at its own index (ids "magpie:<seed>:<i>"; the dropped tries between them are not shipped, and
    none is needed to go on)."""
    rows = load_distilled(shipped)
    tries = []
    for row_id, turns in zip(rows["id"], rows["messages"]):
        user = [t["content"] for t in turns if t["role"] == "user"]
        tries.append({"i": _index(row_id, seed, shipped), "text": user[turn - 1], "finished": True})
    return sorted(tries, key=lambda t: t["i"])  # in index order, as a run kept them


def _index(row_id: str, seed: int, where: str | Path) -> int:
    """The request index of a row id "magpie:<seed>:<i>"; another seed's or source's is refused."""
    tag, row_seed, i = row_id.split(":")
    if tag != "magpie" or int(row_seed) != seed:
        raise ValueError(f"{where} holds {row_id!r}, not a magpie request of seed {seed}")
    return int(i)


def _append(path: Path, tries: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(json.dumps({k: v for k, v in t.items() if k != "why"}) + "\n" for t in tries)


def _seed(seed: int, i: int | str) -> int:
    return int.from_bytes(hashlib.sha256(f"magpie:{seed}:{i}".encode()).digest()[:8], "little") >> 1


def reasons(tries: list[dict]) -> dict[str, int]:
    """How many tries each reason dropped (None: kept), for a run's log."""
    out: dict[str, int] = {}
    for t in tries:
        out[str(t["why"])] = out.get(str(t["why"]), 0) + 1
    return out
