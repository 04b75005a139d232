"""The preference losses against TRL's trainers on the same batch (the `bench` extra: skipped without TRL).

Each trainer gets the same rows, a policy and a *different* reference (so the log-ratios are not
0), and computes its loss on its own collated batch through its own forward; assay computes it
through `Objective.step` (its own tokenisation, shared-prefix forward, reference pass). Loss
and gradient must agree to 1e-5: DPO (sigmoid), IPO, hinge and robust DPO against
`DPOTrainer`, SimPO against `CPOTrainer(loss_type="simpo", cpo_alpha=0)` (TRL keeps SimPO
there, not in DPOTrainer), KTO against `KTOTrainer`, ORPO's odds-ratio term against
`ORPOTrainer` (TRL's ORPO takes its NLL over prompt and response; assay's over the response, as
the paper's L_SFT of y_w given x, so that term differs by design).
"""

import copy
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")

from assay.models import build_char_tokenizer, build_tiny_model  # noqa: E402
from assay.po.data import encode, rows_to_preferences  # noqa: E402
from assay.po.step import Objective  # noqa: E402

ROWS = [{"prompt": "12+3=", "chosen": "15", "rejected": "9"}, {"prompt": "7+7=", "chosen": "14", "rejected": "1444"},
        {"prompt": "1+1=", "chosen": "22", "rejected": "11"}, {"prompt": "30+4=", "chosen": "34", "rejected": "43"}]
COMMON = {"output_dir": None, "per_device_train_batch_size": 4, "report_to": [], "use_cpu": True, "bf16": False, "fp16": False,
          "gradient_checkpointing": False}


@pytest.fixture(scope="module")
def models():
    warnings.filterwarnings("ignore")
    tok = build_char_tokenizer()
    policy = build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, seed=0)
    ref = build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, seed=1)
    return tok, policy, ref


def assay_step(models, loss, args, rows, bos=False):
    """`(metrics, gradients)` of assay's loss on `rows` (prompts after a BOS where TRL's trainer puts one)."""
    tok, policy, ref = models
    if bos:
        rows = [{**r, "prompt": tok.bos_token + r["prompt"]} for r in rows]
    enc = encode(rows_to_preferences(rows, {}, "rows"), tok, 64, "rows")
    model = copy.deepcopy(policy)
    objective = Objective(loss, args, tok.pad_token_id, "cpu")
    metrics = objective.step(model, enc, objective.reference(ref, enc))
    return metrics, {n: p.grad for n, p in model.named_parameters()}


def trl_step(trainer):
    """`(loss, metrics, gradients)` of a TRL trainer on its one batch (every row)."""
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return float(loss), trainer, {n: p.grad for n, p in trainer.model.named_parameters()}


def same_grads(a, b):
    for name, g in a.items():
        assert torch.allclose(g, b[name], atol=1e-5, rtol=1e-4), (name, float((g - b[name]).abs().max()))


@pytest.mark.parametrize("loss, trl_loss, args", [
    ("dpo", "sigmoid", {"beta": 0.1}),
    ("ipo", "ipo", {"beta": 0.1}),
    ("hinge", "hinge", {"beta": 0.5}),
    ("robust", "robust", {"beta": 0.1, "label_smoothing": 0.2}),
])
def test_dpo_family_equals_trl_dpo_trainer(models, tmp_path, loss, trl_loss, args):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok, policy, ref = models
    extra = {"label_smoothing": args["label_smoothing"]} if "label_smoothing" in args else {}
    cfg = DPOConfig(**{**COMMON, "output_dir": str(tmp_path)}, loss_type=[trl_loss], beta=args["beta"], **extra)
    trainer = DPOTrainer(copy.deepcopy(policy), ref_model=copy.deepcopy(ref), args=cfg, train_dataset=Dataset.from_list(ROWS),
                         processing_class=tok)
    want, trainer, grads = trl_step(trainer)
    got, ours = assay_step(models, loss, args, ROWS)
    assert got["po/loss"] == pytest.approx(want, abs=1e-5) and abs(want) > 1e-3
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert abs(logged["rewards/margins"]) > 1e-3  # the reference differs from the policy: the margins are not 0
    for ours_key, theirs in (("po/reward_margin", "rewards/margins"), ("po/logp_chosen", "logps/chosen"), ("po/reward_accuracy", "rewards/accuracies")):
        assert got[ours_key] == pytest.approx(logged[theirs], abs=1e-5), ours_key
    same_grads(ours, grads)


def test_simpo_equals_trl_cpo_trainer(models, tmp_path):
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tok, policy, _ = models
    cfg = CPOConfig(**{**COMMON, "output_dir": str(tmp_path)}, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5, beta=2.0, max_length=64)
    trainer = CPOTrainer(copy.deepcopy(policy), args=cfg, train_dataset=Dataset.from_list(ROWS), processing_class=tok)
    want, _, grads = trl_step(trainer)
    got, ours = assay_step(models, "simpo", {"beta": 2.0, "gamma": 0.5}, ROWS, bos=True)  # CPOTrainer starts each prompt with BOS
    assert got["po/loss"] == pytest.approx(want, abs=1e-5)
    same_grads(ours, grads)


def test_kto_equals_trl_kto_trainer(models, tmp_path):
    """Unpaired rows; each row's mismatched response is the previous row's, in both (TRL: within its sequential batch)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    tok, policy, ref = models
    rows = [{"prompt": "12+3=", "completion": "15", "label": True}, {"prompt": "7+7=", "completion": "1444", "label": False},
            {"prompt": "1+1=", "completion": "2", "label": True}, {"prompt": "30+4=", "completion": "43", "label": False}]
    cfg = KTOConfig(**{**COMMON, "output_dir": str(tmp_path)}, beta=0.1, desirable_weight=1.0, undesirable_weight=1.5,
                    train_sampling_strategy="sequential")
    trainer = KTOTrainer(copy.deepcopy(policy), ref_model=copy.deepcopy(ref), args=cfg, train_dataset=Dataset.from_list(rows),
                         processing_class=tok)
    want, trainer, grads = trl_step(trainer)
    got, ours = assay_step(models, "kto", {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.5}, rows)
    assert got["po/loss"] == pytest.approx(want, abs=1e-5) and got["po/kl"] == pytest.approx(trainer._metrics["train"]["kl"][-1], abs=1e-5)
    same_grads(ours, grads)


def test_orpo_odds_ratio_equals_trl_orpo_trainer(models, tmp_path):
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tok, policy, _ = models
    cfg = ORPOConfig(**{**COMMON, "output_dir": str(tmp_path)}, beta=0.1, max_length=64)
    trainer = ORPOTrainer(copy.deepcopy(policy), args=cfg, train_dataset=Dataset.from_list(ROWS), processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    _, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    got, _ = assay_step(models, "orpo", {"beta": 0.1}, ROWS, bos=True)
    assert got["po/log_odds_ratio"] == pytest.approx(metrics["log_odds_ratio"], abs=1e-5)
    assert got["po/reward_margin"] == pytest.approx(metrics["rewards/margins"], abs=1e-5)
