"""``bigtrain generate``: text from a trained run, greedy or sampled, from its checkpoint or its
Hugging Face export."""

import pytest
import torch

from bigtrain.cli import main
from bigtrain.generate import GenerateError, load_model, sample


@pytest.fixture(scope="module")
def trained_run(corpus_cache, tmp_path_factory):
    run = tmp_path_factory.mktemp("generate") / "run"
    assert main(["train", "--preset", "tiny", "--output-dir", str(run), f"--data.cache_dir={corpus_cache}",
                 "--data.max_bytes=400000", "--train.steps=40", "--logging.progress=false",
                 "--logging.report=false", "--logging.log_every=40"]) == 0
    return run


def _generated(capsys, *args) -> str:
    capsys.readouterr()
    assert main(["generate", *map(str, args)]) == 0
    return capsys.readouterr().out[:-1]  # print's newline


def test_a_trained_run_continues_the_prompt_with_text(trained_run, capsys):
    text = _generated(capsys, trained_run, "--prompt", "def ", "--tokens", 100, "--seed", 1)
    assert text.startswith("def ")
    written = text[4:].encode()
    # An untrained model draws bytes about uniformly (about 37% of them printable ASCII); 40 steps
    # on Python sources already write mostly letters, spaces and punctuation.
    printable = sum(32 <= b < 127 or b == 10 for b in written) / len(written)
    assert printable > 0.8, text


def test_greedy_takes_the_most_likely_byte_each_time(trained_run, capsys):
    model, _ = load_model(trained_run)
    prompt = list(b"import ")
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model.model(torch.tensor([ids]))[0, -1].argmax()))
    assert sample(model, prompt, 12, temperature=0) == ids[len(prompt):]
    assert sample(model, prompt, 12, temperature=1.0, top_k=1, seed=5) == ids[len(prompt):]  # top-1 is greedy
    greedy = _generated(capsys, trained_run, "--prompt", "import ", "--tokens", 12, "--temperature", 0)
    assert greedy.encode() == bytes(ids)


def test_sampling_is_seeded_and_top_k_limits_the_choice(trained_run):
    model, _ = load_model(trained_run)
    prompt = list(b"class ")
    assert sample(model, prompt, 30, seed=3) == sample(model, prompt, 30, seed=3)
    assert sample(model, prompt, 30, seed=3) != sample(model, prompt, 30, seed=4)
    with torch.no_grad():
        top3 = set(model.model(torch.tensor([prompt]))[0, -1].topk(3).indices.tolist())
    assert {sample(model, prompt, 1, temperature=5.0, top_k=3, seed=s)[0] for s in range(40)} <= top3


def test_the_hf_export_writes_the_same_text(trained_run, tmp_path, capsys):
    pytest.importorskip("safetensors")
    assert main(["export", str(trained_run), str(tmp_path / "hf"), "--format", "hf"]) == 0
    args = ("--prompt", "for i in ", "--tokens", 20, "--temperature", 0)
    assert _generated(capsys, tmp_path / "hf", *args) == _generated(capsys, trained_run, *args)


