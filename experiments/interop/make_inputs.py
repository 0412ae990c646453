"""Our side of `make interop`: an EAGLE-3 drafter exported in the speculators layout, and one HumanEval sequence's
inputs with our drafter's answers on them, for experiments/interop/check_speculators.py to replay through the
speculators package's own Eagle3DraftModel.

The inputs are laid out as speculators' forward reads them, entry i = (fused hidden states, token) at index i, with no
shift of its own (its `shift_batch` belongs to its data loader, not to the forward): entry 0 is our sink (a zero
feature, fc(0) = 0, with x_0), entry i >= 1 is ours of position t = i - 1, (h_{i-1}, x_i). After the sequence
x_0..x_N come our greedy chain's tokens c_1..c_{k-1} (zero features): TTT step j at entry i reads token i + j, so at
the root entry N (ours t = N - 1) step j reads c_j, the chain fed back, while the step-0 entries after N stay out of
its sight (causal). Total entries L: a multiple of 128, the block of speculators' flex-attention masks.

Written to OUT/export (the export) and OUT/inputs.safetensors: hidden [1, L, 3H], input_ids [1, L], logits [L-1, k,
V_d] (ours for entries 1..L-1, every TTT step teacher-forced on input_ids), chain [k] (base ids), root (N); its
metadata names the verifier's local dir and our versions.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from specdec.base import load_base
from specdec.data.prompts import humaneval, render_chat
from specdec.drafters.eagle3 import Eagle3
from specdec.export import export, load

BLOCK = 128  # speculators' flex-attention block size: its mask extension per TTT step assumes whole blocks


def random_drafter(base, steps: int, vocab: int, seed: int) -> Eagle3:
    """A fresh Eagle3 with a random draft vocabulary and every weight jittered by 10 % (norms and the lm_head start
    from the base's rows, which would leave part of the layer an identity a layout bug could hide behind)."""
    torch.manual_seed(seed)
    d = Eagle3(base, ttt_steps=steps, draft_vocab_size=vocab)
    d.set_draft_vocab(torch.randperm(base.vocab_size)[:vocab])
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.mul_(1 + 0.1 * torch.randn_like(p))
    return d


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".interop/run")
    ap.add_argument("--drafter", default=None, help="a specdec drafter dir (or any format specdec reads); else random")
    ap.add_argument("--steps", type=int, default=3, help="TTT steps of a random drafter")
    ap.add_argument("--min-new", type=int, default=32, help="at least this many greedy base tokens after the prompt")
    args = ap.parse_args()
    out = Path(args.out)

    base = load_base(device="cpu")
    d = load(args.drafter, base) if args.drafter else random_drafter(base, args.steps, 8192, seed=0)
    d = d.float().eval()
    k = d.ttt_steps
    export(d, "speculators", out / "export", source=args.drafter or "experiments/interop/make_inputs.py (random)")

    # x_0..x_N: the first HumanEval prompt in the chat template and the base's greedy answer, cut so that
    # L = N + 1 + (k - 1) is a whole number of blocks
    prompt = render_chat(base.tokenizer, [{"role": "user", "content": humaneval(limit=1)[0]["turns"][0]}])
    slots = BLOCK * math.ceil((len(prompt) + args.min_new + k - 1) / BLOCK)
    n_tokens = slots - (k - 1)
    new = n_tokens - len(prompt)
    prompt_ids = torch.tensor([prompt])
    ids = base.model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False)
    ids = ids[:, :n_tokens]
    root = n_tokens - 1  # entry N = (h_{N-1}, x_N): where the chain starts

    feats = base.features(ids, layers=tuple(d.aux_layers))
    fused = torch.cat([feats.hidden[l] for l in d.aux_layers], dim=-1)  # [1, N+1, 3H], low to high as fc reads
    zeros = fused.new_zeros(1, 1, fused.shape[-1])
    # entries 0..L-1: sink, h_0..h_{N-1}, zero features under the chain's tokens
    hidden = torch.cat([zeros, fused[:, :root], zeros.expand(1, k - 1, -1)], dim=1)  # [1, L, 3H]
    assert hidden.shape[1] == slots

    # ours at t = i - 1: g_0..g_{N-1}, then zeros (fc(0)) under the chain and one more for t = L - 1, which no
    # entry of theirs mirrors
    g = d.real_feature(feats.hidden)[:, :root]
    g = torch.cat([g, g.new_zeros(1, k, base.hidden_size)], dim=1)  # [1, L, H]

    # our greedy chain from the root: step j reads c_j at token index N + j (zeros past the chain so far)
    chain = []
    for j in range(k):
        tokens = torch.cat([ids, torch.tensor([chain + [0] * (k - 1 - len(chain))])], dim=1)
        step = d.unroll(g, tokens, j + 1)[0, root - 1, j]  # ours t = N - 1 is entry N
        chain.append(int(d.draft_vocab.tokens[step.argmax()]))
    input_ids = torch.cat([ids, torch.tensor([chain[: k - 1]])], dim=1)  # [1, L]
    logits = d.unroll(g, input_ids, k)[0, : slots - 1]  # [L-1, k, V_d]: entries 1..L-1

    tensors = {"hidden": hidden, "input_ids": input_ids, "logits": logits, "chain": torch.tensor(chain),
               "root": torch.tensor(root)}
    meta = {"verifier_dir": str(base.model.name_or_path), "prompt": humaneval(limit=1)[0]["id"],
            "prompt_tokens": str(len(prompt)), "drafter": args.drafter or "random (seed 0, 10 % jitter)",
            "ours": f"torch {torch.__version__}, transformers {transformers.__version__}"}
    save_file({n: t.contiguous() for n, t in tensors.items()}, out / "inputs.safetensors", metadata=meta)
    print(f"make_inputs: {out}/export and {out}/inputs.safetensors: {meta['prompt']}, {len(prompt)} prompt + "
          f"{new} greedy tokens, L = {slots} entries, k = {k}, our chain {chain}")


if __name__ == "__main__":
    main()
