"""python -m specdec.export <drafter dir> --to <format> --out <dir> [--base <name>]: a trained specdec drafter in a
serving engine's format (see specdec/export/__init__.py for the formats and who loads each)."""

from __future__ import annotations

import argparse
import sys

from specdec.base import load_base
from specdec.checkpoint import read_meta
from specdec.export import FORMATS, export, load
from specdec.export.common import CheckpointError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.export", description=__doc__)
    ap.add_argument("drafter", help="a specdec drafter dir (drafter.json + drafter.safetensors)")
    ap.add_argument("--to", required=True, choices=list(FORMATS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", default=None, help="the base it was trained on (default: the one its checkpoint names)")
    args = ap.parse_args(argv)
    try:
        meta = read_meta(args.drafter)
        base = load_base(args.base or meta["base_name"], device="cpu")
        out = export(load(args.drafter, base), args.to, args.out, source=str(args.drafter))
    except (CheckpointError, FileNotFoundError) as e:
        print(f"specdec.export: {e}", file=sys.stderr)
        return 2
    print(f"{args.drafter} -> {out} ({args.to}: {FORMATS[args.to].loads_it})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
