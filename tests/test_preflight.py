"""Checks before launch (bigtrain/preflight.py, bigtrain/plan/fit.py): the data, the output folder,
leftover launcher variables and the run's size, each named with a fix; and what is valid passes."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

import bigtrain.cli as cli
import bigtrain.distributed.launch as launch
import bigtrain.plan.fit as fit
import bigtrain.plan.refit as refit
from bigtrain.config import ConfigError, load_config
from bigtrain.data import load_tokens
from bigtrain.preflight import data_problems, environment_problems, preflight, writable_dir_problem

SEQ = 32  # the tiny preset's data.seq_len: a corpus needs SEQ + 2 tokens


def _cfg(tmp_path, *overrides):
    return load_config(preset="tiny", overrides=[f"--data.cache_dir={tmp_path / 'cache'}", *overrides])


def _problems(tmp_path, source, *overrides):
    return data_problems(_cfg(tmp_path, f"--data.source={source}", *overrides))


# --------------------------------------------------------------------------- data that is fine


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32", "uint32", "int64"])
def test_integer_npy_within_the_vocabulary_passes(tmp_path, dtype):
    path = tmp_path / "t.npy"
    np.save(path, (np.arange(1000) % 256).astype(dtype))
    assert _problems(tmp_path, path) == []


def test_bin_2_d_fortran_npy_and_text_pass(tmp_path):
    (np.arange(SEQ + 2) % 256).astype(np.uint16).tofile(tmp_path / "exact.bin")  # exactly the minimum
    np.save(tmp_path / "f.npy", np.asfortranarray(np.arange(600).reshape(20, 30) % 256, dtype=np.int32))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("x" * (SEQ + 2))
    for source in ("exact.bin", "f.npy", "src", "src/a.txt"):
        assert _problems(tmp_path, tmp_path / source) == [], source
    assert data_problems(_cfg(tmp_path)) == []  # stdlib
    cfg = _cfg(tmp_path, f"--data.source={tmp_path / 'f.npy'}", "--model.vocab_size=300")
    assert data_problems(cfg) == []


def test_ids_up_to_the_vocabulary_pass_with_a_larger_vocabulary(tmp_path):
    path = tmp_path / "t.bin"
    np.array([0, 65535] * 40, dtype=np.uint16).tofile(path)
    assert _problems(tmp_path, path, "--model.vocab_size=65536") == []
    assert "65535" in _problems(tmp_path, path, "--model.vocab_size=65535")[0]


# --------------------------------------------------------------------------- data that is not


def _written(suffix: str, write):
    def make(path):
        path = path.with_suffix(suffix)
        write(path)
        return path
    return make


def _npy(array):
    return _written(".npy", lambda path: np.save(path, array))


def _bin(data: bytes):
    return _written(".bin", lambda path: path.write_bytes(data))


BAD_DATA = {
    "float32": (_npy(np.arange(100, dtype=np.float32)), "float32 values, not integer token ids"),
    "complex": (_npy(np.arange(100, dtype=np.complex64)), "complex64 values"),
    "bool": (_npy(np.ones(100, dtype=bool)), "bool values"),
    "id-at-vocab": (_npy(np.r_[np.zeros(50), 256, np.zeros(50)].astype(np.int32)),
                    "token id 256 at position 50, outside 0 .. model.vocab_size - 1 = 255; "
                    "the largest id is 256: set model.vocab_size to at least 257"),
    "negative-id": (_npy(np.r_[np.zeros(70), -3].astype(np.int64)), "token id -3 at position 70, outside 0 .. model.vocab_size - 1 = 255; the smallest is -3"),
    "short-npy": (_npy(np.zeros(SEQ + 1, dtype=np.uint16)), "has 33 token ids, fewer than data.seq_len + 2 = 34"),
    "empty-npy": (_npy(np.zeros(0, dtype=np.uint16)), "has 0 token ids"),
    "not-npy": (_written(".npy", lambda path: path.write_text("hello")), "is not a .npy file"),
    "odd-bin": (_bin(b"\x00" * 101), "odd number of bytes (101): a .bin holds uint16 token ids"),
    "empty-bin": (_bin(b""), "is empty"),
    "short-bin": (_bin(b"\x00\x00" * (SEQ + 1)), "has 33 token ids"),
    "id-in-bin": (_bin(np.r_[np.zeros(40), 9999].astype(np.uint16).tobytes()), "token id 9999 at position 40"),
    # ids written 4 or 8 bytes each (np.int32 / np.int64 .tofile): read as uint16, every other id would be 0
    "int32-bin": (_bin((np.arange(1, 201) % 250 + 1).astype(np.int32).tobytes()),
                  "every second uint16 value is at most 0 while the others reach 201: it looks like 32- or 64-bit ids"),
    "int64-bin": (_bin((np.arange(1, 201) % 250 + 1).astype(np.int64).tobytes()), "looks like 32- or 64-bit ids"),
    "short-text": (_written(".txt", lambda path: path.write_text("tiny")),
                   "has 4 bytes of text, fewer than data.seq_len + 2 = 34"),
}


@pytest.mark.parametrize("case", list(BAD_DATA), ids=list(BAD_DATA))
def test_bad_token_files_are_named_with_a_fix(tmp_path, case):
    write, needle = BAD_DATA[case]
    path = write(tmp_path / "t")
    problems = _problems(tmp_path, path)
    assert len(problems) == 1 and needle in problems[0], problems
    assert problems[0].startswith(f"data.source = '{path}'")


@pytest.mark.parametrize("suffix", [".npy", ".bin", ".txt"])
def test_a_held_out_slice_shorter_than_a_window_is_refused_before_launch(tmp_path, suffix):
    """data.val_fraction holds out the corpus's last tokens: a slice shorter than one window (or a
    training part shorter than one) is named before launch, not raised by the sampler in every rank."""
    path = tmp_path / f"t{suffix}"
    ids = (np.arange(1000) % 200 + 32).astype(np.uint16)
    np.save(path, ids) if suffix == ".npy" else ids.tofile(path) if suffix == ".bin" else path.write_bytes(
        ids.astype(np.uint8).tobytes() * 2)
    tokens = 2000 if suffix == ".txt" else 1000
    assert _problems(tmp_path, path, "--data.val_fraction=0.1") == []
    short = _problems(tmp_path, path, "--data.val_fraction=0.01")
    assert short == [f"data.val_fraction = 0.01 holds out {tokens // 100} tokens, fewer than one window "
                     f"(data.seq_len + 1 = {SEQ + 1}); raise data.val_fraction or give a longer corpus "
                     f"(data.source = '{path}' has {tokens} tokens)"], short
    most = _problems(tmp_path, path, "--data.val_fraction=0.99")
    assert len(most) == 1 and "before the held-out slice, fewer than data.seq_len + 2" in most[0], most


def test_a_held_out_slice_of_the_standard_library_is_checked_too(tmp_path):
    """'stdlib' without a cap: its length is its files' bytes (or its cached file's)."""
    assert _problems(tmp_path, "stdlib", "--data.max_bytes=0", "--data.val_fraction=0.01") == []
    short = _problems(tmp_path, "stdlib", "--data.max_bytes=0", "--data.val_fraction=1e-7")
    assert len(short) == 1 and short[0].startswith("data.val_fraction = 1e-07 holds out ") and \
        "(data.source = 'stdlib' has " in short[0], short
    capped = _problems(tmp_path, "stdlib", "--data.max_bytes=2000", "--data.val_fraction=0.01")
    assert capped == ["data.val_fraction = 0.01 holds out 20 tokens, fewer than one window (data.seq_len + 1 = 33); "
                      "raise data.val_fraction or give a longer corpus (data.source = 'stdlib' has 2000 tokens)"], capped


def test_folders_without_text_and_special_files(tmp_path):
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "t.csv").write_text("a,b\n" * 100)
    assert "no text files in this folder" in _problems(tmp_path, tmp_path / "csv")[0]
    os.mkfifo(tmp_path / "pipe.txt")  # reading it would block forever
    assert "is a FIFO" in _problems(tmp_path, tmp_path / "pipe.txt")[0]
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s.bin"))
    sock.close()
    assert "is a socket" in _problems(tmp_path, tmp_path / "s.bin")[0]
    (tmp_path / "zero.npy").symlink_to("/dev/zero")
    assert "is a character device" in _problems(tmp_path, tmp_path / "zero.npy")[0]
    assert "is a character device" in _problems(tmp_path, "/dev/zero")[0]
    (tmp_path / "d.bin").mkdir()
    assert "is a folder; a .bin / .npy source must be a token file" in _problems(tmp_path, tmp_path / "d.bin")[0]


def test_a_cap_below_one_window_names_max_bytes(tmp_path):
    assert "data.max_bytes = 20 caps the corpus" in data_problems(_cfg(tmp_path, "--data.max_bytes=20"))[0]


def test_an_unwritable_cache_is_named_unless_the_corpus_is_cached(tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = _cfg(tmp_path, f"--data.cache_dir={tmp_path / 'file' / 'cache'}")
    assert "data.cache_dir" in data_problems(cfg)[0]


def test_load_tokens_refuses_to_cast_floats(tmp_path):
    np.save(tmp_path / "f.npy", np.arange(100, dtype=np.float64))
    with pytest.raises(ValueError, match="float64 values, not integer token ids"):
        load_tokens(str(tmp_path / "f.npy"))


def test_a_large_file_is_scanned_in_chunks(tmp_path, monkeypatch):
    import bigtrain.data_checks as data_checks

    monkeypatch.setattr(data_checks, "SCAN_CHUNK", 1000)
    ids = np.zeros(10_000, dtype=np.uint16)
    ids[7654], ids[9999] = 300, 500  # the first in one chunk, the largest in a later one
    ids.tofile(tmp_path / "t.bin")
    problem = _problems(tmp_path, tmp_path / "t.bin")[0]
    assert "token id 300 at position 7654" in problem and "the largest id is 500" in problem


# --------------------------------------------------------------------------- folders the run writes


def test_writable_folders_pass_and_nothing_is_created(tmp_path):
    before = sorted(tmp_path.rglob("*"))
    assert writable_dir_problem(tmp_path / "a" / "b" / "c", "--output-dir") is None
    assert writable_dir_problem(tmp_path, "--output-dir") is None
    assert sorted(tmp_path.rglob("*")) == before


def test_unwritable_folders_say_why(tmp_path):
    (tmp_path / "file").write_text("x")
    assert "exists and is not a folder" in writable_dir_problem(tmp_path / "file", "--output-dir")
    assert f"'{tmp_path / 'file'}' exists and is not a folder" in writable_dir_problem(tmp_path / "file" / "run", "--x")
    assert "cannot write there" in writable_dir_problem("/proc/bigtrain-test/run", "--output-dir")
    assert "longer than 255 bytes" in writable_dir_problem(tmp_path / ("n" * 300), "--output-dir")
    assert "is empty" in writable_dir_problem("", "--output-dir")


# --------------------------------------------------------------------------- the environment

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "abc", "LOCAL_RANK": "1"}


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT are not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE = 'two' is not a whole number"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "0 <= RANK < WORLD_SIZE"),
    ({**TORCHRUN, "MASTER_PORT": "99999"}, "MASTER_PORT = '99999' is not a port"),
])
def test_leftover_or_malformed_launcher_variables_are_problems(env, needle):
    problems, warnings = environment_problems(env)
    assert len(problems) == 1 and needle in problems[0] and "unset RANK WORLD_SIZE" in problems[0], problems


def test_launchers_pass_and_unmarked_groups_are_warned_about():
    assert environment_problems({}) == ([], [])
    assert environment_problems(TORCHRUN) == ([], [])
    assert environment_problems({"RANK": "0", "WORLD_SIZE": "1"}) == ([], [])
    unmarked = {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}
    problems, warnings = environment_problems(unmarked)
    assert problems == [] and "will wait up to distributed.timeout_s for 1 other rank(s)" in warnings[0]
    assert "ignoring it" in environment_problems({"RANK": "3"})[1][0]


@pytest.fixture
def cli_sentinels(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(cli, "run_rank", lambda cfg, run_dir, lock=None: started.append("rank") or 0)
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv, **_: started.append("torchrun") or 0)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return started


def test_cli_warns_before_joining_an_unlaunched_group(tmp_path, capsys, monkeypatch, cli_sentinels):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    code = cli.main(["train", "--preset", "tiny", "--parallel.dp=2", "--output-dir", str(tmp_path / "run"),
                     f"--data.cache_dir={tmp_path / 'cache'}"])
    assert code == 0 and cli_sentinels == ["rank"]
    assert "bigtrain: warning: environment: RANK = 0, WORLD_SIZE = 2" in capsys.readouterr().err


def test_cli_rejects_an_empty_source_before_anything_starts(tmp_path, capsys, cli_sentinels):
    code = cli.main(["train", "--preset", "tiny", "--data.source=", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "data.source is empty" in err and "Traceback" not in err
    assert cli_sentinels == [] and not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- sizes


def test_the_tiny_and_small_presets_fit():
    for preset in ("tiny", "small"):
        assert fit.size_problems(load_config(preset=preset), local_ranks=2) == ([], [])


@pytest.mark.parametrize("override, field", [
    ("--model.n_layers=1000000000", "model.n_layers = 1000000000"),
    ("--model.vocab_size=100000000000", "model.vocab_size = 100000000000"),
    ("--model.max_seq_len=1000000000000", "model.max_seq_len = 1000000000000: the rotary tables"),
    ("--train.global_batch=4000000000000", "train.global_batch = 4000000000000"),
])
def test_absurd_sizes_are_rejected_with_the_planners_estimate(override, field):
    problems, _ = fit.size_problems(load_config(preset="tiny", overrides=[override]))
    assert len(problems) == 1 and field in problems[0], problems
    assert "this machine has" in problems[0]


def test_activations_beyond_memory_name_the_micro_batch(monkeypatch):
    cfg = load_config(preset="small", overrides=["--train.micro_batch=16", "--train.global_batch=16"])
    # The planner's estimate of this run, then machines a little larger and much smaller than it.
    monkeypatch.setattr(fit, "host_memory", lambda: 2**50)
    assert fit.size_problems(cfg) == ([], [])
    from bigtrain.plan.hardware import get_profile
    from bigtrain.plan.memory import estimate_memory
    from bigtrain.plan.model import ModelSpec

    per_rank = estimate_memory(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), fit._layout(cfg),
                               get_profile("cpu"), 16).total
    monkeypatch.setattr(fit, "host_memory", lambda: int(per_rank * 1.1))
    problems, warnings = fit.size_problems(cfg)
    assert problems == [] and "close to the limit" in warnings[0]
    monkeypatch.setattr(fit, "host_memory", lambda: per_rank // 4)
    problems, _ = fit.size_problems(cfg, local_ranks=2)
    assert "x 2 ranks on this machine" in problems[0] and "the planner estimates per rank" in problems[0]


def test_preflight_lists_every_problem_at_once(tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = _cfg(tmp_path, "--data.source=/dev/zero", "--model.n_layers=1000000000")
    with pytest.raises(ConfigError) as e:
        preflight(cfg, tmp_path / "file")
    text = str(e.value)
    assert len(e.value.problems) == 3
    assert "data.source = '/dev/zero'" in text and "--output-dir" in text and "model.n_layers" in text


# --------------------------------------------------------------------------- a layout that would fit


def test_llama_7b_on_a_24_gib_machine_is_refused_before_launch_with_a_fix(tmp_path, capsys, monkeypatch,
                                                                           cli_sentinels):
    monkeypatch.setattr(fit, "host_memory", lambda: 24 * 2**30)
    code = cli.main(["train", "--preset", "llama-7b", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and cli_sentinels == [] and not (tmp_path / "run").exists()
    assert "6.74e+09 parameters" in err and "100 GiB per rank" in err and "this machine has 24 GiB" in err
    # 100 GiB of states over 23.5 usable GiB: at least 5 machines, so 8 (the search doubles).
    assert "No layout of 1 rank fits this machine; on 8 machines like this one (one rank each)" in err
    # the fastest layout that fits there, as flags to paste (tp 8 on the cpu profile, whose Gloo
    # reduce-scatter and all-gather are slow; ZeRO-3 before they were measured)
    suggestion = err.split("fits (", 1)[1]
    assert "GiB per rank): --parallel." in suggestion


def test_force_launches_what_the_fit_check_refuses(tmp_path, monkeypatch, cli_sentinels):
    monkeypatch.setattr(fit, "host_memory", lambda: 2**20)
    code = cli.main(["train", "--preset", "tiny", "--force", "--output-dir", str(tmp_path / "run"),
                     f"--data.cache_dir={tmp_path / 'cache'}"])
    assert code == 0 and cli_sentinels == ["rank"]
    code = cli.main(["train", "--preset", "tiny", "--output-dir", str(tmp_path / "run2"),
                     f"--data.cache_dir={tmp_path / 'cache'}"])
    assert code == 2 and cli_sentinels == ["rank"]


def test_the_proposed_layout_fits_the_same_machine(monkeypatch):
    cfg = load_config(preset="small", overrides=["--parallel.dp=2", "--train.micro_batch=128", "--train.global_batch=256",
                                                 "--data.seq_len=128"])
    from bigtrain.plan.hardware import get_profile
    from bigtrain.plan.memory import estimate_memory
    from bigtrain.plan.model import ModelSpec

    per_rank = estimate_memory(ModelSpec.from_model_config(cfg.model, cfg.data.seq_len), fit._layout(cfg),
                               get_profile("cpu"), 256).total
    memory = int(2 * per_rank * 0.9)  # two ranks share it: 10% short
    monkeypatch.setattr(fit, "host_memory", lambda: memory)
    problems, _ = refit.size_problems_and_fixes(cfg, local_ranks=2)
    assert len(problems) == 1 and "A layout that fits on this machine (2 ranks): --" in problems[0], problems
    overrides = problems[0].split("(2 ranks): ")[1].split(" (the planner:")[0].split()
    fixed = load_config(preset="small", overrides=["--parallel.dp=2", "--train.micro_batch=128",
                                                   "--train.global_batch=256", "--data.seq_len=128", *overrides])
    assert fixed.parallel.world_size == 2 and fit.size_problems(fixed, local_ranks=2)[0] == []


def test_the_proposed_layout_leaves_room_when_one_does(monkeypatch):
    """llama-1b on a 23.5 GiB host was proposed --train.micro_batch=2 at 23.5 GiB a rank: all of the
    machine (the fit check's 'close to the limit' warning on the very advice it gave). The fastest
    layout below that limit comes first now."""
    cfg = load_config(preset="llama-1b")
    monkeypatch.setattr(fit, "host_memory", lambda: int(23.5 * 2**30))
    problems, _ = refit.size_problems_and_fixes(cfg)
    assert len(problems) == 1 and "A layout that fits on this machine (1 rank): --" in problems[0], problems
    overrides = problems[0].split("(1 rank): ")[1].split(" (the planner:")[0].split()
    fixed = load_config(preset="llama-1b", overrides=overrides)
    assert fit.size_problems(fixed) == ([], []), overrides


def test_the_layouts_proposed_keep_the_runs_fp8_and_say_so():
    # The search behind a proposal prices the run as configured: fp8's weight copies and its speed
    # (the planner once searched in bf16 alone and described its layout without fp8).
    cfg = load_config(preset="small", overrides=["--precision.mode=bf16", "--precision.fp8=rowwise",
                                                 "--parallel.dp=2"])
    result = refit._search(cfg, 2, 2**40, cuda=False)
    assert result.ranked and {plan.layout.fp8 for plan in result.ranked} == {"rowwise"}
    assert ",fp8=rowwise" in result.ranked[0].layout.describe()


def test_the_run_records_its_layout_as_it_runs_on_its_device():
    # compile.enabled = 'auto' compiles on a GPU and not on a CPU: the layout a run records says which.
    from bigtrain import run_info

    cfg = load_config(preset="small", overrides=["--compile.enabled=auto"])
    assert "compiled" in run_info.layout_text(cfg, cuda=True) and "compiled" not in run_info.layout_text(cfg)
    assert run_info.identity(cfg, cuda=True)["layout"] == run_info.layout_text(cfg, cuda=True)


def test_a_model_started_from_a_folder_with_a_tokenizer_is_warned_when_trained_on_other_ids(tmp_path):
    """`--model.init_from=hf:FOLDER` with the default data.tokenizer = 'bytes' fine-tuned a
    pretrained model on byte ids without a word, though the folder held the model's tokenizer.json;
    another tokenizer file is said too; the folder's own (or one with the same bytes) says nothing."""
    from bigtrain.config import load_config
    from bigtrain.preflight import init_from_tokenizer_warnings

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"model": "theirs"}')
    (tmp_path / "other.json").write_text('{"model": "other"}')
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "tokenizer.json").write_text('{"model": "theirs"}')

    def warnings(*overrides):
        return init_from_tokenizer_warnings(load_config(preset="tiny", overrides=[f"--model.init_from=hf:{folder}",
                                                                                   *overrides]))
    said = warnings()
    assert len(said) == 1 and "data.tokenizer = 'bytes'" in said[0], said
    assert f"set data.tokenizer = '{folder}' to train on the model's own tokens" in said[0]
    said = warnings(f"--data.tokenizer={tmp_path / 'other.json'}")
    assert len(said) == 1 and "is not the tokenizer beside model.init_from's weights" in said[0], said
    assert warnings(f"--data.tokenizer={folder}") == []
    assert warnings(f"--data.tokenizer={tmp_path / 'copy'}") == []
    assert warnings("--data.source=ids.bin") == []  # pre-tokenized ids: what they mean is not known
    (folder / "tokenizer.json").unlink()
    assert warnings() == []  # no tokenizer beside the weights (a byte-level export)


