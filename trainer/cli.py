"""``trainer fit | tune | configs | print-config | explain | prepare | sample | plot | export``: the argparse
front end.

User errors (config, overrides, files, checkpoints) print one paragraph to stderr and exit 2,
with no traceback (``TRAINER_DEBUG=1`` shows it). Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from trainer import console

EXIT_USER_ERROR = 2
EXIT_TRAINING_FAILED = 1

USAGE_EXAMPLES = """examples:
  trainer configs
  trainer fit tiny
  trainer fit configs/tiny.yaml optim.lr=3e-4 train.steps=500
  trainer fit configs/tiny.yaml resume=last
  torchrun --nproc-per-node 2 -m trainer fit configs/gpt2-small-ddp.yaml
  torchrun --nproc-per-node 2 --max-restarts 3 -m trainer fit configs/gpt2-small-ddp.yaml resume=auto
  trainer print-config configs/tiny.yaml
  trainer explain --memory configs/llama-1b.yaml
  trainer tune configs/llama-1b.yaml train.grad_accum=16 --budget-s 420
  trainer plot runs/tiny runs/tiny-lr3e-4
  trainer prepare --out data/stdlib-bpe
  trainer fit configs/llama-1b.yaml data.path=data/stdlib-bpe
  trainer sample runs/tiny --prompt "def "
  trainer export runs/llama out/llama
