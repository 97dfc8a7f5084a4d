"""Regional compilation (``compile.enabled``): each transformer block compiled on its own, as torchtitan does.

Every block (after tensor parallelism, experts and the activation-memory wrappers, before the
pipeline split and the engine) is put inside a :class:`CompiledRegion`, a wrapper
(``bigtrain/wrappers.py``) that calls ``torch.compile`` of what it wraps. One compiled function
serves every block of the same structure (dynamo's cache is per code object, the weights are
graph inputs), so a model compiles one forward and one backward graph per kind of block, not per
block. What the wrapper holds is inside the compiled region: recomputation (torch's checkpoint
becomes a higher-order op the compiler recomputes from), the tensor-parallel styles' hooks on the
block's layers (their collectives run eagerly, bigtrain/parallel/eager.py, so the graph breaks around
each and the pieces between compile). What sits on the wrapper stays outside, eager: ZeRO's
gathering hooks, activation offload's saved-tensor hooks (they still see every tensor the
compiled graph saves), the bigtrain check's output probes.

Some modules cannot be traced into one static graph and run eagerly inside a block: a
mixture-of-experts layer (data-dependent token counts per expert, routing statistics kept in
Python) and a linear saving its input in int8 (its shared copy is found by tensor identity). A
block holding one is not compiled whole: its other children are compiled one by one
(:func:`compile_regions`). The final norm is a region too, and the plain loss (fp32 log-softmax
and the target's log-probability, without tensor parallelism) is compiled as a function.

Graphs are static (``dynamic=False``): a step's shapes never change, so after the first step (and
the first evaluation, which runs without a graph for backward) nothing compiles again;
:class:`CompileClock` counts what compiled and how long it took, for the metrics.

On a CPU the graphs are called through inductor's C++ wrapper (``cpp_wrapper``), not its Python
one: the same kernels and library calls, launched from one compiled function per graph instead of
a Python function that calls them one by one. The step is MKL-bound and the Python launching was
the largest cost left outside the kernels: the C++ wrapper took 0.5-6% (4% on average) off the
compiled ``small`` step's CPU time (docs/compile.md). On a GPU, Python launching hides behind the
device's queue, and the wrapper is left as inductor's default. ``TORCHINDUCTOR_CPP_WRAPPER=0``
(inductor's own switch) keeps the Python wrapper on a CPU too: a cold compile is shorter without
the C++ one to build (tests/conftest.py sets it for the suite: a tiny tp2 layout's test, 35 s
against 52 s from an empty inductor cache).

A model computing in 16 bits (bf16/fp16, or float8 linears, whose emulation transposes bf16 copies)
is compiled for AVX2 vectors on a CPU whose inductor would pick AVX-512 (``cpp.simdlen = 256``,
:func:`inductor_options`). There g++ 12.2 at -O3 miscompiles torch's AVX-512 16-bit tile transpose
(``at::vec::transpose_mxn<BFloat16>``, ``<Half>`` alike) once one C++ file calls it twice: its
interprocedural constant propagation clones the function and the clone drops most of its stores,
leaving stack garbage (NaN among it, or finite values) in the transposed copy. Inductor emits one
kernel that transposes two tensors for as little as ``(a.t().contiguous(), b.t().contiguous())``
(96% of the elements wrong, with either wrapper); emulated float8 under Ulysses quantizes three
transposed weights of one shape in the graph before the first all-to-all, and the block's input
gradient came out NaN (docs/compile.md has the reproductions). fp32 kernels use another transpose
and are right; AVX2's 16-bit transpose is right (measured on the same cases).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from bigtrain.memory.checkpointing import Checkpointed
from bigtrain.memory.compression import Int8SavedInput
from bigtrain.memory.selective import RecomputedAttention
from bigtrain.models.moe import MoEFeedForward
from bigtrain.core.blocks import default_unit_modules
from bigtrain.wrappers import ModuleWrapper, WholeBackward, name_in, replace_module

# Modules that run eagerly inside a compiled block (see the module docstring).
EAGER_MODULES: tuple[type, ...] = (MoEFeedForward, Int8SavedInput)


class CompileFallbackWarning(UserWarning):
    """``compile.enabled``: the compiler failed on a region, which runs eagerly from then on."""


class CompiledRegion(WholeBackward, ModuleWrapper):
    """Runs what it wraps through ``torch.compile`` (static shapes). Its one backward computes the
    input and weight gradients together (``WholeBackward``). ``keep_graph``: backward runs with the
    graph retained (the zero-bubble split backward), so the compiled backward must not reuse its
    saved tensors' memory (AOT autograd's donated buffers). ``options``: inductor's, from
    :func:`inductor_options` (see the module docstring). If the compiler fails on it, the region
    runs eagerly from then on, after one :class:`CompileFallbackWarning` per process."""

    kind = "compile"

    def __init__(self, module: nn.Module, keep_graph: bool = False, options: dict | None = None):
        super().__init__(module)
        object.__setattr__(self, "compiled", compiled_function(module.forward, keep_graph, options))
        object.__setattr__(self, "options", dict(options or {}))
        object.__setattr__(self, "failed", False)

    def forward(self, *args, **kwargs):
        if self.failed:
            return self.wrapped.forward(*args, **kwargs)
        try:
            # AOT autograd compiles a static graph's backward at its first backward, outside this
            # call, where a failure would stop the run instead of falling back: compiled with the
            # forward instead, the backward's failure is the forward's, caught here.
            with _backward_compiled_with_forward(), _recompile_limit_raises():
                return self.compiled(*args, **kwargs)
        except (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.InternalTorchDynamoError) as e:
            why = f"torch.compile failed on a {type(self.wrapped).__name__} ({type(e).__name__}: " \
                  f"{str(e).splitlines()[0][:200]})"
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            why = (f"torch.compile recompiled a {type(self.wrapped).__name__} more than "
                   f"torch._dynamo.config.recompile_limit = {torch._dynamo.config.recompile_limit} times (its "
                   f"inputs' shapes, dtypes or devices keep changing; TORCH_LOGS=recompiles says which)")
        object.__setattr__(self, "failed", True)
        # Python's default filter shows a warning once per text and call site: one line for a
        # model whose blocks all fail alike. A filter set to "error" makes any fallback fail
        # (the compiled tests, the fuzzer's compiled samples: check.run.check_compiled_on_rank).
        warnings.warn(f"compile.enabled: {why}; it and any other region that fails run eagerly. "
                      f"Set compile.enabled = false to silence this.", CompileFallbackWarning, stacklevel=2)
        return self.wrapped.forward(*args, **kwargs)


def _backward_compiled_with_forward():
    """AOT autograd's switch that compiles a graph's backward when its forward compiles (torch
    defers it to the first backward where shapes are static); read when a graph compiles."""
    import torch._functorch.config as aot_config  # loaded with dynamo, which may not be yet

    return aot_config.patch(force_non_lazy_backward_lowering=True)


def _recompile_limit_raises():
    """Past ``torch._dynamo.config.recompile_limit`` recompilations of a code object dynamo runs it
    eagerly from then on, saying so only in torch's log: raised instead (``FailOnRecompileLimitHit``),
    the region falls back with bigtrain's one named warning. Dynamo refuses the switch together with
    its ``suppress_errors`` (``TORCHDYNAMO_SUPPRESS_ERRORS``), which a user set to run on regardless."""
    import contextlib

    import torch._dynamo.config as dynamo_config

    if dynamo_config.suppress_errors:
        return contextlib.nullcontext()
    return dynamo_config.patch(fail_on_recompile_limit_hit=True)


def compiled_function(fn, keep_graph: bool = False, options: dict | None = None):
    """``torch.compile(fn)`` with static shapes; ``keep_graph``: for a backward that retains the graph
    (see :class:`CompiledRegion`); ``options``: inductor's (regions compiled with the same options
    share their graphs: dynamo matches them by options)."""
    if keep_graph:
        # AOT autograd donates a backward's saved buffers unless told not to, which forbids the
        # retained graph zb-h1's split backward needs. Read when a graph compiles, and graphs also
        # compile outside any call of ours: a region whose graph breaks under recomputation (cp's
        # ring inside a recomputed attention) compiles its pieces again in backward. So it is set for
        # the process: never donating is always correct, it only keeps some buffers longer.
        import torch._functorch.config as aot_config  # loaded with dynamo, which may not be yet

        aot_config.donated_buffer = False
    return torch.compile(fn, dynamic=False, options=options or None)


CPP_WRAPPER_ENV = "TORCHINDUCTOR_CPP_WRAPPER"  # inductor's switch; '0' here: the Python wrapper on a CPU too
AVX2_BITS = 256


def inductor_options(device: torch.device | str, sixteen_bit: bool) -> dict:
    """Inductor's options for a model's regions on ``device``: on a CPU its C++ wrapper (unless
    ``TORCHINDUCTOR_CPP_WRAPPER=0``), and where the model computes in 16 bits and inductor would
    vectorize for AVX-512, AVX2 vectors (the module docstring says why). On a GPU: none."""
    if torch.device(device).type != "cpu":
        return {}
    options = {"cpp_wrapper": True} if os.environ.get(CPP_WRAPPER_ENV) != "0" else {}
    if sixteen_bit and _vector_bits() > AVX2_BITS:
        options["cpp.simdlen"] = AVX2_BITS
    return options


def _vector_bits() -> int:
    """The width of the vectors inductor generates CPU kernels for by default (0: none)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return pick_vec_isa().bit_width()


