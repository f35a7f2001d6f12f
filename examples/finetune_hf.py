"""Instruction-tune a causal LM with transformers' Trainer and acco: AccoTrainer.

Two processes on CPU (gloo), a few minutes on a 2-core machine, no download:

    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py

Compare the modes (same samples, same committed updates, same schedule):

    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py --mode sync
    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py --mode dpu

Local steps (each rank trains its own replica; an outer round averages them every
``--sync-every`` updates, behind the next ones), and plain ``transformers.Trainer`` (DDP) for
comparison, each for the same training time:

    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py --mode local --time-budget 60 --max-steps 1000
    torchrun --standalone --nproc_per_node=2 examples/finetune_hf.py --mode trainer --time-budget 60 --max-steps 1000

Your model and data (a local Hugging Face causal LM directory; an Alpaca-style JSON or
JSONL file of ``{"instruction", "input", "output"}`` records), on GPUs (nccl):

    torchrun --standalone --nproc_per_node=8 examples/finetune_hf.py \\
        --model path/to/model --data alpaca.json --device cuda --bf16

A single process (no torchrun, no torch.distributed):

    python examples/finetune_hf.py --max-steps 20

With no ``--model``, a small Llama is built from a config, with a byte-level BPE tokenizer
trained in seconds on the instruction set; with no ``--data``, the instruction set comes
from the docstrings of Python's standard library ("Describe what the function
`pathlib.Path.chmod` does." with its signature as input -> the docstring's first
paragraph). Every prompt token (instruction, input, the template) is masked out of the loss:
only the response is learnt. 5% of the records are held out for the eval loss.

Defaults follow the ACCO paper's fine-tuning set-up where it fits: AdamW with betas
(0.9, 0.95), no weight decay, a cosine schedule, and lr 2e-5 for a pretrained ``--model``
(the small model built from scratch needs a larger one, 1e-3). One update covers
``--grad-accum`` micro-batches of ``--batch-size`` records per rank in every mode; in
``acco`` mode that is two rounds of half as many. Checkpoints every ``--save-steps``
updates go to ``--output-dir``; ``--resume`` continues from the newest one, at any number of
processes.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import math
import os
import random
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback

from acco.integrations.hf import AccoTrainer

PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
EVAL_FRACTION = 0.05
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "__pycache__"}


# ----------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--mode", choices=["acco", "dpu", "sync", "local", "trainer"], default="acco",
        help="AccoTrainer's acco_mode, or trainer: plain transformers.Trainer (DDP), for comparison")
    add("--sync-every", type=int, default=None, help="--mode local: updates per outer round (default: acco's)")
    add("--sync-delay", default=None, help="--mode local: updates an outer round overlaps, or auto (default: acco's)")
    add("--model", default=None, help="a local Hugging Face causal LM directory (default: a small Llama from scratch)")
    add("--data", default=None, help="Alpaca-style .json or .jsonl (default: built from the stdlib's docstrings)")
    add("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    add("--backend", default=None, help="torch.distributed backend (default: gloo on cpu, nccl on cuda)")
    add("--output-dir", default="runs/finetune_hf")
    add("--seq-len", type=int, default=128, help="records are cut to this many tokens")
    add("--batch-size", type=int, default=8, help="records per micro-batch, per rank")
    add("--grad-accum", type=int, default=4, help="micro-batches per update, per rank (even for --mode acco)")
    add("--max-steps", type=int, default=100, help="committed optimizer updates")
    add("--lr", type=float, default=None, help="peak learning rate (default: 2e-5 with --model, 1e-3 without)")
    add("--warmup-steps", type=int, default=None, help="default: 0 with --model, 5%% of the updates without")
    add("--weight-decay", type=float, default=0.0)
    add("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    add("--eval-steps", type=int, default=25, help="evaluate every this many updates")
    add("--eval-records", type=int, default=128, help="held-out records to evaluate on")
    add("--save-steps", type=int, default=0, help="checkpoint every this many updates (0: only at the end)")
    add("--resume", action="store_true", help="resume from the newest checkpoint in --output-dir")
    add("--bf16", action="store_true", help="bf16 autocast, as Trainer's bf16=True")
    add("--accumulate-while-waiting", action="store_true",
        help="keep computing extra micro-batches while a round is in flight (each update covers more samples)")
    add("--max-records", type=int, default=6000, help="at most this many records from the stdlib (default data)")
    add("--seed", type=int, default=1234)
    add("--timeout", type=float, default=300, help="seconds before a stuck collective fails")
    add("--time-budget", type=float, default=None,
        help="stop after this many seconds of training (evaluations excluded), at the next log step")
    args = parser.parse_args(argv)
    if args.mode != "local" and (args.sync_every is not None or args.sync_delay is not None):
        parser.error("--sync-every and --sync-delay need --mode local")
    if args.sync_delay is not None and args.sync_delay not in ("auto", "half"):
        args.sync_delay = int(args.sync_delay)
    if args.accumulate_while_waiting and args.mode in ("local", "trainer"):
        parser.error(f"--accumulate-while-waiting does not apply to --mode {args.mode}")
    if args.mode == "acco" and args.grad_accum % 2:
        parser.error("--mode acco splits an update into two rounds: --grad-accum must be even")
    if args.model is not None and not Path(args.model).is_dir():
        parser.error(f"--model {args.model}: not a directory (a local Hugging Face model is expected)")
    if args.data is not None and not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")
    if args.lr is None:
        args.lr = 2e-5 if args.model else 1e-3
    if args.warmup_steps is None:
        args.warmup_steps = 0 if args.model else max(1, args.max_steps // 20)
    return args


# --------------------------------------------------------------------------- distributed


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    backend: str | None


def setup_distributed(device: str, backend: str | None, timeout: datetime.timedelta) -> Dist:
    """Join the process group when launched by torchrun (``RANK`` is set); else one process.
    The Trainer then uses this group."""
    if "RANK" not in os.environ:
        return Dist(0, 1, None)
    if device == "cpu":
        # Every rank on one machine shares its cores: don't oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    dist.init_process_group(backend=backend, timeout=timeout)
    return Dist(dist.get_rank(), dist.get_world_size(), backend)


def print0(ctx: Dist, *values: object) -> None:
    if ctx.rank == 0:
        print(*values, flush=True)


# ---------------------------------------------------------------------------------- data


def stdlib_records(max_records: int, seed: int) -> list[dict[str, str]]:
    """Instruction records from the documented public functions and classes of Python's
    standard library (parsed, never imported), shuffled with ``seed``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    records = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(f for f in files if f.endswith(".py")):
            path = Path(directory, name)
            module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            records += _documented(tree, module)
    random.Random(seed).shuffle(records)
    return records[:max_records]


