import pytest


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a Python without it (the GPU machine's) still runs the tests
def pytest_xdist_auto_num_workers(config):
    """`pytest -n auto` (the README's test command): one worker per core this process may use, at most four, and one
    per 3 GiB of free memory (a worker holds torch and a model or two, and many tests start `assay` processes of their
    own). Most tests are single-threaded, so on two cores two workers take the suite from ~13 to ~8 minutes."""
    from assay.threads import cores

    usable = cores()
    try:
        with open("/proc/meminfo") as f:
            free_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        by_memory = max(1, free_kib // (3 * 2**20))
    except (OSError, StopIteration, ValueError):
        by_memory = usable
    return max(1, min(usable, 4, by_memory))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised 2-layer Qwen2 with the project's tokenizer, saved in HF format."""
    from assay.models import build_char_tokenizer, build_tiny_model, quiet_hf

    quiet_hf()
    out = tmp_path_factory.mktemp("tiny-model")
    tok = build_char_tokenizer()
    build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, seed=0).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def bundled():
    """`(model, tokenizer)` of the bundled tiny-arith model, shared by the engine tests."""
    from assay.models import load_policy

    model, tok = load_policy("tiny-arith")
    return model.eval(), tok


@pytest.fixture(scope="session")
def vllm_server():
    """One real `vllm serve` process on the bundled model for the whole session (its URL)."""
    from _engines import VllmServer, require_vllm

    from assay.models import resolve_model_path

    require_vllm()
    server = VllmServer(str(resolve_model_path("tiny-arith")))
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def engine_sampler(bundled, request):
    """`engine_sampler(name)`: one sampler of backend `name` over `bundled`'s model for the whole session."""
    from _engines import require_vllm

    from assay.config import RolloutConfig
    from assay.rollout.base import make_sampler

    made = {}

    def get(name: str):
        if name not in made:
            require_vllm()
            rollout = RolloutConfig(backend=name)
            if name == "openai":
                rollout.server_url = request.getfixturevalue("vllm_server")
            made[name] = make_sampler(name, bundled[0], bundled[1], rollout)
        return made[name]

    yield get
    for sampler in made.values():
        sampler.close()
