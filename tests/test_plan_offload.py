"""The planner's offload tiers (issue 13): what offload.optimizer / offload.params take off the device,
what their transfers cost per step at the profile's bandwidths, and `bigtrain plan` saying when
offload makes a model fit."""

import argparse
import json
from dataclasses import replace

import pytest

from bigtrain.config import ConfigError
from bigtrain.plan import Cluster, Layout, ModelSpec, estimate_memory, get_profile
from bigtrain.plan.cli import add_plan_parser
from bigtrain.plan.cost import OVERLAP, stage_costs, step_time
from bigtrain.plan.layout import layout_problems, parse_layout
from helpers import tiny_config

H100 = get_profile("h100-80g")


def _model() -> ModelSpec:
    from bigtrain.config import load_config

    return ModelSpec.from_model_config(load_config(preset="llama-7b").model, 4096)


def test_offloaded_states_leave_the_device_and_are_counted_on_their_tier():
    model, base = _model(), Layout(zero=1, precision="bf16", recompute="full")
    plain = estimate_memory(model, base, H100, 8)
    cpu = estimate_memory(model, replace(base, offload_optimizer="cpu"), H100, 8)
    # bf16 AdamW: the optimizer term is the fp32 masters and two moments, 12 bytes per parameter (+ step counts)
    assert plain.optimizer == pytest.approx(12 * model.params, rel=1e-3)
    host = cpu.detail["tiers"]["host"]
    assert cpu.optimizer == 0 and host["masters"] + host["state"] == plain.optimizer
    assert cpu.detail["host_states"] == sum(host.values()) and cpu.detail["nvme_states"] == 0
    assert (cpu.params, cpu.activations) == (plain.params, plain.activations)
    both = estimate_memory(model, replace(base, zero=3, offload_optimizer="nvme", offload_params="nvme"), H100, 8)
    zero3 = estimate_memory(model, replace(base, zero=3), H100, 8)
    assert both.params == both.grads == both.optimizer == 0  # the gradient shards in files too, at ZeRO 2-3
    # weights, masters, state and gradients in files; the state's per-tensor step counts stay in memory
    assert both.detail["nvme_states"] + both.detail["tiers"]["host"]["state"] == zero3.model_states
    assert both.buffers["zero3_gathered"] == zero3.buffers["zero3_gathered"]  # what is gathered stays


def test_the_step_adds_the_transfers_at_the_profile_bandwidths():
    model, cluster = _model(), Cluster.build(1, H100)
    base = Layout(zero=1, precision="bf16", recompute="full")
    layout = replace(base, offload_optimizer="cpu")
    t = step_time(model, layout, cluster, 8)
    states = estimate_memory(model, base, H100, 8)
    shard = model.params  # one rank: the whole model, unpadded
    # The host step: the norm and AdamW read the fp32 accumulator (4 + 4), the masters and state go in and
    # out, the updated weights are cast into the staging ring (2) and go up over PCIe (2).
    expected = 2 * shard / H100.host_bandwidth + (2 * states.optimizer + 10 * shard) / H100.host_memory_bandwidth
    assert t.breakdown["offload_optimizer"] == pytest.approx(expected, rel=1e-3)
    assert t.breakdown["optimizer_step"] == 0  # the device no longer steps
    # Each of the 8 micro-batches' bf16 gradients goes down (2 bytes) and is folded into the fp32
    # accumulator (the first copied: 2 + 4; the others 2 + 8): exposed beyond the backward it overlaps.
    costs = stage_costs(model, layout, cluster)
    per_micro_batch = max(2 * shard / H100.host_bandwidth, (6 + 7 * 10) * shard / 8 / H100.host_memory_bandwidth)
    assert t.breakdown["offload_gradients"] == pytest.approx(8 * max(0.0, per_micro_batch - OVERLAP * costs.compute_b),
                                                             rel=1e-3, abs=1e-9)
    nvme = step_time(model, replace(layout, offload_optimizer="nvme"), cluster, 8).breakdown["offload_optimizer"]
    assert nvme == pytest.approx(expected + 2 * states.optimizer / H100.nvme_bandwidth, rel=1e-3)
    # The delayed update hides the host step behind the next step's compute (8 long micro-batches here).
    delayed = step_time(model, replace(layout, delayed_update=True), cluster, 8)
    window = OVERLAP * 8 * (costs.compute_f + costs.compute_b)
    assert delayed.breakdown["offload_optimizer"] == pytest.approx(max(0.0, expected - window), abs=1e-9)
    assert delayed.step_time_s < t.step_time_s