def test_a_held_out_slice_nothing_evaluates_is_warned():
    """data.val_fraction without train.eval_every took tokens from training and logged no eval_loss,
    without a word (eval_every without a slice is refused)."""
    from bigtrain.preflight import held_out_warnings

    said = held_out_warnings(load_config(preset="tiny", overrides=["--data.val_fraction=0.1"]))
    assert said == ["data.val_fraction = 0.1 holds out the corpus's last tokens from training, but train.eval_every = 0 "
                    "never evaluates them (no eval_loss is logged); set train.eval_every, e.g. 2, or "
                    "data.val_fraction = 0"]
    assert held_out_warnings(load_config(preset="tiny", overrides=["--data.val_fraction=0.1",
                                                                   "--train.eval_every=5"])) == []


def test_a_held_out_corpus_that_is_training_data_is_refused(tmp_path):
    """data.val_source naming the training folder again, or one of its files: eval_loss was measured
    on text the run trains on, without a word."""
    from bigtrain.data_checks import held_out_overlap_problems

    (tmp_path / "corpus").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "corpus" / name).write_text("text " * 20)
    (tmp_path / "val.txt").write_text("held " * 20)

    def problems(val, *more):
        return held_out_overlap_problems(_cfg(tmp_path, f"--data.source={tmp_path / 'corpus'}",
                                              f"--data.val_source={val}", "--train.eval_every=1", *more))

    said = problems(tmp_path / "corpus" / "b.txt")
    assert len(said) == 1 and said[0].startswith(f"data.val_source = '{tmp_path / 'corpus' / 'b.txt'}' reads what "
                                                 f"data.source = '{tmp_path / 'corpus'}' trains on"), said
    assert "and 1 more" in problems(f"{tmp_path}/corpus/./")[0]
    assert "data.blend's" in problems(tmp_path / "val.txt", f"--data.blend={tmp_path / 'val.txt'}=0.5")[0]
    assert problems(tmp_path / "val.txt") == []


def test_a_warm_up_as_long_as_the_run_is_warned():
    """A preset's warm-up under a short --train.steps: the learning rate never reached optim.lr."""
    from bigtrain.preflight import schedule_warnings

    said = schedule_warnings(load_config(preset="tiny", overrides=["--optim.warmup_steps=500", "--train.steps=2"]))
    assert schedule_warnings(load_config(preset="tiny", overrides=["--optim.warmup_steps=1", "--train.steps=1"])) == []
    assert said == ["optim.warmup_steps = 500 > train.steps = 2: the learning rate rises for the whole run and ends "
                    "at 1.2e-05, not optim.lr = 0.003; lower optim.warmup_steps (e.g. 1) or train longer"]
    assert schedule_warnings(load_config(preset="tiny")) == []
