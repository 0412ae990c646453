"""Self-distilled training data: the frozen base's own responses to chat prompts. Drafters learn the base's
distribution best from text the base itself wrote. Prompts are rendered exactly as evaluation renders them
(`render_chat`: the base's chat template, assistant turn opened).

Layout of `out_dir`:
    meta.json              generation settings and base fingerprint; a rerun with others is refused
    shards/00000/, ...     `Dataset.save_to_disk` of up to `shard_size` rows, written atomically: the unit of resuming
        id, messages (prompt turns + the assistant's response), prompt, response, response_tokens, finished,
        temperature, top_k, top_p, max_new_tokens, seed, engine, base, base_sha256

Run: python -m specdec.data.distill [limit=2000] [sampler.temperature=0.7] [backend=hf]
Train on it: python train.py data=distilled
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import hydra
import torch
from datasets import Dataset, concatenate_datasets, load_from_disk
from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from specdec.base import Base
from specdec.checkpoint import write_json
from specdec.data.prompts import render_chat
from specdec.data.stdlib_tasks import task_group, task_kind
from specdec.data.stream import stream
from specdec.engines import EngineConfig, build
from specdec.sampling.config import SamplerConfig

# our decode loop, no drafter, continuous batching | transformers' generate, left padding | any OpenAI-compatible
# server (vLLM, SGLang, llama.cpp's llama-server) at `base_url`, serving the same base: the scale-out path
ENGINES = ("specdec", "hf", "openai")


def distill(
    prompts: Dataset,
    base: Base,
    out_dir: str,
    sampler: SamplerConfig,
    batch_size: int = 16,
    limit: int | None = None,
    shard_size: int = 64,
    seed: int = 0,
    engine: str = "specdec",
    max_shards: int | None = None,
    decode_engine: EngineConfig | None = None,
    server: dict | None = None,
) -> Dataset:
    """Generate the base's response to the first `limit` prompts (rows with `messages`, optionally `id`) into
    `out_dir`. Resumable: prompts whose id is in a complete shard are skipped, so a rerun generates only the
    rest; a rerun with other settings or another base is refused. `max_shards` bounds a run: it stops once
    `out_dir` holds that many shards (shortest prompts first), so a bounded set is reproducible and a rerun with a
    larger bound extends it. `decode_engine`: how our loop's forwards run (engine=specdec; None: auto). `server`:
    engine=openai's {base_url, model}. Returns every row of `out_dir`."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    out = Path(out_dir).expanduser()
    eos = _eos(base, sampler)
    settings = {"temperature": float(sampler.temperature), "top_k": int(sampler.top_k), "top_p": float(sampler.top_p),
                "max_new_tokens": int(sampler.max_new_tokens), "seed": int(seed), "engine": engine}
    fingerprint = base.fingerprint()
    _write_or_check_meta(out, {**settings, "eos_token_id": eos, "base": base.name, "fingerprint": fingerprint})

    existing = _shards(out)
    done = set(load_distilled(out)["id"]) if existing else set()
    todo = [p for p in _prompt_rows(prompts, limit) if p[0] not in done]
    rendered = {i: render_chat(base.tokenizer, m) for i, m in todo}
    # Shards of similar prompt lengths: a batch pads to its longest prompt, so mixing lengths wastes prefill.
    # Which prompts are answered does not change (the first `limit`), only the order they are answered in.
    todo.sort(key=lambda p: len(rendered[p[0]]))
    first = int(existing[-1].name) + 1 if existing else 0
    if max_shards is not None:
        todo = todo[: max(0, max_shards - first) * shard_size]
    if engine == "specdec":
        run = _ours(base, sampler, eos, seed, batch_size, decode_engine)
    elif engine == "hf":
        run = _hf(base, sampler, eos, seed, batch_size, shard_size)
    else:
        run = _openai(base, sampler, eos, seed, batch_size, **(server or {}))
    constant = {**settings, "base": base.name, "base_sha256": fingerprint["weights_sha256"]}
    generated, t0 = 0, time.perf_counter()
    with tqdm(total=len(todo), desc="distill", unit="prompt") as bar:
        # one run over every prompt (a continuous batch refills across shard boundaries), each shard written as
        # soon as it and those before it are answered
        answers = run([rendered[i] for i, _ in todo], [i for i, _ in todo])
        for s, (lo, responses) in enumerate(_in_shards(answers, len(todo), shard_size, bar), start=first):
            generated += sum(len(r) for r in responses)
            rows = [_row(base, i, m, r, eos) | constant for (i, m), r in zip(todo[lo : lo + shard_size], responses)]
            _save_atomic(out / "shards" / f"{s:05d}", Dataset.from_list(rows))
    seconds = time.perf_counter() - t0
    if generated:
        print(f"[specdec] distilled {bar.n:,} responses, {generated:,} tokens in {seconds:.0f} s "
              f"({generated / max(seconds, 1e-9):.1f} tok/s, {engine}, batch {batch_size}) -> {out}")
    return load_distilled(out)