def test_offload_layout_keys_parse_check_and_run():
    fixed = parse_layout("zero=3,offload_optimizer=nvme,offload_params=nvme,delayed_update=on")
    assert fixed == {"zero": 3, "offload_optimizer": "nvme", "offload_params": "nvme", "delayed_update": True}
    with pytest.raises(ConfigError, match="offload_params = 'gpu': must be one of none, cpu, nvme"):
        parse_layout("offload_params=gpu")
    model, cluster = _model(), Cluster.build(1, H100)
    problems = layout_problems(Layout(zero=0, offload_optimizer="cpu", offload_params="nvme"), model, cluster, 8)
    assert any("offload_optimizer = cpu needs zero >= 1" in p for p in problems)
    assert any("offload_params = nvme needs zero = 3" in p for p in problems)
    # The planner's overrides are the runtime's config keys.
    layout = Layout(zero=3, precision="fp32", offload_optimizer="nvme", offload_params="nvme", delayed_update=True)
    cfg = tiny_config("", *layout.to_overrides())
    assert (cfg.offload.optimizer, cfg.offload.params, cfg.offload.delayed_update) == ("nvme", "nvme", True)


def _cli(*argv):
    parser = argparse.ArgumentParser(prog="bigtrain")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    return args.run(args)


def test_plan_says_when_offload_makes_the_7b_fit_one_h100(capsys):
    """The seeds' example: 7B with mixed-precision AdamW does not fit one 80 GB H100; with the optimizer's
    state and masters on the host it does."""
    assert _cli("plan", "--preset", "llama-7b", "--gpus", 1, "--hardware", "h100-80g") == 1
    text = capsys.readouterr().out
    assert "Nothing fits on 1 x h100-80g" in text
    assert "With offload it fits:" in text and "offload_optimizer=cpu" in text and "--offload.optimizer=cpu" in text
    assert _cli("plan", "--preset", "llama-7b", "--gpus", 1, "--hardware", "h100-80g", "--json") == 1
    fit = json.loads(capsys.readouterr().out)["offload_fit"]
    assert fit["layout"]["offload_optimizer"] == "cpu" and fit["fits"]
    assert fit["memory"]["total"] <= fit["memory"]["capacity"] and fit["memory"]["host_states"] > 60 * 2**30
    assert fit["time"]["breakdown"]["offload_optimizer"] > 0


def test_preflight_counts_what_offload_keeps_off_the_device(monkeypatch):
    """A 203M-parameter model (16P = 3.25 GB of states) on a machine of 2.5 GiB: rejected as it is,
    accepted with the optimizer and parameters in files; on a CPU device 'cpu' offload moves nothing."""
    from bigtrain.plan import fit

    monkeypatch.setattr(fit, "machine_memory", lambda cuda: (int(2.5 * 2**30), "this machine has"))
    wide = ["--model.dim=1024", "--model.n_layers=16", "--model.n_heads=8", "--model.n_kv_heads=0",
            "--data.seq_len=16", "--model.max_seq_len=16", "--train.micro_batch=1", "--train.global_batch=1",
            "--parallel.zero=3", "--precision.mode=fp32"]
    problems, _ = fit.size_problems(tiny_config("", *wide))
    assert problems and "optimizer state alone" in problems[0]
    problems, _ = fit.size_problems(tiny_config("", *wide, "--offload.optimizer=cpu"))
    assert problems  # the host is the device
    problems, _ = fit.size_problems(tiny_config("", *wide, "--offload.optimizer=nvme", "--offload.params=nvme"))
    assert not problems, problems


