"""experiments/bench_ar.py's greedy check: where a path's tokens leave HF generate's, and HF's own logit gap there."""

import math

import torch

from conftest import experiment_script


def test_divergence_names_the_first_differing_token_and_hfs_logit_gap(tiny):
    diverges = experiment_script("bench_ar").diverges
    prompt = [5, 9, 13, 2, 7]
    hf = tiny.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                             max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    logits = tiny.model(torch.tensor([prompt + hf[:3]])).logits[0, -1]
    other = int(logits.topk(2).indices[1])  # the runner-up where HF chose hf[3]
    d = diverges(tiny, prompt, hf[:3] + [other] + hf[4:], hf)
    assert (d["at"], d["ours"], d["hf"]) == (3, other, hf[3])
    assert math.isclose(d["logit_gap"], float(logits[hf[3]] - logits[other]), rel_tol=1e-5)
    assert d["logit_gap"] > 0  # greedy: HF's token is the argmax of its own forward
    # a path that stops early differs where it ends, with no token to compare
    assert diverges(tiny, prompt, hf[:2], hf)["at"] == 2


def test_spans_group_consecutive_rows_alike():
    spans = experiment_script("bench_ar").spans
    assert spans({"1": 8192, "2": 8192, "3": 4096, "4": 4096, "5": 4096}) == [(1, 2, 8192), (3, 5, 4096)]
    assert spans({1: 16384, 2: 8192, 4: 8192}) == [(1, 1, 16384), (2, 2, 8192), (4, 4, 8192)]