"""


CONFIG_HELP = "YAML config file, or the name of a shipped config (trainer configs lists them)"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: exit 2, with the usage line
        # argparse names a trailing nargs="*" positional among the missing ones when an earlier one is missing
        # (`trainer fit` alone: "required: config, overrides"); the overrides are optional.
        message = message.replace("config, overrides", "config")
        self.print_usage(sys.stderr)
        sys.stderr.write(f"trainer: error: {message}\n")
        sys.exit(EXIT_USER_ERROR)


def _number(cast: type, expected: str, *, least: float | None = None, above: float | None = None, below=None):
    """An argparse ``type`` for a numeric flag: the argument as ``cast`` (int or float), refused (exit 2, saying
    ``expected``) unless it is a finite number, at least ``least``, above ``above`` and below ``below`` where given.
    Finite first: nan compares false with every bound, so a check such as ``x <= 0`` alone lets it through."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        inside = value is not None and math.isfinite(value)
        inside = inside and (least is None or value >= least) and (above is None or value > above)
        if not (inside and (below is None or value < below)):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="trainer",
        description="Train PyTorch models from a YAML config, with the whole step compiled.",
        epilog=USAGE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    over = (
        "key=value overrides (later wins), e.g. optim.lr=3e-4; resume=last|PATH resumes, resume=auto resumes "
        "if there is a checkpoint (fit only)"
    )
    f = sub.add_parser("fit", help="train from a config")
    f.add_argument("config", help=CONFIG_HELP)
    f.add_argument("overrides", nargs="*", help=over)
    sub.add_parser("configs", help="list the configs shipped with trainer")
    pc = sub.add_parser("print-config", help="print the resolved config with each field's help")
    pc.add_argument("config", nargs="?", help=CONFIG_HELP + "; omit it for the defaults")
    pc.add_argument("overrides", nargs="*", help=over)
    pc.add_argument("--no-help", action="store_true", help="plain YAML without the help comments")
    e = sub.add_parser("explain", help="run a few compiled steps and print the compile report")
    e.add_argument("config", help=CONFIG_HELP)
    e.add_argument("overrides", nargs="*", help=over)
    steps = _number(int, "a positive whole number of steps", least=1)
    e.add_argument("--steps", type=steps, default=3, help="steps to run (default 3)")
    e.add_argument("--dump-code", metavar="DIR", help="write the code Inductor generated, per graph, into DIR")
    e.add_argument("--verbose", action="store_true", help="also list the kernel patterns nearly matched, and why not")
    e.add_argument(
        "--memory",
        action="store_true",
        help="predict the peak memory per rank, by part, from each checkpointing mode's traced step (no GPU "
        "needed), and the largest micro-batch that fits",
    )
    e.add_argument("--gpu", help="with --memory: the GPU to fit (h100, h200, or a size in GB; default: this one's)")
    e.add_argument("--world", type=steps, help="with --memory: the number of GPUs (default: torchrun's, or 1)")
    e.add_argument(
        "--micro-batches", metavar="B,B,...", help="with --memory: the micro-batches to predict (e.g. 4,16,32)"
    )
    e.add_argument("--json", action="store_true", help="with --memory: print the prediction as JSON")
    e.add_argument(
        "--measure",
        action="store_true",
        help="with --memory: measure short runs of each mode instead (on the GPU: calibration)",
    )
    t = sub.add_parser(
        "tune",
        help="find the fastest micro-batch, checkpointing, bucket size and precision by "
        "measurement; writes CONFIG.tuned.yaml",
    )
    t.add_argument("config", help=CONFIG_HELP)
    t.add_argument("overrides", nargs="*", help="key=value overrides, applied before the search")
    budget = _number(float, "a positive finite number of seconds", above=0)
    t.add_argument("--budget-s", type=budget, default=600.0, help="wall-clock seconds to spend (default 600)")
    pl = sub.add_parser("plot", help="plot loss, tokens/s and lr of one or more runs to a PNG")
    pl.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (holding metrics.jsonl)")
    pl.add_argument("-o", "--out", help="PNG path (default: <first run>/plot.png)")
    pr = sub.add_parser("prepare", help="tokenize text into a data directory (train.bin, val.bin, meta.json)")
    pr.add_argument(
        "sources",
        nargs="*",
        metavar="SOURCE",
        help="text files, directories of them, .jsonl, .parquet, hf:NAME (a Hugging Face dataset), or "
        "stdlib:functions (chat records made from the standard library); none: the embedded corpus",
    )
    pr.add_argument(
        "--tokenizer",
        default="bpe:8192",
        metavar="TOK",
        help="a tokenizer.json or Hugging Face model directory, tiktoken:NAME (gpt2, cl100k_base, "
        "o200k_base), or bpe:N: an N-token BPE trained on the sources (default bpe:8192)",
    )
    pr.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    pr.add_argument("--field", default="text", help="the text field of .jsonl, .parquet and datasets (default text)")
    fraction = _number(float, "a number in [0, 1)", least=0, below=1)
    pr.add_argument("--val-fraction", type=fraction, default=0.05, help="documents held out for val.bin (default 0.05)")
    workers = _number(int, "a positive number of processes", least=1)
    pr.add_argument("--workers", type=workers, default=None, help="tokenizer processes (default: the CPU count)")
    pr.add_argument("--force", action="store_true", help="replace DIR if it holds a prepared corpus")
    pr.add_argument(
        "--format",
        choices=("auto", "text", "chat", "completion"),
        default="auto",
        help="records: text (--field), chat (messages of role and content) or completion (prompt and completion); "
        "auto: what each source's first record holds (default auto)",
    )
    pr.add_argument(
        "--train-on",
        choices=("completion", "all"),
        default=None,
        help="the tokens of chat and completion data a model is trained to predict: the assistant turns or the "
        "completion, or all (default completion)",
    )
    pr.add_argument(
        "--chat-template",
        metavar="PATH",
        help="a .jinja chat template (default: the tokenizer's chat_template.jinja or tokenizer_config.json, "
        "else ChatML)",
    )
    length = _number(int, "a positive number of tokens", least=1)
    pr.add_argument(
        "--seq-len", type=length, metavar="N", help="say how many chat or completion documents are longer than N tokens"
    )
    sa = sub.add_parser("sample", help="generate text from a run's last checkpoint")
    sa.add_argument("run_dir", metavar="RUN_DIR", help="run directory (config.yaml and checkpoints/)")
    sa.add_argument(
        "--prompt",
        default="",
        help="text to continue (default: none, start from EOS / a newline); on chat data, a user's turn to answer",
    )
    sa.add_argument("--raw", action="store_true", help="on chat data, continue --prompt as text, without the template")
    tokens = _number(int, "a positive number of tokens to generate", least=1)
    sa.add_argument("--tokens", type=tokens, default=200, help="tokens to generate (default 200)")
    temperature = _number(float, "a finite number, 0 (greedy) or more", least=0)
    sa.add_argument(
        "--temperature", type=temperature, default=0.8, help="sampling temperature; 0 is greedy (default 0.8)"
    )
    top_k = _number(int, "0 (every token) or a positive number of tokens", least=0)
    sa.add_argument("--top-k", type=top_k, default=200, help="sample from the k likeliest tokens (default 200)")
    sa.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    sa.add_argument("--checkpoint", default="last", help="last (default) or a checkpoint path")
    sa.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    ex = sub.add_parser("export", help="write a model.hf run's last checkpoint as a Hugging Face model directory")
    ex.add_argument("run_dir", metavar="RUN_DIR", help="run directory (config.yaml and checkpoints/)")
    ex.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (AutoModelForCausalLM.from_pretrained)")
    return p