# -- the host and the NVMe are finite (issue 28) --------------------------------------------------------
def test_the_profile_carries_host_memory_and_nvme_per_gpu_settable_with_hw(capsys):
    assert H100.host_memory_bytes == 134_000_000_000 and H100.nvme_bytes == 64 * 2**30
    assert _cli("plan", "--preset", "llama-7b", "--gpus", 1, "--hw", "host_memory_bytes=256e9",
                "--hw", "nvme_bytes=3.84e12", "--json") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["hardware"]["host_memory_bytes"] == 256_000_000_000
    assert report["hardware"]["nvme_bytes"] == 3_840_000_000_000
    with pytest.raises(ConfigError, match="host_memory_bytes = 0: a rate or size must be >= 1"):
        _cli("plan", "--preset", "llama-7b", "--hw", "host_memory_bytes=0")


def test_no_offload_fit_exceeds_the_hosts_memory(capsys):
    """13B on one H100 with 100 GB of host memory: no offload fits (the smallest, 8-bit state in files
    with masters and gradients in host memory, needs about 104 GiB): no fit is proposed, and the
    closest says what it would need; with a DGX H100's share (256 GB) fp32 AdamW fits, and says so
    within that share."""
    assert _cli("plan", "--preset", "llama-13b", "--gpus", 1, "--hardware", "h100-80g", "--json",
                "--hw", "host_memory_bytes=100e9") == 1
    report = json.loads(capsys.readouterr().out)
    assert "offload_fit" not in report
    closest = report["offload_closest"]
    assert closest["memory"]["host"] > closest["memory"]["host_capacity"] == 100_000_000_000
    assert "Even with offload nothing fits" in closest["explanation"][0]
    assert _cli("plan", "--preset", "llama-13b", "--gpus", 1, "--hardware", "h100-80g", "--json",
                "--hw", "host_memory_bytes=256e9") == 1
    fit = json.loads(capsys.readouterr().out)["offload_fit"]
    assert fit["fits"] and 190 * 2**30 < fit["memory"]["host"] <= fit["memory"]["host_capacity"] == 256e9
    assert fit["memory"]["total"] <= fit["memory"]["capacity"]


def test_13b_fits_the_lent_hosts_memory_with_the_state_alone_on_nvme(capsys):
    """Issue 28: 13B on one H100 with 134 GB of host memory and 64 GiB of NVMe. No offload of fp32
    AdamW fits, nor 8-bit AdamW's with the masters beside it in host memory (about 128 GiB) or in
    files (73 GiB of NVMe); ZeRO-Infinity's split does: masters and gradients in host memory, the
    8-bit state alone in files; the planner says so, names the optimizer it changed, and the layout
    keys it prints are the ones `bigtrain train` takes."""
    assert _cli("plan", "--preset", "llama-13b", "--gpus", 1, "--hardware", "h100-80g", "--json",
                "--hw", "host_memory_bytes=134000000000") == 1
    report = json.loads(capsys.readouterr().out)
    fit = report["offload_fit"]
    assert fit["fits"] and fit["layout"]["offload_optimizer"] == "nvme" and fit["layout"]["offload_masters"] == "cpu"
    assert fit["memory"]["host"] <= fit["memory"]["host_capacity"] == 134_000_000_000
    assert 0 < fit["memory"]["nvme"] <= fit["memory"]["nvme_capacity"]
    assert "adamw8bit" in " ".join(fit["explanation"]) and "--offload.masters=cpu" in " ".join(fit["explanation"])