def test_what_generation_cannot_use_is_refused(trained_run, tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 1
    assert "no valid checkpoint" in capsys.readouterr().err
    main(["export", str(tmp_path), str(tmp_path / "out")])  # export says why there is none, as generate does
    assert "unless checkpoint.save_final = false" in capsys.readouterr().err
    assert main(["generate", str(trained_run), "--prompt", "x", "--temperature", "-1", "--top-k", "-2"]) == 1
    err = capsys.readouterr().err
    assert "--temperature = -1.0" in err and "--top-k = -2" in err
    with pytest.raises(GenerateError, match="prompt is empty"):
        sample(load_model(trained_run)[0], [], 3)


def test_an_export_the_place_refuses_is_said_naming_it_not_a_traceback(trained_run, tmp_path, capsys):
    """OUT an existing folder without --format hf (runs/mine-hf given twice), or a path through a
    file: each was a traceback from safetensors' writer (SafetensorError, 'Is a directory')."""
    pytest.importorskip("safetensors")
    (tmp_path / "hf").mkdir()
    (tmp_path / "a-file").write_text("")
    capsys.readouterr()
    assert main(["export", str(trained_run), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "is a folder; --format safetensors writes one file" in err and "--format hf" in err
    for out, fmt in ((tmp_path / "a-file" / "model.safetensors", "safetensors"), (tmp_path / "a-file" / "hf", "hf")):
        assert main(["export", str(trained_run), str(out), "--format", fmt]) == 1
        err = capsys.readouterr().err
        assert f"{out} could not be written (a part of its path is a file" in err, err
    assert main(["export", str(trained_run), str(tmp_path / "hf" / "model.safetensors")]) == 0


def test_a_hugging_face_family_run_writes_what_its_model_computes(corpus_cache, tmp_path, capsys):
    """A run of ``model.family = "hf"`` (a Qwen3 config.json) generates through its family's model,
    under the Hugging Face names its checkpoint holds: greedy is transformers' own argmax, step by
    step, on the weights the export writes. (Until 2026-11-27 ``generate`` read such a run as
    bigtrain's Llama and failed on its names.)"""
    transformers = pytest.importorskip("transformers")
    from pathlib import Path

    fixture = Path(__file__).resolve().parent / "fixtures" / "hf" / "qwen3"
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--output-dir", str(run), f"--data.cache_dir={corpus_cache}",
                 "--model.family=hf", f"--model.hf_config={fixture}", "--data.seq_len=32", "--train.steps=3",
                 "--logging.progress=false", "--logging.report=false"]) == 0
    assert main(["export", str(run), str(tmp_path / "hf"), "--format", "hf"]) == 0
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = list(b"def ")
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = _generated(capsys, run, "--prompt", "def ", "--tokens", 8, "--temperature", 0)
    assert greedy == bytes(ids).decode("utf-8", errors="replace")


def test_a_run_whose_config_json_is_gone_generates_from_the_copy_its_checkpoint_recorded(corpus_cache, tmp_path,
                                                                                          capsys):
    """(It was refused by name: the file is read again to build the model. A checkpoint now records
    the config.json it trained with, bigtrain.checkpoint.hf.model_as_trained.)"""
    pytest.importorskip("transformers")
    import shutil
    from pathlib import Path

    fixture = Path(__file__).resolve().parent / "fixtures" / "hf" / "llama"
    moved = tmp_path / "llama"
    shutil.copytree(fixture, moved)
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--output-dir", str(run), f"--data.cache_dir={corpus_cache}",
                 "--model.family=hf", f"--model.hf_config={moved}", "--data.seq_len=32", "--train.steps=1",
                 "--logging.progress=false", "--logging.report=false"]) == 0
    shutil.rmtree(moved)
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "x", "--tokens", "2"]) == 0, capsys.readouterr().err