def _split_resume(overrides: list[str]) -> tuple[list[str], str | None]:
    """The overrides without ``resume=...``, and its value (the last one given; None without one): ``last``,
    ``auto`` or a path.

    Raises:
        ValueError: ``resume=`` without a value.
    """
    resume, rest = None, []
    for item in overrides:
        if item.startswith("resume="):
            resume = item.partition("=")[2]
            if not resume:
                raise ValueError(
                    f"resume: expected resume=last, resume=auto or resume=PATH (in argument '{item}'); auto resumes "
                    "from the run directory's last checkpoint if it has one and otherwise starts fresh"
                )
        else:
            rest.append(item)
    return rest, resume


def main(argv: list[str] | None = None) -> int:
    from trainer.distributed.env import exit_code

    code = _main(argv)
    _exit_on_sigterm(code)
    return exit_code(code)  # a torchrun worker that used gloo exits here (see exit_code)


def _exit_on_sigterm(code: int) -> None:
    """Under torchrun, from here the process only exits, with ``code``: a SIGTERM now ends it with that code at once.
    torchrun sends one to every rank when a rank exits; a rank that had decided its own exit (2 for a config error
    that every rank found) would otherwise die of the signal (-15) on its way out."""
    import signal
    import threading

    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not a torchrun worker
        return

    def exit_now(*_) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, exit_now)


