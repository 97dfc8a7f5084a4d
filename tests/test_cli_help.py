"""The command line for a user finding their way: suggestions for mistyped flags and commands
(exit 2), ``train --help`` with fields, defaults and examples, dp from the world size; and what
importing the command line costs a process."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bigtrain.cli import _infer_dp, _parser, _resolve, main


@pytest.mark.parametrize("argv, hint", [
    (["train", "--steps=5"], "--steps=5: did you mean --train.steps=5?"),
    (["train", "--output_dir", "x"], "--output_dir: did you mean --output-dir?"),
    (["train", "--seq-len=64"], "did you mean --data.seq_len=64?"),
    (["train", "--parallel-dp=2"], "--parallel-dp=2: did you mean --parallel.dp=2?"),
    (["config", "--global_batch=4"], "did you mean --train.global_batch=4?"),
    (["plan", "--layuot", "auto"], "--layuot: did you mean --layout?"),
    (["check", "--stpes=2"], "did you mean --steps=2?"),
    (["export", "run", "out", "--formt", "hf"], "did you mean --format?"),
    (["generate", "run", "--prompt", "x", "--temprature=0"], "did you mean --temperature=0?"),
    (["trian", "--preset", "tiny"], "no command 'trian'; did you mean 'train'?"),
    # a preset or config file given bare was taken for a run folder; a command left out was
    # "invalid choice: 'tiny'"
    (["train", "tiny"], "  tiny: a preset is given as --preset tiny\n"),
    (["train", "smal"], "  smal: a preset is given as --preset small\n"),
    (["train", "nowhere/my.toml"], "  nowhere/my.toml: a config file is given as --config nowhere/my.toml\n"),
    (["--preset", "tiny"], "bigtrain: no command before --preset; give one first, e.g. bigtrain train --preset tiny"),
    (["--train.steps=3"], "bigtrain: no command before --train.steps; give one first, e.g. bigtrain train"),
    # with --preset, a bare --resume resumed a new runs/tiny-<time>: "nothing valid to resume from"
    (["train", "--preset", "tiny", "--resume"], "--resume continues the run in --output-dir: give --output-dir RUN_DIR"),
])
def test_a_mistyped_flag_or_command_gets_a_suggestion_and_exit_2(argv, hint, capsys):
    assert main(argv) == 2
    assert hint in capsys.readouterr().err


def test_a_mistyped_config_key_is_named_with_the_close_one(capsys):
    assert main(["config", "--train.stesp=5"]) == 2
    assert "unknown key 'train.stesp'; did you mean 'steps'?" in capsys.readouterr().err


def test_plan_does_not_suggest_config_overrides(capsys):
    assert main(["plan", "--parallel.dp=2"]) == 2
    err = capsys.readouterr().err
    assert "section.key" not in err and "bigtrain plan --help lists its flags" in err


def test_train_help_lists_fields_defaults_and_examples(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "bigtrain train --preset tiny" in out
    assert "--train.steps=300" in out  # the default preset's value
    assert "[parallel] dp=1 dp_replicate=1 dp_shard=0 tp=1" in out and "[train] steps=300" in out and "val_fraction=0" in out


def _train_args(*argv):
    args, rest = _parser().parse_known_args(["train", *argv])
    return args, rest


@pytest.mark.parametrize("argv, world, dp", [
    (("--preset", "tiny"), 2, 2),
    (("--preset", "tiny", "--parallel.tp=2"), 4, 2),
    (("--preset", "tiny", "--parallel.dp=1"), 2, 1),  # set by the user: theirs, and validation names the mismatch
    (("--preset", "tiny", "--parallel.tp=3"), 4, 1),  # tp does not divide the world: left to validation
])
def test_dp_follows_the_world_size_when_nothing_sets_it(argv, world, dp, capsys):
    args, rest = _train_args(*argv)
    cfg = _infer_dp(args, rest, _resolve(args, rest), world)
    assert cfg.parallel.dp == dp


def test_dp_follows_the_world_size_under_a_config_file_that_leaves_it_unset(tmp_path, capsys):
    """The README's ``bigtrain config --preset small > my.toml`` then ``torchrun --nproc-per-node 2 -m
    bigtrain train --config my.toml``: the file leaves parallel.dp commented, so dp is the world
    size's (dp_given reads the file: its only test in the suite; that line's launch from a fresh
    shell is in the extended lane, tests/extended.txt); a file that sets dp keeps it."""
    assert main(["config", "--preset", "small"]) == 0
    text = capsys.readouterr().out
    assert "# dp = 1" in text
    unset, given = tmp_path / "my.toml", tmp_path / "dp1.toml"
    unset.write_text(text)
    given.write_text(text.replace("# dp = 1", "dp = 1", 1))
    for path, dp in ((unset, 2), (given, 1)):
        args, rest = _train_args("--config", str(path))
        assert _infer_dp(args, rest, _resolve(args, rest), 2).parallel.dp == dp, path.name


def test_world_size_without_auto_is_checked_against_the_layout(capsys):
    assert main(["train", "--preset", "tiny", "--parallel.dp=1", "--world-size", "2"]) == 2
    assert "world size 2 (--world-size) != parallel.dp" in capsys.readouterr().err  # not "from the launcher"


def test_a_world_no_dp_can_make_names_the_other_axes_not_dp(capsys):
    """tp=2 on --world-size 1: the fix once named was "set parallel.dp = 1" (dp was 1 already) or
    "launch 2 ranks" (the user had given --world-size, not launched anything)."""
    assert main(["train", "--preset", "tiny", "--parallel.tp=2", "--world-size", "1"]) == 2
    err = capsys.readouterr().err
    assert "tp x pp x sp x cp = 2 does not divide it" in err and "or give --world-size 2" in err, err
    assert "set parallel.dp" not in err, err


def test_a_batch_hsdp_cannot_split_names_the_axis_the_user_set(capsys):
    """Only parallel.dp_shard given (dp follows as dp_replicate x dp_shard): the message named
    parallel.dp alone, a field the user never typed (scripts/fuzz-inputs.sh 400 1, as the README
    runs it, exited 1 on it)."""
    assert main(["train", "--preset", "tiny", "--parallel.dp_shard=3"]) == 2
    err = capsys.readouterr().err
    assert ("train.micro_batch x parallel.dp (parallel.dp_replicate x parallel.dp_shard = 1 x 3) = 4 x 3; "
            "use train.global_batch = 12 or change train.micro_batch or parallel.dp_shard") in err, err


def test_init_from_under_the_hf_family_is_not_read_as_a_llama(tmp_path, capsys):
    """docs/families.md's `--model.family=hf --model.hf_config=runs/qwen-hf --model.init_from=hf:runs/qwen-hf`
    was refused for a Qwen3 export: the CLI read the folder as bigtrain's Llama ("model_type = 'qwen3',
    not 'llama' or 'qwen2'"), which only the llama family's [model] fields are taken from."""
    folder = tmp_path / "qwen-hf"
    folder.mkdir()
    (folder / "config.json").write_bytes((Path(__file__).parent / "fixtures" / "hf" / "qwen3" / "config.json").read_bytes())
    (folder / "model.safetensors").write_bytes(b"")
    argv = ["config", "--preset", "tiny", "--model.family=hf", f"--model.hf_config={folder}",
            f"--model.init_from=hf:{folder}"]
    assert main(argv) == 0, capsys.readouterr().err
    assert f'init_from = "hf:{folder}"' in capsys.readouterr().out


