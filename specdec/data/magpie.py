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
requests that set kept, so a fresh machine extends the shipped set instead of sampling it again."""

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


def open_user_turn(tokenizer) -> list[int]:
    """The chat template rendered up to where a user's first message would start (its system turn included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
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
    eos = base.config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    cfg = SamplerConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, eos_token_id=eos)
    engine = build(device=base.device)
    while sum(t["why"] is None for t in tries) < count and len(tries) < 8 * count:
        # the next index: after the last one tried (a cache started from a shipped set holds only its kept ones)
        start = 1 + max((t["i"] for t in tries), default=-1)
        # in chunks, each appended to the cache as it ends: an interrupted run loses one chunk at most
        n = min(max(batch_size, count - sum(t["why"] is None for t in tries)), CHUNK)
        gens = [torch.Generator(device=base.device).manual_seed(_seed(seed, start + k)) for k in range(n)]
        new = [None] * n
        for k, tokens in stream(base, [prefix] * n, cfg, batch_size, gens, engine=engine):
            finished = bool(tokens) and tokens[-1] in eos
            text = base.tokenizer.decode(tokens, skip_special_tokens=True).strip()
            new[k] = {"i": start + k, "text": text, "finished": finished}
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


def shipped_requests(shipped: str | Path, seed: int = 0) -> list[dict]:
    """The tries a shipped set of answers stands for: its requests, each kept, at its own index (ids
    "magpie:<seed>:<i>"; the dropped tries between them are not shipped, and none is needed to go on)."""
    rows = load_distilled(shipped)
    tries = []
    for row_id, turns in zip(rows["id"], rows["messages"]):
        tag, row_seed, i = row_id.split(":")
        if tag != "magpie" or int(row_seed) != seed:
            raise ValueError(f"{shipped} holds {row_id!r}, not a magpie request of seed {seed}")
        tries.append({"i": int(i), "text": turns[0]["content"], "finished": True})
    return sorted(tries, key=lambda t: t["i"])  # in index order, as a run kept them


def _append(path: Path, tries: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(json.dumps({k: v for k, v in t.items() if k != "why"}) + "\n" for t in tries)


def _seed(seed: int, i: int) -> int:
    return int.from_bytes(hashlib.sha256(f"magpie:{seed}:{i}".encode()).digest()[:8], "little") >> 1


def reasons(tries: list[dict]) -> dict[str, int]:
    """How many tries each reason dropped (None: kept), for a run's log."""
    out: dict[str, int] = {}
    for t in tries:
        out[str(t["why"])] = out.get(str(t["why"]), 0) + 1
    return out
