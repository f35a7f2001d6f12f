"""AccoTrainer against transformers.Trainer and against hand-written acco loops.

Every test launches fresh processes as torchrun would (accelerate's state is per process;
``run_fresh`` in tests/ranks.py) and trains a tiny Llama built from a config on padded data, so token
counts differ per micro-batch and per rank.
"""

from __future__ import annotations

import inspect
import math
import os
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from tests.helpers import assert_params_close  # noqa: E402
from tests.ranks import run_fresh  # noqa: E402
from tests.reference import params_of  # noqa: E402

pytestmark = pytest.mark.timeout(240)
ATOL = 1e-6  # these comparisons allow 1e-6 absolute (rtol 1e-5), tighter than the helpers' default

SEQ_LEN = 16
PER_DEVICE = 2
SEQUENTIAL_SAMPLING = "train_sampling_strategy" in inspect.signature(TrainingArguments).parameters


# --------------------------------------------------------------------------- set-up


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def padded_examples(count: int = 64, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Sequences of 3 to 16 tokens padded to 16 (labels -100 on the padding)."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        length = int(torch.randint(3, SEQ_LEN + 1, (1,), generator=generator))
        ids = torch.randint(1, 64, (SEQ_LEN,), generator=generator)
        labels, mask = ids.clone(), torch.ones(SEQ_LEN, dtype=torch.long)
        ids[length:], labels[length:], mask[length:] = 0, -100, 0
        examples.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return examples


def training_args(output_dir: str, **overrides):
    settings = dict(
        output_dir=output_dir, use_cpu=True, report_to=[],
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,  # a backend alone makes accelerate go distributed dataloader_num_workers=0,
        disable_tqdm=True, seed=0, train_sampling_strategy="sequential", per_device_train_batch_size=PER_DEVICE,
        gradient_accumulation_steps=4, max_steps=4, optim="adamw_torch", learning_rate=1e-2, weight_decay=0.1,
        lr_scheduler_type="cosine", warmup_steps=1, max_grad_norm=0.5, logging_steps=1, save_strategy="no",
    )
    settings.update(overrides)
    if not SEQUENTIAL_SAMPLING:  # older transformers 5.x: seeded random order, the same in every run
        del settings["train_sampling_strategy"]
    return TrainingArguments(**settings)


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def rank_micro_batches(examples, rank: int, world_size: int):
    """This rank's micro-batches in the Trainer's order: sequential sampling, and global
    batch b (of PER_DEVICE examples) on rank b % world_size (accelerate's BatchSamplerShard)."""
    from transformers import default_data_collator

    batches = [examples[i : i + PER_DEVICE] for i in range(0, len(examples) - PER_DEVICE + 1, PER_DEVICE)]
    for b in range(rank, len(batches) - len(batches) % world_size, world_size):
        yield default_data_collator(batches[b])


def rank_info() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Probe(TrainerCallback):
    """Records the parameters every evaluation sees."""

    def __init__(self) -> None:
        self.evaluated: dict[int, dict[str, torch.Tensor]] = {}

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.evaluated[state.global_step] = params_of(model)


# ----------------------------------------------------------------- rank functions


def sync_against_ddp_trainer(output_dir: str) -> dict:
    """Plain Trainer (DDP) and AccoTrainer(sync) with the same arguments, SGD then AdamW."""
    from transformers import Trainer
    from torch.nn.parallel import DistributedDataParallel

    from acco.integrations.hf import AccoTrainer

    out = {}
    examples = padded_examples()
    # SGD unclipped (its update is proportional to the gradient: any error in the token
    # weighting shows), AdamW clipped below every gradient norm (the clipping path).
    for optim, lr, clip in (("sgd", 0.1, 5.0), ("adamw_torch", 1e-2, 0.5)):
        runs = {}
        for name, cls, extra in (("ddp", Trainer, {}), ("acco", AccoTrainer, {"acco_mode": "sync"})):
            args = training_args(f"{output_dir}/{optim}-{name}", optim=optim, learning_rate=lr, max_grad_norm=clip)
            trainer = cls(model=tiny_llama(), args=args, train_dataset=examples, **extra)
            trainer.train()
            runs[name] = {"params": params_of(trainer.model), "lr": logged(trainer, "learning_rate"),
                          "grad_norm": logged(trainer, "grad_norm"),
                          "wrapped": type(trainer.model_wrapped).__name__}
        out[optim] = runs
    # The guard: a model wrapped after all is refused at the next training step.
    try:
        trainer.training_step(DistributedDataParallel(trainer.model), examples[0])
        out["guard"] = "no error"
    except RuntimeError as error:
        out["guard"] = str(error)
    return out


def acco_against_hand_loop(output_dir: str, mode: str) -> dict:
    """AccoTrainer(acco or dpu) evaluating every update and saving every 2, against the
    documented loop over the same micro-batches; the committed parameters after each update."""
    from transformers import get_cosine_schedule_with_warmup

    from acco import AccoOptimizer
    from acco.integrations.hf import AccoTrainer

    examples = padded_examples()
    probe = Probe()
    args = training_args(output_dir, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=2,
                         per_device_eval_batch_size=4)
    trainer = AccoTrainer(model=tiny_llama(), args=args, train_dataset=examples, eval_dataset=examples[:8],
                          callbacks=[probe], acco_mode=mode)
    trainer.train()

    # The loop from the README, with the Trainer's optimizer, groups and schedule.
    rank, world_size = rank_info()
    model = tiny_llama()
    decay = set(trainer.get_decay_parameter_names(model))
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.1},
              {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]
    opt = AccoOptimizer(groups, torch.optim.AdamW, mode=mode, max_grad_norm=0.5, lr=1e-2, betas=(0.9, 0.999),
                        eps=1e-8)
    scheduler = get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=4)
    committed, lrs = {}, []
    batches = rank_micro_batches(examples, rank, world_size)
    rounds_per_update, per_round = (2, 2) if mode == "acco" else (1, 4)
    for _ in range(4):
        for _ in range(rounds_per_update):
            for _ in range(per_round):
                batch = next(batches)
                model(**batch).loss.backward()
                opt.accumulate(weight=float(batch["labels"][:, 1:].ne(-100).sum()))
            lrs.append(opt.param_groups[0]["lr"])
            if opt.step():
                scheduler.step()
                committed[opt.num_updates] = params_of(model)
    if opt.finish():
        scheduler.step()
        committed[opt.num_updates] = params_of(model)

    from safetensors.torch import load_file

    saved = {step: load_file(f"{output_dir}/checkpoint-{step}/model.safetensors") for step in (2, 4)}
    return {
        "trainer": params_of(trainer.model), "loop": params_of(model), "committed": committed,
        "evaluated": probe.evaluated, "saved": saved, "trainer_lr": logged(trainer, "learning_rate"),
        "loop_lr": lrs, "updates": trainer.acco_optimizer.num_updates, "eval_loss": logged(trainer, "eval_loss"),
        "scheduler_updates": trainer.lr_scheduler.updates,
    }


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def resume_args(output_dir: str):
    return training_args(output_dir, gradient_accumulation_steps=2, max_steps=6, save_strategy="steps", save_steps=3)


