"""The table pages under experiments/pages/ show their committed results as the table scripts wrote them
(experiments/sync_pages.py copies them; a hand edit of a number on a page fails here)."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("sync_pages", ROOT / "experiments" / "sync_pages.py")
sync_pages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sync_pages)

RESULT = """# A table

`python experiments/t.py 'train:data.path=${paths.cache_dir}/x'` · 2026-12-01 · cpu (AMD EPYC (family 25, model 1), x86_64, 2 cores), 2 threads

| k | × AR (ours) |
|---|---|
| 1 | 1.10 |

α̂ as in [docs/sampler.md §4](../../../docs/sampler.md#4-metrics).

![t](t.png)
"""

PAGE = """# `t`: a table

- **Command** (as the result file records it): `python experiments/t.py`
- **Machine**: cpu (Intel(R) Xeon(R) Processor (family 6, model 167), x86_64, 2 cores), 2 threads
- **Date**: 2026-11-26
- **Result**: [results/t/t.md](../results/t/t.md)

## The table

From [results/t/t.md](../results/t/t.md):

| k | × AR (ours) |
|---|---|
| 1 | 0.90 |

![t](../results/t/t.png)

## Reading

- Prose a person wrote stays.
"""


def test_synced_takes_header_and_table_from_the_result_and_keeps_the_prose():
    page = sync_pages.synced("t", PAGE, RESULT)
    assert "- **Command** (as the result file records it): `python experiments/t.py 'train:data.path=${paths.cache_dir}/x'`" in page
    assert "- **Machine**: cpu (AMD EPYC (family 25, model 1), x86_64, 2 cores), 2 threads" in page
    assert "- **Date**: 2026-12-01" in page
    assert "| 1 | 1.10 |" in page and "| 1 | 0.90 |" not in page
    assert "![t](../results/t/t.png)" in page  # the image link made relative to pages/
    assert "[docs/sampler.md §4](../../docs/sampler.md#4-metrics)" in page  # and a link to docs/
    assert page.endswith("## Reading\n\n- Prose a person wrote stays.\n")
    assert sync_pages.synced("t", page, RESULT) == page  # a synced page stays as it is


def test_every_table_page_matches_its_committed_result():
    pages = sync_pages.table_pages()
    assert {"drafters", "leviathan", "medusa_heads", "self_speculative"} <= {name for name, _, _ in pages}
    assert sync_pages.main(["--check"]) == 0, "run `python experiments/sync_pages.py` (it lists the pages out of date)"
