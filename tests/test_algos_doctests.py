"""The examples in the docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = [
    "assay.algos.advantages", "assay.algos.credit", "assay.algos.kl", "assay.algos.losses",
    "assay.algos.correction", "assay.algos.entropy", "assay.algos.turns", "assay.training.extras", "assay.data.selection", "assay.algos.args", "assay.workers",
    "assay.rewards.executor", "assay.rewards.monitors", "assay.rewards.steps", "assay.training.hacking", "assay.registry", "assay.training.old_policy",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
