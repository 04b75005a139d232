"""The device rule (`assay.devices`), checked where CI can see it: a lint over the whole package.

On a CPU every tensor is on the CPU, so a tensor made on the wrong device never fails a test
here; on a GPU it stops the run at the first sampled token or the first update (both seen on
an H200). The rule makes such a tensor impossible to write without stating its device:

- A: every tensor factory (`torch.tensor`, `arange`, `zeros`, `full`, `rand*`, `Generator`, ...)
  names `device=`;
- B: every draw with a `generator=` takes it from `generator_for(gen, device)`, which hands
  back a generator living on the device it draws for.

The last tests put the two bugs the H200 found back into today's code and check that the lint
catches each.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "assay"

#: torch functions that make a new tensor (or generator) and take `device=`
FACTORIES = {
    "tensor", "as_tensor", "arange", "range", "zeros", "ones", "full", "empty", "empty_strided", "eye", "linspace",
    "logspace", "rand", "randn", "randint", "randperm", "normal", "tril_indices", "triu_indices", "Generator",
}
#: where rule B is implemented rather than followed
EXEMPT_B = {"devices.py"}


def _is_generator_for(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and node.value is None:
        return True
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Name) and f.id == "generator_for") or (isinstance(f, ast.Attribute) and f.attr == "generator_for")


def lint(source: str, name: str = "<source>") -> list[str]:
    """Every breach of rules A and B in `source`, as `name:line: what`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES:
            if "device" not in keywords:
                found.append(f"{name}:{node.lineno}: torch.{f.attr}(...) does not say its device (rule A)")
        if "generator" in keywords and Path(name).name not in EXEMPT_B and not _is_generator_for(keywords["generator"]):
            found.append(f"{name}:{node.lineno}: a draw's generator=... does not come from generator_for(gen, device) (rule B)")
    return found


def _package() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_the_package_keeps_the_device_rule():
    found = [f for p in _package() for f in lint(p.read_text(), str(p.relative_to(SRC)))]
    assert not found, "the device rule (assay/devices.py) is broken:\n" + "\n".join(found)


def test_the_lint_reads_every_module_of_the_package():
    names = {str(p.relative_to(SRC)) for p in _package()}
    for part in ("rollout/torch_sampler.py", "rollout/decoder.py", "training/learner.py", "batch.py", "training/rl.py", "eval/policy.py",
                 "rm/train.py", "models/llama.py", "algos/advantages.py", "recipes/build.py"):
        assert part in names


@pytest.mark.parametrize("source, expected", [
    ("torch.arange(4)", ["rule A"]),
    ("torch.arange(4, device=x.device)", []),
    ("torch.Generator().manual_seed(0)", ["rule A"]),
    ('torch.Generator(device="cpu").manual_seed(0)', []),
    ("x.new_zeros(3) + torch.zeros_like(x)", []),
    ("torch.multinomial(p, 1, generator=gen)", ["rule B"]),
    ("torch.multinomial(p, 1, generator=generator_for(gen, p.device))", []),
    ("q.exponential_(generator=gen)", ["rule B"]),
    ('torch.randn(3, device="cpu", generator=devices.generator_for(g, "cpu"))', []),
    ("torch.rand(3, generator=None)", ["rule A"]),
])
def test_the_lint_by_hand(source, expected):
    found = lint(source)
    assert [next(r for r in ("rule A", "rule B") if r in f) for f in found] == expected


def _mutated(path: str, old: str, new: str) -> str:
    source = (SRC / path).read_text()
    assert source.count(old) == 1, f"{path} no longer holds {old!r}: update this test with the code"
    return source.replace(old, new)


def test_bug_1_put_back_is_caught():
    """The H200's first crash: the run's CPU generator drew tokens from CUDA probabilities (`torch.multinomial`)."""
    assert not lint((SRC / "rollout/torch_sampler.py").read_text())
    buggy = _mutated("rollout/torch_sampler.py", "generator=generator_for(gen, probs.device)", "generator=gen")
    assert any("rule B" in f for f in lint(buggy))
    original = "    tok = torch.multinomial(probs, 1, generator=gen)[:, 0]\n"  # the line as it crashed
    assert any("rule B" in f for f in lint(original.strip()))
    unseeded = _mutated("training/rl.py", 'torch.Generator(device="cpu")', "torch.Generator()")
    assert any("rule A" in f for f in lint(unseeded))


def test_bug_2_put_back_is_caught():
    """The H200's second crash: a Batch held CPU rewards beside CUDA tokens, and an index on one device selected from both."""
    assert not lint((SRC / "batch.py").read_text())
    cpu_rewards = _mutated("batch.py", "for r in results], dtype=torch.float32, device=device)", "for r in results], dtype=torch.float32)")
    assert any("rule A" in f for f in lint(cpu_rewards))
    cpu_index = _mutated("training/rl.py", "torch.arange(B, device=self.device)", "torch.arange(B)")
    assert any("rule A" in f for f in lint(cpu_index))
