"""SpaceTrainer's callbacks (``space.train.callbacks``): the epoch seed and the time budget."""
from types import SimpleNamespace

from transformers import TrainerControl, TrainerState

from space.data.collator import SpaceCollator
from space.train import callbacks
from space.train.callbacks import EpochSeedCallback, TimeBudgetCallback


def test_the_collator_learns_each_epoch():
    """Spans are drawn afresh every epoch (DESIGN §3.2) only if the collator is told the epoch.
    Catches a callback that leaves it at 0 (every epoch would train the same spans)."""
    import torch

    collator = SpaceCollator(torch.tensor([300]), 2, 0, spans_per_sample=2, seed=7)
    sample = [{"input_ids": list(range(10, 50)), "prompt_len": 5, "idx": i} for i in range(3)]
    cb = EpochSeedCallback(collator)
    seen = []
    for epoch in (0.0, 1.0, 2.0):
        cb.on_epoch_begin(None, TrainerState(epoch=epoch), TrainerControl())
        seen.append((collator.epoch, collator(sample)["mask_offset"].tolist(), collator(sample)["labels"].tolist()))
    assert [e for e, *_ in seen] == [0, 1, 2]
    assert seen[0][1:] != seen[1][1:] and seen[1][1:] != seen[2][1:]  # fresh spans


def test_the_time_budget_counts_from_the_first_step(monkeypatch):
    """A 1-minute budget with 25-second steps stops after step 3 (75 s), and saves there. Catches
    a clock restarted at every step (a budget no step alone exceeds would never stop the run)."""
    now = [1000.0]
    monkeypatch.setattr(callbacks.time, "monotonic", lambda: now[0])
    cb, args = TimeBudgetCallback(minutes=1.0), SimpleNamespace(device="cpu")
    stopped = []
    for step in range(1, 6):
        control = TrainerControl()
        cb.on_step_begin(args, None, control)
        now[0] += 25.0
        cb.on_step_end(args, None, control)
        if control.should_training_stop:
            assert control.should_save
            stopped.append(step)
    assert stopped[:1] == [3]


def test_a_checkpoint_is_marked_whole_only_after_every_rank_wrote_its_files(tmp_path, monkeypatch):
    """HF writes each rank's rng_state_{rank}.pth before on_save, with no barrier: rank 0 marked the
    checkpoint whole (space_settings.json) while another rank could still be writing, so a kill in
    between left a checkpoint a resume took without that rank's RNG. on_save waits for every rank
    first (faked here: two ranks, the barrier recording whether the mark was already there)."""
    from types import SimpleNamespace

    import torch

    from space.train.callbacks import SETTINGS_FILE, SpaceCheckpointCallback

    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    marked_at_barrier = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a, **k: marked_at_barrier.append((ckpt / SETTINGS_FILE).exists()))
    SpaceCheckpointCallback({"mask_num": 3}).on_save(SimpleNamespace(output_dir=str(tmp_path)),
                                                     SimpleNamespace(is_world_process_zero=True, global_step=3), None)
    assert marked_at_barrier == [False] and (ckpt / SETTINGS_FILE).is_file()


def test_only_rank_0_writes_the_checkpoint_s_space_files(tmp_path):
    """Every rank calls on_save; only the main process writes the mask rows, the sampler head and
    the settings mark (two ranks writing one file raced). Catches the ``is_world_process_zero``
    check dropped; rank 0 writes all three."""
    import torch

    from space.artifact import MASK_EMBEDDING, SAMPLER_HEAD
    from space.sampler_head import SamplerHead
    from space.train.callbacks import SETTINGS_FILE, SpaceCheckpointCallback

    ckpt = tmp_path / "checkpoint-5"
    ckpt.mkdir()
    emb = SimpleNamespace(mask_rows=torch.nn.Parameter(torch.zeros(3, 4)))
    cb = SpaceCheckpointCallback({"mask_num": 3}, mask_embedding=emb, sampler=SamplerHead(4, 2))
    args = SimpleNamespace(output_dir=str(tmp_path))
    cb.on_save(args, SimpleNamespace(is_world_process_zero=False, global_step=5), None)
    assert list(ckpt.iterdir()) == []
    cb.on_save(args, SimpleNamespace(is_world_process_zero=True, global_step=5), None)
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([MASK_EMBEDDING, SAMPLER_HEAD, SETTINGS_FILE])
