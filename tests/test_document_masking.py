"""Block-causal attention over packed documents (``model.attn_mask = "block_causal"``,
``model.reset_positions``): the model against each document run alone, the trainer's layouts
against the independent reference (which runs each document alone), the refusals.

The property that proves the mask: a packed window's loss and gradients equal the sum over its
documents, each run as a sequence of its own (fp32, 1e-5 relative); with reset positions, each
document's logits equal those of the document alone from position 0.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bigtrain.check.run import check_compiled_on_rank, check_on_rank
from bigtrain.config import ConfigError, ModelConfig
from bigtrain.core.documents import DocumentBoundaries, document_ids, document_positions
from bigtrain.models.llama import Llama
from bigtrain.parallel.parallel_model import ParallelModel
from bigtrain.testing import run_ranks
from helpers import tiny_config

HF = Path(__file__).resolve().parent / "fixtures" / "hf"
END = 10  # '\n': data.document_end of the test corpus
RTOL = 1e-5
WORDS = "alpha beta gamma delta eps zeta eta theta iota kappa".split()


@pytest.fixture(scope="module")
def documents_corpus(tmp_path_factory):
    """Short documents (0 to 8 words, no newline in them: '\\n' is their end), many to a window of 32."""
    root = tmp_path_factory.mktemp("documents")
    rnd = random.Random(0)
    with open(root / "docs.jsonl", "w") as f:
        for _ in range(400):
            words = rnd.choice([0, 1, 1, 2, 3, 5, 8])
            f.write(json.dumps({"text": " ".join(rnd.choice(WORDS) for _ in range(words))}) + "\n")
    return str(root / "docs.jsonl"), str(root / "cache")


def packed_config(corpus, *overrides):
    source, cache = corpus
    return tiny_config(cache, f"--data.source={source}", "--data.document_end=\n", "--data.max_bytes=0",
                       "--model.attn_mask=block_causal", "--train.global_batch=4", "--train.micro_batch=2",
                       *overrides)


# -- the model: a packed window against its documents alone ---------------------------------------
def _window(seed: int) -> torch.Tensor:
    """Two rows of 24 ids with end tokens written in: documents of 1 to 9 tokens, a row starting
    mid-document, one ending on its end token."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(11, 256, (2, 24), generator=gen)
    tokens[0, [3, 4, 12, 13, 20]] = END
    tokens[1, [0, 9, 23]] = END
    return tokens


def _model() -> Llama:
    model = Llama(ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64))
    model.init_weights(0)
    return model


def _alone(row: list[int]) -> list[tuple[int, int]]:
    """This test's own split of a row at its end tokens (the token after END begins a document)."""
    cuts = [0] + [i + 1 for i, t in enumerate(row[:-1]) if t == END] + [len(row)]
    return list(zip(cuts[:-1], cuts[1:]))


@pytest.mark.parametrize("reset", [False, True], ids=["window-positions", "reset-positions"])
def test_a_packed_window_trains_as_its_documents_alone(reset):
    torch.manual_seed(0)
    tokens, targets = _window(1), torch.randint(0, 256, (2, 24))
    bounds = DocumentBoundaries(ends=(END,), reset_positions=reset)
    packed = _model()
    kwargs = {"documents": document_ids(tokens, bounds)}
    if reset:
        kwargs["positions"] = document_positions(tokens, bounds)
    logits = packed(tokens, **kwargs)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()

    alone, loss = _model(), 0.0
    for r in range(2):
        for a, b in _alone(tokens[r].tolist()):
            out = alone(tokens[r:r + 1, a:b], start_pos=0 if reset else a)
            torch.testing.assert_close(logits[r:r + 1, a:b], out, rtol=RTOL, atol=1e-6)
            part = F.cross_entropy(out.flatten(0, 1), targets[r, a:b], reduction="sum")
            part.backward()
            loss += float(part.detach())
    packed_loss = float(F.cross_entropy(logits.detach().flatten(0, 1), targets.flatten(), reduction="sum"))
    assert packed_loss == pytest.approx(loss, rel=RTOL)
    for (name, p), q in zip(packed.named_parameters(), alone.parameters()):
        assert (p.grad - q.grad).norm() <= RTOL * q.grad.norm(), name


def test_without_the_mask_the_packed_window_differs():
    """The comparison above can fail: causal attention over the packed window is far from it."""
    tokens = _window(1)
    model = _model()
    causal = model(tokens)
    masked = model(tokens, documents=document_ids(tokens, DocumentBoundaries(ends=(END,))))
    assert (causal - masked).abs().max() > 1e-2