def _holds_eager(module: nn.Module) -> bool:
    return any(isinstance(m, EAGER_MODULES) for m in module.modules())


def compile_regions(root: nn.Module, name: str, keep_graph: bool = False, options: dict | None = None) -> list[str]:
    """Wrap the submodule ``name`` of ``root`` in a :class:`CompiledRegion` in place, or, if it holds
    a module that must run eagerly, each of its children that holds none (recursively). Returns the
    names of the regions."""
    module = root.get_submodule(name)
    if isinstance(module, EAGER_MODULES + (RecomputedAttention,)):
        # A recomputed attention core runs eagerly by design (memory/selective.py): a region around
        # it alone would compile nothing and be recorded as compiled. Inside a block compiled whole
        # it breaks the graph instead (so it is not one of EAGER_MODULES, which split the block).
        return []
    if isinstance(module, Checkpointed) and not _holds_eager(module):
        # Compiled inside its checkpoint, not around it (as its children are when it holds an eager
        # module, below): traced through, the checkpoint makes AOT autograd replay the random state
        # of every seeded op it recomputes, SDPA's among them, which inductor cannot lower on a CPU
        # (torch 2.13: ``AssertionError: ... RunAndSaveRngState``; the block ran eagerly). Inside,
        # the same compiled forward runs again in backward.
        replace_module(root, name, Checkpointed(CompiledRegion(module.wrapped, keep_graph, options)))
        return [name]
    if not _holds_eager(module):
        replace_module(root, name, CompiledRegion(module, keep_graph, options))
        return [name]
    return [region for child, _ in module.named_children()
            for region in compile_regions(root, f"{name}.{child}", keep_graph, options)]


