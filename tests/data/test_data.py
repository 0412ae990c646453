import json

import numpy as np
import pytest

from specdec.data import sources
from specdec.data.datamodule import TextDataModule


def _dm(tiny, source, tmp_path, **kw):
    kw = {"block_size": 16, "batch_size": 2, "val_fraction": 0.25, "cache_dir": str(tmp_path / "cache"), **kw}
    dm = TextDataModule(source, tiny.tokenizer, **kw)
    dm.setup()
    return dm


def _ids(dm, split):
    return dm.blocks[split][:]["input_ids"]  # [N, block_size]


def test_text_files_pack_into_blocks(tiny, corpus, tmp_path):
    dm = _dm(tiny, lambda: sources.text(str(corpus / "*.txt")), tmp_path)
    train, val = _ids(dm, "train"), _ids(dm, "val")
    assert train.shape[1] == val.shape[1] == 16 and len(train) > 10 and len(val) > 0
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == (2, 16)
    # documents are separated by EOS
    assert (train == tiny.tokenizer.eos_token_id).any()


def test_split_is_by_document(tiny, tmp_path):
    docs = [f"document number {i} " * 6 for i in range(8)]
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join(json.dumps({"body": d}) for d in docs))
    dm = _dm(tiny, lambda: sources.text(str(p), field="body"), tmp_path, block_size=8)
    val_text = tiny.tokenizer.decode(_ids(dm, "val").flatten())  # blocks in order: documents read through
    train_text = tiny.tokenizer.decode(_ids(dm, "train").flatten())
    val_ids = {i for i in range(8) if f"number {i} " in val_text}
    assert val_ids and not any(f"number {i} " in train_text for i in val_ids)


def test_split_without_groups_is_a_seeded_permutation_and_groups_stay_whole(tiny):
    dm = TextDataModule(lambda: None, tiny.tokenizer, val_fraction=0.25, seed=3, cache_dir=None)
    order = np.random.default_rng(3).permutation(12).tolist()
    assert dm._split(12, None) == (order[:3], order[3:])  # the split (and packing order) of every earlier cache
    groups = ["a", "a", "b", "b", "b", "c", "d", "d", "e", "f", "f", "f"]
    val, train = dm._split(12, groups)
    assert sorted(val + train) == list(range(12)) and len(val) >= 3
    assert not {groups[i] for i in val} & {groups[i] for i in train}
    with pytest.raises(ValueError, match="one group holds all 4 documents"):
        dm._split(4, ["x"] * 4)


def test_cache_is_reused(tiny, corpus, tmp_path):
    src = lambda: sources.text(str(corpus / "*.txt"))  # noqa: E731
    a = _dm(tiny, src, tmp_path)
    assert len(list((tmp_path / "cache").iterdir())) == 1
    b = _dm(tiny, src, tmp_path)
    assert np.array_equal(_ids(a, "train").numpy(), _ids(b, "train").numpy())
    _dm(tiny, src, tmp_path, block_size=8)  # other packing settings: another cache entry
    assert len(list((tmp_path / "cache").iterdir())) == 2


@pytest.mark.parametrize("form", ["messages", "conversations"])
def test_chat_rows_render_with_the_chat_template(tiny, tmp_path, form):
    if form == "messages":
        row = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello!"}]}
    else:
        row = {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello!"}]}
    p = tmp_path / "chat.jsonl"
    p.write_text("\n".join(json.dumps(row) for _ in range(4)))
    ds = sources.chat(str(p), field=form)
    assert ds[0]["messages"][1] == {"role": "assistant", "content": "hello!"}
    dm = TextDataModule(lambda: ds, tiny.tokenizer, block_size=8, val_fraction=0.25, cache_dir=None)
    texts, _, answers = dm._docs(ds)
    assert texts[0] == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\nhello!<|im_end|>\n"
    # the answer mask: the assistant's turn from its content through its end-of-turn token
    start, end = answers[0][0]
    assert texts[0][start:end] == "hello!<|im_end|>\n"
    n = len(tiny.tokenizer(texts[0], add_special_tokens=False)["input_ids"])
    ids, mask = TextDataModule(lambda: ds, tiny.tokenizer, block_size=n + 1, cache_dir=None)._pack(texts[:1], answers[:1])
    # (the EOS that closes a packed document is the packing's: left out)
    assert tiny.tokenizer.decode(ids[0][mask[0] == 1]) == "hello!<|im_end|>\n"
    assert tiny.tokenizer.decode(ids[0][mask[0] == 0]) == ("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
                                                          + tiny.tokenizer.eos_token)


def test_stdlib_corpus_is_real_source():
    ds = sources.stdlib_code(max_files=5)
    assert len(ds) == 5 and all(p.endswith(".py") and "test" not in p.split("/")[0] for p in ds["path"])
    assert any("def " in t or "import " in t for t in ds["text"])


def test_too_little_text_is_a_clear_error(tiny, tmp_path):
    p = tmp_path / "tiny.txt"
    p.write_text("ab")
    with pytest.raises(ValueError, match="too little text"):
        _dm(tiny, lambda: sources.text(str(p)), tmp_path, block_size=64)
