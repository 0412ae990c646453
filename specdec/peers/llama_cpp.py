"""llama.cpp as a peer: its own server (`llama-server`, built by `make peers`) on localhost, serving the same GGUF with
the same threads, fed the same prompt token ids.

Why the server and not llama-cpp-python in process: one build gives every llama.cpp decoder a user would run (plain,
its n-gram speculation, a draft model, an EAGLE-3 drafter), each a server flag; the prompt goes in as token ids and the
answer comes back as token ids, so no tokenizer stands between the two sides; and the time a request costs beyond
llama.cpp's own compute is one HTTP round trip on loopback per answer (`make bench` compares the server's decode rate
with `llama-bench`'s own: within 10 %, the peer is not handicapped by its wrapper).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bin_dir() -> Path:
    """Where `make peers` puts the tools (SPECDEC_PEERS overrides: a build elsewhere)."""
    return Path(os.environ.get("SPECDEC_PEERS", ROOT / ".peers")) / "bin"


def tool(name: str) -> Path:
    path = bin_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: `make peers` builds llama.cpp's tools (about 10 min, once)")
    return path


def available() -> str | None:
    """None where the tools are built, else the one-line reason they are not (for skips and optional peers)."""
    try:
        tool("llama-server")
        return None
    except FileNotFoundError as e:
        return str(e)


@dataclass
class Completion:
    tokens: list[int]
    seconds: float  # wall time of the request: prefill, decode and one loopback round trip
    prompt_ms: float  # llama.cpp's own split of it
    decode_ms: float
    drafted: int = 0  # llama.cpp's speculation, where the server runs one
    accepted: int = 0


class LlamaServer:
    """One `llama-server` process with one slot, started on a free localhost port; `complete` is one request.

    `args`: the server's own flags beyond model, threads and context (e.g. `--spec-type ngram-simple`,
    `-md draft.gguf`). The prompt cache is off per request, so every answer pays its prefill, as ours do."""

    def __init__(self, gguf: str | Path, threads: int, args: list[str] = (), ctx: int = 4096, start_s: float = 120):
        self.port = _free_port()
        self.cmd = [str(tool("llama-server")), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
                    "-c", str(ctx), "-np", "1", "--host", "127.0.0.1", "--port", str(self.port), "--no-webui",
                    *map(str, args)]
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + start_s
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {' '.join(self.cmd)}")
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"llama-server not ready after {start_s:.0f} s: {' '.join(self.cmd)}")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def complete(self, prompt: list[int], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, ignore_eos: bool = False) -> Completion:
        body = {"prompt": prompt, "n_predict": max_new_tokens, "temperature": temperature, "top_p": top_p,
                "top_k": top_k, "min_p": 0.0, "seed": seed, "cache_prompt": False, "return_tokens": True,
                "stream": False, "ignore_eos": ignore_eos}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        seconds = time.perf_counter() - t0
        t = out.get("timings", {})
        return Completion(list(out["tokens"]), seconds, t.get("prompt_ms", float("nan")),
                          t.get("predicted_ms", float("nan")), t.get("draft_n", 0), t.get("draft_n_accepted", 0))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bench(gguf: str | Path, threads: int, prompt: int, tokens: int, depth: int = 0, reps: int = 3) -> dict[str, float]:
    """`llama-bench`'s own pp and tg tok/s on this machine (mean over its reps; tg after `depth` tokens of context):
    the figures the server peer must come within 10 % of, so that the peer is not handicapped by its wrapper."""
    def run(*flags: str) -> float:
        out = subprocess.run([str(tool("llama-bench")), "-m", str(gguf), "-t", str(threads), "-r", str(reps),
                              "-o", "json", *flags], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)[0]["avg_ts"]
    return {"prefill": run("-p", str(prompt), "-n", "0"), "decode": run("-p", "0", "-n", str(tokens), "-d", str(depth))}


def build_flags() -> str:
    """What `make peers` built: the llama-cpp-python version and the cmake flags (its stamp file)."""
    stamp = bin_dir() / ".built"
    return stamp.read_text().strip() if stamp.exists() else "unknown"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
