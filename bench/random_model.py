"""A random-weight stand-in for the built-in model, written where `resolve_model` finds it
(bench/offline/stand_ins.py says how), or a random-weight Llama directory.

    python -m bench.random_model describe MODEL.gguf MANIFEST.json.gz   # here, ~0.6 MB
    python -m bench.random_model write MANIFEST.json.gz SITE [--num-layers N]   # there
    python -m bench.random_model llama DIR [--shape 1b|tiny] [--device cuda]   # anywhere
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from bench.offline.stand_ins import LLAMA_SHAPES, describe, write, write_random_llama


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    describe_cmd = commands.add_parser("describe", help="model.gguf -> manifest.json.gz")
    describe_cmd.add_argument("model", type=Path)
    describe_cmd.add_argument("manifest", type=Path)
    write_cmd = commands.add_parser("write", help="manifest.json.gz -> SITE/<package>/<file>")
    write_cmd.add_argument("manifest", type=Path)
    write_cmd.add_argument("site", type=Path)
    write_cmd.add_argument("--num-layers", type=int, help="keep the first N layers only")
    write_cmd.add_argument("--seed", type=int, default=0)
    llama_cmd = commands.add_parser("llama", help="a random HF-format Llama directory")
    llama_cmd.add_argument("out_dir", type=Path)
    llama_cmd.add_argument("--shape", choices=sorted(LLAMA_SHAPES), default="1b")
    llama_cmd.add_argument("--device", default="cpu")
    llama_cmd.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "llama":
        write_random_llama(args.out_dir, args.shape, device=args.device, seed=args.seed)
        print(f"{args.out_dir}: random Llama ({args.shape})")
        return 0
    if args.command == "describe":
        with gzip.open(args.manifest, "wt", encoding="utf-8") as out:
            json.dump(describe(args.model), out)
        print(f"{args.manifest}: {args.manifest.stat().st_size / 1e6:.1f} MB")
        return 0
    with gzip.open(args.manifest, "rt", encoding="utf-8") as manifest_file:
        manifest = json.load(manifest_file)
    path = write(manifest, args.site, num_layers=args.num_layers, seed=args.seed)
    layers = "all" if args.num_layers is None else str(args.num_layers)
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB, random weights, {layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
