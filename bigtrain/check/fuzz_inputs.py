"""The input fuzzer: hostile and clumsy configs, data, folders and environments, each to be rejected.

Every case of :mod:`bigtrain.check.input_cases` runs through the real command-line entry,
``bigtrain.cli.main(["train" | "check", ...])``, in this process, with the places a run starts
(``run_rank``, ``_check_rank``, ``launch_local``, ``init_distributed``) replaced by recorders and an
alarm as the timeout guard. A case passes when the command

* exits with code 2,
* prints a message naming the field, flag or variable the case broke,
* prints no traceback (and raises nothing out of ``main``),
* starts nothing: no rank, no torchrun, no process group,
* leaves the files as they were: nothing created, changed or removed under the fuzz folder
  (validation creates nothing; the writability probe's temporary file is gone again),

within the timeout. Anything else is counted as a traceback, a hang, accepted (it reached a rank),
a wrong exit code, an unnamed field, a start, or a leftover, and printed.

``python -m bigtrain.fuzz_inputs N SEED`` (``scripts/fuzz-inputs.sh``) runs N cases. This module
is handed the command-line module (``cli``: its ``main`` runs a case, its ``run_rank`` is where a
run would start) by that entry point, above both packages: the CLI runs ``bigtrain check``, so
importing it from here would make a cycle between ``bigtrain.check`` and ``bigtrain.cli``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from bigtrain.check.input_cases import generate
from bigtrain.check.input_recipe import Case

CLEAN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "GROUP_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
VERDICTS = ("rejected", "traceback", "hang", "accepted", "exit-code", "unnamed", "started", "leftover")


class Hang(Exception):
    pass


@dataclass
class Outcome:
    case: Case
    verdict: str
    code: object = None
    output: str = ""
    seconds: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == "rejected"


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (links not followed) with its size and modification time; folders
    by name only (the writability probe adds and removes an entry, which changes a folder's time)."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            out[os.path.relpath(os.path.join(folder, name), root)] = (-1, -1)
        for name in files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out


@contextlib.contextmanager
def _patched(started: list[str], cli):
    """Every place a run starts, replaced by a recorder."""
    import bigtrain.check.cli as check_cli
    import bigtrain.distributed.launch as launch

    saved = (cli.run_rank, check_cli._check_rank, launch.launch_local, launch.init_distributed)
    cli.run_rank = lambda cfg, run_dir, lock=None: started.append("rank") or 0
    check_cli._check_rank = lambda cfg, out, steps: started.append("check rank") or 0
    launch.launch_local = lambda nproc, argv, **_: started.append(f"torchrun x {nproc}") or 0
    launch.init_distributed = lambda *a, **k: started.append("init_distributed")
    try:
        yield
    finally:
        cli.run_rank, check_cli._check_rank, launch.launch_local, launch.init_distributed = saved


@contextlib.contextmanager
def _environment(changes: dict[str, str | None]):
    saved = dict(os.environ)
    for name in CLEAN_ENV:
        os.environ.pop(name, None)
    for name, value in changes.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _alarm(seconds: float):
    def fire(signum, frame):
        raise Hang(f"no answer within {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def argv_of(case: Case, folder: Path, cache: Path, args: list[str]) -> list[str]:
    base = [case.command]
    if case.uses_preset:
        base += ["--preset", "tiny"]
    base += ["--output-dir", str(folder / "run"), f"--data.cache_dir={cache}", "--logging.progress=false"]
    return base + args  # the case's own flags come last and win


def run_case(case: Case, root: Path, index: int, cli, timeout: float = 30.0) -> Outcome:
    """Build the case in its own folder under ``root`` and run it through ``cli.main`` (``cli``:
    the :mod:`bigtrain.cli` module)."""
    import torch.distributed as dist

    folder = root / f"case-{index:04d}"
    folder.mkdir()
    cwd = root / "cwd"  # a default run directory (runs/...) would land here
    cwd.mkdir(exist_ok=True)
    old_cwd = os.getcwd()
    started: list[str] = []
    out, err = io.StringIO(), io.StringIO()
    code, raised = None, None
    start = time.perf_counter()
    try:
        os.chdir(cwd)
        args, env = case.build(folder)
        before = _tree(root)
        with _patched(started, cli), _environment(env), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err), _alarm(timeout):
            try:
                code = cli.main(argv_of(case, folder, root / "cache", args))
            except SystemExit as e:  # argparse's own errors
                code = e.code
    except Hang as e:
        raised = ("hang", str(e))
    except BaseException:  # noqa: BLE001 - whatever escaped is the finding
        raised = ("traceback", traceback.format_exc())
    finally:
        os.chdir(old_cwd)
    seconds = time.perf_counter() - start
    text = out.getvalue() + err.getvalue()
    outcome = Outcome(case, "rejected", code, text, seconds)
    after = _tree(root)
    changed = sorted(set(before.items()) ^ set(after.items())) if raised is None else []
    if raised is not None:
        outcome.verdict, outcome.detail = raised
    elif "Traceback" in text:
        outcome.verdict = "traceback"
    elif started or dist.is_initialized():
        outcome.verdict, outcome.detail = ("accepted" if code == 0 else "started"), ", ".join(started)
    elif code != 2:
        outcome.verdict = "exit-code"
    elif not any(name in text for name in case.names):
        outcome.verdict, outcome.detail = "unnamed", f"expected one of {case.names}"
    elif changed:
        outcome.verdict, outcome.detail = "leftover", ", ".join(sorted({p for p, _ in changed}))
    return outcome


def run(count: int, seed: int, cli, timeout: float = 30.0, verbose: bool = True) -> tuple[list[Outcome], object]:
    """Generate ``count`` cases with ``seed`` and run each through ``cli`` (the :mod:`bigtrain.cli`
    module); (outcomes, the draw)."""
    import torch

    torch.set_num_threads(1)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="bigtrain-fuzz-inputs-") as tmp:
        root = Path(tmp)
        (root / "cwd").mkdir()
        here = os.getcwd()
        os.chdir(root / "cwd")  # relative names in the cases are judged where they run
        try:
            draw = generate(count, seed)
        finally:
            os.chdir(here)
        for i, case in enumerate(draw.cases):
            outcome = run_case(case, root, i, cli, timeout)
            outcomes.append(outcome)
            if verbose:
                first = next((line for line in outcome.output.splitlines() if line.startswith("  - ")),
                             outcome.output.strip().splitlines()[-1] if outcome.output.strip() else "")
                print(f"[{i + 1}/{len(draw.cases)}] {outcome.verdict:9s} {outcome.seconds:5.2f}s "
                      f"{case.label()}  | {first.strip()[:150]}", flush=True)
                if not outcome.ok:
                    print("    " + (outcome.detail or outcome.output)[-2500:].replace("\n", "\n    "), flush=True)
    return outcomes, draw


def summary(outcomes: list[Outcome], draw, count: int, seed: int) -> str:
    counts = {v: sum(o.verdict == v for o in outcomes) for v in VERDICTS}
    kinds = {}
    for o in outcomes:
        kinds[o.case.kind] = kinds.get(o.case.kind, 0) + 1
    commands = {c: sum(o.case.command == c for o in outcomes) for c in ("train", "check")}
    slowest = max((o.seconds for o in outcomes), default=0.0)
    return (f"fuzz-inputs: {len(outcomes)} cases (seed {seed}; by kind "
            f"{', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}; train {commands['train']}, "
            f"check {commands['check']}); {len(draw.skipped_valid)} drawn values skipped as possibly valid; "
            + ", ".join(f"{counts[v]} {v}" for v in VERDICTS) + f"; slowest case {slowest:.2f} s")


def main(cli, argv: list[str] | None = None) -> int:
    """The fuzzer's command line, run against ``cli`` (the :mod:`bigtrain.cli` module)."""
    parser = argparse.ArgumentParser(prog="python -m bigtrain.fuzz_inputs", description=__doc__.split("\n")[0])
    parser.add_argument("count", type=int, help="cases to run")
    parser.add_argument("seed", type=int, help="the generator's seed (same seed, same cases)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a case may take (default 30)")
    parser.add_argument("--quiet", action="store_true", help="print failures and the summary only")
    args = parser.parse_args(argv)
    outcomes, draw = run(args.count, args.seed, cli, args.timeout, verbose=not args.quiet)
    if args.quiet:
        for o in outcomes:
            if not o.ok:
                print(f"{o.verdict}: {o.case.label()}\n    {(o.detail or o.output)[-2500:]}")
    print(summary(outcomes, draw, args.count, args.seed))
    return 0 if all(o.ok for o in outcomes) else 1
