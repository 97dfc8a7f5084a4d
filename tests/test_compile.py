"""compile.enabled: regional torch.compile of the blocks (bigtrain/parallel/compile.py).

Compiling is slow on this machine (6-25 s a graph, cold): these tests are few and on the tiny
model; the multi-rank ones are marked slow. The layout fuzzer draws compile on and off against the
independent (eager) reference (bigtrain/check/fuzz.py), and benchmarks/bench_compile.py measures it.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn

from bigtrain.check.run import check_compiled_on_rank, check_layout
from bigtrain.config import ConfigError, load_config
from bigtrain.distributed.mesh import Mesh
from bigtrain.plan.fit import runtime_compiles
from bigtrain.models.feed_forward import FeedForward
from bigtrain.parallel.compile import CPP_WRAPPER_ENV, CompiledRegion, CompileFallbackWarning, graphs_compiled
from bigtrain.testing import run_ranks
from bigtrain.train import Trainer
from bigtrain.validation import validate
from helpers import compiled_once_for_all_ranks, tiny_config

COMPILE = ["--compile.enabled=true"]
# The shape of tests/test_plan.py's compiled blocks (3 sequences of 24 tokens, ffn 160): its fp32
# forward graphs are the warm-up test's, so whichever of the two runs second reads them from inductor's
# cache (CI starts from an empty one). In one process the warm-up test still compiles in its first
# step: the backward and evaluation graphs at least, which the plan's test never compiles.
PLAN_SHAPE = ["--model.ffn_hidden=160", "--train.micro_batch=3", "--train.global_batch=3", "--data.seq_len=24"]


def test_compiled_steps_recompile_nothing_after_warm_up_and_report_their_compile_time(corpus_cache, tmp_path):
    """After the first step and the first evaluation (a graph without backward), no step or
    evaluation compiles again (dynamo's count of graphs stays put); the first step reports how long
    it compiled, the later ones nothing."""
    cfg = tiny_config(corpus_cache, *COMPILE, "--memory.checkpointing=full", "--data.val_fraction=0.1",
                      *PLAN_SHAPE)
    trainer = Trainer(cfg, tmp_path, Mesh({}), "cpu")
    assert set(trainer.parallel.transforms) == {"layers.0", "layers.1", "norm"}
    # compiled inside its checkpoint (bigtrain/parallel/compile.py says why)
    assert trainer.parallel.transforms["layers.0"] == ("checkpoint", "compile")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # a region that fell back to eager fails here
        first = trainer.train_step()
    trainer.evaluate()
    warm = graphs_compiled()
    evaluation, _ = trainer.compile_clock.take()  # the evaluation's graphs (the next step would report them)
    assert evaluation > 0
    later = [trainer.train_step() for _ in range(3)]
    trainer.evaluate()
    assert graphs_compiled() == warm, "a step after warm-up compiled again"
    assert first.compile_s > 0 and first.record()["compile_s"] == first.compile_s
    assert all(r.compile_s == 0.0 and "compile_s" not in r.record() for r in later)


def test_a_compiled_run_matches_the_independent_reference(corpus_cache, tmp_path, monkeypatch):
    """One process, fp32: the compiled blocks (recomputed, offloaded, the fused head) train like the
    eager reference within fp32's 1e-5, their graphs called as a CPU run calls them: through the
    C++ wrapper (which tests/conftest.py turns off for the other compiled tests), and torch honours
    it: compiled from an empty inductor cache, each graph's generated wrapper is C++."""
    from torch._inductor.utils import fresh_cache

    monkeypatch.delenv(CPP_WRAPPER_ENV, raising=False)
    cfg = tiny_config(corpus_cache, *COMPILE, "--memory.checkpointing=selective", "--memory.activation_offload=true",
                      "--memory.offload_min_bytes=256", "--model.fused_loss=true", "--model.fused_loss_chunk=32")
    cache = tmp_path / "inductor"
    cache.mkdir()
    # compiles now, whatever this machine's cache holds (as CI does: it starts from an empty one)
    with fresh_cache(dir=str(cache), delete=False), warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        report = check_layout(cfg, Mesh({}), tmp_path / "run", steps=3)
    assert report.agree, report.text()
    wrappers = [p for p in cache.rglob("*.cpp") if "inductor_entry" in p.read_text()]
    assert len(wrappers) >= 4, "the forward and the backward graph of the block and of the norm each get a C++ wrapper"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--parallel.zero=3"],
    ["--parallel.pp=2", "--train.micro_batch=2", "--parallel.pp_schedule=zb-h1", "--memory.checkpointing=full"],
    ["--parallel.dp=2", "--parallel.ep=2", "--model.moe_experts=4", "--parallel.moe_grouped_mm=true"],
    # Ulysses, ZeRO-2 and every-k recomputation (one block of the two recomputed, one not): compiled
    # layouts issue 27 lists that no other test here compiles (the fuzzer draws them too)
    ["--parallel.sp=2", "--parallel.zero=2", "--memory.checkpointing=every", "--memory.checkpoint_every=2"],
], ids=["tp2-sp-zero3", "pp2-zb-h1", "moe-ep2", "ulysses-sp2-zero2-every2"])
def test_compiled_layouts_match_the_independent_reference(layout, corpus_cache, tmp_path):
    cfg = tiny_config(corpus_cache, *COMPILE, *layout)
    # pipeline stages compile graphs of their own; the other layouts' ranks compile the same ones
    once = contextlib.nullcontext() if cfg.parallel.pp > 1 else compiled_once_for_all_ranks(tmp_path / "compiled")
    with once:
        report = run_ranks(check_compiled_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), 3, timeout=600,
                           group_timeout=600)[0]  # a stage waits on its peer compiling from a cold cache
    assert report.agree, report.text()