def test_one_mask_a_forward_is_saved_for_backward_whatever_the_layers():
    """What block-causal attention adds to the saved activations, measured by the storages autograd
    saves: one (batch, 1, seq, seq) mask in the compute dtype a forward, shared by the layers (a
    boolean mask given to each layer was turned into an fp32 copy and saved by every one)."""
    tokens = _window(2)
    model = Llama(ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64))
    model.init_weights(0)

    def saved_storages(**kwargs) -> dict[int, tuple]:
        out = {}

        def pack(t):
            out[t.untyped_storage().data_ptr()] = (tuple(t.shape), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens, **kwargs).sum()
        return out

    causal = saved_storages()
    masked = saved_storages(documents=document_ids(tokens, DocumentBoundaries(ends=(END,))))
    masks = [nbytes for shape, nbytes in masked.values() if shape == (2, 1, 24, 24)]
    assert masks == [2 * 24 * 24 * 4], masks  # one fp32 mask for the four layers
    extra = sum(n for _, n in masked.values()) - sum(n for _, n in causal.values())
    assert extra == 2 * 24 * 24 * 4, extra


# -- the trainer against the reference (each document alone) ---------------------------------------
ONE_PROCESS = {
    "llama": [],
    "llama-reset": ["--model.reset_positions=true"],
    # capacity per sequence: the reference runs the window whole with its own written-out documents
    "moe-capacity-reset": ["--model.moe_experts=4", "--model.moe_capacity_factor=1.0",
                           "--model.moe_aux_loss_coef=0.01", "--model.reset_positions=true"],
    "fused-loss-recompute": ["--model.fused_loss=true", "--memory.checkpointing=full"],
}


@pytest.mark.parametrize("name", list(ONE_PROCESS))
def test_one_process_matches_the_reference(name, documents_corpus, tmp_path):
    cfg = packed_config(documents_corpus, *ONE_PROCESS[name])
    report = check_on_rank(0, 1, cfg, str(tmp_path), 3)
    assert report.agree, report.text()


def test_a_trainer_without_the_mask_fails_the_reference(documents_corpus, tmp_path, monkeypatch):
    """The mutation the check must catch: the trainer attends causally over the packed window."""
    monkeypatch.setattr(ParallelModel, "document_kwargs", lambda self, tokens: {})
    report = check_on_rank(0, 1, packed_config(documents_corpus), str(tmp_path), 2)
    assert not report.agree


def test_positions_that_restart_a_token_late_fail_the_reference(documents_corpus, tmp_path, monkeypatch):
    """Rotary attention depends on the distance between positions only, so positions shifted by a
    constant within a document (reset or not) attend alike, up to rounding; a restart one token
    late (a document's first token counted on from the document before) changes distances, and the
    check sees it."""
    real = ParallelModel.document_kwargs

    def late(self, tokens):
        out = real(self, tokens)
        positions = out["positions"].clone()
        first = (positions == 0) & (torch.arange(positions.shape[1]) > 0)
        positions[first] = positions.roll(1, dims=1)[first] + 1
        return {**out, "positions": positions}

    monkeypatch.setattr(ParallelModel, "document_kwargs", late)
    report = check_on_rank(0, 1, packed_config(documents_corpus, "--model.reset_positions=true"), str(tmp_path), 2)
    assert not report.agree


def windowed_mistral(tmp_path: Path, window: int = 4) -> str:
    fields = json.loads((HF / "mistral" / "config.json").read_text())
    (tmp_path / "mistral").mkdir()
    (tmp_path / "mistral" / "config.json").write_text(json.dumps({**fields, "sliding_window": window}))
    return str(tmp_path / "mistral")


HF_ARGS = ["--model.family=hf", "--optim.name=adamw"]


def test_hf_one_process_with_a_sliding_window_matches_transformers_documents_alone(documents_corpus, tmp_path):
    pytest.importorskip("transformers")
    cfg = packed_config(documents_corpus, *HF_ARGS, f"--model.hf_config={windowed_mistral(tmp_path)}",
                        "--model.reset_positions=true")
    report = check_on_rank(0, 1, cfg, str(tmp_path / "run"), 3)
    assert report.agree, report.text()


