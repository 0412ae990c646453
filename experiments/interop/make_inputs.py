"""Our side of `make interop`: one drafter of each family the speculators package trains (EAGLE-3, P-EAGLE, DFlash),
exported in the speculators layout, and one sequence's inputs per family with our drafter's answers on them, for
experiments/interop/check_speculators.py to replay through speculators' own model classes.

Each family's inputs are laid out as its speculators forward reads them, entry i = (fused hidden states, token) at
index i, with no shift of its own (`shift_batch` belongs to its data loader, not to the forward). Hidden states are
the inputs of the drafter's aux layers (HF hidden_states[l]), concatenated low to high as fc reads them.

- eagle3 (on SmolLM2): x_0..x_N, the first HumanEval prompt in the chat template and the base's greedy answer.
  Entry 0 is our sink (a zero feature, fc(0) = 0, with x_0), entry i >= 1 ours of position t = i - 1, (h_{i-1},
  x_i). After x_N come our greedy chain's tokens c_1..c_{k-1} (zero features): TTT step j at entry i reads token
  i + j, so at the root entry N (ours t = N - 1) step j reads c_j, the chain fed back, while the step-0 entries after
  N stay out of its sight (causal). L = N + k entries, a multiple of 128, the block of speculators' flex-attention
  masks (its mask extension per TTT step assumes whole blocks). Ours: `Eagle3.unroll`, every TTT step
  teacher-forced on input_ids -> logits [L-1, k, V_d] for entries 1..L-1.
- peagle (on SmolLM2, the same x_0..x_N): entries 0..N as eagle3's, then K - 1 entries of zero features and token 0
  that no entry <= N sees, so that the masked entries of anchor N (orig positions N + 1 .. N + K - 1) exist. Their
  entry (anchor i, depth k) is ours (t = i - 1, depth k). Ours: `PEagle.forward_train` outside training (every depth
  at every position) -> logits [N, K, V_d] for t = 0..N-1 (t = N would read x_{N+1}); chain [K] our drafts from the
  root t = N - 1 as base ids.
- dflash (on a tiny random Qwen3 saved to OUT/dflash-verifier: speculators' DFlash layers are Qwen3's, so our export
  refuses SmolLM2's Llama layers): x_0..x_N the first N + 1 byte tokens of the same prompt, then b entries of zero
  features and token 0, because speculators' anchor selection leaves the last b positions out: its anchors then run
  0..N, each block seeing only entries before its anchor. Ours: `DFlash.forward_train` (one block per position) ->
  logits [N + 1, b - 1, V_d], block a's masked slots 1..b-1; chain [b - 1] our drafts from the root anchor N, base
  ids. L = N + 1 + b = 256.

Written to OUT/export/<family> (the exports), OUT/dflash-verifier (the Qwen3 base, what their DFlash reads its
embeddings from) and OUT/inputs.safetensors: tensors `<family>.<name>`, metadata `<family>.<key>` (the verifier's
local dir, the drafter, the sequence), the prompt, the machine and our versions.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import ByT5Tokenizer, Qwen3Config, Qwen3ForCausalLM

from specdec.base import CHATML, Base, load_base
from specdec.data.prompts import humaneval, render_chat
from specdec.drafters.dflash import DFlash
from specdec.drafters.drafter import Drafter
from specdec.drafters.eagle3 import Eagle3
from specdec.drafters.peagle import PEagle
from specdec.engines.measure import cpu_model
from specdec.export import export, load

BLOCK = 128  # speculators' flex-attention block size: its EAGLE-3 mask extension per TTT step assumes whole blocks
FAMILIES = ("eagle3", "peagle", "dflash")
DFLASH_SLOTS = 256  # entries of the DFlash sequence, its b trailing ones included


@torch.no_grad()
def perturb(d: torch.nn.Module, gen: torch.Generator) -> None:
    """Every trainable weight w -> w (1 + 0.1 n) + 0.1 rms(w) n' (n, n' standard normal). A fresh drafter starts
    from the base: identity blocks in fc, zeros in EAGLE-3's token half of q/k/v, the base's norms and lm_head rows.
    Scaling alone would leave the zeros zero (the token embedding and two of three fused layers out of the logits) and
    the copies near-copies, where a swapped or misread tensor could hide; the added noise makes each weight count."""
    for p in d.parameters():
        if p.requires_grad:
            rms = float(p.pow(2).mean().sqrt()) or 0.02
            p.mul_(1 + 0.1 * torch.randn(p.shape, generator=gen)).add_(0.1 * rms * torch.randn(p.shape, generator=gen))


def greedy_sequence(base: Base, k: int, min_new: int) -> tuple[torch.Tensor, int]:
    """x_0..x_N: the first HumanEval prompt in the chat template and the base's greedy answer, cut so that
    N + 1 + (k - 1) is a whole number of blocks -> ([1, N + 1] ids, prompt length)."""
    prompt = render_chat(base.tokenizer, [{"role": "user", "content": humaneval(limit=1)[0]["turns"][0]}])
    slots = BLOCK * math.ceil((len(prompt) + min_new + k - 1) / BLOCK)
    n_tokens = slots - (k - 1)
    new = n_tokens - len(prompt)
    prompt_ids = torch.tensor([prompt])
    ids = base.model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False)
    return ids[:, :n_tokens], len(prompt)


def fused(base: Base, ids: torch.Tensor, layers: list[int]):
    """The base's features of ids and their aux layers concatenated low to high -> (features, [1, T, n·H])."""
    feats = base.features(ids, layers=tuple(layers))
    return feats, torch.cat([feats.hidden[l] for l in layers], dim=-1)