def test_on_a_cpu_the_graphs_are_called_through_inductor_s_cpp_wrapper(corpus_cache, tmp_path, monkeypatch):
    """The compiled CPU step is MKL-bound and Python launching was the largest cost left outside
    the kernels (docs/compile.md): on a CPU every region and the loss compile with inductor's C++
    wrapper (that torch honours it, the generated wrapper being C++, is checked where a compiled run
    is: test_a_compiled_run_matches_the_independent_reference); on a GPU, inductor's default; with
    inductor's own switch at 0 (``TORCHINDUCTOR_CPP_WRAPPER=0``), the Python wrapper."""
    from bigtrain.models.llama import Llama
    from bigtrain.parallel.compile import apply_compile

    monkeypatch.setenv(CPP_WRAPPER_ENV, "0")
    with torch.device("meta"):
        plain = apply_compile(Llama(tiny_config(corpus_cache).model), device="cpu")
    assert not plain.cpp_wrapper
    monkeypatch.delenv(CPP_WRAPPER_ENV)
    trainer = Trainer(tiny_config(corpus_cache, *COMPILE), tmp_path / "run", Mesh({}), "cpu")
    regions = [m for m in trainer.parallel.model.modules() if isinstance(m, CompiledRegion)]
    assert len(regions) == 3 and all(r.options["cpp_wrapper"] for r in regions)  # two blocks and the final norm
    assert trainer.parallel.compiled.cpp_wrapper and trainer.parallel.compiled.loss_fn is not None
    with torch.device("meta"):
        on_gpu = Llama(trainer.cfg.model)
    compiled = apply_compile(on_gpu, device="cuda")
    assert not compiled.cpp_wrapper
    assert not any(m.options for m in on_gpu.modules() if isinstance(m, CompiledRegion))


