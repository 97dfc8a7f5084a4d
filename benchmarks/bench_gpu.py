"""bigtrain on one GPU: training tokens/s and MFU in bf16, for the ``small`` and ``llama-1b`` presets.

Each preset runs through the real trainer (``bigtrain.train.Trainer`` on a one-rank mesh, device
``cuda``, bf16 compute with fp32 master weights, fp32 gradients and AdamW: ZeRO stage 0 on one
rank), on the preset's own model, sequence length and micro-batch (``--seq`` / ``--micro-batch``
change them), ``--accum`` micro-batches per optimizer step. A step is what ``bigtrain train`` runs:
sampling, forward, backward, clipping, AdamW, zeroing. After ``--warmup`` untimed steps, each of
``--steps`` timed steps is bracketed by ``torch.cuda.synchronize()``; the report gives the median.

    tokens/s = tokens per step / median step time
    MFU      = tokens/s x (6 N + 12 L h s) / peak

N counts the weights a token is multiplied by (every block matrix and the output projection; the
input embedding is a lookup, norms are O(h)); 12 L h s is attention's QK^T and AV forward and
backward over the full s x s matrix (PaLM's convention; a causal kernel does about half). It is the
planner's ``ModelSpec.model_flops_per_token``. Recomputation (``--checkpointing``) is not counted:
this is model FLOPs utilization, not hardware FLOPs. The peak is the device's dense bf16 rate:
989 TFLOP/s for H100 SXM and for H200 (the same chip; GH200 too), 756 for H100 PCIe, 835 for H100
NVL, 312 for A100; another device needs ``--peak-tflops``.

Each row also gives the planner's step time and peak memory for its layout (``bigtrain.run_info.prediction``:
compile and fp8 included), in brackets after the measured ones.

``--variants`` runs each preset several ways: ``eager`` (``compile.enabled = false``), ``compiled``
(``compile.enabled = true``: each block compiled, bigtrain/parallel/compile.py) and ``fp8``
(compiled, ``precision.fp8 = rowwise``; listed as skipped where the checkout has no
``precision.fp8``) and ``hf-family`` (transformers' ``LlamaForCausalLM`` of the preset's shape,
from a config.json, trained by bigtrain: ``model.family = "hf"``, its decoder layers compiled). Each row reports the seconds its first steps spent compiling. ``--peer
hf-compiled`` (or ``hf``, or ``hf,hf-compiled``) adds transformers' ``LlamaForCausalLM`` of the same
shape in the same process and recipe (fp32 weights, bf16 autocast, loss in fp32, gradient clipping,
fused AdamW with the preset's settings, the same tokens per step), ``torch.compile``-d whole as a
user would: the peer a compiled bigtrain step is measured against (docs/compile.md).

Without a CUDA device the script prints "no CUDA device: skipped" and exits 0 (``--allow-cpu``
runs it on the CPU instead: a smoke test of this script, whose figures mean nothing). The report
is Markdown, ready for the GPU section of docs/benchmarks.md.

    python benchmarks/bench_gpu.py                                   # small and llama-1b
    python benchmarks/bench_gpu.py --presets llama-1b --micro-batch 8 --checkpointing full
    python benchmarks/bench_gpu.py --presets llama-1b --variants eager,compiled,fp8 --peer hf-compiled
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bigtrain.config import PrecisionConfig, load_config
from bigtrain.distributed.mesh import Mesh
from bigtrain.models.llama import count_parameters
from bigtrain.plan.hardware import PRESETS
from bigtrain.plan.model import ModelSpec
from bigtrain.run_info import prediction
from bigtrain.train import Trainer
from bigtrain.validation import validate

SKIPPED = "no CUDA device: skipped"
# (substring of torch.cuda.get_device_name, dense bf16 FLOP/s, where the number comes from); first match wins.
PEAKS = [("GH200", PRESETS["h200-141g"].peak_flops_bf16, "GH200: the H100 chip, 989 TFLOP/s dense bf16"),
         ("H200", PRESETS["h200-141g"].peak_flops_bf16, "H200: the H100 SXM chip, 989 TFLOP/s dense bf16"),
         ("H100 PCIe", 756e12, "H100 PCIe datasheet: 756 TFLOP/s dense bf16"),
         ("H100 NVL", 835e12, "H100 NVL datasheet: 835 TFLOP/s dense bf16"),
         ("H100", PRESETS["h100-80g"].peak_flops_bf16, "H100 SXM datasheet: 989 TFLOP/s dense bf16"),
         ("A100", PRESETS["a100-80g"].peak_flops_bf16, "A100 datasheet: 312 TFLOP/s dense bf16")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="small,llama-1b", help="comma-separated presets (default small,llama-1b)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per preset (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--loss-steps", type=int, default=0, help="timed steps of the compiled and fp8 variants "
                   "instead of --steps: enough for fp8's loss to be compared with bf16's (default: --steps)")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per micro-batch (default: the preset's)")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default: the preset's)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage (one rank: only the code path changes)")
    p.add_argument("--checkpointing", default="none", help="memory.checkpointing: none, full or every")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak of the device (default: detected)")
    p.add_argument("--cache-dir", default="", help="data.cache_dir for the tokenized corpus")
    p.add_argument("--variants", default="eager", help="comma-separated: eager, compiled, fp8, hf-family "
                                                       "(default eager)")
    p.add_argument("--peer", default="none", help="comma-separated peers in the same call: hf (transformers "
                                                  "LlamaForCausalLM, eager), hf-compiled (torch.compile-d); none")
    p.add_argument("--allow-cpu", action="store_true", help="without CUDA, run on the CPU (a smoke test)")
    p.add_argument("--json", default="", help="also write every number to this file (row by row)")
    p.add_argument("--report-from", default="", help="print the Markdown report of this --json file and exit")
    return p.parse_args(argv)


def pick_device(script: str, allow_cpu: bool) -> str | None:
    """'cuda' when there is one; else 'cpu' if ``allow_cpu`` (a smoke run), or None after saying
    that the script skipped (the GPU lane's scripts exit 0 on a machine without a GPU)."""
    if torch.cuda.is_available():
        return "cuda"
    if allow_cpu:
        return "cpu"
    print(f"{script}: {SKIPPED}")
    return None


def detect_peak(device_name: str, override_tflops: float) -> tuple[float | None, str]:
    if override_tflops > 0:
        return override_tflops * 1e12, f"--peak-tflops {override_tflops:g}"
    for key, peak, source in PEAKS:
        if key.lower() in device_name.lower():
            return peak, source
    return None, f"unknown peak for '{device_name}': pass --peak-tflops"


VARIANTS = {"eager": ["--compile.enabled=false"], "compiled": ["--compile.enabled=true"],
            "fp8": ["--compile.enabled=true", "--precision.fp8=rowwise"],
            # the other recipe: one scale per operand (cuBLAS's float8 kernel, no per-row scale
            # reductions): which of the two issue 27's 1.30x can come from at this shape
            "fp8-tensorwise": ["--compile.enabled=true", "--precision.fp8=tensorwise"],
            # bring your own model: transformers' LlamaForCausalLM of the preset's shape, trained by
            # bigtrain (model.family = "hf", its decoder layers compiled), against the same model
            # compiled by hand (--peer hf-compiled)
            "hf-family": ["--compile.enabled=true", "--model.family=hf"]}


def variant_missing(variant: str) -> str:
    """Why this checkout cannot run ``variant`` ('' when it can)."""
    if variant not in VARIANTS:
        return f"unknown variant (use {', '.join(VARIANTS)})"
    if variant.startswith("fp8") and "fp8" not in PrecisionConfig.__dataclass_fields__:
        return "precision.fp8 is not in this checkout"
    return ""


def steps_of(variant: str, args: argparse.Namespace) -> int:
    """Timed steps of ``variant``: --loss-steps for the two whose losses are compared, if given."""
    return args.loss_steps if args.loss_steps and variant in ("compiled", "fp8") else args.steps


def preset_config(name: str, args: argparse.Namespace, device: str, variant: str = "eager"):
    base = load_config(preset=name)
    micro = args.micro_batch or base.train.micro_batch
    seq = args.seq or base.data.seq_len
    overrides = [
        "--precision.mode=bf16", f"--train.device={device}", f"--parallel.zero={args.zero}",
        f"--train.micro_batch={micro}", f"--train.global_batch={micro * args.accum}", f"--data.seq_len={seq}",
        f"--model.max_seq_len={max(seq, base.model.max_seq_len)}", f"--memory.checkpointing={args.checkpointing}",
        f"--train.steps={args.warmup + steps_of(variant, args)}", "--logging.progress=false", "--logging.report=false",
        "--logging.measure_memory=false", "--checkpoint.save_final=false"]
    if args.cache_dir:
        overrides.append(f"--data.cache_dir={args.cache_dir}")
    if variant.startswith("fp8") and device != "cuda":  # the smoke run on the CPU: float8 numerics, emulated
        overrides.append("--precision.fp8_emulate=true")
    if variant == "hf-family":
        overrides.append(f"--model.hf_config={llama_config_json(base, seq)}")
    cfg = load_config(preset=name, overrides=overrides + VARIANTS[variant])
    validate(cfg, world_size=1, cuda_available=device == "cuda")
    return cfg


def llama_config_json(cfg, seq: int) -> Path:
    """A config.json of transformers' LlamaForCausalLM with ``cfg``'s model shape (the hf-family
    variant's model), in a folder of its own under the system's temporary directory."""
    m = cfg.model
    fields = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
              "hidden_size": m.dim, "intermediate_size": m.ffn_dim, "num_hidden_layers": m.n_layers,
              "num_attention_heads": m.n_heads, "num_key_value_heads": m.kv_heads,
              "max_position_embeddings": max(seq, m.max_seq_len), "rms_norm_eps": m.norm_eps,
              "rope_theta": m.rope_theta, "tie_word_embeddings": m.tie_embeddings, "attention_bias": False,
              "mlp_bias": False, "initializer_range": 0.02}
    folder = Path(tempfile.gettempdir()) / f"bench-gpu-hf-{m.n_layers}x{m.dim}-{seq}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(fields, indent=1))
    return folder / "config.json"