def test_init_from_a_qwen3_folder_names_the_hf_family_as_the_fix(tmp_path, capsys):
    """`--model.init_from=hf:FOLDER` of a Qwen3 (or Mistral) folder said only "model_type = 'qwen3',
    not 'llama' or 'qwen2'", and with --model.family=hf added, "needs model.hf_config": a user
    coming from transformers was not told the two fields that train it (the folder's path quoted,
    since a path may hold a space)."""
    folder = tmp_path / "my qwen"
    folder.mkdir()
    (folder / "config.json").write_bytes((Path(__file__).parent / "fixtures" / "hf" / "qwen3" / "config.json").read_bytes())
    (folder / "model.safetensors").write_bytes(b"")
    assert main(["config", "--preset", "tiny", f"--model.init_from=hf:{folder}"]) == 2
    err = capsys.readouterr().err
    assert f"add --model.family=hf --model.hf_config='{folder}'" in err, err
    assert main(["config", "--preset", "tiny", "--model.family=hf", f"--model.init_from=hf:{folder}"]) == 2
    err = capsys.readouterr().err
    assert f"set model.hf_config = '{folder}', the folder model.init_from reads" in err, err


@pytest.mark.parametrize("family", ["llama", "hf"])
def test_init_from_a_folder_of_pytorch_model_bin_is_refused_before_launch_with_the_conversion(family, tmp_path, capsys):
    """A folder of an older Hugging Face save (config.json and pytorch_model.bin, no safetensors)
    passed validation under the llama family and the ranks died with a traceback ("holds no
    .safetensors file"); it is refused before launch, with the line that writes safetensors."""
    folder = tmp_path / "old-save"
    folder.mkdir()
    fixture = "llama" if family == "llama" else "qwen3"
    (folder / "config.json").write_bytes((Path(__file__).parent / "fixtures" / "hf" / fixture / "config.json").read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"")
    argv = ["config", "--preset", "tiny", f"--model.init_from=hf:{folder}"]
    argv += ["--model.family=hf", f"--model.hf_config={folder}"] if family == "hf" else []
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (f"{folder} holds no *.safetensors weights: it holds pytorch_model.bin, which bigtrain does not read (a "
            f"pickle); write safetensors beside it with transformers") in err, err
    assert f"M.from_pretrained('{folder}').save_pretrained('{folder}')" in err