def train_then_stop(output_dir: str) -> dict:
    """Uninterrupted: 6 updates (checkpoints at 3 and 6). Stopped: the same, stopped at 3."""
    from acco.integrations.hf import AccoTrainer

    examples = padded_examples()
    whole = AccoTrainer(model=tiny_llama(), args=resume_args(f"{output_dir}/whole"), train_dataset=examples)
    whole.train()
    stopped = AccoTrainer(model=tiny_llama(), args=resume_args(f"{output_dir}/stopped"), train_dataset=examples,
                          callbacks=[StopAt(3)])
    stopped.train()
    return {"whole": params_of(whole.model), "whole_lr": logged(whole, "learning_rate"),
            "stopped_updates": stopped.acco_optimizer.num_updates,
            "acco_files": sorted(p.name for p in Path(f"{output_dir}/stopped/checkpoint-3/acco").iterdir())}


class SlowRank(TrainerCallback):
    """Makes one rank slower after each micro-batch, as a slower device would be."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_substep_end(self, args, state, control, **kwargs):
        if rank_info()[0] == self.rank:
            time.sleep(self.seconds)

    def on_step_end(self, args, state, control, **kwargs):
        self.on_substep_end(args, state, control)


def resume_then_accumulate_while_waiting(output_dir: str) -> dict:
    """New processes: resume the stopped run; then a run where rank 1 is slow and rank 0
    keeps accumulating while the round is in flight."""
    from acco.integrations.hf import AccoTrainer

    examples = padded_examples()
    resumed = AccoTrainer(model=tiny_llama(seed=5), args=resume_args(f"{output_dir}/stopped"), train_dataset=examples)
    resumed.train(resume_from_checkpoint=f"{output_dir}/stopped/checkpoint-3")

    args = training_args(f"{output_dir}/waiting", gradient_accumulation_steps=2, max_steps=4, logging_steps=2)
    waiting = AccoTrainer(model=tiny_llama(), args=args, train_dataset=examples, callbacks=[SlowRank(1, 0.5)],
                          acco_accumulate_while_waiting=True)
    waiting.train()
    acco = waiting.acco_optimizer
    return {"resumed": params_of(resumed.model), "resumed_lr": logged(resumed, "learning_rate"),
            "resumed_updates": resumed.acco_optimizer.num_updates,
            "waiting": params_of(waiting.model), "waiting_updates": acco.num_updates,
            "micro_batches": [s.local_micro_batches for s in acco.round_stats],
            "extra": logged(waiting, "acco_extra_micro_batches"), "hidden": logged(waiting, "acco_hidden_share")}


LOCAL_KWARGS = {"sync_every": 2, "sync_delay": 1, "overlap": "estimate", "pacing": "lockstep"}  # a round launched after every even step lands one step later


def counting_examples(count: int = 64, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    """Padded sequences of 3 to 16 tokens that count up from a random start: a pattern a tiny
    model learns within a few updates, so the loss visibly falls."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        length = int(torch.randint(3, SEQ_LEN + 1, (1,), generator=generator))
        start = int(torch.randint(0, 63, (1,), generator=generator))
        ids = (start + torch.arange(SEQ_LEN)) % 63 + 1
        labels, mask = ids.clone(), torch.ones(SEQ_LEN, dtype=torch.long)
        ids[length:], labels[length:], mask[length:] = 0, -100, 0
        examples.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return examples


