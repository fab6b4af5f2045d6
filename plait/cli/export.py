"""`plait export RUN_DIR [--out model.safetensors] [--step N] [--dtype fp32|bf16]`."""

from __future__ import annotations

import json

from plait.async_training.ps_export import export_ps, is_ps_run
from plait.cli.args import Parser, parse_or_help
from plait.models import GPTConfig
from plait.train.export import DTYPES, META_CONFIG, export, exported_header


def _parser() -> Parser:
    parser = Parser(
        prog="plait export",
        description="Write the model of a run's checkpoint as one consolidated safetensors file that a "
        "plain one-process GPT loads with load_state_dict(strict=True), whatever layout trained it; "
        "the header holds the model config (plait.train.export.load_exported rebuilds the model).",
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", help="a run directory (config.toml, checkpoints/ or ps_checkpoints/)"
    )
    parser.add_argument(
        "--out",
        help="the file to write (default RUN_DIR/model.safetensors); for an hf:* model the save_pretrained "
        "directory (default RUN_DIR/hf)",
    )
    parser.add_argument("--step", type=int, help="export this step's checkpoint (default: the latest)")
    parser.add_argument(
        "--dtype", default="fp32", help=f"{' or '.join(DTYPES)}: the tensors' dtype (default fp32)"
    )
    return parser


def main(argv: list[str]) -> int:
    args = parse_or_help(_parser(), argv)
    if isinstance(args, int):
        return args
    if is_ps_run(args.run_dir):  # trained by parameter servers: their checkpoints, ps_checkpoints/
        out = export_ps(args.run_dir, args.out, step=args.step, dtype=args.dtype)
    else:
        out = export(args.run_dir, args.out, step=args.step, dtype=args.dtype)
    if out.is_dir():  # a Hugging Face model: a save_pretrained directory
        print(
            f"plait: exported {args.run_dir} ({args.dtype}) to {out} (save_pretrained: config.json, "
            "model.safetensors; transformers.AutoModelForCausalLM.from_pretrained loads it)"
        )
        return 0
    meta, n = exported_header(out)
    if META_CONFIG in meta:
        n = GPTConfig(**json.loads(meta[META_CONFIG])).n_params()
        what = ""
    else:  # a python: run: the factory's module's own state dict
        what = f"; load it with load_state_dict into the module of {meta.get('plait.source')}"
    step = meta["plait.step"]
    print(f"plait: exported step {step} of {args.run_dir} ({n:,} parameters, {args.dtype}) to {out}{what}")
    return 0