def test_a_region_the_compiler_fails_on_runs_eagerly_after_one_named_warning():
    torch.manual_seed(0)
    block = FeedForward(16, 32)
    region = CompiledRegion(block)

    def failing_backend(gm, example_inputs):
        raise RuntimeError("this backend cannot compile anything")

    object.__setattr__(region, "compiled", torch.compile(block.forward, backend=failing_backend))
    x = torch.randn(2, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # even so, a region warns once: the second call runs eagerly at once
        torch.testing.assert_close(region(x), block.forward(x), rtol=0, atol=0)
        torch.testing.assert_close(region(x), block.forward(x), rtol=0, atol=0)
    named = [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert len(named) == 1 and "compile.enabled" in str(named[0].message)
    assert region.failed



def test_a_region_past_dynamos_recompile_limit_says_so_once_with_the_named_warning():
    """Past torch._dynamo.config.recompile_limit recompilations of its code, dynamo runs a region
    eagerly with only torch's own log line: a run compiled nothing more and no bigtrain warning said
    so. Now the region falls back as on a compiler failure, after one CompileFallbackWarning."""
    torch.manual_seed(0)
    block = FeedForward(16, 32)
    region = CompiledRegion(block)
    object.__setattr__(region, "compiled", torch.compile(block.forward, backend="eager", dynamic=False))
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (2, 3, 4):  # static shapes: a second shape recompiles, past the limit of 1
            x = torch.randn(rows, 16)
            torch.testing.assert_close(region(x), block.forward(x), rtol=0, atol=0)
    named = [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert len(named) == 1 and "recompile" in str(named[0].message), [str(w.message) for w in caught]
    assert region.failed

def test_a_region_whose_backward_the_compiler_fails_on_runs_eagerly_instead_of_stopping_the_run():
    """AOT autograd compiles a static graph's backward at its first backward, outside the region's
    call: a failure there stopped the run from inside loss.backward(). The region has it compiled
    with the forward, so it falls back like a forward that fails, and the gradients are eager's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    block = FeedForward(16, 32)
    region = CompiledRegion(block)

    def failing_backward(gm, example_inputs):
        raise RuntimeError("this backend cannot compile a backward")

    backend = aot_autograd(fw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward),
                           bw_compiler=failing_backward)
    object.__setattr__(region, "compiled", torch.compile(block.forward, backend=backend))
    x = torch.randn(2, 16, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        region(x).square().sum().backward()
    assert region.failed and any(issubclass(w.category, CompileFallbackWarning) for w in caught)
    grads = [x.grad] + [p.grad for p in block.parameters()]
    x_eager = x.detach().clone().requires_grad_()
    block.zero_grad()
    block.forward(x_eager).square().sum().backward()
    for got, want in zip(grads, [x_eager.grad] + [p.grad for p in block.parameters()]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_compile_settings_are_validated_before_launch(corpus_cache):
    cfg = load_config("tiny", overrides=["--compile.enabled=sometimes"])
    with pytest.raises(ConfigError, match=r"compile\.enabled = 'sometimes': must be one of"):
        validate(cfg)
    dlrm = load_config("dlrm-tiny", overrides=["--compile.enabled=true"])
    with pytest.raises(ConfigError, match=r"compile\.enabled = true compiles the decoder's transformer blocks"):
        validate(dlrm)
    assert runtime_compiles(load_config("tiny"), "cuda") and not runtime_compiles(load_config("tiny"), "cpu")
    assert runtime_compiles(load_config("tiny", overrides=COMPILE), "cpu")


FLOAT8_ULYSSES = ["--parallel.sp=2", "--precision.mode=bf16", "--precision.fp8=tensorwise", "--precision.fp8_emulate=true"]


def test_sixteen_bit_regions_compile_for_avx2_vectors_where_inductor_would_pick_avx512(corpus_cache, tmp_path,
                                                                                       monkeypatch):
    """g++ 12.2 miscompiles torch's AVX-512 16-bit tile transpose when one C++ file calls it twice
    (docs/compile.md): a model computing in bf16/fp16 or holding float8 linears compiles for AVX2
    vectors on such a CPU, whatever the wrapper; fp32 keeps inductor's default; a GPU gets no
    options. Compiled float8 under Ulysses, refused while its NaN was not understood, is accepted."""
    import bigtrain.parallel.compile as compile_module
    from bigtrain.parallel.compile import inductor_options

    monkeypatch.delenv(CPP_WRAPPER_ENV, raising=False)
    monkeypatch.setattr(compile_module, "_vector_bits", lambda: 512)
    assert inductor_options("cpu", sixteen_bit=True) == {"cpp_wrapper": True, "cpp.simdlen": 256}
    assert inductor_options("cpu", sixteen_bit=False) == {"cpp_wrapper": True}
    assert inductor_options("cuda", sixteen_bit=True) == {}
    monkeypatch.setenv(CPP_WRAPPER_ENV, "0")
    assert inductor_options("cpu", sixteen_bit=True) == {"cpp.simdlen": 256}
    monkeypatch.setattr(compile_module, "_vector_bits", lambda: 256)  # an AVX2 CPU: inductor's own choice
    assert inductor_options("cpu", sixteen_bit=True) == {}
    for run, (flags, sixteen) in enumerate((([], False), (["--precision.mode=bf16"], True),
                                            (["--precision.mode=fp16"], True),
                                            (["--precision.fp8=tensorwise", "--precision.fp8_emulate=true"], True))):
        trainer = Trainer(tiny_config(corpus_cache, *COMPILE, *flags), tmp_path / str(run), Mesh({}), "cpu")
        assert trainer.parallel.compiled.options == inductor_options("cpu", sixteen), flags
    validate(load_config("tiny", overrides=FLOAT8_ULYSSES + COMPILE))
    assert runtime_compiles(load_config("tiny", overrides=FLOAT8_ULYSSES), "cuda")


def test_two_sixteen_bit_transposes_in_one_kernel_compile_right():
    """The smallest case of the miscompilation (two bf16 transposes fused into one kernel: 96% of the
    elements wrong, NaN among them, on an AVX-512 CPU with g++ 12.2) compiled with the options a
    bf16 model gets (on an AVX2 CPU, inductor's own)."""
    from bigtrain.parallel.compile import compiled_function, inductor_options

    def transposed(a, b):
        return a.t().contiguous() * 2, b.t().contiguous() * 3

    a, b = (torch.randn(256, 128, dtype=torch.bfloat16) for _ in range(2))
    out = compiled_function(transposed, options=inductor_options("cpu", sixteen_bit=True))(a, b)
    for got, want in zip(out, transposed(a, b)):
        assert torch.equal(got, want)


def test_two_float8_linears_on_one_input_compile_right_through_the_cpp_wrapper(monkeypatch):
    """The graph that gave compiled float8 under Ulysses NaN gradients (fuzz seed 20261416 sample
    13), as small as it goes: q and k, emulated float8 linears of two widths on one bf16 input,
    compiled as a bf16 CPU run compiles them (the C++ wrapper). On an AVX-512 CPU with g++ 12.2 the
    input gradient was NaN with inductor's default vectors; with a bf16 model's options it equals
    eager's exactly. Compiled float8 under Ulysses itself trains like the reference in the layout
    fuzzer's samples (docs/correctness.md: seeds 20261430-20261431)."""
    from bigtrain.fp8.linear import convert_to_float8
    from bigtrain.fp8.scaling import Float8Recipe
    from bigtrain.parallel.compile import compiled_function, inductor_options

    class QueryKey(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.ModuleDict({"q": nn.Linear(64, 64, bias=False),
                                                        "k": nn.Linear(64, 32, bias=False)})])

        def forward(self, x):
            block = self.layers[0]
            return block["q"](x).sum(-1) + block["k"](x).sum(-1)

    monkeypatch.delenv(CPP_WRAPPER_ENV, raising=False)
    torch.manual_seed(0)
    model = QueryKey()
    convert_to_float8(model, Float8Recipe("tensorwise"), "emulated")
    model = model.to(torch.bfloat16)
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)

    def input_gradient(fn):
        leaf = x.clone().requires_grad_()
        fn(leaf).sum().backward()
        return leaf.grad

    compiled = compiled_function(model.forward, options=inductor_options("cpu", sixteen_bit=True))
    assert torch.equal(input_gradient(compiled), input_gradient(model.forward))


def test_a_one_block_model_compiles_its_block(corpus_cache, tmp_path):
    """The blocks are the family's container (a Llama's ``layers``), not the largest container of
    two or more: a one-layer Llama with compile.enabled = true stopped in its rank ("Llama has no
    blocks") after validation had accepted it."""
    cfg = tiny_config(corpus_cache, *COMPILE, "--model.n_layers=1")
    trainer = Trainer(cfg, tmp_path, Mesh({}), "cpu")
    assert set(trainer.parallel.transforms) == {"layers.0", "norm"}


def test_a_toml_boolean_sets_runtime_compiles(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[compile]\nenabled = true\n")
    assert load_config("tiny", path=path).compile.enabled == "true"


def test_a_split_backward_never_donates_buffers():
    """zb-h1 keeps the graph for its W pass; AOT autograd's donated buffers forbid that. Graphs also
    compile in backward (a region whose graph breaks under recomputation, as cp's ring inside a
    recomputed attention: the fuzzer's seed 20261308 sample 17 crashed so), so it is off for the
    process, not only inside our calls."""
    import torch._functorch.config as aot_config

    from bigtrain.parallel.compile import compiled_function

    before = aot_config.donated_buffer
    try:
        compiled_function(lambda x: x * 2, keep_graph=True)
        assert aot_config.donated_buffer is False
    finally:
        aot_config.donated_buffer = before


def test_a_compiled_check_that_falls_back_to_eager_fails(corpus_cache, tmp_path, monkeypatch):
    """Run eagerly, a compiled sample would agree and prove nothing: the fuzzer's compiled samples
    and the compiled layout tests check through check_compiled_on_rank, where a fallback raises."""
    import bigtrain.parallel.compile as compile_module

    def failing(fn, keep_graph=False, options=None):
        def backend(gm, example_inputs):
            raise RuntimeError("this backend cannot compile anything")
        return torch.compile(fn, backend=backend)

    monkeypatch.setattr(compile_module, "compiled_function", failing)
    cfg = tiny_config(corpus_cache, *COMPILE)
    with pytest.raises(CompileFallbackWarning, match="torch.compile failed on a TransformerBlock"):
        check_compiled_on_rank(0, 1, cfg, str(tmp_path), 1)


def test_the_record_names_compiled_only_the_regions_that_compile(corpus_cache):
    """A recomputed attention core runs eagerly by design (memory/selective.py: dynamo is disabled
    on it). Where int8 compression makes a block compile child by child, a region around the core
    alone would compile nothing and still be recorded as compiled (ParallelModel.transforms, the
    run's summary); it is left eager, recorded as recomputed only. In a block compiled whole it
    stays inside the block's region (a graph break). Meta device: nothing compiles here."""
    from bigtrain.from_config import activation_plan
    from bigtrain.memory.activations import apply_activation_memory
    from bigtrain.models.llama import Llama
    from bigtrain.parallel.compile import apply_compile
    from bigtrain.wrappers import transforms_of

    def compiled_record(*overrides):
        cfg = tiny_config(corpus_cache, *COMPILE, "--memory.checkpointing=selective",
                          "--memory.selective_attention=true", *overrides)
        with torch.device("meta"):
            model = Llama(cfg.model)
        apply_activation_memory(model, activation_plan(cfg))
        regions = apply_compile(model).regions
        return regions, transforms_of(model)

    regions, record = compiled_record("--memory.activation_compression=int8")
    assert "layers.0.attention.core" not in regions
    assert record["layers.0.attention.core"] == ("recompute",)
    assert record["layers.0.attention_norm"] == ("compile", "recompute")  # a norm's region does compile
    regions, record = compiled_record()
    assert "layers.0" in regions and record["layers.0"] == ("compile",)
    assert record["layers.0.attention.core"] == ("recompute",)