def local_args(output_dir: str):
    """6 inner updates of 2 micro-batches; checkpoints at 2, 4 and 6 (a round in flight at each),
    evaluations at 3 (right after a landing) and 6 (a round in flight)."""
    return training_args(output_dir, gradient_accumulation_steps=2, max_steps=6, learning_rate=3e-3,
                         save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=3,
                         per_device_eval_batch_size=4)


def named_global_values(acco, model) -> dict[str, torch.Tensor]:
    """``acco.global_parameters()`` by the model's parameter names."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: value for group, values in zip(acco.param_groups, acco.global_parameters())
            for p, value in zip(group["params"], values)}


class LocalProbe(TrainerCallback):
    """At every step's end (before AccoTrainer's own callback puts the global values in the model
    for an evaluation or a save): this replica's parameters and the global values; at every
    evaluation, the parameters it sees."""

    def __init__(self) -> None:
        self.trainer = None
        self.live: dict[int, dict[str, torch.Tensor]] = {}
        self.global_values: dict[int, dict[str, torch.Tensor]] = {}
        self.evaluated: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.live[state.global_step] = params_of(model)
        self.global_values[state.global_step] = named_global_values(self.trainer.acco_optimizer, model)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.evaluated.setdefault(state.global_step, params_of(model))


def local_trainer(output_dir: str, seed: int = 0, callbacks=()):
    from acco.integrations.hf import AccoTrainer

    examples = counting_examples()
    return AccoTrainer(model=tiny_llama(seed), args=local_args(output_dir), train_dataset=examples,
                       eval_dataset=examples[:8], callbacks=list(callbacks), acco_mode="local",
                       acco_kwargs=LOCAL_KWARGS)


def local_steps(output_dir: str) -> dict:
    """AccoTrainer(acco_mode="local"): 6 inner updates, evaluated after training too."""
    from safetensors.torch import load_file

    probe = LocalProbe()
    trainer = local_trainer(f"{output_dir}/whole", callbacks=[probe])
    probe.trainer = trainer
    trainer.train()
    acco = trainer.acco_optimizer
    return {
        "params": params_of(trainer.model), "global_values": named_global_values(acco, trainer.model),
        "updates": acco.num_updates, "steps": trainer.state.global_step, "outer": acco.outer_rounds,
        "wrapped": type(trainer.model_wrapped).__name__, "loss": logged(trainer, "loss"),
        "eval_loss": logged(trainer, "eval_loss"), "after_training": trainer.evaluate()["eval_loss"],
        "live": probe.live, "global_at": probe.global_values, "evaluated": probe.evaluated,
        "saved": {step: load_file(f"{output_dir}/whole/checkpoint-{step}/model.safetensors") for step in (2, 4)},
        "outer_rounds": logged(trainer, "acco_outer_rounds"), "outer_bytes": logged(trainer, "acco_outer_bytes"),
        "hidden": logged(trainer, "acco_hidden_share"),
    }


def local_steps_resumed(output_dir: str) -> dict:
    """New processes: the local run resumed from its checkpoint at step 2 (a round in flight)."""
    resumed = local_trainer(f"{output_dir}/resumed", seed=5)
    resumed.train(resume_from_checkpoint=f"{output_dir}/whole/checkpoint-2")
    return {"params": params_of(resumed.model), "updates": resumed.acco_optimizer.num_updates,
            "outer": resumed.acco_optimizer.outer_rounds, "loss": logged(resumed, "loss")}


def one_process(output_dir: str, two_rank_checkpoint: str, local_checkpoint: str) -> dict:
    """No torchrun: rejected settings, a plain run, and resumes of a 2-rank checkpoint (acco
    mode) and of a 2-replica one (local mode)."""
    import copy

    from safetensors.torch import load_file
    from torch.utils.data import IterableDataset

    from acco.integrations.hf import AccoTrainer

    examples = padded_examples()
    base = training_args(f"{output_dir}/rejected")

    def changed(**values):
        # Set after construction: TrainingArguments itself refuses some of these on a CPU
        # (fp16) or needs their packages (deepspeed); what is tested is AccoTrainer's check.
        args = copy.copy(base)
        for name, value in values.items():
            setattr(args, name, value)
        return args

    rejected = {
        "fp16": dict(args=changed(fp16=True)),
        "torch_compile": dict(args=changed(torch_compile=True)),
        "deepspeed": dict(args=changed(deepspeed={"zero_optimization": {"stage": 1}})),
        "fsdp": dict(args=changed(fsdp=["full_shard"])),
        "auto_find_batch_size": dict(args=changed(auto_find_batch_size=True)),
        "reduce_lr_on_plateau": dict(args=changed(lr_scheduler_type="reduce_lr_on_plateau")),
        "gradient_accumulation_steps": dict(args=changed(gradient_accumulation_steps=3)),
        "optim": dict(args=changed(optim="adamw_bnb_8bit")),
        "acco_mode": dict(args=base, acco_mode="zero"),
        "acco_kwargs": dict(args=base, acco_kwargs={"mode": "sync"}),
        "optimizers": dict(args=base, optimizers=(torch.optim.SGD(tiny_llama().parameters(), lr=0.1), None)),
        "optimizer_cls_and_kwargs": dict(args=base, optimizer_cls_and_kwargs=(lambda: None, {})),
        "IterableDataset": dict(args=base, acco_accumulate_while_waiting=True, train_dataset=type(
            "Stream", (IterableDataset,), {"__iter__": lambda self: iter(examples)})()),
        # mode="local": its own arguments in another mode, and what it cannot honour.
        "sync_every": dict(args=base, acco_mode="acco", acco_kwargs={"sync_every": 2}),
        "sync_delay": dict(args=base, acco_mode="local", acco_kwargs={"sync_every": 2, "sync_delay": 3}),
        "overlap": dict(args=base, acco_mode="local", acco_kwargs={"overlap": "sometimes"}),
        "outer_bits": dict(args=base, acco_mode="local", acco_kwargs={"outer_bits": 3}),
        "outer_error_feedback": dict(args=base, acco_mode="dpu", acco_kwargs={"outer_error_feedback": False}),
        "param_dtype": dict(args=base, acco_mode="local", acco_kwargs={"param_dtype": torch.bfloat16}),
        "acco_accumulate_while_waiting": dict(args=base, acco_mode="local", acco_accumulate_while_waiting=True),
        # Replicas at different step counts would meet the Trainer's collectives at different times.
        "pacing": dict(args=base, acco_mode="local", acco_kwargs={"pacing": "speed"}),
    }
    messages = {}
    for name, kwargs in rejected.items():
        kwargs.setdefault("train_dataset", examples)
        try:
            AccoTrainer(model=tiny_llama(), **kwargs)
            messages[name] = "accepted"
        except ValueError as error:
            messages[name] = str(error)

    plain = AccoTrainer(model=tiny_llama(), args=training_args(f"{output_dir}/plain"), train_dataset=examples)
    plain.train()

    seen: dict = {}

    class Loaded(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            acco = resumed.acco_optimizer
            acco.eval()  # the committed parameters of update 3, all-gathered again after resharding
            seen["committed"] = params_of(model)
            acco.train()

    resumed = AccoTrainer(model=tiny_llama(seed=5), args=resume_args(f"{output_dir}/resumed"),
                          train_dataset=examples, callbacks=[Loaded()])
    resumed.train(resume_from_checkpoint=two_rank_checkpoint)

    class LoadedLocal(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["local_global"] = named_global_values(local.acco_optimizer, model)
            seen["local_live"] = params_of(model)

    local = local_trainer(f"{output_dir}/local", seed=5, callbacks=[LoadedLocal()])
    local.train(resume_from_checkpoint=local_checkpoint)

    bf16 = AccoTrainer(model=tiny_llama(), args=training_args(f"{output_dir}/bf16", bf16=True, max_steps=2),
                       train_dataset=examples)
    bf16.train()
    return {"bf16_loss": logged(bf16, "loss"), "bf16_dtypes": {p.dtype for p in bf16.model.parameters()},"rejected": messages, "plain_updates": plain.acco_optimizer.num_updates,
            "plain_loss": logged(plain, "loss"), "resumed_updates": resumed.acco_optimizer.num_updates,
            "committed_at_resume": seen["committed"],
            "checkpoint": load_file(f"{two_rank_checkpoint}/model.safetensors"),
            "local_global": seen["local_global"], "local_live": seen["local_live"],
            "local_checkpoint": load_file(f"{local_checkpoint}/model.safetensors"),
            "local_updates": local.acco_optimizer.num_updates, "local_params": params_of(local.model),
            "local_end": named_global_values(local.acco_optimizer, local.model)}


# --------------------------------------------------------------------------- tests


def test_sync_mode_equals_trainer_with_ddp(tmp_path) -> None:
    """AccoTrainer(sync) equals Trainer with DDP on 2 ranks (SGD unclipped, AdamW clipped): parameters,
    learning rates and logged grad norms; a DDP-wrapped model is refused."""
    results = run_fresh(sync_against_ddp_trainer, str(tmp_path))
    for rank_result in results:
        for optim in ("sgd", "adamw_torch"):
            ddp, acco = rank_result[optim]["ddp"], rank_result[optim]["acco"]
            assert ddp["wrapped"] == "DistributedDataParallel" and acco["wrapped"] == "LlamaForCausalLM"
            assert_params_close(acco["params"], ddp["params"], atol=ATOL)
            assert acco["lr"] == pytest.approx(ddp["lr"], rel=1e-12) and len(acco["lr"]) == 4
            # acco's grad norm (on the comm lane, before clipping) is the one DDP's Trainer logs.
            assert acco["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-4)
        assert max(rank_result["sgd"]["ddp"]["grad_norm"]) < 5.0  # never clipped
        assert min(rank_result["adamw_torch"]["ddp"]["grad_norm"]) > 0.5  # clipped at every update
        assert "DistributedDataParallel" in rank_result["guard"]
    assert_params_close(results[0]["adamw_torch"]["acco"]["params"], results[1]["adamw_torch"]["acco"]["params"],
                        rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["acco", "dpu"])
def test_matches_hand_written_loop_and_evaluates_committed_parameters(tmp_path, mode) -> None:
    """AccoTrainer(acco or dpu) equals the documented hand-written loop, and every evaluation and
    checkpoint holds the committed parameters of its update."""
    if not SEQUENTIAL_SAMPLING:
        pytest.skip("the hand-written loop needs the Trainer's data order: train_sampling_strategy='sequential'")
    results = run_fresh(acco_against_hand_loop, str(tmp_path), mode)
    for rank_result in results:
        assert rank_result["updates"] == 4 and rank_result["scheduler_updates"] == 4
        assert_params_close(rank_result["trainer"], rank_result["loop"], atol=ATOL)
        assert_params_close(rank_result["trainer"], rank_result["committed"][4], atol=ATOL)
        # Evaluations and checkpoints at step j hold the parameters of update j, never the
        # acco estimate (or dpu's previous parameters) the model computes at meanwhile.
        assert sorted(rank_result["evaluated"]) == [1, 2, 3, 4]
        for step, evaluated in rank_result["evaluated"].items():
            assert_params_close(evaluated, rank_result["committed"][step], atol=ATOL)
        for step, saved in rank_result["saved"].items():
            assert_params_close(saved, rank_result["committed"][step], atol=ATOL)
        # The LR each update was handed over with, as logged at its step.
        commits = rank_result["loop_lr"][1::2] if mode == "acco" else rank_result["loop_lr"]
        assert rank_result["trainer_lr"] == pytest.approx(commits, rel=1e-12)
        assert all(math.isfinite(loss) for loss in rank_result["eval_loss"])
    assert_params_close(results[0]["trainer"], results[1]["trainer"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """Two ranks: 6 updates uninterrupted, and the same run stopped at update 3."""
    directory = tmp_path_factory.mktemp("resume")
    return directory, run_fresh(train_then_stop, str(directory))


def test_resume_after_a_stop_is_exact_and_accumulate_while_waiting(stopped_run) -> None:
    """A run stopped at update 3 and resumed in new processes ends bit for bit where the uninterrupted
    run does; with a slow rank the fast one accumulates extra micro-batches and the ranks still
    agree."""
    directory, first = stopped_run
    assert [r["stopped_updates"] for r in first] == [3, 3]
    assert any(name.endswith(".distcp") for name in first[0]["acco_files"])
    second = run_fresh(resume_then_accumulate_while_waiting, str(directory))  # new processes: only files carry over
    for before, after in zip(first, second):
        assert after["resumed_updates"] == 6
        assert_params_close(after["resumed"], before["whole"], rtol=0, atol=0)
        assert after["resumed_lr"] == before["whole_lr"]  # the first 3 from the checkpoint's log history
        assert after["waiting_updates"] == 4
    # Rank 1 is slow: rank 0 computed extra micro-batches while rounds were in flight
    # (one is scheduled per round), and the ranks still agree on every parameter.
    assert max(second[0]["micro_batches"]) > 1 and second[0]["extra"][-1] > 0
    assert all(0.0 <= share <= 1.0 for share in second[0]["hidden"])
    assert_params_close(second[0]["waiting"], second[1]["waiting"], rtol=0, atol=0)


def test_one_process_rejected_settings_and_resume_from_two_ranks(stopped_run, local_run, tmp_path) -> None:
    """Without torchrun: unsupported settings are refused naming the argument, a plain and a bf16 run
    train, a 2-rank checkpoint resumes on 1 rank at its committed parameters, and a 2-replica
    local-mode one by the documented rule (the global values, and rank 0's replica)."""
    directory, first = stopped_run
    checkpoint = str(directory / "stopped" / "checkpoint-3")
    local_directory, local = local_run
    (result,) = run_fresh(one_process, str(tmp_path), checkpoint, str(local_directory / "whole" / "checkpoint-2"),
                          world_size=1, torchrun=False)
    for name, message in result["rejected"].items():
        assert message != "accepted", name
        assert name in message, (name, message)
    assert result["plain_updates"] == 4 and all(math.isfinite(x) for x in result["plain_loss"])
    # bf16 autocast as with Trainer(bf16=True): fp32 parameters, the forward pass in bf16.
    assert result["bf16_dtypes"] == {torch.float32} and all(math.isfinite(x) for x in result["bf16_loss"])
    # Resharded from 2 ranks to 1: the update in flight at the checkpoint is the committed
    # model saved beside it; training then goes on to the end.
    assert_params_close(result["committed_at_resume"], result["checkpoint"], rtol=0, atol=0)
    assert result["resumed_updates"] == 6
    assert first[0]["stopped_updates"] == 3
    # 2 replicas -> 1: the global values resharded, the replica rank 0's; then on to the end.
    assert_params_close(result["local_global"], result["local_checkpoint"], rtol=0, atol=0)
    assert_params_close(result["local_live"], local[0]["live"][2], rtol=0, atol=0)
    assert result["local_updates"] == 6
    assert_params_close(result["local_params"], result["local_end"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    """Two replicas: AccoTrainer(acco_mode="local"), checkpoints at 2, 4 and 6."""
    directory = tmp_path_factory.mktemp("local")
    return directory, run_fresh(local_steps, str(directory))


def test_local_mode_trains_evaluates_global_values_and_resumes_exactly(local_run) -> None:
    """AccoTrainer(acco_mode="local") on 2 ranks: the loss falls, no DDP, one inner update per Trainer
    step; evaluations and checkpoints hold the global values while the replicas differ; every rank
    ends at the same parameters; a resume from a checkpoint with a round in flight ends where the
    uninterrupted run does."""
    directory, whole = local_run
    for result in whole:
        assert result["wrapped"] == "LlamaForCausalLM"
        assert result["updates"] == result["steps"] == 6 and result["outer"] == 3  # landed at 3, 5, and by finish()
        assert len(result["loss"]) == 6 and max(result["loss"][-2:]) < min(result["loss"][:2])
        assert len(result["eval_loss"]) == 2 and all(math.isfinite(x) for x in result["eval_loss"])
        assert math.isfinite(result["after_training"])
        assert_params_close(result["params"], result["global_values"], rtol=0, atol=0)
        # Evaluations and checkpoints: the global values of the last landed round (at 6 and 4 this
        # replica's own parameters have moved on; at 3 a round has just landed).
        for step, evaluated in result["evaluated"].items():
            assert_params_close(evaluated, result["global_at"][step], rtol=0, atol=0)
        assert sorted(result["evaluated"]) == [3, 6]
        for step, saved in result["saved"].items():
            assert_params_close(saved, result["global_at"][step], rtol=0, atol=0)
        assert not torch.equal(result["live"][4]["model.norm.weight"], result["global_at"][4]["model.norm.weight"])
        # Logs: the outer rounds landed so far (one at 3, one at 5), and their bytes.
        assert result["outer_rounds"] == [0, 0, 1, 1, 2, 2]
        assert sum(result["outer_bytes"]) > 0 and all(0.0 <= h <= 1.0 for h in result["hidden"])
    # The replicas differ between rounds, and end identical.
    assert not torch.equal(whole[0]["live"][4]["model.norm.weight"], whole[1]["live"][4]["model.norm.weight"])
    assert_params_close(whole[0]["params"], whole[1]["params"], rtol=0, atol=0)
    resumed = run_fresh(local_steps_resumed, str(directory))  # new processes: only files carry over
    for before, after in zip(whole, resumed):
        assert after["updates"] == 6 and after["outer"] == 3
        assert after["loss"] == before["loss"]  # the first 2 from the checkpoint's log history, the rest recomputed
        assert_params_close(after["params"], before["params"], rtol=0, atol=0)  # bit for bit (integer sync_delay)


@pytest.mark.parametrize("mode", ["acco", "dpu", "sync"])
def test_optimizer_eval_shows_the_update_in_flight_and_train_restores(mode) -> None:
    """AccoOptimizer.eval()/train(), what AccoTrainer relies on, in a plain loop (one process)."""
    from acco import AccoOptimizer, RoundKind

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = AccoOptimizer(model, torch.optim.AdamW, mode=mode, lr=0.1)
    swaps = 0
    for _ in range(7):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.accumulate()
        opt.step()
        live = params_of(model)
        opt.eval()
        shown = params_of(model)
        opt.eval()  # idempotent
        assert_params_close(params_of(model), shown, rtol=0, atol=0)
        opt.train()
        assert_params_close(params_of(model), live, rtol=0, atol=0)
        if opt.in_flight is RoundKind.COMMIT:
            swaps += 1
            assert any(not torch.equal(live[n], shown[n]) for n in live)  # an estimate (or dpu's lag) was showing
            # What eval() shows is what the next step() lands; after that step() the copy
            # eval() set aside is stale, and train() must leave the model as it is.
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.accumulate()
            opt.eval()
            opt.step()
            opt.train()
            assert_params_close(params_of(model), shown, rtol=0, atol=0)
    opt.finish()
    assert swaps > 0 if mode != "sync" else swaps == 0