def load_distilled(out_dir: str | Path) -> Dataset:
    """Every row of a distilled set: its complete shards, concatenated in order, or a shipped `.jsonl.gz`."""
    path = Path(out_dir).expanduser()
    if path.name.endswith(".jsonl.gz"):
        return _load_shipped(path)
    shards = _shards(path)
    if not shards:
        raise FileNotFoundError(f"no distilled data in {out_dir} (make it with: python -m specdec.data.distill)")
    return concatenate_datasets([load_from_disk(str(p)) for p in shards])


Paths = str | Path | Sequence[str | Path] | None  # one distilled set, several (their rows joined), None = shipped


def distilled(path: Paths = None, kinds: Sequence[str] | None = None) -> Dataset:
    """Data-module source: the distilled conversations as `messages` (rendered with the base's chat template), and
    each one's `group` (the function it answers about: the train/val split keeps a group on one side).
    `path`: a distill out_dir or a shipped .jsonl.gz, or a list of them (e.g. the greedy and the sampled shipped
    sets); None = the greedy set shipped in the package. `kinds`: keep only the rows of these stdlib_tasks kinds
    (the id's last field, e.g. ["complete"]); None = every row."""
    paths = _paths(path)
    ds = concatenate_datasets([load_distilled(p).select_columns(["id", "messages"]) for p in paths])
    if kinds is not None:
        wanted = set(kinds)
        ds = ds.filter(lambda i: task_kind(i) in wanted, input_columns="id")
        if not len(ds):
            raise ValueError(f"no distilled rows of kinds {sorted(wanted)} in {', '.join(map(str, paths))}")
    return ds.map(lambda i: {"group": task_group(i)}, input_columns="id").select_columns(["messages", "group"])


def check_base(base: Base, path: Paths = None) -> None:
    """One-line error when a distilled set was generated by another base (its manifest / meta.json fingerprint)."""
    found = base.fingerprint()
    for path in _paths(path):
        meta_path = _manifest_path(path) if path.name.endswith(".jsonl.gz") else path / "meta.json"
        meta = json.loads(meta_path.read_text())
        diff = sorted(k for k in found if meta["fingerprint"].get(k) != found[k])
        if diff:
            raise ValueError(f"distilled data {path} was generated by base {meta.get('base')!r}, not by "
                             f"{base.name!r} (fingerprint differs in {', '.join(diff)}): distill it again with this base")


def _paths(path: Paths) -> list[Path]:
    """Each entry as a path; None = the shipped greedy set, and a bare name of a shipped file (e.g.
    "stdlib_complete_sampled.jsonl.gz") is that file in the package, so a config can name it on any machine."""
    if path is None:
        return [SHIPPED]
    entries = [path] if isinstance(path, (str, Path)) else path
    return [SHIPPED.with_name(str(p)) if _is_shipped_name(p) else Path(p).expanduser() for p in entries]


def _is_shipped_name(p: str | Path) -> bool:
    return Path(p).name == str(p) and not Path(p).exists() and SHIPPED.with_name(str(p)).exists()


# -- the shipped text ----------------------------------------------------------------------------------
# The default set is shipped inside the package as text (prompts + responses), so no user regenerates it;
# `make distill` reproduces it: the resumable shards above, then `ship` writes this file and its manifest.
SHIPPED = Path(__file__).resolve().parent / "shipped" / "stdlib_tasks.jsonl.gz"
# completion-format prompts (complete, complete_method) answered by sampling (T = 0.7, top-p 0.95): opt in with
# data.source.path=[<SHIPPED>, <SHIPPED_SAMPLED>]
SHIPPED_SAMPLED = SHIPPED.with_name("stdlib_complete_sampled.jsonl.gz")
SHIPPED_COLUMNS = ("id", "messages", "response_tokens", "finished")


def _manifest_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl.gz") + ".manifest.json")