def test_a_relative_data_path_not_found_says_where_it_was_looked_for(tmp_path, monkeypatch, capsys):
    """A run's config.toml keeps data.source and data.tokenizer as given ('corpus', 'tok.json'):
    `--resume` from another folder said "no such file or folder" of a folder the user could see.
    A relative path is said to be read from the current folder, which is named."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["config", "--preset", "tiny", "--data.source=corpus", "--data.tokenizer=tok.json"]) == 2
    err = capsys.readouterr().err
    here = f"(a relative path, looked for in the current folder {tmp_path / 'elsewhere'}: run from the folder it is relative to"
    assert f"data.source = 'corpus': no such file or folder {here}" in err, err
    assert f"data.tokenizer = 'tok.json': no such file {here}" in err, err
    assert main(["config", "--preset", "tiny", f"--data.source={tmp_path / 'corpus'}"]) == 2
    assert "relative path" not in capsys.readouterr().err


def test_a_folder_given_to_resume_says_output_dir(capsys):
    """`bigtrain train --resume runs/x` (resume_from_checkpoint=PATH, as elsewhere) said only
    "unrecognized arguments: runs/x"; it names --output-dir, the folder quoted (it may hold a space)."""
    assert main(["train", "--resume", "runs/my run"]) == 2
    err = capsys.readouterr().err
    assert ("runs/my run: a run folder is given as --output-dir 'runs/my run' (--resume takes no value: "
            "bigtrain train --output-dir 'runs/my run' --resume continues that run)") in err, err


def test_a_closed_pipe_ends_the_command_quietly():
    """`bigtrain fields | head`: the reader leaves early; the command stops with the pipe's status
    (128 + SIGPIPE), not a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "bigtrain", "fields"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before it prints: its first write finds no reader
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_warnings_are_said_by_the_launcher_not_again_by_its_ranks(monkeypatch, capsys):
    """`bigtrain train --parallel.tp=2 --parallel.zero=1` printed each warning twice: the launcher
    before the launch, then its rank 0 on the same resolved config."""
    from bigtrain.distributed.launch import LAUNCHER_ENV, parent_of
    from bigtrain.preflight import print_warnings

    print_warnings(["said once"])
    assert "bigtrain: warning: said once" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    print_warnings(["said once"])  # a rank of another launcher (torchrun): its rank 0 says them
    assert "said once" in capsys.readouterr().err
    monkeypatch.setenv(LAUNCHER_ENV, str(parent_of(os.getppid())))  # as launch_local's ranks see it
    print_warnings(["said once"])  # a rank bigtrain started: the launcher said them
    assert capsys.readouterr().err == ""


def test_a_leftover_launcher_pid_does_not_silence_a_users_own_torchrun(monkeypatch, capsys):
    """BIGTRAIN_LAUNCHER_PID inherited by a shell (a user's own torchrun started from it) silenced
    that run's warnings, made its ranks exit 0 on a stop and watch a stranger's pid: it counts only
    when it names the parent of the rank's agent, the launcher that started it."""
    from bigtrain.distributed.launch import LAUNCHER_ENV, bigtrain_launcher, launched_by_bigtrain, parent_of
    from bigtrain.preflight import print_warnings

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    launcher = parent_of(os.getppid())  # what launch_local's value would be here (pid 1 under some shells)
    for leftover in {"1", str(os.getpid()), str(os.getppid()), "x"} - {str(launcher)}:  # init, self, parent, junk
        monkeypatch.setenv(LAUNCHER_ENV, leftover)
        assert not launched_by_bigtrain() and bigtrain_launcher() is None, leftover
        print_warnings(["said once"])
        assert "bigtrain: warning: said once" in capsys.readouterr().err, leftover


