"""`scripts/mutation-check.sh` counts a mutation as caught only by a test the mutation broke: a test that fails on the
unmutated tree too (the machine: another user's sandbox, a full disk) is no catch."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def tree(at: Path, answer: int) -> Path:
    """A small project: `f()` returns `answer`; `test_env` fails whatever the code (as a busy machine makes a test fail)."""
    (at / "src").mkdir(parents=True)
    (at / "tests").mkdir()
    (at / "src" / "m.py").write_text(f"def f():\n    return {answer}\n")
    (at / "tests" / "test_env.py").write_text("def test_machine():\n    assert False, 'another process holds the sandbox'\n")
    (at / "tests" / "test_real.py").write_text("from m import f\n\n\ndef test_f():\n    assert f() == 1\n")
    return at


def test_a_failure_without_the_mutation_is_not_a_catch(tmp_path):
    check = load_script()
    clean = tree(tmp_path / "clean", 1)
    caught, env = check.catcher(tree(tmp_path / "broken", 2), clean, ())
    assert caught == "tests/test_real.py::test_f" and env == ["tests/test_env.py::test_machine"]
    missed, env = check.catcher(tree(tmp_path / "harmless", 1), clean, ())
    assert missed is None and env == ["tests/test_env.py::test_machine"]  # only the machine failed: MISSED, not caught