def ship(out_dir: str | Path, target: str | Path = SHIPPED, command: str = "") -> Path:
    """Write every row of `out_dir` as a deterministic .jsonl.gz (sorted by id, gzip mtime 0) with a manifest of
    the command, the generation settings, the base fingerprint and the file's sha256."""
    out, target = Path(out_dir).expanduser(), Path(target)
    meta = json.loads((out / "meta.json").read_text())
    ds = load_distilled(out)
    rows = sorted((dict(zip(SHIPPED_COLUMNS, r)) for r in zip(*(ds[c] for c in SHIPPED_COLUMNS))),
                  key=lambda r: r["id"])
    target.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    with open(target, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:
        gz.write(body)
    manifest = {"command": command, "rows": len(rows), "response_tokens": sum(r["response_tokens"] for r in rows),
                "finished": sum(r["finished"] for r in rows),
                "sha256": hashlib.sha256(target.read_bytes()).hexdigest(),
                **{k: meta[k] for k in ("temperature", "top_k", "top_p", "max_new_tokens", "seed", "engine",
                                        "eos_token_id", "base", "fingerprint")}}
    write_json(_manifest_path(target), manifest)
    return target


def restore(shipped: str | Path, out_dir: str | Path, shard_size: int = 128) -> None:
    """Start an empty `out_dir` from a shipped set (its rows as shards, its manifest's settings as meta.json), so
    that a distill run into it extends the shipped set instead of generating it again. A rerun into an `out_dir`
    that already holds every shipped row does nothing (resuming); any other non-empty `out_dir` is refused."""
    shipped, out = Path(shipped).expanduser(), Path(out_dir).expanduser()
    manifest = json.loads(_manifest_path(shipped).read_text())
    rows = _load_shipped(shipped)
    if _shards(out):
        missing = set(rows["id"]) - set(load_distilled(out)["id"])
        if missing:
            raise ValueError(f"{out} already holds distilled data without {len(missing)} rows of {shipped}: "
                             f"restore into an empty out_dir")
        return
    keys = ("temperature", "top_k", "top_p", "max_new_tokens", "seed", "engine")
    _write_or_check_meta(out, {**{k: manifest[k] for k in keys}, "eos_token_id": manifest["eos_token_id"],
                               "base": manifest["base"], "fingerprint": manifest["fingerprint"]})
    constant = {**{k: manifest[k] for k in keys}, "base": manifest["base"],
                "base_sha256": manifest["fingerprint"]["weights_sha256"]}
    full = [{"id": r["id"], "messages": r["messages"],
             "prompt": next(t["content"] for t in reversed(r["messages"]) if t["role"] == "user"),
             "response": r["messages"][-1]["content"], "response_tokens": r["response_tokens"],
             "finished": r["finished"], **constant} for r in rows]
    for s, lo in enumerate(range(0, len(full), shard_size)):
        _save_atomic(out / "shards" / f"{s:05d}", Dataset.from_list(full[lo : lo + shard_size]))


def _load_shipped(path: Path) -> Dataset:
    manifest = json.loads(_manifest_path(path).read_text())
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise ValueError(f"{path} does not match its manifest (sha256): regenerate it with make distill")
    return Dataset.from_list([json.loads(line) for line in gzip.decompress(data).decode().splitlines()])


# -- prompts -----------------------------------------------------------------------------------------
def _prompt_rows(prompts: Dataset, limit: int | None) -> list[tuple[str, list[dict]]]:
    """(id, prompt turns) of the first `limit` distinct prompts. A conversation is cut before its first assistant
    turn: later turns would answer someone else's assistant. Where the prompts' `base_turns` column is true, its
    assistant turns are the base's own answers (magpie.follow_ups), so it is kept up to its last user turn. Without
    an `id` column the id hashes the turns."""
    rows, seen = [], set()
    ids = prompts["id"] if "id" in prompts.column_names else None
    own = prompts["base_turns"] if "base_turns" in prompts.column_names else None
    for n, messages in enumerate(prompts["messages"]):
        turns = [{"role": m["role"], "content": m["content"]} for m in messages]
        roles = [t["role"] for t in turns]
        if own is not None and own[n]:
            turns = turns[: len(roles) - roles[::-1].index("user")] if "user" in roles else []
        elif "assistant" in roles:
            turns = turns[: roles.index("assistant")]
        key = str(ids[n]) if ids is not None else hashlib.sha256(json.dumps(turns).encode()).hexdigest()[:16]
        if key in seen or not any(t["role"] == "user" for t in turns):
            continue
        seen.add(key)
        rows.append((key, turns))
        if limit is not None and len(rows) >= limit:
            break
    return rows


# -- generation --------------------------------------------------------------------------------------
# (prompt ids sorted by length, row ids) -> (index, generated tokens: EOS included when the base closed its turn) for
# every prompt, in the order the engine answers them
Engine = Callable[[list[list[int]], list[str]], Iterator[tuple[int, list[int]]]]


def _in_shards(answers: Iterator[tuple[int, list[int]]], n: int, shard_size: int,
               bar: tqdm) -> Iterator[tuple[int, list[list[int]]]]:
    """(lo, the responses to prompts lo .. lo + shard_size - 1 in order) for each shard of the n prompts, in order,
    as soon as it and every shard before it are answered: an engine answers in its own order (a continuous batch
    ends short answers first), and a shard is written whole, the unit of resuming."""
    responses: list[list[int]] = [[] for _ in range(n)]
    missing = [min(shard_size, n - lo) for lo in range(0, n, shard_size)]  # per shard: answers still to come
    done = 0
    for i, tokens in answers:
        responses[i] = tokens
        missing[i // shard_size] -= 1
        bar.update(1)
        while done < len(missing) and not missing[done]:
            yield done * shard_size, responses[done * shard_size : (done + 1) * shard_size]
            done += 1


def _ours(base: Base, sampler: SamplerConfig, eos: list[int], seed: int, batch_size: int,
          decode_engine: EngineConfig | None) -> Engine:
    cfg = replace(sampler, eos_token_id=eos)
    fast = build(decode_engine, base.device)

    def run(prompt_ids: list[list[int]], ids: list[str]) -> Iterator[tuple[int, list[int]]]:
        # one generator per row, seeded by the row's id: a sampled response does not depend on its batch or shard
        gens = [torch.Generator(device=base.device).manual_seed(_row_seed(seed, i)) for i in ids]
        return stream(base, prompt_ids, cfg, batch_size, gens, engine=fast)

    return run


def _hf(base: Base, sampler: SamplerConfig, eos: list[int], seed: int, batch_size: int, shard_size: int) -> Engine:
    pad = base.tokenizer.pad_token_id if base.tokenizer.pad_token_id is not None else (eos or [0])[0]
    sampling = {"do_sample": True, "temperature": sampler.temperature, "top_p": sampler.top_p,
                "top_k": sampler.top_k or None} if sampler.temperature > 0 else {"do_sample": False}

    def run_batch(prompt_ids: list[list[int]], ids: list[str]) -> list[list[int]]:
        longest = max(len(p) for p in prompt_ids)
        ids_t = torch.tensor([[pad] * (longest - len(p)) + p for p in prompt_ids], device=base.device)  # [B, P]
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompt_ids], device=base.device)
        # HF samples from the global generator: seeded per batch, so reproducible for the same batches only
        with torch.random.fork_rng(devices=[base.device] if base.device.type == "cuda" else []):
            torch.manual_seed(_row_seed(seed, ids[0]))
            seq = base.model.generate(ids_t, attention_mask=mask, max_new_tokens=sampler.max_new_tokens,
                                      eos_token_id=eos, pad_token_id=pad, **sampling)  # [B, P + n]
        return [_cut_at_eos(row[longest:].tolist(), eos) for row in seq]

    def run(prompt_ids: list[list[int]], ids: list[str]) -> Iterator[tuple[int, list[int]]]:
        # fixed batches within each shard: a resumed run batches, hence seeds, its shards as an uninterrupted one
        for lo in range(0, len(ids), shard_size):
            end = min(lo + shard_size, len(ids))
            for start in range(lo, end, batch_size):
                rows = range(start, min(start + batch_size, end))
                yield from zip(rows, run_batch([prompt_ids[i] for i in rows], [ids[i] for i in rows]))

    return run


