import pytest


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