def eagle3_inputs(base: Base, d: Eagle3, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    k, root = d.ttt_steps, ids.shape[1] - 1  # entry N = (h_{N-1}, x_N): where the chain starts
    slots = root + k
    feats, h = fused(base, ids, d.aux_layers)  # [1, N+1, 3H]
    zeros = h.new_zeros(1, 1, h.shape[-1])
    # entries 0..L-1: sink, h_0..h_{N-1}, zero features under the chain's tokens
    hidden = torch.cat([zeros, h[:, :root], zeros.expand(1, k - 1, -1)], dim=1)  # [1, L, 3H]
    # ours at t = i - 1: g_0..g_{N-1}, then zeros (fc(0)) under the chain and one more for t = L - 1, which no entry
    # of theirs mirrors
    g = d.real_feature(feats.hidden)[:, :root]
    g = torch.cat([g, g.new_zeros(1, k, base.hidden_size)], dim=1)  # [1, L, H]
    # our greedy chain from the root: step j reads c_j at token index N + j (zeros past the chain so far)
    chain: list[int] = []
    for j in range(k):
        tokens = torch.cat([ids, torch.tensor([chain + [0] * (k - 1 - len(chain))])], dim=1)
        step = d.unroll(g, tokens, j + 1)[0, root - 1, j]  # ours t = N - 1 is entry N
        chain.append(int(d.draft_vocab.tokens[step.argmax()]))
    input_ids = torch.cat([ids, torch.tensor([chain[: k - 1]])], dim=1)  # [1, L]
    logits = d.unroll(g, input_ids, k)[0, : slots - 1]  # [L-1, k, V_d]: entries 1..L-1
    return {"hidden": hidden, "input_ids": input_ids, "logits": logits, "chain": torch.tensor(chain),
            "root": torch.tensor(root)}


def peagle_inputs(base: Base, d: PEagle, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    k, root = d.num_depths, ids.shape[1] - 1
    feats, h = fused(base, ids, d.aux_layers)  # [1, N+1, 3H]
    zeros = h.new_zeros(1, 1, h.shape[-1])
    hidden = torch.cat([zeros, h[:, :root], zeros.expand(1, k - 1, -1)], dim=1)  # [1, N+K, 3H]
    input_ids = torch.cat([ids, ids.new_zeros(1, k - 1)], dim=1)  # [1, N+K]
    logits = d.forward_train(feats, ids).logits[0, :root]  # [N, K, V_d]: t = 0..N-1
    chain = d.draft_vocab.tokens[logits[root - 1].argmax(-1)]  # [K]: the root entry's drafts, base ids
    return {"hidden": hidden, "input_ids": input_ids, "logits": logits, "chain": chain, "root": torch.tensor(root)}


def dflash_inputs(base: Base, d: DFlash, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    b, root = d.block_size, ids.shape[1] - 1
    feats, h = fused(base, ids, d.aux_layers)  # [1, N+1, 3H]
    hidden = torch.cat([h, h.new_zeros(1, b, h.shape[-1])], dim=1)  # [1, N+1+b, 3H]
    input_ids = torch.cat([ids, ids.new_zeros(1, b)], dim=1)  # [1, N+1+b]
    logits = d.forward_train(feats, ids).logits[0]  # [N+1, b-1, V_d]: block a's masked slots
    block = d.token_ids(logits[root].argmax(-1))  # [b-1]: the root block's drafts, base ids
    return {"hidden": hidden, "input_ids": input_ids, "logits": logits, "chain": block, "root": torch.tensor(root)}


def qwen3_verifier(path: Path, seed: int = 0) -> Base:
    """A tiny random Qwen3 (4 layers, hidden 64, the byte-level test tokenizer) saved to `path` and loaded back the
    way specdec loads any local HF dir: the DFlash base, and the verifier dir their DFlash reads. Its weights are
    drawn 10× wider than HF's default (std 0.2): at 0.02 the logits of hidden 64 are a few hundredths apart, and the
    argmaxes the check compares would be near-ties."""
    tok = ByT5Tokenizer(extra_ids=0)
    tok.chat_template = CHATML
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=len(tok), max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, initializer_range=0.2)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return load_base(str(path), device="cpu")


def random_drafter(family: str, base: Base, args) -> Drafter:
    """A fresh drafter of `family` with a random draft vocabulary, perturbed (seed 0, whatever else runs)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if family == "eagle3":
        d = Eagle3(base, ttt_steps=args.steps, draft_vocab_size=8192)
    elif family == "peagle":
        d = PEagle(base, num_depths=args.depths, num_layers=2, draft_vocab_size=8192)
    else:
        d = DFlash(base, num_layers=2, block_size=args.block, aux_layers=[1, 2, 3], draft_vocab_size=192,
                   own_lm_head=True)
    d.set_draft_vocab(torch.randperm(base.vocab_size, generator=gen)[: d.draft_vocab.size])
    perturb(d, gen)
    return d.eval()


DESCRIBE = {"eagle3": "random EAGLE-3 (seed 0, perturbed)", "peagle": "random P-EAGLE, 2 layers (seed 0, perturbed)",
            "dflash": "random DFlash, 2 layers, own lm_head (seed 0, perturbed)"}


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".interop/run")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    ap.add_argument("--drafter", default=None, help="an EAGLE-3 drafter dir (or any format specdec reads); else random")
    ap.add_argument("--steps", type=int, default=3, help="TTT steps of a random EAGLE-3")
    ap.add_argument("--depths", type=int, default=4, help="depths of the random P-EAGLE")
    ap.add_argument("--block", type=int, default=8, help="block size of the random DFlash")
    ap.add_argument("--min-new", type=int, default=32, help="at least this many greedy base tokens after the prompt")
    args = ap.parse_args()
    out, families = Path(args.out), args.families.split(",")
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise SystemExit(f"make_inputs: unknown families {sorted(unknown)}; known: {', '.join(FAMILIES)}")
    tensors: dict[str, torch.Tensor] = {}
    meta = {"ours": f"torch {torch.__version__}, transformers {transformers.__version__}",
            "prompt": humaneval(limit=1)[0]["id"],
            "machine": f"{cpu_model()}, {platform.machine()}, {os.cpu_count()} cores"}

    if {"eagle3", "peagle"} & set(families):
        base = load_base(device="cpu")
        drafters = {f: random_drafter(f, base, args) for f in ("eagle3", "peagle") if f in families}
        if args.drafter and "eagle3" in drafters:
            drafters["eagle3"] = load(args.drafter, base).float().eval()
        k = drafters["eagle3"].ttt_steps if "eagle3" in drafters else args.steps
        ids, prompt_len = greedy_sequence(base, k, args.min_new)  # (P-EAGLE's too: one sequence for both)
        for fam, d in drafters.items():
            what = args.drafter if fam == "eagle3" and args.drafter else DESCRIBE[fam]
            export(d, "speculators", out / "export" / fam, source=f"experiments/interop/make_inputs.py ({what})")
            make = eagle3_inputs if fam == "eagle3" else peagle_inputs
            tensors |= {f"{fam}.{n}": t for n, t in make(base, d, ids).items()}
            meta |= {f"{fam}.verifier_dir": str(base.model.name_or_path), f"{fam}.drafter": what,
                     f"{fam}.sequence": f"{prompt_len} prompt + {ids.shape[1] - prompt_len} greedy tokens"}
        if "peagle" in drafters:
            meta["peagle.mask_token_id"] = str(drafters["peagle"].mask_token_id)

    if "dflash" in families:
        base = qwen3_verifier(out / "dflash-verifier")
        d = random_drafter("dflash", base, args)
        export(d, "speculators", out / "export" / "dflash",
               source=f"experiments/interop/make_inputs.py ({DESCRIBE['dflash']})")
        prompt = render_chat(base.tokenizer, [{"role": "user", "content": humaneval(limit=1)[0]["turns"][0]}])
        ids = torch.tensor([prompt[: DFLASH_SLOTS - args.block]])
        tensors |= {f"dflash.{n}": t for n, t in dflash_inputs(base, d, ids).items()}
        meta |= {"dflash.verifier_dir": str((out / "dflash-verifier").resolve()), "dflash.drafter": DESCRIBE["dflash"],
                 "dflash.sequence": f"the first {ids.shape[1]} of {len(prompt)} prompt tokens (bytes)"}

    save_file({n: t.contiguous() for n, t in tensors.items()}, out / "inputs.safetensors", metadata=meta)
    for fam in families:
        print(f"make_inputs: {fam}: {out}/export/{fam}, {meta[f'{fam}.sequence']}, "
              f"L = {tensors[f'{fam}.input_ids'].shape[1]} entries, logits {tuple(tensors[f'{fam}.logits'].shape)}, "
              f"our drafts from the root {tensors[f'{fam}.chain'].tolist()}")


if __name__ == "__main__":
    main()
