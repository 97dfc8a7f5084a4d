"""What a model family is to bigtrain (issue 30; torchtitan's ``TrainSpec``): how its model is built
and initialized, how tensor parallelism cuts it, its blocks, its loss, its own config checks, and
what the steps above the model (preflight, the planner, ``bigtrain check``, the launcher) ask of it.

A :class:`Family` is plain data: functions and flags, no state. The registry
(:mod:`bigtrain.families.registry`) maps ``model.family`` to one; a user's module adds its own with
``register_family`` (``model.family_module`` imports it). Code outside ``bigtrain/families`` asks
the family and never names one.

A slot left None means bigtrain's Llama's implementation only for the built-in decoders
(``llama_fallbacks``). In a family of one's own it means the family has none: what needs the slot
(tp, pp, recomputation, the fused loss, the planner, export, generate) is
refused before launch naming it (:mod:`bigtrain.families.own`), never run with Llama's.

Layering: this package sits above the model, parallel and recommender packages (it names their
pieces) and below validation, the trainer, preflight, the planner, ``check`` and the CLI (they ask
it). A slot whose usual implementation lives above it (the decoder trainer, the dense planner's size
check) is ``None`` for the families that use the usual one, and the caller supplies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch
    from torch import nn

    from bigtrain.config import Config, ModelConfig

InitFn = Callable[[str, tuple], "torch.Tensor"]  # (parameter name, full shape) -> full fp32 value
Rules = Callable[["Config"], list[str]]


def no_problems(cfg: "Config") -> list[str]:
    return []


@dataclass(frozen=True)
class Family:
    """One model family. ``check_config`` holds every rule about its own config fields and the
    layouts it supports (validation runs it after the generic rules)."""

    name: str
    summary: str  # one line for help texts and errors
    check_config: Rules = no_problems

    # -- a decoder trained by bigtrain.train.Trainer: tokens (batch, seq) -> logits -------------
    build_meta: Callable[["Config"], "nn.Module"] | None = None  # the whole model on the meta device
    # Each parameter's (and computed buffer's) full initial value by name. None: the model's own
    # ``initial_value`` (bigtrain's Llama; model.init_from under llama_fallbacks), else, in a family
    # of one's own, (seed, name) draws: norms' weights one, biases zero, other weights normal with
    # model.init_std (bigtrain.families.own.seeded_init).
    init_fn: Callable[["Config", "nn.Module"], InitFn | None] | None = None
    # {module pattern: style} for tensor / sequence parallelism (model, tp, sequence_parallel, ulysses);
    # None: parallelize's default (the reference Llama's plan; a family of one's own: none, tp refused).
    tp_plan: Callable[["nn.Module", int, bool, bool], dict] | None = None
    # The container of its blocks (nn.ModuleList): what recomputation wraps, one by one, and ZeRO's
    # units (without it, core/blocks.py default_unit_modules guesses the largest list of blocks). None:
    # the model's ``layers`` (the reference Llama's; a family of one's own: none, recomputation and
    # activation offload refused).
    blocks: Callable[["nn.Module"], "nn.Module"] | None = None
    # The attribute (a dotted path) of its output projection: what model.fused_loss wraps into the
    # loss and int8 compression takes as the last linear (the reference Llama's ``output``); the
    # model then takes ``forward(tokens, with_head=False)``, ending at its final norm. None: it has none.
    head: str | None = None
    # The attribute (a dotted path) of its final norm, which compile.enabled compiles as a region of
    # its own beside the blocks (the reference Llama's ``norm``). None: none is compiled.
    final_norm: str | None = None
    # Its split into pipeline stages, (model, stages, balance, split points) -> stages; None: the
    # reference Llama's (bigtrain.parallel.pipeline.partition.split_model; a family of one's own: none).
    split_stages: Callable[..., list] | None = None
    # Its attention over a sequence cut by context parallelism (parallel.cp > 1), (model, the cp
    # AxisComm, parallel.cp_mode) -> the names of the modules changed (bigtrain.parallel.context's
    # apply_context_parallel fails on none); None: the family has none and validation refuses cp.
    context_parallel: Callable[..., list] | None = None
    reads_tokens: bool = True  # a token corpus (data.source, data.tokenizer): preflight checks it
    # (its vocabulary size, the field that sets it): what preflight checks the tokenizer and the token
    # ids against; None: model.vocab_size (a family described by its own file sets it there).
    vocabulary: Callable[["Config"], tuple[int, str]] | None = None
    # The model's description outside the config, as the model was built from it (a config.json's
    # fields; None: the config says all): each checkpoint records it, so a resume says what changed in
    # the file since, and export and generate build what the run trained (bigtrain.checkpoint.hf).
    description: Callable[["ModelConfig"], dict] | None = None
    # The model's parameter count from the config (the run summary, the planner).
    parameter_count: Callable[["Config"], int] | None = None
    # ``bigtrain export --format hf`` of its checkpoints: (the run's [model], {name: full tensor},
    # the folder) -> the folder written; None: the Llama conversion (bigtrain.checkpoint.hf).
    export: Callable[["ModelConfig", dict, Any], Any] | None = None

    # -- what the steps above the model ask ---------------------------------------------------
    # Before launch, without measuring the machine: can the planner place the model at all.
    placement_problems: Rules = no_problems
    # Preflight's size check (cfg, local ranks, cuda, nvme_dir=, machine=(bytes, what has them): this
    # machine's memory, each GPU's or the host's) -> (problems, warnings); None: the
    # dense planner's (bigtrain.plan.refit.size_problems_and_fixes), of ``planner_config(cfg)`` if given.
    size_problems: Callable[..., tuple[list[str], list[str]]] | None = None
    # The config of bigtrain's Llama with this model's shapes (layers, widths, heads, MLP, vocabulary,
    # ties, biases), which the dense planner prices in its place; None: cfg itself.
    planner_config: Callable[["Config"], "Config"] | None = None
    # ``bigtrain plan`` for this family (cfg, gpus, as_json) -> exit code; None: the dense search.
    plan_command: Callable[["Config", int, bool], int] | None = None
    # Its independent reference for ``bigtrain check``: a class (cfg, device) with train_step(capture)
    # -> ReferenceStep, learning_rate(step) and problems(cfg) (what it does not state), and which
    # modules' outputs are compared (by name); None: the decoder reference of bigtrain.check.reference
    # (a family of one's own: bigtrain.check.reference_own's, of its model, comparing its blocks' outputs).
    reference: type | None = None
    captured: Callable[[str], bool] | None = None
    # Its own step, taken by bigtrain.train.Trainer (whose run, NaN policy, signals, metrics and
    # checkpoint commit every family shares): (cfg, mesh, device) -> an object holding ``parallel``
    # (full_weights, full_grads, owned_chunks, load_sharded, placements), ``model``, ``engine``,
    # ``sampler``, ``per_step`` and ``unit`` (what the throughput counts), ``train_step(step, lr, before_update)``
    # -> (loss, grad norm, skipped), ``evaluate()`` -> held-out metrics and ``summary()``; None: the
    # decoder's step (tokens -> logits, micro-batches, pipelines) in the Trainer.
    own_step: Callable[..., Any] | None = None
    # ``bigtrain generate`` from its checkpoints: ([model] section) -> (the whole model on the CPU in
    # fp32, buffers computed, called as tokens (1, T) -> logits (1, T, vocab); its vocabulary size;
    # the most tokens it reads at once). The checkpoint's weights are then copied in by name. None:
    # bigtrain's Llama (a family that reads no tokens writes none either).
    generation_model: Callable[["ModelConfig"], tuple["nn.Module", int, int]] | None = None
    # The "format" its checkpoints' manifests record and its resume accepts; None: bigtrain.checkpoint.FORMAT.
    checkpoint_format: str | None = None
    # The trainer gathers the full optimizer state (``bigtrain check`` replays 8-bit AdamW steps from it).
    full_optimizer_state: bool = True
    compiles: bool = False  # compile.enabled may compile its blocks (the reference decoder's only)
    # Its model takes ``documents`` (and per-row ``positions``) in forward and attends block-causally
    # with them (model.attn_mask = 'block_causal', bigtrain.core.documents); False: refused before launch.
    document_mask: bool = False
    # Its ring attention (parallel.cp_mode 'ring' / 'hybrid') masks each pair of chunks by the documents'
    # ids (bigtrain.core.documents.DocumentIds); False: block-causal attention needs cp_mode 'all-to-all'.
    ring_documents: bool = False
    # Its attention takes a BlockMask as the documents' mask (model.attention = 'flex', FlexAttention);
    # False: 'flex' is refused before launch ('auto' stays on sdpa's dense mask).
    flex_attention: bool = False
    # Its blocks' linear layers may compute in float8 (precision.fp8) and keep int8 copies of their
    # inputs (memory.activation_compression): plain nn.Linear modules a wrapper or a swap can take.
    block_linears: bool = False
    # The decoder-shape fields of [model] (dim, n_layers, n_heads, ...) describe it (validation
    # checks them against tp and sp); a family with its own description (a config.json) does not.
    model_fields: bool = False
    # A slot above left None takes bigtrain's Llama's implementation (its tp plan, ``model.layers``,
    # its stage split, the dense planner of the [model] fields, the decoder reference, the Llama export
    # and generation): the built-in decoders. False (a family registered from outside): None means
    # none, and validation refuses what needs the slot (bigtrain.families.own).
    llama_fallbacks: bool = False
    # The [model] fields it reads; None: every one. A command-line override of another would change
    # nothing (an hf decoder's shape is its config.json's), so the CLI refuses it (cli_help).
    model_keys: tuple[str, ...] | None = None


def vocabulary_of(family: Family, cfg: "Config") -> tuple[int, str]:
    """The vocabulary ``family``'s model has under ``cfg`` and the field that sets it: what token ids
    are checked against (model.vocab_size, unless the family's own file sets it: Family.vocabulary)."""
    return family.vocabulary(cfg) if family.vocabulary is not None else (cfg.model.vocab_size, "model.vocab_size")