def test_a_sigmoid_bias_moe_run_generates_with_its_trained_router_biases(corpus_cache, tmp_path):
    """The routers' biases of ``model.moe_router = 'sigmoid-bias'`` are model state outside the
    gradient (persistent buffers, checkpointed by name). Generation read only the parameters, so it
    routed every token with zero biases: another model than the run trained, without a word. The
    decoder must hold every tensor of the checkpoint and compute what the model loaded from all of
    them computes."""
    from bigtrain.checkpoint.commit import newest_valid_checkpoint
    from bigtrain.checkpoint.export import checkpoint_weights
    from bigtrain.checkpoint.hf import model_config
    from bigtrain.models.llama import build_model

    run = tmp_path / "run"
    assert main(["train", "--preset", "moe-tiny", "--output-dir", str(run), f"--data.cache_dir={corpus_cache}",
                 "--data.max_bytes=400000", "--model.moe_router=sigmoid-bias", "--train.steps=12",
                 "--logging.progress=false", "--logging.report=false"]) == 0
    path, meta = newest_valid_checkpoint(run / "checkpoints")
    weights = checkpoint_weights(path)
    biases = {name: w for name, w in weights.items() if name.endswith("expert_bias")}
    assert biases and all(bool(b.abs().sum() > 0) for b in biases.values())  # 12 steps moved them
    decoder, _ = load_model(run)
    held = decoder.model.state_dict()
    for name, w in weights.items():
        assert torch.equal(held[name], w), name
    reference = build_model(model_config(meta["config"]["model"]), device="cpu")
    reference.init_buffers()
    reference.load_state_dict(weights)  # strict: every parameter and persistent buffer
    # Random bytes route more tokens near the biases' margin than text does (measured at 20 steps: logits
    # 0.12 apart with the biases left at zero, equal on 24 bytes of Python source).
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(decoder.model.eval()(ids), reference.eval()(ids))


class _Always:
    """A decoder whose next token is always ``token`` (greedy), whatever it read."""

    vocab_size, context = 16, 8

    def __init__(self, token: int):
        self.token = token

    def last_logits(self, ids):
        return torch.nn.functional.one_hot(torch.tensor(self.token), self.vocab_size).float()


def test_generation_stops_after_the_models_end_of_text_token_unless_told_not_to():
    assert sample(_Always(7), [1, 2], 5, temperature=0, stop={7}) == [7]
    assert sample(_Always(7), [1, 2], 5, temperature=0, stop={3}) == [7] * 5
    assert sample(_Always(7), [1, 2], 5, temperature=0) == [7] * 5


def test_the_end_of_text_is_the_one_transformers_would_stop_at(tmp_path):
    """A Hugging Face folder's eos_token_id (one or a list); a run's, the eos its export names: its
    data.document_end for a byte-level run, none without one (a byte run writes every token asked)."""
    import json

    from bigtrain.data.tokenizer import ByteTokenizer
    from bigtrain.generate import end_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert end_ids(tmp_path, ByteTokenizer(), {}) == {5, 7}
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert end_ids(tmp_path, ByteTokenizer(), {}) == {2}
    assert end_ids(tmp_path, ByteTokenizer(), {"data": {"document_end": "\n"}}) == {10}
    assert end_ids(tmp_path, ByteTokenizer(), {"data": {"document_end": ""}}) == set()


def test_ignore_eos_is_a_flag_of_generate(trained_run, capsys):
    assert _generated(capsys, trained_run, "--prompt", "def ", "--tokens", 6, "--temperature", 0, "--ignore-eos") == \
        _generated(capsys, trained_run, "--prompt", "def ", "--tokens", 6, "--temperature", 0)


def test_a_byte_level_run_with_a_padded_vocabulary_writes_bytes(tmp_path):
    """model.vocab_size = 320 on text read as bytes: its ids are bytes and padding rows, so generate
    writes bytes from the first 256 ids. It was refused as "trained on pre-tokenized ids (corpus/)";
    a run that did train on ids is still refused."""
    from bigtrain.generate import text_tokenizer

    class Padded:
        vocab_size = 320

    for source in ("corpus/", "stdlib"):
        tokenizer = text_tokenizer(tmp_path, Padded(), {"data": {"tokenizer": "bytes", "source": source}})
        assert tokenizer.vocab_size == 256 and tokenizer.decode(list(b"caf\xc3\xa9")) == "caf\u00e9"
    with pytest.raises(GenerateError, match=r"pre-tokenized ids \(ids.npy\)"):
        text_tokenizer(tmp_path, Padded(), {"data": {"tokenizer": "bytes", "source": "ids.npy"}})
    with pytest.raises(GenerateError, match="no tokenizer.json in the folder"):
        text_tokenizer(tmp_path, Padded(), {})  # a Hugging Face folder: nothing says its ids are bytes