class DeviceMemory:
    """One run's device memory: ``peak_gib`` counts from what was allocated when it started (a
    run before it that left memory behind does not inflate it), and ``leftover_gib`` is what this
    run still holds once its objects are deleted and collected (0 for a run that frees everything:
    more is a leak, reported rather than hidden)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.base = 0
        if self.cuda:
            gc.collect()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def finish(self) -> dict:
        """Call after the run's objects are deleted."""
        gc.collect()
        if not self.cuda:
            return {"peak_memory_gib": None, "leftover_gib": None}
        out = {"peak_memory_gib": (torch.cuda.max_memory_allocated() - self.base) / 2**30,
               "leftover_gib": (torch.cuda.memory_allocated() - self.base) / 2**30}
        torch.cuda.empty_cache()
        return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_preset(name: str, args: argparse.Namespace, device: str, peak: float | None, variant: str = "eager") -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as run_dir:
        cfg = preset_config(name, args, device, variant)
        memory = DeviceMemory(device)
        trainer = Trainer(cfg, Path(run_dir), Mesh({}), device)
        warm = [trainer.train_step() for _ in range(args.warmup)]
        losses, compile_s = [r.loss for r in warm], sum(r.compile_s for r in warm)
        times = []
        for _ in range(steps_of(variant, args)):
            _sync(device)
            start = time.perf_counter()
            losses.append(trainer.train_step().loss)
            _sync(device)
            times.append(time.perf_counter() - start)
    params = count_parameters(trainer.model)
    del trainer  # the next preset gets the whole device
    measured = memory.finish()
    spec = ModelSpec.from_model_config(cfg.model, cfg.data.seq_len)
    tokens = cfg.train.global_batch * cfg.data.seq_len
    median = statistics.median(times)
    tokens_per_s = tokens / median
    achieved = tokens_per_s * spec.model_flops_per_token()
    planned = prediction(cfg, device == "cuda")  # the planner on this layout, compile and fp8 included
    return {"preset": name, "variant": variant, "compile_s": compile_s, "params": params,
            "planner_step_s": planned["step_time_s"] if planned else None,
            "planner_peak_gib": planned["peak_bytes"] / 2**30 if planned else None,
            "matmul_params": spec.matmul_params,
            "layers": cfg.model.n_layers, "dim": cfg.model.dim, "seq": cfg.data.seq_len,
            "micro_batch": cfg.train.micro_batch, "accum": args.accum, "tokens_per_step": tokens,
            "flops_per_token": spec.model_flops_per_token(), "step_s": times, "median_step_s": median,
            "tokens_per_s": tokens_per_s, "achieved_tflops": achieved / 1e12,
            "mfu": achieved / peak if peak else None, "loss_first_last": [losses[0], losses[-1]],
            "losses": losses, **measured,
            "checkpointing": cfg.memory.checkpointing, "zero": cfg.parallel.zero}


