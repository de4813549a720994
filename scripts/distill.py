"""`selfdraft distill`: self-distillation data - the target rewrites the assistant turns of a source,
or (--synthesize N) writes its own prompts and answers them.

The JSONL it writes (resumable: rerun the same command after a kill) is a training source as is:
list it under `data.sources` in a run config.
"""

from __future__ import annotations

import argparse
import math

from selfdraft.errors import UserError
from selfdraft.scripts.options import add_device_argument, check_counts, resolve_device

BATCH, VLLM_BATCH = 8, 256
# the options of --synthesize, with their defaults: given without it, they would do nothing
SYNTH_DEFAULTS = {
    "--synth-temperature": 1.0,
    "--synth-top-p": 0.95,
    "--synth-chunk": 32,
    "--synth-max-tokens": 128,
    "--answer-temperatures": [0.0, 1.0],
    "--synth-system": None,
}
SYNTH_FLAGS = tuple(SYNTH_DEFAULTS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--source", default="sharegpt:200", help="sharegpt[:N], a JSONL file or a dataset")
    parser.add_argument("--out", required=True, help="JSONL file to append regenerated conversations to")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="conversations per durable append (default 8; 256 with --generator vllm, which schedules "
        "them all at once)",
    )
    parser.add_argument(
        "--heldout-fraction",
        type=float,
        default=0.02,
        help="skip the records of the held-out split (the benchmarks' prompts); use the runs' value",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="skip turns whose prompt is longer (a long prompt costs the whole batch; training "
        "sequences are cut at data.max_length anyway); default: the context minus --max-new-tokens",
    )
    parser.add_argument(
        "--first-turns", action="store_true", help="regenerate only each conversation's first answer"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy answers; > 0: answers sampled from the target at this temperature, "
        "seeded per record and turn (--seed), so a resumed build draws the same ones",
    )
    parser.add_argument("--seed", type=int, default=0, help="the sampled answers' base seed")
    parser.add_argument(
        "--multi-turn",
        action="store_true",
        help="only conversations with two or more user turns, every turn answered after the target's "
        "own earlier answers (first-turn builds already cover single exchanges)",
    )
    parser.add_argument(
        "--synthesize",
        type=int,
        default=None,
        metavar="N",
        help="no source: the target writes N prompts itself (its chat template up to a user turn, sampled "
        "at --synth-temperature/--synth-top-p), de-duplicated and filtered, each answered at every "
        "--answer-temperatures entry; prompts go to OUT's .prompts file; rerun to resume",
    )
    parser.add_argument("--synth-temperature", type=float, default=SYNTH_DEFAULTS["--synth-temperature"])
    parser.add_argument("--synth-top-p", type=float, default=SYNTH_DEFAULTS["--synth-top-p"])
    parser.add_argument(
        "--synth-chunk", type=int, default=SYNTH_DEFAULTS["--synth-chunk"], help="prompts sampled per resumable chunk"
    )
    parser.add_argument(
        "--synth-max-tokens",
        type=int,
        default=SYNTH_DEFAULTS["--synth-max-tokens"],
        help="a sampled prompt longer than this is dropped",
    )
    parser.add_argument(
        "--synth-system",
        default=SYNTH_DEFAULTS["--synth-system"],
        help="a system turn the target sees while it writes prompts (not while it answers them), to steer "
        "what it asks, e.g. 'You help people write and debug Python.' for coding requests; default: its "
        "template's own",
    )
    parser.add_argument(
        "--answer-temperatures",
        type=float,
        nargs="+",
        default=SYNTH_DEFAULTS["--answer-temperatures"],
        help="with --synthesize",
    )
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="the target's dtype while it generates (auto: bf16 on CUDA and on CPUs with native bf16)",
    )
    parser.add_argument(
        "--generator",
        "--engine",
        choices=("auto", "selfdraft", "target", "vllm"),
        default="auto",
        help="selfdraft: batched speculative generation with the shipped heads (a finished answer leaves "
        "the batch; the same greedy answers, exact in fp32); target: the target's own batched generate; "
        "vllm: vLLM's continuous batching (~4.5x the target's generate on a CPU; installed in "
        ".venv-vllm by `make check-vllm`; greedy answers equal up to low-precision near-ties); "
        "auto (default): selfdraft where heads are shipped for --target, else target",
    )
    add_device_argument(parser)