def _openai(base: Base, sampler: SamplerConfig, eos: list[int], seed: int, batch_size: int,
            base_url: str | None = None, model: str | None = None) -> Engine:
    """An OpenAI-compatible server's /v1/completions, `batch_size` requests in flight (its own batching does the
    rest). The prompt goes as the base's token ids (the chat template rendered here, as for the other engines); the
    answer comes back as text, tokenized by the base's tokenizer again, with the EOS where the server stopped on one."""
    import json
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    if not base_url:
        raise ValueError("the openai engine (backend=openai) needs server.base_url=http://<host>:<port> (vLLM, SGLang "
                         "or llama-server serving the base)")
    url = base_url.rstrip("/") + ("/completions" if base_url.rstrip("/").endswith("/v1") else "/v1/completions")

    def one(prompt: list[int], row_id: str) -> list[int]:
        body = {"model": model or base.name, "prompt": prompt, "max_tokens": sampler.max_new_tokens,
                "temperature": sampler.temperature, "top_p": sampler.top_p, "seed": _row_seed(seed, row_id) % 2**31}
        if sampler.top_k:
            body["top_k"] = sampler.top_k  # (not OpenAI's own field; vLLM, SGLang and llama.cpp read it)
        req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            choice = json.loads(r.read())["choices"][0]
        tokens = base.tokenizer(choice["text"], add_special_tokens=False)["input_ids"]
        stopped = choice.get("finish_reason") == "stop" and eos
        return tokens + [eos[0]] if stopped else tokens

    def run(prompt_ids: list[list[int]], ids: list[str]) -> Iterator[tuple[int, list[int]]]:
        with ThreadPoolExecutor(max(1, batch_size)) as pool:
            yield from enumerate(pool.map(one, prompt_ids, ids))

    return run