LAYOUTS = {
    "dp2-zero3": ["--parallel.dp=2", "--parallel.zero=3"],
    "dp2-zero1-reset": ["--parallel.dp=2", "--parallel.zero=1", "--model.reset_positions=true"],
    "tp2-sp-reset": ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--model.reset_positions=true"],
    "pp2-1f1b-reset": ["--parallel.pp=2", "--train.micro_batch=1", "--model.reset_positions=true"],
    "pp2-interleaved": ["--parallel.pp=2", "--model.n_layers=4", "--parallel.pp_schedule=interleaved",
                           "--parallel.pp_virtual=2", "--train.micro_batch=1"],
    "pp2-zb-h1-recompute": ["--parallel.pp=2", "--train.micro_batch=1", "--parallel.pp_schedule=zb-h1",
                            "--memory.checkpointing=full"],
    "ulysses-sp2-reset": ["--parallel.sp=2", "--model.reset_positions=true"],
    "ulysses-sp2-tp2": ["--parallel.sp=2", "--parallel.tp=2", "--parallel.sequence_parallel=true"],
    # context parallelism's all-to-all: the whole sequence in position order around attention
    "cp2-all-to-all-reset": ["--parallel.cp=2", "--parallel.cp_mode=all-to-all", "--model.reset_positions=true"],
    "cp2-all-to-all-tp2-sp-pp2": ["--parallel.cp=2", "--parallel.cp_mode=all-to-all", "--parallel.tp=2",
                                  "--parallel.sequence_parallel=true", "--parallel.pp=2", "--train.micro_batch=1",
                                  "--model.reset_positions=true"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_the_reference(name, documents_corpus, tmp_path):
    cfg = packed_config(documents_corpus, *LAYOUTS[name])
    report = run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path), 3, timeout=300)[0]
    assert report.agree, report.text()


HF_LAYOUTS = {
    "tp2-sp-reset": ["--parallel.tp=2", "--parallel.sequence_parallel=true", "--model.reset_positions=true"],
    "pp2": ["--parallel.pp=2", "--train.micro_batch=1"],
    "ulysses-sp2-reset": ["--parallel.sp=2", "--model.reset_positions=true"],
    "cp2-all-to-all-reset": ["--parallel.cp=2", "--parallel.cp_mode=all-to-all", "--model.reset_positions=true"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HF_LAYOUTS))
def test_hf_layout_with_a_sliding_window_matches_the_reference(name, documents_corpus, tmp_path):
    pytest.importorskip("transformers")
    cfg = packed_config(documents_corpus, *HF_ARGS, f"--model.hf_config={windowed_mistral(tmp_path)}",
                        *HF_LAYOUTS[name])
    report = run_ranks(check_on_rank, cfg.parallel.world_size, cfg, str(tmp_path / "run"), 3, timeout=300)[0]
    assert report.agree, report.text()


# -- the held-out loss: evaluation attends block-causally too ----------------------------------------
def _evaluate(rank, world_size, cfg, run_dir):
    from bigtrain.distributed.mesh import Mesh
    from bigtrain.train import Trainer

    return Trainer(cfg, run_dir, Mesh.from_config(cfg.parallel, rank, world_size)).evaluate()


@pytest.mark.parametrize("layout", [
    [],
    pytest.param(["--parallel.pp=2", "--train.micro_batch=1"], marks=pytest.mark.slow),
    pytest.param(["--parallel.sp=2"], marks=pytest.mark.slow),
], ids=["one-process", "pp2", "ulysses-sp2"])
def test_the_held_out_loss_is_the_reference_model_s_over_documents_alone(layout, documents_corpus, tmp_path):
    from bigtrain.check.reference import ReferenceRun

    cfg = packed_config(documents_corpus, "--data.val_fraction=0.1", "--model.reset_positions=true", *layout)
    world = cfg.parallel.world_size
    seen = run_ranks(_evaluate, world, cfg, str(tmp_path))[0] if world > 1 else _evaluate(0, 1, cfg, str(tmp_path))
    run, t = ReferenceRun(cfg), cfg.train
    with torch.no_grad():
        total = sum(float(F.cross_entropy(run._logits(run.compute, x, None).flatten(0, 1), y.flatten(), reduction="sum"))
                    for x, y in (run.sampler.eval_batch(b, t.eval_batches, 0, t.global_batch)
                                 for b in range(t.eval_batches)))
    assert seen == pytest.approx(total / (t.eval_batches * t.global_batch * cfg.data.seq_len), rel=RTOL)