@dataclass
class Compiled:
    """What :func:`apply_compile` did: the regions, and the loss function to use."""

    regions: list[str]
    loss_fn: object | None = None  # a compiled plain loss (None: the model's loss as it is)
    options: dict = field(default_factory=dict)  # inductor's, for every region (inductor_options)

    @property
    def cpp_wrapper(self) -> bool:
        """The graphs are called through inductor's C++ wrapper (on a CPU)."""
        return bool(self.options.get("cpp_wrapper"))


def apply_compile(model: nn.Module, loss_fn=None, keep_graph: bool = False,
                  device: torch.device | str = "cpu", blocks: nn.Module | None = None,
                  sixteen_bit: bool = False, final_norm: str | None = "norm") -> Compiled:
    """Compile every block of ``model`` (the children of ``blocks``, the family's container of them;
    not given: of its largest container of modules with parameters, a Llama's ``layers``, which
    takes two blocks to find) and its final norm (``final_norm``, a dotted name, when the model has
    it: a Hugging Face decoder's is ``model.norm``) regionally, in place; and ``loss_fn`` (a plain
    function of logits and targets) when given. ``keep_graph``: see :class:`CompiledRegion`;
    ``device``: where the graphs run; ``sixteen_bit``: the model computes in bf16/fp16 or holds float8
    linears (both choose inductor's options: :func:`inductor_options`)."""
    options = inductor_options(device, sixteen_bit)
    if blocks is not None:  # a one-block model too, which the search below cannot tell from no blocks
        root = name_in(model, blocks)
        blocks = [f"{root}.{name}" for name, _ in blocks.named_children()]
    else:
        names = {id(m): n for n, m in model.named_modules()}
        blocks = [names[id(m)] for m in default_unit_modules(model)]
    if not blocks:
        raise ValueError(f"compile.enabled: {type(model).__name__} has no blocks (a list of modules with parameters) "
                         f"to compile one by one; set compile.enabled = false")
    regions = [region for name in blocks for region in compile_regions(model, name, keep_graph, options)]
    if final_norm is not None and final_norm in dict(model.named_modules()):
        regions += compile_regions(model, final_norm, keep_graph, options)
    compiled_loss = compiled_function(loss_fn, keep_graph, options) if loss_fn is not None else None
    return Compiled(regions, compiled_loss, options)


class CompileClock:
    """Seconds spent compiling (dynamo, AOT autograd and inductor; backward graphs included, which
    compile at their first backward) and compilations, in this process, from dynamo's callbacks
    (one clock per process: :func:`compile_clock`). ``take()``: what accrued since the last call."""

    def __init__(self):
        self.seconds, self.compiles = 0.0, 0
        self._taken = (0.0, 0)
        self._started: float | None = None
        torch._dynamo.callback.on_compile_start(self._start)
        torch._dynamo.callback.on_compile_end(self._end)

    def _start(self, *args) -> None:  # torch >= 2.7 passes the trigger; earlier versions nothing
        self._started = time.perf_counter()

    def _end(self, *args) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self.compiles += 1
            self._started = None

    def take(self) -> tuple[float, int]:
        """(seconds, compilations) since the last ``take``."""
        seconds, compiles = self.seconds - self._taken[0], self.compiles - self._taken[1]
        self._taken = (self.seconds, self.compiles)
        return seconds, compiles


_clock: CompileClock | None = None


def compile_clock() -> CompileClock:
    """This process's compile clock (started on first use: what compiled before is not counted)."""
    global _clock
    if _clock is None:
        _clock = CompileClock()
    return _clock


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process (every recompilation adds one): the tests count
    them across steps."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