def _eos(base: Base, sampler: SamplerConfig) -> list[int]:
    eos = base.config.eos_token_id if sampler.eos_token_id is None else sampler.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]


def _cut_at_eos(tokens: list[int], eos: list[int]) -> list[int]:
    """Up to and including the first EOS: HF pads rows that finished early."""
    for n, t in enumerate(tokens):
        if t in eos:
            return tokens[: n + 1]
    return tokens


def _row_seed(seed: int, row_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{row_id}".encode()).digest()[:8], "little") >> 1


def _row(base: Base, row_id: str, turns: list[dict], tokens: list[int], eos: list[int]) -> dict:
    response = base.tokenizer.decode(tokens, skip_special_tokens=True)
    return {
        "id": row_id,
        "messages": turns + [{"role": "assistant", "content": response}],
        "prompt": next(t["content"] for t in reversed(turns) if t["role"] == "user"),
        "response": response,
        "response_tokens": len(tokens),  # generated, the closing EOS included
        "finished": bool(tokens) and tokens[-1] in eos,
    }


# -- storage -----------------------------------------------------------------------------------------
def _shards(out: Path) -> list[Path]:
    """Complete shards in order; a half-written one lives in a .tmp- dir and is not listed."""
    root = out / "shards"
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.isdigit()) if root.exists() else []


def _save_atomic(path: Path, ds: Dataset) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=path.parent, prefix=".tmp-")
    shown = not are_progress_bars_disabled()
    disable_progress_bars()  # one bar per shard would break the prompt bar
    try:
        ds.save_to_disk(tmp)
    finally:
        if shown:
            enable_progress_bars()
    try:
        os.replace(tmp, path)
    except OSError:  # another process finished this shard first
        shutil.rmtree(tmp, ignore_errors=True)


def _write_or_check_meta(out: Path, meta: dict) -> None:
    path = out / "meta.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = [k for k in meta if k != "base" and old.get(k) != meta[k]]  # the fingerprint decides the base, not its name
        if diff:
            shown = ", ".join(f"{k} {old.get(k)} != {meta[k]}" if k != "fingerprint" else f"base {old.get('base')}"
                              for k in diff)
            raise ValueError(f"{out} holds distilled data made with other settings ({shown}); "
                             f"use another out_dir or delete it")
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, meta)


@hydra.main(version_base="1.3", config_path="../../configs", config_name="distill")
def main(cfg: DictConfig) -> None:
    print(OmegaConf.to_yaml(cfg, resolve=False))
    base: Base = hydra.utils.instantiate(cfg.base)
    prompts = hydra.utils.instantiate(cfg.prompts)
    if not isinstance(prompts, Dataset):  # a source that needs the base (specdec.data.magpie: the base writes them)
        prompts = prompts(base=base)
    sampler: SamplerConfig = hydra.utils.instantiate(cfg.sampler)
    if cfg.start_from:
        restore(cfg.start_from, cfg.out_dir, shard_size=cfg.shard_size)
    distill(prompts, base, cfg.out_dir, sampler, batch_size=cfg.batch_size, limit=cfg.limit,
            shard_size=cfg.shard_size, seed=cfg.seed, engine=cfg.backend, max_shards=cfg.max_shards,
            decode_engine=hydra.utils.instantiate(cfg.decode_engine),
            server=OmegaConf.to_container(cfg.server) if "server" in cfg else None)
    if cfg.ship_to:
        overrides = " ".join(HydraConfig.get().overrides.task)
        command = cfg.ship_command or f"python -m specdec.data.distill {overrides}".strip()
        target = ship(cfg.out_dir, cfg.ship_to, command=command)
        print(f"[specdec] shipped {target} ({target.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
