import pytest

from assay.config import RunConfig, load_config
from assay.errors import AssayError


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(None, ["train.steps=7", "algo.kl_coef=0.05", "rollout.group_size=4", "data.task_args={terms: 3}"])
    assert cfg.train.steps == 7 and cfg.algo.kl_coef == 0.05 and cfg.rollout.group_size == 4
    assert cfg.data.task_args == {"terms": 3}
    assert RunConfig().model.path == "tiny-arith"
    assert RunConfig().algo.mismatch == "none" and not RunConfig().selection.dynamic  # new pieces are off by default
    cfg = load_config(None, ["algo.advantage=gae", "critic.lr=3e-4", "selection.dynamic=true", "selection.pool_size=16"])
    assert cfg.critic.lr == 3e-4 and cfg.selection.dynamic and cfg.selection.pool_size == 16
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 3\noptim:\n  lr: 1.0e-3\n")
    cfg = load_config(str(f), ["train.steps=5"])
    assert cfg.train.steps == 5 and cfg.optim.lr == 1e-3


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.stpes=3", "unknown config key 'train.stpes'; allowed here: steps"),
        ("bogus=1", "unknown config key 'bogus'"),
        ("train.steps=-1", "invalid config value train.steps=-1"),
        ("rollout.temperature=hot", "invalid config value rollout.temperature='hot'"),
        ("model.dtype=int3", "'float32', 'bfloat16' or 'float16'"),
        ("trainsteps", "is not key=value"),
        ("algo.mismatch=ti", "invalid config value algo.mismatch='ti': Input should be 'none', 'tis' or 'mis'"),
        ("algo.mismatch_floor=3", "invalid config value algo.mismatch_floor=3.0: must be below algo.mismatch_cap=2.0"),
        ("algo.mismatch_level=batch", "'token' or 'sequence'"),
        ("critic.value_clip=0", "invalid config value critic.value_clip=0"),
        ("critic.lr=-1", "invalid config value critic.lr=-1"),
        ("critic.gamma=1", "unknown config key 'critic.gamma'; allowed here: lr, betas"),
        ("selection.prompts=best", "'stream' or 'variance'"),
        ("selection.pool_size=4", "invalid config value selection.pool_size=4: must be at least rollout.prompts_per_step=16"),
        ("selection.var_decay=1", "invalid config value selection.var_decay=1"),
        ("selection.retry_frac=2", "invalid config value selection.retry_frac=2"),
        ("selection.max_rounds=0", "invalid config value selection.max_rounds=0"),
        ("selection.dynamc=true", "unknown config key 'selection.dynamc'"),
        ("cluster={learner_workers: 2, gpus_per_learner: 0.5}", "invalid config value cluster.gpus_per_learner=0.5: with learner_workers=2 each"),
    ],
)
def test_bad_overrides_name_key_value_and_allowed(override, needle):
    with pytest.raises(AssayError) as e:
        load_config(None, [override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(AssayError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1,\n")
    with pytest.raises(AssayError, match="not valid YAML"):
        load_config(str(bad))
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n")
    with pytest.raises(AssayError, match="mapping"):
        load_config(str(lst))