def _documented(tree: ast.Module, module: str) -> Iterator[dict[str, str]]:
    for node in tree.body:
        for child in [node, *(node.body if isinstance(node, ast.ClassDef) else [])]:
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            docstring = ast.get_docstring(child)
            if not docstring or child.name.startswith("_"):
                continue
            summary = " ".join(docstring.split("\n\n")[0].split())
            if not 10 <= len(summary) <= 300:
                continue
            owner = f"{node.name}." if child is not node else ""
            qualified = f"{module}.{owner}{child.name}"
            if isinstance(child, ast.ClassDef):
                yield {"instruction": f"Describe what the class `{qualified}` is for.",
                       "input": f"class {child.name}", "output": summary}
            else:
                yield {"instruction": f"Describe what the function `{qualified}` does.",
                       "input": f"def {child.name}({ast.unparse(child.args)})", "output": summary}


def load_records(path: str) -> list[dict[str, str]]:
    """Alpaca-style records from a JSON list or JSONL file; ``input`` may be missing."""
    text = Path(path).read_text(encoding="utf-8")
    records = json.loads(text) if text.lstrip().startswith("[") else [json.loads(l) for l in text.splitlines() if l.strip()]
    for number, record in enumerate(records):
        if not isinstance(record, dict) or not {"instruction", "output"} <= set(record):
            raise SystemExit(f"{path}: record {number} needs 'instruction' and 'output' (and optionally 'input')")
    return records


def prompt_of(record: dict[str, str]) -> str:
    template = PROMPT if record.get("input") else PROMPT_NO_INPUT
    return template.format(instruction=record["instruction"], input=record.get("input", ""))


