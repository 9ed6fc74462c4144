"""SpaceTrainer's guard against non-finite steps (``space.train.trainer``): what counts as a bad
step, and that a good step ends a run of bad ones."""
import torch
from transformers import TrainingArguments

from space.config import SpaceSettings
from space.models import tiny_random_llama
from space.train.trainer import SpaceTrainer

from tests.train.test_recipes import tiny_batch


def guard(tmp_path, model=None, limit=10):
    model = model if model is not None else tiny_random_llama()[0]
    return SpaceTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]),
                        space=SpaceSettings(mode="full", mask_num=3, max_nonfinite_steps=limit))


def end_step(trainer, step, grad_norm):
    """What HF does at the end of optimizer step ``step``: hand the guard its gradient norm."""
    trainer.state.global_step = step
    trainer._maybe_log_save_evaluate(torch.zeros(()), torch.tensor(grad_norm), trainer.model, None, 0, None, 0.0)


def test_a_finite_step_ends_a_run_of_nonfinite_ones(tmp_path):
    """The guard counts *consecutive* bad steps. Catches a count that is never reset by a good
    step: a run with isolated NaN steps would then be stopped (or refused its artifact at the
    end) as if it had diverged."""
    trainer = guard(tmp_path)
    trainer._loss_finite = torch.tensor(False)
    end_step(trainer, 1, float("nan"))
    assert trainer.nonfinite_steps == 1
    end_step(trainer, 2, 1.0)  # a good step: finite loss (flag reset) and gradient norm
    assert trainer.nonfinite_steps == 0
    end_step(trainer, 3, float("inf"))
    assert trainer.nonfinite_steps == 1


def test_a_nonfinite_step_that_ends_an_epoch_saves_no_checkpoint(tmp_path):
    """Under ``save_strategy: epoch`` HF asks for a checkpoint between the step's call of the hook
    and the epoch end's second call. Catches a guard that returns early on the second call without
    refusing it: the NaN weights were saved, and a resume started from them."""
    trainer = guard(tmp_path)
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    trainer._loss_finite = torch.tensor(False)
    end_step(trainer, 1, float("nan"))  # the step's own call
    trainer.control.should_save = True  # on_epoch_end, save_strategy "epoch"
    end_step(trainer, 1, float("nan"))  # the epoch end's call
    assert trainer.nonfinite_steps == 1 and not list(tmp_path.glob("checkpoint-*"))
    trainer._loss_finite = torch.tensor(True)
    end_step(trainer, 2, 1.0)
    trainer.control.should_save = True  # a good step at an epoch's end is saved
    end_step(trainer, 2, 1.0)
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-2"]


def test_under_fp16_only_the_loss_counts(tmp_path):
    """Under fp16 an overflowing gradient norm is the loss scaler's business (it skips the step and
    lowers the scale): a step with a finite loss must not count. Catches a guard that reads the
    gradient norm under fp16 too (the first steps of every fp16 run overflow while the scale settles)."""
    trainer = guard(tmp_path)
    trainer.args.fp16 = True  # the guard reads the flag only (fp16 needs a GPU)
    for step in (1, 2, 3):
        end_step(trainer, step, float("inf"))
        assert trainer.nonfinite_steps == 0


def test_a_nonfinite_micro_batch_early_in_the_step_counts(tmp_path):
    """Gradient accumulation: the step's first micro-batch has a NaN loss, its second a finite one.
    The step is bad (under fp16, where the gradient norm does not count, the loss flag is all that
    tells). Catches a flag that keeps only the last micro-batch's finiteness."""
    model, batch = tiny_batch("full")
    trainer = guard(tmp_path, model)
    trainer.args.fp16 = True
    weight = next(p for n, p in model.named_parameters() if "down_proj" in n)
    saved = weight.detach().clone()
    model.train()
    with torch.no_grad():
        weight.fill_(float("nan"))
    assert not torch.isfinite(trainer.compute_loss(model, batch))
    with torch.no_grad():
        weight.copy_(saved)
    assert torch.isfinite(trainer.compute_loss(model, batch))
    end_step(trainer, 1, 1.0)
    assert trainer.nonfinite_steps == 1