def run_hf_peer(name: str, args: argparse.Namespace, device: str, peak: float | None, compiled: bool) -> dict:
    """transformers' LlamaForCausalLM of the preset's shape, trained with the trainer's recipe: fp32
    weights, bf16 autocast, fp32 loss, clipping, fused AdamW; ``compiled``: ``torch.compile(model)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = preset_config(name, args, device)
    m, o = cfg.model, cfg.optim
    seq, batch = cfg.data.seq_len, cfg.train.micro_batch
    # transformers 5 takes the rotary base in rope_parameters, 4.x as rope_theta
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta}}
            if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters else {"rope_theta": m.rope_theta})
    hf_config = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim,
                            num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads,
                            max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps,
                            tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False, **rope)
    hf_config._attn_implementation = "sdpa"
    memory = DeviceMemory(device)
    torch.manual_seed(cfg.train.seed)
    model = LlamaForCausalLM(hf_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=True)
    run = torch.compile(model) if compiled else model
    gen = torch.Generator().manual_seed(cfg.train.seed)
    batches = [torch.randint(0, m.vocab_size, (batch, seq + 1), generator=gen).to(device) for _ in range(args.accum)]

    def step() -> float:
        total = 0.0
        for tokens in batches:
            with torch.autocast(device, dtype=torch.bfloat16):
                logits = run(input_ids=tokens[:, :-1]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) / args.accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(total)

    started = time.perf_counter()
    losses = [step() for _ in range(args.warmup)]
    warmup_s = time.perf_counter() - started
    times = []
    for _ in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        losses.append(step())
        _sync(device)
        times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    del model, run, optimizer
    measured = memory.finish()
    spec = ModelSpec.from_model_config(cfg.model, seq)
    tokens = batch * args.accum * seq
    median = statistics.median(times)
    achieved = tokens / median * spec.model_flops_per_token()
    return {"preset": name, "variant": "hf-compiled" if compiled else "hf", "compile_s": None,
            "warmup_s": warmup_s, "params": params, "layers": m.n_layers, "dim": m.dim, "seq": seq,
            "micro_batch": batch, "accum": args.accum, "tokens_per_step": tokens,
            "flops_per_token": spec.model_flops_per_token(), "step_s": times, "median_step_s": median,
            "tokens_per_s": tokens / median, "achieved_tflops": achieved / 1e12, "mfu": achieved / peak if peak else None,
            "loss_first_last": [losses[0], losses[-1]], "losses": losses, **measured,
            "checkpointing": "none", "zero": 0}


def machine(device: str, peak: float | None, peak_source: str) -> dict:
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.processor()})",
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "peak_bf16_tflops": peak / 1e12 if peak else None, "peak_source": peak_source}
    if device == "cuda":
        out["memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return out


def report(args: argparse.Namespace, out: dict) -> None:
    m = out["machine"]
    print(f"```\n{out['command']}\n```\n")
    print(f"Device: {m['device']}; torch {m['torch']}, CUDA {m['cuda']}, Python {m['python']}; peak "
          + (f"{m['peak_bf16_tflops']:.0f} TFLOP/s dense bf16 ({m['peak_source']})" if m["peak_bf16_tflops"]
             else m["peak_source"]) + ".\n")
    print("| preset | variant | params | seq | micro-batch x accum | tokens/step | median step ms (planner) | tokens/s | "
          "model TFLOP/s | MFU | peak memory GiB (planner) | compile s | loss first -> last |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out["results"]:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "n/a"
        if r.get("planner_peak_gib") is not None:
            mem += f" ({r['planner_peak_gib']:.1f})"
        step = f"{r['median_step_s'] * 1e3:.1f}" + (f" ({r['planner_step_s'] * 1e3:.1f})" if r.get("planner_step_s")
                                                     else "")
        compiled = f"{r['compile_s']:.0f}" if r.get("compile_s") else ("in warm-up" if r["variant"] == "hf-compiled"
                                                                         else "-")
        print(f"| {r['preset']} | {r['variant']} | {r['params'] / 1e6:.1f} M | {r['seq']} | {r['micro_batch']} x "
              f"{r['accum']} | {r['tokens_per_step']} | {step} | {r['tokens_per_s']:,.0f} | "
              f"{r['achieved_tflops']:.1f} | {mfu} | {mem} | {compiled} | "
              f"{r['loss_first_last'][0]:.3f} -> {r['loss_first_last'][1]:.3f} |")
    for skipped in out.get("skipped", []):
        print(f"| {skipped['preset']} | {skipped['variant']} | skipped: {skipped['why']} |")
    leaks = [f"- {r['preset']} {r['variant']}: {r['leftover_gib']:.2f} GiB still allocated after the run was deleted "
             "(a leak; the peak memory above counts from the memory allocated before the run)"
             for r in out["results"] if (r.get("leftover_gib") or 0) > LEAK_GIB]
    for line in ([""] + leaks if leaks else []) + ratios(out["results"]) + fp8_losses(out["results"]):
        print(line)
    print("\nMFU = tokens/s x (6 N + 12 L h s) / peak; N = weights in matmuls (blocks and output head), "
          "L layers, h hidden size, s sequence length.")


def ratios(results: list[dict]) -> list[str]:
    """Each bigtrain variant's tokens/s and peak memory against the compiled transformers peer's."""
    lines = []
    for peer in (r for r in results if r["variant"] == "hf-compiled"):
        for r in results:
            if r["preset"] == peer["preset"] and r["variant"] not in ("hf", "hf-compiled"):
                mem = (f", peak memory {r['peak_memory_gib']:.1f} vs {peer['peak_memory_gib']:.1f} GiB"
                       if r["peak_memory_gib"] is not None and peer["peak_memory_gib"] is not None else "")
                lines.append(f"- {r['preset']} {r['variant']}: {r['tokens_per_s'] / peer['tokens_per_s']:.2f}x the "
                             f"tokens/s of LlamaForCausalLM + torch.compile{mem}")
    return [""] + lines if lines else []


LEAK_GIB = 0.01  # what a deleted run may leave allocated (torch's own caches: cuBLAS workspaces, ...)
LOSS_WINDOW = 10  # the last steps whose mean loss compares fp8 with bf16: one step's loss is noisy


def fp8_losses(results: list[dict]) -> list[str]:
    """fp8's loss at the end of the run against the compiled bf16 run's (same data, same steps):
    the mean of the last LOSS_WINDOW steps' losses of each, and their relative difference."""
    lines = []
    for fp8 in (r for r in results if r["variant"] == "fp8" and r.get("losses")):
        for bf16 in (r for r in results if r["preset"] == fp8["preset"] and r["variant"] == "compiled"):
            if len(bf16.get("losses", [])) != len(fp8["losses"]):
                continue
            window = min(LOSS_WINDOW, len(fp8["losses"]))
            a, b = (statistics.fmean(r["losses"][-window:]) for r in (fp8, bf16))
            lines.append(f"- {fp8['preset']} fp8 after {len(fp8['losses'])} steps: mean loss of the last {window} "
                         f"{a:.4f} vs bf16 (compiled) {b:.4f}: {(a - b) / b:+.2%}")
    return [""] + lines if lines else []


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report_from:  # a run's file, finished or cut short
        with open(args.report_from) as f:
            report(args, json.load(f))
        return 0
    device = pick_device("bench_gpu", args.allow_cpu)
    if device is None:
        return 0
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak, peak_source = detect_peak(name, args.peak_tflops)
    command = "python benchmarks/bench_gpu.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    out = {"command": command.strip(), "machine": machine(device, peak, peak_source), "results": [], "skipped": []}
    peers = [p.strip() for p in args.peer.split(",") if p.strip() and p.strip() != "none"]
    if any(p not in ("hf", "hf-compiled") for p in peers):
        raise SystemExit(f"--peer {args.peer}: use hf, hf-compiled or none")
    for preset in (p.strip() for p in args.presets.split(",") if p.strip()):
        # The peers first: every ratio needs them, should a time limit cut the variants short.
        for peer in peers:
            out["results"].append(run_hf_peer(preset, args, device, peak, compiled=peer == "hf-compiled"))
            _save(args, out)  # row by row: a run cut short by a time limit keeps what it measured
        for variant in (v.strip() for v in args.variants.split(",") if v.strip()):
            why = variant_missing(variant)
            if why:
                out["skipped"].append({"preset": preset, "variant": variant, "why": why})
                continue
            out["results"].append(run_preset(preset, args, device, peak, variant))
            _save(args, out)
    report(args, out)
    _save(args, out)
    return 0


def _save(args: argparse.Namespace, out: dict) -> None:
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