def test_an_offload_that_cannot_fit_this_hosts_memory_is_refused_before_launch(monkeypatch):
    """On a GPU machine: the planner's host tier of every local rank against the host's memory,
    naming the bytes needed and available; the files against the disk under offload.nvme_dir."""
    from bigtrain.plan import fit

    monkeypatch.setattr(fit, "machine_memory", lambda cuda: (80 * 2**30, "each GPU of this machine has"))
    monkeypatch.setattr(fit, "host_memory", lambda: 2 * 2**30)  # less than the process's own allowance
    cfg = tiny_config("", "--parallel.zero=2", "--offload.optimizer=cpu")
    problems, _ = fit.size_problems(cfg, local_ranks=2, cuda=True)
    assert len(problems) == 1, problems
    assert "offload.optimizer = 'cpu', offload.params = 'none' keep" in problems[0]
    assert "x 2 ranks on this machine" in problems[0] and "4.01 GiB of host memory needed" in problems[0]
    assert "this machine has 2 GiB" in problems[0] and "offload.optimizer = 'nvme'" in problems[0]
    assert not fit.size_problems(tiny_config("", "--parallel.zero=2"), cuda=True)[0]
    monkeypatch.setattr(fit, "host_memory", lambda: 64 * 2**30)
    monkeypatch.setattr(fit, "disk_free", lambda path: 1000)
    nvme = tiny_config("", "--parallel.zero=2", "--offload.optimizer=nvme")
    problems, _ = fit.size_problems(nvme, cuda=True, nvme_dir="/tmp/bigtrain-nvme")
    assert len(problems) == 1 and "in files" in problems[0] and "its disk has 1000 B free" in problems[0]


def test_files_on_a_filesystem_in_memory_are_counted_as_host_memory_and_warned_of(tmp_path, monkeypatch):
    """offload.nvme_dir on a tmpfs (/dev/shm) passed the disk check, though its files take the host's
    memory: the run is warned (the field, what it costs, the fix) and the size check counts the
    files as host memory: a run that fits with them on a disk is refused with them in memory."""
    from bigtrain.plan import fit

    monkeypatch.setattr(fit, "_mounts", lambda: [("/", "ext4"), (str(tmp_path / "shm"), "tmpfs")])
    (tmp_path / "shm").mkdir()
    assert fit.memory_filesystem(str(tmp_path / "shm" / "not-yet" / "offload")) == "tmpfs"
    assert fit.memory_filesystem(str(tmp_path / "disk")) is None
    states = ["--parallel.zero=3", "--offload.optimizer=nvme", "--offload.params=nvme"]
    problems, warnings = fit.size_problems(tiny_config("", *states), nvme_dir=str(tmp_path / "shm" / "offload"))
    assert not problems
    said = [w for w in warnings if "offload.nvme_dir" in w]
    assert len(said) == 1 and "tmpfs" in said[0] and "take host memory, not disk" in said[0], warnings
    assert "set offload.nvme_dir to a directory on a disk" in said[0] and "offload.optimizer = 'cpu'" in said[0]
    _, warnings = fit.size_problems(tiny_config("", *states), nvme_dir=str(tmp_path / "disk"))
    assert not [w for w in warnings if "offload.nvme_dir" in w], warnings
    # 203M parameters (3.25 GB of states) on 2.5 GiB: they fit with their files on a disk, not in memory.
    monkeypatch.setattr(fit, "machine_memory", lambda cuda: (int(2.5 * 2**30), "this machine has"))
    wide = tiny_config("", "--model.dim=1024", "--model.n_layers=16", "--model.n_heads=8", "--model.n_kv_heads=0",
                       "--data.seq_len=16", "--model.max_seq_len=16", "--train.micro_batch=1",
                       "--train.global_batch=1", "--precision.mode=fp32", *states)
    monkeypatch.setattr(fit, "disk_free", lambda path: 2**40)
    assert not fit.size_problems(wide, nvme_dir=str(tmp_path / "disk"))[0]
    problems, _ = fit.size_problems(wide, nvme_dir=str(tmp_path / "shm" / "offload"))
    assert problems and "a tmpfs" in problems[0], problems
    # On a GPU machine: the host's memory holds the host tier and the files.
    monkeypatch.setattr(fit, "host_memory", lambda: int(2.5 * 2**30))
    gpu = fit.size_problems(wide, cuda=True, nvme_dir=str(tmp_path / "disk"))[0]
    in_memory = fit.size_problems(wide, cuda=True, nvme_dir=str(tmp_path / "shm" / "offload"))[0]
    assert not [p for p in gpu if "host memory needed" in p]
    assert [p for p in in_memory if "host memory needed" in p and "(tmpfs, in memory)" in p], in_memory