# -- compiled: the mask is data, so a new window's documents compile nothing ------------------------
@pytest.mark.slow
def test_compiled_blocks_recompile_nothing_for_new_documents_and_match_the_reference(documents_corpus, tmp_path):
    from bigtrain.distributed.mesh import Mesh
    from bigtrain.parallel.compile import graphs_compiled
    from bigtrain.train import Trainer

    # full recomputation around the compiled blocks (Checkpointed(CompiledRegion)) and a held-out
    # slice: the evaluation compiles graphs of its own (no backward) once too
    cfg = packed_config(documents_corpus, "--compile.enabled=true", "--model.reset_positions=true",
                        "--memory.checkpointing=full", "--data.val_fraction=0.1")
    trainer = Trainer(cfg, tmp_path / "counted", Mesh({}), "cpu")
    assert trainer.parallel.transforms["layers.0"] == ("checkpoint", "compile")
    first = trainer.train_step()
    trainer.evaluate()
    warm = graphs_compiled()
    trainer.compile_clock.take()  # the evaluation's compile time (the next step would report it)
    # each step's windows hold other documents: other masks and positions
    later = [trainer.train_step() for _ in range(3)]
    trainer.evaluate()
    assert graphs_compiled() == warm, "a step or an evaluation with other documents compiled again"
    # the first step reports how long it compiled, the later ones nothing
    assert first.compile_s > 0 and first.record()["compile_s"] == first.compile_s
    assert all(r.compile_s == 0.0 and "compile_s" not in r.record() for r in later)
    report = check_compiled_on_rank(0, 1, cfg, str(tmp_path / "checked"), 3)
    assert report.agree, report.text()


# -- refusals before launch ---------------------------------------------------------------------------
def _problems(corpus_cache, *overrides) -> list[str]:
    with pytest.raises(ConfigError) as err:
        tiny_config(corpus_cache, *overrides)
    return err.value.problems


def test_reset_positions_without_block_causal_names_both_fields(corpus_cache):
    problems = _problems(corpus_cache, "--model.reset_positions=true")
    assert any("model.reset_positions" in p and "model.attn_mask = 'block_causal'" in p for p in problems), problems


def test_an_unknown_mask_is_refused(corpus_cache):
    assert any("model.attn_mask = 'document'" in p for p in _problems(corpus_cache, "--model.attn_mask=document"))


def test_a_byte_corpus_without_a_document_end_is_refused(corpus_cache):
    problems = _problems(corpus_cache, "--model.attn_mask=block_causal")
    assert any("model.attn_mask = 'block_causal'" in p and "data.document_end" in p for p in problems), problems


def test_a_pre_tokenized_corpus_is_refused(corpus_cache, tmp_path):
    import numpy as np

    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "ids.bin")
    problems = _problems(corpus_cache, "--model.attn_mask=block_causal", f"--data.source={tmp_path / 'ids.bin'}")
    assert any("pre-tokenized" in p and "model.attn_mask" in p for p in problems), problems


def test_the_ring_raises_if_a_mask_reaches_it():
    """Never silently across documents: a whole sequence's mask that reaches ring attention (which
    masks its pairs by the documents' ids, tests/test_ring_documents.py) is an error."""
    from bigtrain.parallel.ring_attention import RingAttention

    ring = RingAttention(torch.nn.Identity(), comm=None, chunks=None)
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="a mask of the whole sequence"):
        ring(q, q, q, torch.zeros(1, 1, 4, 4))


def test_a_family_without_a_document_mask_is_refused():
    from bigtrain.config import load_config
    from bigtrain.validation import validate

    with pytest.raises(ConfigError) as err:
        validate(load_config("dlrm-tiny", overrides=["--model.attn_mask=block_causal"]))
    assert any("has no document mask" in p for p in err.value.problems), err.value.problems


def test_a_tokenizer_s_own_frame_marks_documents(tmp_path):
    """A tokenizer.json whose post-processor puts a BOS before each document needs no
    data.document_end: its BOS begins documents (and data.document_end adds an end)."""
    pytest.importorskip("tokenizers")
    from tokenizers import processors

    from bigtrain.config import DataConfig
    from bigtrain.data.boundaries import boundary_ids
    from helpers import byte_level_bpe, stdlib_texts

    tok = byte_level_bpe(300, ["<s>", "</s>"], stdlib_texts(3))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(tmp_path / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert boundary_ids(DataConfig(tokenizer=str(tmp_path / "tokenizer.json"))) == ((bos,), ())
    assert boundary_ids(DataConfig(tokenizer=str(tmp_path / "tokenizer.json"), document_end="</s>")) == ((bos,), (eos,))