def test_hsdp_axes_given_are_not_overridden_by_the_world_size(capsys):
    """dp_replicate x dp_shard, both given, set dp: --world-size 8 with 2 x 2 once set dp = 8 itself
    and then asked for parallel.dp = 4; the fix named is the HSDP axis."""
    assert main(["train", "--preset", "tiny", "--world-size", "8", "--parallel.dp_replicate=2",
                 "--parallel.dp_shard=2", "--parallel.zero=3", "--train.global_batch=16"]) == 2
    err = capsys.readouterr().err
    assert "parallel.dp = 8 (world size" not in err and "set parallel.dp_shard = 4 (HSDP" in err, err


HF_LLAMA = "--model.hf_config=tests/fixtures/hf/llama"


@pytest.mark.parametrize("argv, refused", [
    (("--model.family=hf", HF_LLAMA, "--model.vocab_size=512", "--model.dim=64"), ("vocab_size", "dim")),
    (("--model.name=hf", HF_LLAMA, "--model.n_layers=8"), ("n_layers",)),  # the older spelling of family
    (("--preset", "dlrm-tiny", "--model.family=dlrm", "--model.dim=8"), ("dim",)),
    (("--model.hf_config=tests/fixtures/hf/llama",), ("hf_config",)),  # model.family left at 'llama'
])
def test_a_model_field_the_family_does_not_read_is_refused_on_the_command_line(argv, refused, capsys):
    """--model.vocab_size=512 beside model.family = 'hf' trained the config.json's 256 all the same:
    an override that changes nothing is refused, by train, config and check alike."""
    for command in ("train", "config", "check"):
        assert main([command, *argv]) == 2
        err = capsys.readouterr().err
        for key in refused:
            assert f"--model.{key}: model.family = " in err and f"does not read model.{key}" in err, err
    assert "set model.family = 'hf' to use model.hf_config" in err or refused != ("hf_config",)


def test_the_fields_a_family_reads_are_taken_on_the_command_line(capsys):
    """The preset's decoder shape beside model.family = 'hf' is documented use (docs/families.md):
    only what the command line sets is judged."""
    assert main(["config", "--preset", "tiny", "--model.family=hf", HF_LLAMA, "--model.fused_loss=true",
                 "--model.fused_loss_chunk=7"]) == 0
    assert "\nfused_loss_chunk = 7 " in capsys.readouterr().out


def test_a_value_may_follow_its_flag_as_argparse_users_type_it(capsys):
    assert main(["config", "--preset", "tiny", "--optim.lr", "1e-3", "--parallel.zero", "1"]) == 0
    out = capsys.readouterr().out
    assert "\nlr = 0.001 " in out and "\nzero = 1 " in out


def test_a_key_as_close_to_two_fields_names_both(capsys):
    assert main(["config", "--parallel.dpp=2"]) == 2
    assert "unknown key 'parallel.dpp'; did you mean 'pp' or 'dp'?" in capsys.readouterr().err


def test_fields_shows_each_default(capsys):
    assert main(["fields"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["parallel.dp"].endswith("(default: 1)") and lines["optim.name"].endswith('(default: "adamw")')


def test_zero_on_one_rank_is_run_with_a_warning_that_it_shards_nothing(corpus_cache, tmp_path, capsys):
    assert main(["train", "--preset", "tiny", "--parallel.zero=3", "--train.steps=1", "--output-dir", str(tmp_path),
                 f"--data.cache_dir={corpus_cache}", "--data.max_bytes=400000", "--logging.report=false"]) == 0
    assert ("warning: parallel.zero = 3 with parallel.dp = 1: ZeRO shards over the data-parallel ranks, so one rank "
            "holds everything") in capsys.readouterr().err


def test_the_command_line_and_the_trainer_import_dcp_only_to_save_or_load(tmp_path):
    """torch.distributed.checkpoint (and the DTensor stack it imports) cost every process that
    imported the CLI about 1.2 s of CPU (the DLRM family's checkpoint module reached it at start);
    the suite starts many such processes. It is imported by the first save or load instead."""
    code = ("import sys, bigtrain.cli, bigtrain.train, bigtrain.families, bigtrain.recsys.train; "
            "print([m for m in sys.modules if m.startswith('torch.distributed.checkpoint')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_bare_resume_names_the_newest_run_here(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name in ("small-1", "small-2", "not-a-run"):
        (tmp_path / "runs" / name).mkdir(parents=True)
    for name, when in (("small-1", 1000), ("small-2", 2000)):
        (tmp_path / "runs" / name / "config.toml").write_text("")
        os.utime(tmp_path / "runs" / name, (when, when))
    assert main(["train", "--resume"]) == 2
    assert f"give --output-dir RUN_DIR (the newest here: {Path('runs') / 'small-2'})" in capsys.readouterr().err