def train_tokenizer(records: list[dict[str, str]], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the records' own text (seconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator((prompt_of(r) + r["output"] for r in records), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def tokenize(records: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, seq_len: int) -> list[dict[str, list[int]]]:
    """input_ids = prompt + response + eos, cut to ``seq_len``; labels = -100 on the prompt."""
    examples = []
    for record in records:
        prompt = tokenizer(prompt_of(record), add_special_tokens=False)["input_ids"]
        response = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if tokenizer.bos_token_id is not None:
            prompt = [tokenizer.bos_token_id] + prompt
        ids = (prompt + response)[:seq_len]
        labels = ([-100] * len(prompt) + response)[:seq_len]
        if any(label != -100 for label in labels[1:]):  # something of the response is left to learn
            examples.append({"input_ids": ids, "labels": labels})
    return examples


@dataclass
class PadCollator:
    """Pads a micro-batch to its longest record: padding is masked out of attention and loss."""

    pad_id: int

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        length = max(len(e["input_ids"]) for e in examples)
        ids = torch.full((len(examples), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(examples), length), -100, dtype=torch.long)
        mask = torch.zeros((len(examples), length), dtype=torch.long)
        for row, example in enumerate(examples):
            n = len(example["input_ids"])
            ids[row, :n] = torch.tensor(example["input_ids"])
            labels[row, :n] = torch.tensor(example["labels"])
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def small_llama(vocab_size: int, seq_len: int, tokenizer: PreTrainedTokenizerBase, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)  # the same initial model on every rank (acco also broadcasts rank 0's)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=seq_len, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


# ---------------------------------------------------------------------------- progress


class Progress(TrainerCallback):
    """Rank 0 prints one line per log: loss, learning rate, acco's telemetry, eval loss."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.start = time.perf_counter()
        self.first_step = 0
        self.extra_micro_batches = 0.0
        self.eval_losses: list[tuple[int, float]] = []

    def on_train_begin(self, args, state, control, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.first_step = state.global_step  # > 0 when resumed

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:  # type: ignore[no-untyped-def]
        logs = logs or {}
        self.extra_micro_batches = logs.get("acco_extra_micro_batches", self.extra_micro_batches)
        if "eval_loss" in logs:
            self.eval_losses.append((state.global_step, logs["eval_loss"]))
        if not state.is_world_process_zero:
            return
        if "eval_loss" in logs:
            print(f"update {state.global_step:4d} | eval loss {logs['eval_loss']:.4f}", flush=True)
        elif "loss" in logs:
            parts = [f"update {state.global_step:4d}/{self.max_steps}", f"train loss {logs['loss']:.4f}",
                     f"lr {logs.get('learning_rate', math.nan):.2e}"]
            if "grad_norm" in logs:
                parts.append(f"grad norm {logs['grad_norm']:.3f}")
            if "acco_hidden_share" in logs:
                parts.append(f"comm hidden {logs['acco_hidden_share']:4.0%}")
            if "acco_micro_batches_per_round" in logs:
                parts.append(f"micro-batches/round {logs['acco_micro_batches_per_round']:.1f}")
            if "acco_outer_rounds" in logs:
                parts.append(f"outer rounds {logs['acco_outer_rounds']:.0f}")
            parts.append(f"{self.elapsed():6.1f} s")
            print(" | ".join(parts), flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class TimeBudget(TrainerCallback):
    """Stops training once ``seconds`` of training have passed (from the first step,
    evaluations excluded), with a final evaluation. Checked at each log step: the ranks agree
    through one all-reduce there, so they stop at the same step."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start: float | None = None
        self.evaluating = 0.0  # seconds spent in evaluations since the start
        self.trained = 0.0  # seconds of training when it stopped

    def on_step_begin(self, args, state, control, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if self.start is None:
            self.start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if self.start is not None:
            self.evaluating += (logs or {}).get("eval_runtime", 0.0)

    def on_step_end(self, args, state, control, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if state.global_step % args.logging_steps:
            return
        self.trained = time.perf_counter() - (self.start or 0.0) - self.evaluating
        over = torch.tensor([float(self.trained >= self.seconds)])
        if dist.is_initialized():
            dist.all_reduce(over, op=dist.ReduceOp.MAX)
        if over.item():
            control.should_training_stop = True
            control.should_evaluate = True


# ------------------------------------------------------------------------------ training


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = setup_distributed(args.device, args.backend, datetime.timedelta(seconds=args.timeout))
    try:
        train(args, ctx)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(args: argparse.Namespace, ctx: Dist) -> None:
    records = load_records(args.data) if args.data else stdlib_records(args.max_records, args.seed)
    cut = len(records) - max(1, int(len(records) * EVAL_FRACTION))
    train_records, held_out = records[:cut], records[cut:][: args.eval_records]

    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    else:
        # Rank 0 trains the tokenizer; the others load it, so every rank has the same one.
        tokenizer_dir = Path(args.output_dir) / "tokenizer"
        if ctx.rank == 0 and not (tokenizer_dir / "tokenizer.json").is_file():
            train_tokenizer(train_records, vocab_size=4096).save_pretrained(tokenizer_dir)
        if dist.is_initialized():
            dist.barrier()
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
        model = small_llama(len(tokenizer), args.seq_len, tokenizer, args.seed)
    train_set = tokenize(train_records, tokenizer, args.seq_len)
    eval_set = tokenize(held_out, tokenizer, args.seq_len)

    training_args = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=args.device == "cpu",
        ddp_backend=ctx.backend,
        bf16=args.bf16,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.max_steps,
        optim="adamw_torch",
        learning_rate=args.lr,
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=args.weight_decay,
        lr_scheduler_type="cosine",
        warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        eval_on_start=not args.resume,
        logging_steps=max(1, min(args.eval_steps // 5, 10)),
        save_strategy="steps",
        save_steps=args.save_steps or args.max_steps,
        save_total_limit=2,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_timeout=int(args.timeout),
        seed=args.seed,
    )
    samples_per_update = args.batch_size * args.grad_accum * ctx.world_size
    progress = Progress(args.max_steps)
    budget = TimeBudget(args.time_budget) if args.time_budget is not None else None
    common = dict(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set,
                  data_collator=PadCollator(tokenizer.pad_token_id), processing_class=tokenizer,
                  callbacks=[progress] + ([budget] if budget else []))
    if args.mode == "trainer":
        trainer = Trainer(**common)
    else:
        local = {"sync_every": args.sync_every, "sync_delay": args.sync_delay}
        trainer = AccoTrainer(**common, acco_mode=args.mode, acco_accumulate_while_waiting=args.accumulate_while_waiting,
                              acco_kwargs={name: value for name, value in local.items() if value is not None})
    trainer.remove_callback(PrinterCallback)  # Progress prints rank 0's lines instead of every log dict
    print0(
        ctx,
        f"mode {args.mode} | {ctx.world_size} rank(s) on {args.device} | "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters | "
        f"{len(train_set):,} train + {len(eval_set):,} held-out records | {args.max_steps} updates x "
        f"{args.grad_accum} micro-batches x {args.batch_size} records x {ctx.world_size} rank(s) | "
        f"{args.grad_accum // 2 if args.mode == 'acco' else args.grad_accum} micro-batches per round",
    )
    resume = args.resume and any(Path(args.output_dir).glob("checkpoint-*"))
    started = time.perf_counter()
    output = trainer.train(resume_from_checkpoint=True if resume else None)
    seconds = time.perf_counter() - started
    # The Trainer evaluates after the last update (a step-based eval strategy always does).
    first = progress.eval_losses[0][1] if progress.eval_losses else math.nan
    final = progress.eval_losses[-1][1] if progress.eval_losses else math.nan
    samples = samples_per_update * (output.global_step - progress.first_step)
    extra = (f" + {progress.extra_micro_batches * args.batch_size:,.0f} extra on rank 0 while waiting"
             if args.accumulate_while_waiting else "")
    print0(ctx, f"{output.global_step - progress.first_step} updates, {samples:,} samples{extra} in {seconds:.1f} s "
                f"({samples / seconds:.1f} samples/s, evaluation included)")
    print0(ctx, f"eval loss {first:.4f} -> {final:.4f}")
    if budget is not None:  # the model train() ended with (local mode: after finish()'s last outer round)
        print0(ctx, f"time budget {budget.seconds:.0f} s: {output.global_step} updates in {budget.trained:.1f} s of "
                    f"training | eval loss after training {trainer.evaluate()['eval_loss']:.4f}")
    trainer.save_model(str(Path(args.output_dir) / "final"))


if __name__ == "__main__":
    main()