def run(args: argparse.Namespace) -> int:
    from selfdraft.corpora.sources import load_source
    from selfdraft.destinations import check_destination
    from selfdraft.training.data.distill import ROW_LOG, regenerate_assistant_turns
    from selfdraft.training.data.rowlog import check_row_log
    from selfdraft.training.data.synthesize import PROMPTS_LOG, prompts_path

    _check_numbers(args)
    if not 0 <= args.heldout_fraction < 1:
        raise UserError(
            f"--heldout-fraction {args.heldout_fraction} is outside [0, 1): pass the runs' value, e.g. 0.02"
        )
    # --out is appended to (a rerun resumes), so an existing file is fine; the source never is
    check_destination(args.out, [args.source], overwrite=True, option="--out", is_file=True, creates_folder=True)
    # an existing --out is resumed: it must be a log this command wrote, or it is refused untouched
    check_row_log(args.out, what=ROW_LOG)
    if args.synthesize is not None:
        check_row_log(prompts_path(args.out), key="chunk", what=PROMPTS_LOG)
    if args.multi_turn and args.first_turns:
        raise UserError("--multi-turn and --first-turns contradict each other; pass one")
    if args.synthesize is not None and args.synthesize < 1:
        raise UserError(f"--synthesize {args.synthesize}: pass the number of prompts to write, e.g. 2000")
    if args.generator == "vllm":
        from selfdraft.bench.vllm_engine import require_vllm

        require_vllm("--generator vllm")  # before any work
    if args.batch_size is None:
        args.batch_size = VLLM_BATCH if args.generator == "vllm" else BATCH
    device = resolve_device(args.device)
    records = None
    if args.synthesize is None:  # the source is read before the model loads: a bad one fails at once
        records = [r for r in load_source(args.source) if "messages" in r]
        if args.multi_turn:
            records = [r for r in records if user_turns(r) >= 2]
        if not records:
            raise UserError(f"{args.source} has no chat records to regenerate")
    model, tokenizer = _load_generator(args, device)
    if records is None:
        return _synthesize(args, model, tokenizer)
    out = regenerate_assistant_turns(
        model,
        tokenizer,
        records,
        args.out,
        args.max_new_tokens,
        args.batch_size,
        heldout_fraction=args.heldout_fraction,
        first_turns=args.first_turns,
        max_prompt_tokens=args.max_prompt_tokens,
        temperature=args.temperature,
        seed=args.seed,
    )
    print(f"wrote {out}")
    return 0


def _load_generator(args: argparse.Namespace, device: str):
    """(what answers, its tokenizer) for --generator: a vLLM engine, selfdraft with the shipped heads,
    or the target itself."""
    from transformers import AutoTokenizer

    from selfdraft.target import load_target, resolve_target_path
    from selfdraft.training.config import resolve_precision
    from selfdraft.training.data.distill import load_vllm_target, resolve_generator

    dtype = resolve_precision(args.precision, device)
    generator = resolve_generator(args.generator, args.target)
    if generator == "vllm":
        return load_vllm_target(args.target, dtype), AutoTokenizer.from_pretrained(resolve_target_path(args.target))
    if generator == "selfdraft":
        from selfdraft.inference import SelfDraftModel

        model = SelfDraftModel.from_pretrained(args.target, dtype=dtype, device=device)
        return model, model.tokenizer
    return load_target(args.target, dtype=dtype, device=device)


def _check_numbers(args: argparse.Namespace) -> None:
    """Every count and temperature, before any work (one line naming the flag and the fix)."""
    check_counts(
        {
            "--max-new-tokens": args.max_new_tokens,
            "--batch-size": args.batch_size,
            "--max-prompt-tokens": args.max_prompt_tokens,
            "--synth-chunk": args.synth_chunk,
            "--synth-max-tokens": args.synth_max_tokens,
        }
    )
    temperatures = {"--temperature": [args.temperature], "--answer-temperatures": args.answer_temperatures}
    for flag, values in temperatures.items():
        for t in values:
            if not math.isfinite(t) or t < 0:
                raise UserError(f"{flag} {t}: pass 0 (greedy) or a positive, finite temperature")
    if not (math.isfinite(args.synth_temperature) and args.synth_temperature > 0):
        raise UserError(f"--synth-temperature {args.synth_temperature}: prompts are sampled; pass e.g. 1.0")
    if not 0 < args.synth_top_p <= 1:
        raise UserError(f"--synth-top-p {args.synth_top_p}: pass a value in (0, 1], e.g. 0.95")
    if args.synthesize is None:
        given = [f for f in SYNTH_FLAGS if getattr(args, f.lstrip("-").replace("-", "_")) != SYNTH_DEFAULTS[f]]
        if given:
            raise UserError(f"{', '.join(given)} only apply with --synthesize N; drop them or add --synthesize")


def user_turns(record: dict) -> int:
    return sum(1 for m in record["messages"] if m["role"] == "user")


def _synthesize(args: argparse.Namespace, model, tokenizer) -> int:
    from selfdraft.training.data.synthesize import SynthesisConfig, prompts_path, synthesize

    config = SynthesisConfig(
        prompts=args.synthesize,
        chunk=args.synth_chunk,
        temperature=args.synth_temperature,
        top_p=args.synth_top_p,
        max_prompt_tokens=args.synth_max_tokens,
        answer_temperatures=tuple(args.answer_temperatures),
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        seed=args.seed,
        heldout_fraction=args.heldout_fraction,
        system=args.synth_system,
    )
    stats = synthesize(model, tokenizer, args.out, config)
    print(f"synthesis: {stats}")
    print(f"wrote {args.out} and {prompts_path(args.out)}")
    return 0
