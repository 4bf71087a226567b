"""`train`: the run config from the flags (a YAML file, a resumed run's config, a stage's base run),
`--iso` reshaping, and the summary line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import CheckpointError, LatentloopError
from .parser import EXIT_INTERRUPTED, print_json


def _run_config_from_args(args):
    from ..config import RunConfig, apply_overrides, config_sections, load_yaml
    from ..train.state import ONE_OFF_TRAIN_FIELDS

    saved = Path(args.out) / "config.json"
    file = config_sections(load_yaml(args.config)) if args.config else None
    stage = _given_stage(args, file)
    if stage in ("sft", "extend") and not args.resume:
        from ..train import stage_config

        if not args.init_from:
            raise LatentloopError(f"--stage {stage} continues a trained run: give --init-from RUN")
        if args.arch or args.preset or args.tokenizer:
            raise LatentloopError(f"--stage {stage} keeps the base run's arch, shape and tokenizer: drop "
                                  f"--arch/--preset/--tokenizer")
        flags = {"train.steps": args.steps, "train.batch_size": args.batch_size, "train.lr": args.lr,
                 "train.seed": args.seed, "train.device": args.device, "train.trackers": args.log,
                 "train.profile_steps": args.profile}
        # a config file goes through the stage too (its RoPE scaling and defaults), between the stage's
        # defaults and the flags: the base run < the stage < the file < the flags and --set
        return stage_config(stage, args.init_from, args.overrides, data=args.data, flags=flags, file=file,
                            file_name=args.config)
    if _resumes_saved_config(args, stage):  # the run's own config.json (a file laid over it)
        try:
            raw = json.loads(saved.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"cannot resume: {saved} is unreadable or cut short ({exc})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"cannot resume: {saved} does not hold a run config")
        raw = config_sections(raw)
        for name in ONE_OFF_TRAIN_FIELDS:  # a launch's own (a config.json from before they were left out)
            raw["train"].pop(name, None)
        if args.preset is not None:  # its fields were overridden by the saved ones: ignored without a word
            _check_resumed_preset(args.preset, raw["model"], args.overrides, reshaped=bool(args.iso))
        # what config.json records, before the file: a strategy the file gives is chosen now, and stands
        _recorded_none_under_torchrun(raw, args.overrides, saved, in_file="strategy" in (file or {}).get("train", {}))
        # "the same command plus --resume" of a run built on a base (--stage, --init-from): the file
        # laid over the run's config, not in its place; the file alone lacks the model the run took
        # from its base, and the resume was refused as "a different run"
        for key, value in (file or {}).items():  # sections field by field; anything else as the file has it
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                raw[key].update(value)
            else:
                raw[key] = value
    else:
        raw = config_sections(file if file is not None else {})
    flags = {"model.arch": args.arch, "model.preset": args.preset, "data.source": args.data,
             "data.tokenizer": args.tokenizer, "train.steps": args.steps, "train.batch_size": args.batch_size,
             "train.lr": args.lr, "train.seed": args.seed, "train.device": args.device, "train.stage": args.stage,
             "train.trackers": args.log, "train.profile_steps": args.profile}
    for key, value in flags.items():
        if value is not None:
            section, name = key.split(".")
            raw[section][name] = value
    if args.init_from and not (args.resume and saved.is_file()):
        _inherit_from_run(raw, args.init_from)
    elif not raw["model"].get("preset") and not args.config and not (args.resume and saved.is_file()):
        raw["model"]["preset"] = "tiny"
    return RunConfig.from_dict(apply_overrides(raw, args.overrides))


def _given_stage(args, file: dict | None = None) -> str | None:
    """The stage a run trains: --stage, else the config file's own train.stage (`file`: the file's
    sections, read here when not given)."""
    if args.stage or not args.config:
        return args.stage
    if file is None:
        from ..config import config_sections, load_yaml

        file = config_sections(load_yaml(args.config))
    return file["train"].get("stage")


def _resumes_saved_config(args, stage: str | None) -> bool:
    """Whether a train command starts from the run's own config.json: resuming a run that has one,
    unless a --config file says the whole config of a run made from nothing (a file's dense shape is
    reshaped by --iso again, as when the run started); a run built on a base (--stage sft / extend,
    --init-from) starts from its saved config with the file laid over it."""
    saved = Path(args.out) / "config.json"
    return bool(args.resume and saved.is_file()
                and (not args.config or args.init_from or stage in ("sft", "extend")))


def _check_resumed_preset(preset: str, saved_model: dict, overrides: list[str], reshaped: bool = False) -> None:
    """A resumed run keeps the model its config.json records: `--preset` is accepted where the preset
    (with the command's --set, which the resume checks itself) says what the run holds (the documented
    resume, "the same command plus --resume"), and refused where it would change the shape, which was
    ignored without a word."""
    from ..config import PRESETS

    if preset not in PRESETS:
        raise LatentloopError(f"unknown preset {preset!r}: choose from {', '.join(PRESETS)}")
    set_here = {item.split("=", 1)[0].rsplit(".", 1)[-1] for item in overrides or ()}
    if reshaped:  # --iso turned the preset's dense depth into the run's recurrent one (`_iso_shaped`)
        set_here.add("n_layer")
    differing = sorted(key for key, value in PRESETS[preset].items()
                       if key in saved_model and key not in set_here and saved_model[key] != value)
    if differing:
        key = differing[0]
        raise LatentloopError(f"cannot resume with --preset {preset}: its {key} is {PRESETS[preset][key]!r}, and the "
                              f"run holds {saved_model[key]!r}; a resumed run keeps its model (drop --preset, or "
                              f"start a new run)")


def _recorded_none_under_torchrun(raw: dict, overrides: list[str], saved: Path, in_file: bool = False) -> None:
    """A resumed run whose config.json records train.strategy none, resumed under torchrun (more than
    one process) without a strategy on the command line, resumes with auto (ddp there), said once.

    Why: before a run kept the strategy as given, it recorded what auto resolved to, so a run started
    with the default in one process recorded none, and `torchrun ... train --resume` was refused as if
    the user had chosen none. A recorded none cannot tell the two apart; the launch can: starting
    several processes asks for them. A none given now (--set train.strategy=none, or a --config file
    laid over the run's config: `in_file`) is still refused."""
    import os

    from ..distributed import launch_env

    processes = launch_env()[2]
    if raw["train"].get("strategy") != "none" or processes <= 1:
        return
    if in_file or any(item.split("=", 1)[0].strip() in ("strategy", "train.strategy") for item in overrides):
        return  # chosen now: it stands (a none is refused as for a new run)
    raw["train"]["strategy"] = "auto"
    if os.environ.get("RANK", "0") in ("", "0"):  # torchrun starts every process alike: said once
        print(f"latentloop: {saved} records train.strategy none, as a run of one process with the default auto "
              f"recorded it before runs kept auto; started as {processes} processes, it resumes with auto (ddp): "
              f"--set train.strategy=fsdp2 (or none) chooses otherwise", file=sys.stderr)


def _inherit_from_run(raw: dict, run: str) -> None:
    """--init-from: the model's shape and options, and the tokenizer, come from that run (a config
    file's model fields and --set still override them)."""
    from ..checkpoint import find_tokenizer_file, resolve_checkpoint
    from ..interop.upcycle import upcycle_fields

    if raw["model"].get("preset"):
        raise LatentloopError("--preset does not combine with --init-from (the model's shape comes from that run)")
    raw["model"] = upcycle_fields(run, raw["model"].get("arch")) | raw["model"]
    raw["data"].setdefault("tokenizer", str(find_tokenizer_file(resolve_checkpoint(run))))


def first_batches(count: int) -> str:
    """How much of a split a loss covers: `count` batches from its start (0: all of them)."""
    return f"the first {count} batches" if count else "every batch"


def cmd_train(args) -> int:
    import os

    from ..train import fit, setup

    config = _run_config_from_args(args)
    # a config resumed from the run's own config.json holds its shape already (a --config file's is
    # reshaped as when the run started): reshaping it again refused the documented resume ("the same
    # command plus --resume")
    from_saved = _resumes_saved_config(args, _given_stage(args))  # as `_run_config_from_args` decided it
    if args.iso and from_saved:
        if os.environ.get("RANK", "0") in ("", "0"):
            print(f"latentloop: --iso {args.iso} shapes a run when it starts: the resumed run keeps the shape its "
                  f"config.json records", file=sys.stderr)
    elif args.iso:
        config = _iso_shaped(config, args.iso, show=os.environ.get("RANK", "0") in ("", "0"))  # once per job
    if config.train.stage == "extend" and args.init_from and os.environ.get("RANK", "0") in ("", "0"):
        from ..checkpoint import read_run_config, resolve_checkpoint

        base = read_run_config(resolve_checkpoint(args.init_from)).model
        print(f"extend: context {base.sequence_len} -> {config.model.sequence_len}, RoPE base (rope_theta) "
              f"{base.rope_theta:g} -> {config.model.rope_theta:g}", file=sys.stderr)
    state = setup(config, args.out, resume=args.resume, progress=not args.no_progress, init_from=args.init_from)
    if state.init_report is not None and state.dist.is_main:  # once for the job, not once per process
        report = state.init_report
        print(f"initialised from {args.init_from} ({report['source_arch']} -> {config.model.arch}): "
              f"{report['mapping']}; {len(report['new'])} new tensors"
              + (f"; {report['grown_rows']} new token rows (the chat tokens), each the mean of the old rows"
                 if report.get("grown_rows") else "")
              + (f"; exact at step 0: {report['exact_at_step0']}" if "exact_at_step0" in report else ""),
              file=sys.stderr)
    summary = fit(state, progress=not args.no_progress)
    if not state.dist.is_main:  # rank 0 reports for the job
        return EXIT_INTERRUPTED if summary.get("interrupted") else 0
    if args.json:  # strict JSON: a loss that is not a number (no step ran) is null, never NaN
        print_json(summary)
    elif summary.get("nothing_to_train"):
        print(f"{args.out} is already at step {summary['step']:,} of {config.train.steps:,}: nothing to train "
              f"(--steps N continues it to step N); checkpoint {summary['checkpoint']}")
    else:
        scored = ("val: skipped (Ctrl+C)" if summary.get("validation_skipped") else
                  f"val loss {summary['val_loss']:.4f}, bpb {summary['val_bpb']:.4f} (on "
                  f"{summary.get('val_tokens', 0):,} tokens: {first_batches(config.train.eval_batches)} of the val "
                  f"split; `latentloop eval` scores all of it)")
        print(f"trained {config.model.arch} ({summary['params']:,} params) for {summary['step']} steps, "
              f"{summary['tokens']:,} tokens: {scored}; checkpoint {summary['checkpoint']}")
    if summary.get("interrupted"):  # stopped by Ctrl+C after a whole step, saved: said, and not a success
        print(f"latentloop: interrupted at step {summary['step']} of {config.train.steps}, saved; "
              f"`latentloop train --out {args.out} --resume` continues", file=sys.stderr)
        return EXIT_INTERRUPTED
    if summary.get("validation_skipped"):  # every step trained and saved; only the score is missing
        print(f"latentloop: interrupted in the final validation; every step is trained and saved: "
              f"`latentloop eval {args.out}` scores it", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def _iso_shaped(config, iso: str, show: bool = True):
    """Reshape a config whose arch trades depth for compute (its `iso_fields`) from its dense depth;
    print params and FLOPs/token of both (`show`)."""
    import dataclasses

    from ..archs import ARCHS, build_model
    from ..config import ModelConfig, model_config

    shape = config.model.iso_fields(iso)
    if shape is None:
        able = [name for name, spec in ARCHS.items() if spec.config_class.iso_fields is not ModelConfig.iso_fields]
        raise LatentloopError(f"--iso applies to an arch whose depth recurs ({', '.join(able)}); "
                              f"this one is {config.model.arch}")
    dense_layers = config.model.n_layer
    fields = {f.name: getattr(config.model, f.name) for f in dataclasses.fields(config.model)
              if f.name not in shape and f.name != "n_layer"}
    reshaped = model_config(config.model.arch, None, **fields, **shape)
    config.model = reshaped
    if not show:
        return config
    dense_fields = {f.name: fields[f.name] for f in dataclasses.fields(ModelConfig) if f.name in fields}
    dense = build_model(ModelConfig(**{**dense_fields, "n_layer": dense_layers}))
    recurrent = build_model(reshaped)
    T = reshaped.sequence_len
    dense_flops, recurrent_flops = dense.flops_per_token(T), recurrent.flops_per_token(T)
    matched = f"{dense_layers} " + ("block applications per token" if iso == "flops" else "distinct blocks")
    print(f"iso {iso} ({matched} in both): dense {ModelConfig.arch} {dense_layers} layers: "
          f"{dense.num_params():,} params, {dense_flops:,.0f} FLOPs/token (fwd+bwd)")
    print(f"iso {iso}: {reshaped.arch} {reshaped.depth_summary()}: {recurrent.num_params():,} params "
          f"({recurrent.num_params() / dense.num_params():.2f}x), {recurrent_flops:,.0f} FLOPs/token at R "
          f"({recurrent_flops / dense_flops:.2f}x" + ("; the rest is the recurrence's own projection and gate, "
                                                      "once per step)" if iso == "flops" else ")"))
    return config


