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
        base = _base(args.base or meta["base_name"], named_by="--base" if args.base else "its checkpoint")
        out = export(load(args.drafter, base), args.to, args.out, source=str(args.drafter))
    except (CheckpointError, FileNotFoundError) as e:
        print(f"specdec.export: {e}", file=sys.stderr)
        return 2
    print(f"{args.drafter} -> {out} ({args.to}: {FORMATS[args.to].loads_it})")
    return 0


def _base(name: str, named_by: str):
    """The base the drafter is exported for, or one line saying why it cannot be loaded and what to pass instead:
    the hub client's own error (no such directory, not on the hub, offline) runs over several lines."""
    try:
        return load_base(name, device="cpu")
    except OSError as e:
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__).rstrip(".")
        raise CheckpointError(f"cannot load the base {name!r} ({named_by} names it): {reason}; pass the base the "
                              f"drafter was trained on as --base <hub name or model directory>") from None


if __name__ == "__main__":
    sys.exit(main())