def _main(argv: list[str] | None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse's: --help (0), or a bad argument (2, said on stderr with the usage)
        return e.code
    from trainer.checkpoint import CheckpointError
    from trainer.config import ConfigError

    try:
        return _run(args)
    except (ConfigError, CheckpointError, ValueError, FileNotFoundError) as e:
        if os.environ.get("TRAINER_DEBUG"):
            raise
        _exit_on_sigterm(EXIT_USER_ERROR)  # said below, then exits 2 whatever torchrun sends meanwhile
        _user_error(e)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        console.error("\ninterrupted")
        return 130


def _user_error(e: Exception, prefix: str = "trainer: error") -> None:
    """Print ``e`` on stderr (``trainer.distributed.env.print_error``), unless it was already (``e.reported``)."""
    from trainer.distributed.env import print_error
    from trainer.errors import TrainingError

    if not (isinstance(e, TrainingError) and e.reported):
        print_error(e, prefix)


def _run(args) -> int:
    from trainer.config import load_config, to_yaml

    if args.command == "print-config":
        if args.config and "=" in args.config and not os.path.exists(args.config):
            args.overrides.insert(0, args.config)  # `trainer print-config optim.lr=1` (defaults + overrides)
            args.config = None
        cfg = load_config(args.config, args.overrides)
        console.info(to_yaml(cfg, with_help=not args.no_help).rstrip("\n"))
        return 0
    if args.command == "configs":
        from trainer.shipped import format_configs

        console.info(format_configs())
        return 0
    if args.command == "plot":
        from trainer.plot import plot_runs

        console.info(str(plot_runs(args.runs, args.out)))
        return 0
    if args.command == "export":
        return _export(args.run_dir, args.out_dir)
    if args.command == "prepare":
        from trainer.prepare import main as prepare

        return prepare(args)
    if args.command == "sample":
        from trainer.sample import main as sample

        return sample(args)
    import contextlib

    json_alone = getattr(args, "json", False)  # stdout is the JSON alone: the config's line goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if json_alone else contextlib.nullcontext():
        given, args.config = args.config, _config_file(args.config)
    overrides, resume = _split_resume(args.overrides)
    if args.command == "explain" and resume:
        raise ValueError("resume: not supported by explain")
    if args.command == "explain" and args.memory:
        from trainer.explain_memory import explain_memory

        return explain_memory(
            args.config,
            overrides,
            gpu=args.gpu,
            world=args.world,
            micro_batches=_micro_batches(args.micro_batches),
            as_json=args.json,
            measure=args.measure,
        )
    if args.command == "explain":
        return _explain(args.config, overrides, args.steps, args.dump_code, args.verbose)
    if args.command == "tune":
        from trainer.shipped import find_config
        from trainer.tune import tune

        if resume:
            raise ValueError("resume: not supported by tune")
        return tune(args.config, overrides, args.budget_s, shipped=find_config(given)[1])
    cfg = load_config(args.config, overrides)
    from trainer.errors import TrainingError
    from trainer.loop import Trainer

    try:
        summary = Trainer(cfg, resume=resume).fit()
    except TrainingError as e:
        _user_error(e, prefix="trainer")
        if e.peer_exited:  # torchrun must see the lost rank's exit before this one's
            from trainer.distributed.env import await_launcher

            await_launcher(terminated=e.terminated)
        return EXIT_TRAINING_FAILED
    _print_summary(summary)
    return 0


def _config_file(config: str) -> str:
    """The file ``trainer fit CONFIG`` reads; says so where a shipped config stands in for ``CONFIG``."""
    from trainer.shipped import find_config

    path, shipped = find_config(config)
    if shipped:
        console.info(f"config: {path}, shipped with trainer (no {config} in the working directory)")
    return str(path)


def _micro_batches(value: str | None) -> list[int] | None:
    """``--micro-batches``' list; exit 2 for anything but positive whole numbers."""
    if value is None:
        return None
    try:
        sizes = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--micro-batches: '{value}' is not a list of positive whole numbers (e.g. 4,16,32)")
    return sizes


def _explain(config: str, overrides: list[str], steps: int, dump_dir: str | None, verbose: bool = False) -> int:
    """Run a few compiled steps in a scratch run directory and print the compile report."""
    import contextlib
    import json
    import tempfile
    from pathlib import Path

    from trainer.compile.debug import dump_code
    from trainer.compile.report import format_text
    from trainer.config import load_config
    from trainer.loop import Trainer

    scratch = tempfile.mkdtemp(prefix="trainer-explain-")
    forced = [
        "compile.enabled=true",
        f"train.steps={steps}",
        "schedule.warmup_steps=0",  # these few steps are not the run: the config's warm-up would outlast them
        "train.eval_every=0",
        "checkpoint.enabled=false",
        "log.progress=false",
        f"run.dir={scratch}",
    ]
    cfg = load_config(config, [*overrides, *forced])
    cfg.compile.cache_dir = cfg.compile.cache_dir or str(Path(scratch) / "compile_cache")
    dumping = dump_code(dump_dir) if dump_dir else contextlib.nullcontext([])
    trainer = Trainer(cfg)
    with dumping as files:
        trainer.fit()
    if console.rank() != 0:  # rank 0 alone writes the report (each rank has its own scratch dir)
        return 0
    report = json.loads((Path(scratch) / "compile_report.json").read_text())
    console.info(format_text(report, verbose))
    plan = json.loads((Path(scratch) / "plan.json").read_text())
    console.info("plan: what each auto became (the run directory's plan.json)" if plan["choices"] else "plan: no auto")
    for line in plan["choices"]:
        console.info(f"  {line}")
    from trainer.describe import mesh_report

    console.info(mesh_report(plan["mesh"]))
    strategy = cfg.distributed.strategy
    if strategy in ("ddp", "fsdp") and "WORLD_SIZE" not in os.environ:
        console.info(
            f"distributed.strategy={strategy}: the plan each rank would follow under torchrun (this single process "
            "communicated nothing)"
        )
    if strategy == "ddp":
        from trainer.describe import ddp_plan_report

        console.info(ddp_plan_report(trainer.raw_model, trainer.plan, trainer.splitter))
    elif strategy == "fsdp":
        from trainer.describe import fsdp_units_report

        console.info(fsdp_units_report(trainer.raw_model, cfg))
    else:
        console.info("No bucket plan: distributed.strategy=none (add distributed.strategy=ddp or fsdp to see its plan)")
    if dump_dir:
        console.info(f"generated code: {len(files)} file(s) in {dump_dir}")
        for f in files:
            console.info(f"  {f}")
    return 0


def _export(run_dir: str, out_dir: str) -> int:
    """Rebuild a ``model.hf`` run's model from its config.yaml, load its last checkpoint (model.pt, or an fsdp
    run's DCP shards read whole) and write it with ``save_pretrained``, its special token ids those of the trained
    vocabulary, the run's config.yaml beside it."""
    import shutil
    from pathlib import Path

    from trainer import checkpoint
    from trainer.sample import run_config

    run, out = Path(run_dir), Path(out_dir)
    cfg = run_config(run, "export")  # its data and model.hf found wherever the run was launched from
    config = run / "config.yaml"
    if cfg.model.hf is None:
        model = f"model.target {cfg.model.target}" if cfg.model.target else f"the built-in GPT ({cfg.model.preset})"
        raise ValueError(
            f"export: {run} trained {model}; export writes a Hugging Face model and needs a run of a model.hf model"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"export: OUT_DIR {out} is a file; expected a directory to write")
    if out.resolve() == run.resolve():
        raise ValueError("export: OUT_DIR is the run directory; name a directory of its own")
    if not (run / "checkpoints" / checkpoint.LAST).is_file():
        raise checkpoint.CheckpointError(
            f"export: no complete checkpoint in {run / 'checkpoints'} (the run saved none: checkpoint.enabled=false, "
            "or it stopped before its first save)"
        )
    path = checkpoint.resolve("last", run, asked="export")  # the newest intact one, with a warning past a damaged one
    from trainer.models.hf import build_hf_model, save_pretrained

    m = cfg.model
    try:  # random weights (no download): the checkpoint's replace them
        model = build_hf_model(m.hf, overrides=dict(m.hf_overrides))
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"export: rebuilding the model of {config}: {e}") from None
    meta = checkpoint.load_model_weights(path, model)
    if said := _special_ids(model, cfg):
        console.info(said)
    save_pretrained(model, out, source=m.hf)
    shutil.copy2(config, out / "trainer_config.yaml")
    console.info(f"exported {path} (step {meta.get('step')}) to {out}")
    return 0


def _special_ids(model, cfg) -> str | None:
    """Set the exported model's special token ids to the trained vocabulary's (:func:`fit_special_ids`)."""
    from trainer.codec import data_eos
    from trainer.data import data_vocab_size
    from trainer.models.hf import fit_special_ids

    data, eos_id = data_eos(cfg.data.path)
    try:
        vocab = data_vocab_size(cfg.data.path, cfg.data.vocab_size)
    except (ValueError, FileNotFoundError):  # the data is gone: the model's vocabulary is what is known
        data, vocab = "unknown", model.hf.config.vocab_size
    return fit_special_ids(model, vocab, data, eos_id)


def _print_summary(s: dict) -> None:
    from trainer.metrics import format_fields

    fields = [
        ("steps", "done: {} steps"),
        ("loss", "loss {:.4f}"),
        ("val_loss", "val_loss {:.4f}"),
        ("mean_tokens_per_s", "{:,.0f} tok/s"),
        ("first_step_s", "first step {:.1f} s"),
        ("peak_mem_gb", "peak mem {:.2f} GB"),
        ("checkpoint", "checkpoint {}"),
    ]
    console.info(format_fields(s, fields))


if __name__ == "__main__":
    sys.exit(main())
