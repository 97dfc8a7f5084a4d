"""The commands that read a finished run's folder: ``bigtrain export`` (its weights as a Hugging
Face folder or a safetensors file) and ``bigtrain generate`` (text from its newest checkpoint)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bigtrain.families import find_family


def hf_folder_writer(model):
    """``bigtrain export --format hf``'s writer for the run's family (its [model] section): its own,
    None for the Llama conversion (bigtrain's decoders); a ValueError, which export prints, for a family
    that has none (a family of one's own, unless it gives Family.export)."""
    from bigtrain.families.own import none_for

    family = find_family(model)
    if family is None:
        raise ValueError(f"model.family = '{model.family}': the run's family is not registered here "
                         f"(model.family_module = '{model.family_module}' did not register it); run from where "
                         f"its module imports")
    if family.export is None and not family.llama_fallbacks:
        raise ValueError(none_for(family, "export", "--format hf (a Hugging Face folder of the model)",
                                  "use --format safetensors (every weight by its name)"))
    return family.export


def cmd_export(args: argparse.Namespace) -> int:
    from bigtrain.checkpoint.export import export

    try:
        path, kind = export(Path(args.run_dir), Path(args.out), args.format,
                            folder_writer=hf_folder_writer)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"bigtrain export: {e}", file=sys.stderr)
        return 1
    if kind == "torch":
        print(f"bigtrain export: safetensors is not installed (pip install safetensors); wrote a torch.save "
              f"file instead: {path}")
    else:
        print(f"bigtrain export: wrote {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from bigtrain.generate import GenerateError, generate_text

    try:
        text = generate_text(Path(args.run_dir), args.prompt, args.tokens, args.temperature, args.top_k, args.seed,
                             ignore_eos=args.ignore_eos)
    except (GenerateError, FileNotFoundError) as e:
        print(f"bigtrain generate: {e}", file=sys.stderr)
        return 1
    print(text)
    return 0
