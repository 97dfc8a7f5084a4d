"""A fixed sample of the input fuzzer (scripts/fuzz-inputs.sh runs the full set; docs/reliability.md
has its figures): every case must exit 2 naming its field, print no traceback, start nothing and
leave no file behind."""

from __future__ import annotations

import pytest

import bigtrain.cli as cli
from bigtrain.check.fuzz_inputs import VERDICTS, run, summary
from bigtrain.check.input_cases import generate
from bigtrain.check.input_fields import FLOAT_FIELDS, INT_FIELDS, float_is_bad, int_is_bad

SAMPLE, SEED = 40, 11


def test_the_sample_of_hostile_inputs_is_rejected_cleanly():
    outcomes, draw = run(SAMPLE, SEED, cli, verbose=False)
    bad = [f"{o.verdict}: {o.case.label()}\n{(o.detail or o.output)[-1500:]}" for o in outcomes if not o.ok]
    assert not bad, "\n".join(bad) + "\n" + summary(outcomes, draw, SAMPLE, SEED)
    assert len(outcomes) == SAMPLE
    assert len({o.case.kind for o in outcomes}) >= 5 and {o.case.command for o in outcomes} == {"train", "check"}


def test_cases_are_reproducible_and_distinct():
    a, b = generate(120, 3), generate(120, 3)
    assert [c.label() for c in a.cases] == [c.label() for c in b.cases]
    assert len({c.label() for c in a.cases}) == 120
    assert [c.label() for c in generate(120, 4).cases] != [c.label() for c in a.cases]


@pytest.mark.parametrize("name, text", [("train.steps", "5"), ("train.steps", " 7 "), ("model.n_kv_heads", "0"),
                                        ("data.ignore_target", "-1"), ("data.max_bytes", "0"), ("train.seed", "0")])
def test_values_that_may_be_valid_are_not_in_the_must_reject_set(name, text):
    assert not int_is_bad(name, text)


@pytest.mark.parametrize("name, text", [("train.steps", "0"), ("train.steps", "1.5"), ("train.steps", str(2**63)),
                                        ("data.max_bytes", "10"), ("model.n_layers", str(10**9)),
                                        ("train.seed", "-1")])
def test_values_that_are_certainly_invalid_are(name, text):
    assert int_is_bad(name, text)


def test_every_numeric_field_has_a_domain():
    from bigtrain.config import Config, _field_types, _section_types

    numeric = {f"{section}.{key}": typ for section, cls in _section_types().items()
               for key, typ in _field_types(cls).items() if typ in (int, float)}
    assert {k for k, t in numeric.items() if t is int} == set(INT_FIELDS)
    assert {k for k, t in numeric.items() if t is float} == set(FLOAT_FIELDS)
    assert float_is_bad("optim.lr", "nan") and not float_is_bad("optim.lr", "1e6")
    assert Config()  # the domains describe the tiny preset on top of these defaults
    assert "rejected" in VERDICTS
