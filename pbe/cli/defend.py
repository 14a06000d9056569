"""``pbe erase | detect | analyze | demo``: the defence from the command line."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pbe.cli.common import add_common, add_model_arg, load_model_and_test, output_unit, resolve_dataset
from pbe.activations import KAPPA_THRESHOLD, PROBE_SIZE
from pbe.adversarial import MONITOR_PGD
from pbe.detection import ALPHA, BUDGET_LABELS, SCAN_IMAGES, SCAN_L2_RMS
from pbe.utils import PBEError, check_writable


def _pgd_args(p) -> None:
    p.add_argument("--eps", type=float, help="PGD L-inf budget in [0, 1] pixel units (default 6/255)")
    p.add_argument("--steps", type=int, help="PGD steps")


def _pgd_config(args, base=None):
    from dataclasses import replace

    from pbe.adversarial import PGDConfig
    cfg = base or PGDConfig()
    if args.eps is not None and not 0 < args.eps <= 1:
        raise PBEError(f"--eps must be in (0, 1] (pixel units; 6/255 = 0.0235), got {args.eps}")
    if args.steps is not None and args.steps < 1:
        raise PBEError(f"--steps must be >= 1, got {args.steps}")
    if args.eps is not None:
        cfg = replace(cfg, eps=args.eps, step=args.eps / 3 if cfg.step is not None else None)
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    return cfg


def _poisoned_from(run_dir: Path, clean_train):
    """Rebuild the exact poisoned training set of a `pbe attack` run and check its indices."""
    import attacks
    from pbe import rundir
    info_path = run_dir / "poison.json"
    if not info_path.is_file():
        raise PBEError(f"{info_path} not found; --poison-from takes a `pbe attack --out` directory")
    rundir.verify(run_dir)
    try:
        info = json.loads(info_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PBEError(f"{info_path} is not valid JSON ({err}); rerun the `pbe attack` that made it") from err
    attack = attacks.load(run_dir / "attack")
    poisoned = attack.poison(clean_train, info["rate"], info["seed"])
    if poisoned.poison_indices.tolist() != info["poison_indices"]:
        raise PBEError(f"re-poisoning {run_dir} gave other indices than poison.json; dataset or version differ")
    return poisoned, attack


DEFENSE_STATE = "state"  # in the staging folder: the defence's resumable stages (Defense.__call__'s state_dir)
CLEAN_FRACTION = 0.05  # clean-extra defences: the share of the clean training set they get (BackdoorBench's)


def clean_indices(n: int, fraction: float, seed: int) -> torch.Tensor:
    """The clean extra set a clean-extra defence gets: a seeded draw of `fraction` of `n` training samples, sorted."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:round(fraction * n)].sort().values


def _setting_options(args, defense) -> None:
    """Refuse the data options of the other setting (the defence would ignore them); default --clean-fraction."""
    if defense.setting == "no-clean" and args.clean_fraction is not None:
        raise PBEError(f"--clean-fraction is for defences with a clean extra set; {defense.name} works without "
                       "clean data (on the training set of --poison-from or --train-data): drop it")
    if defense.setting == "clean-extra" and args.train_data is not None:
        raise PBEError(f"--train-data is for defences without clean data; {defense.name} takes a clean extra set, "
                       "--clean-fraction of the clean training set: drop it (--poison-from still names the attack)")
    if defense.setting == "clean-extra" and args.clean_fraction is None:
        args.clean_fraction = CLEAN_FRACTION


def _run_identity(args) -> dict:
    """What names a defence run: the command and every option that changes its result."""
    skip = {"func", "out", "overwrite", "no_progress", "device"}
    return {k: v if isinstance(v, (int, float, bool, type(None))) else str(v)
            for k, v in sorted(vars(args).items()) if k not in skip}


def run_defense(args, defense) -> dict:
    """Shared by ``pbe defend`` and ``pbe erase``: give `defense` the data its setting allows, measure
    it against the attack (evaluation only), and write model, report, metrics and plots to --out as
    one unit (``pbe.cli.common.output_unit``)."""
    from pbe import checkpoint, data
    from pbe.defenses import Evaluation
    from pbe.plots import plot_histograms, plot_rounds
    from pbe.utils import hardware_string, toolkit_version, write_json

    resolve_dataset(args)
    _setting_options(args, defense)
    # the code's version is part of a defence run's identity: a finished run of other code is not reused
    run = {**_run_identity(args), "defense": defense.name, "params": defense.resolved(),
           "toolkit_version": toolkit_version()}
    with output_unit(args, run, drop=(DEFENSE_STATE,)) as stage:
        if stage is None:
            return json.loads((args.out / "metrics.json").read_text())
        model, meta, test = load_model_and_test(args)
        attack = None
        if args.attack_state:
            import attacks
            attack = attacks.load(args.attack_state)
        clean_train = data.load(args.dataset, args.data_root, "train")
        poison_indices, extra = None, {}
        if defense.setting == "no-clean":
            if args.poison_from:
                inputs, attack = _poisoned_from(Path(args.poison_from), clean_train)
                poison_indices = inputs.poison_indices
            elif args.train_data:
                inputs = data.load(args.train_data, args.data_root, "train")
            else:
                raise PBEError(f"{defense.name} works without clean data and needs the (poisoned) training set: "
                               "--poison-from RUN_DIR (a `pbe attack` output) or --train-data DATASET")
        else:
            if not 0 < args.clean_fraction <= 1:
                raise PBEError(f"--clean-fraction must be in (0, 1], got {args.clean_fraction}")
            if args.poison_from and attack is None:
                import attacks
                attack = attacks.load(Path(args.poison_from) / "attack")
            idx = clean_indices(len(clean_train), args.clean_fraction, args.seed)
            inputs = clean_train.subset(idx)
            extra["clean_indices"] = idx.tolist()
        result = defense(model, inputs, seed=args.seed, device=args.device, progress=not args.no_progress,
                         evaluation=Evaluation(test, attack, poison_indices), train_size=len(clean_train),
                         state_dir=stage / DEFENSE_STATE)
        report = {**result.report, **extra, "hardware": hardware_string(), "toolkit_version": run["toolkit_version"],
                  "command": " ".join(["pbe"] + sys.argv[1:])}
        write_json(stage / "report.json", report)
        summary = {k: report.get(k) for k in ("defense", "setting", "params", "before", "after", "der", "detection",
                                              "epoch_equivalents", "wall_s")}
        if "rounds" in report:
            plot_rounds(report, stage / "rounds.png")
        if report.get("monitor_before") and report.get("monitor_after"):  # the schedules that run the monitor
            plot_histograms(report["monitor_before"], report["monitor_after"], stage / "adversarial_labels.png",
                            test.classes)
            for when in ("monitor_before", "monitor_after"):
                summary[when] = {k: report[when][k] for k in ("top_label", "top_kappa", "suspected")}
        if defense.name == "pbe":  # what it decided: target, isolation, the named target's check
            from pbe.defenses.pbe import decisions
            summary["decisions"] = decisions(report)
        estimate = (report.get("acc_drop_estimate") or {}).get("estimate")
        if estimate is not None:  # above pbe.defenses.pbe.ACC_DROP_WARNING the defence has warned (PBEWarning)
            summary["acc_drop_estimate"] = estimate
        kept = {k: v for k, v in meta.items() if k not in ("metrics", "run")}  # the input's run is not this one
        checkpoint.save(result.model, stage / "model", {**kept, "defense": defense.name, "setting": defense.setting,
                                                        "seed": args.seed, "run": run, "metrics": summary})
        write_json(stage / "metrics.json", summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "params"}))
    return report


def cmd_defend(args) -> dict:
    from pbe import defenses
    from pbe.utils import parse_params
    return run_defense(args, defenses.create(args.defense, **parse_params(args.param)))


def cmd_erase(args) -> dict:
    from pbe import defenses
    from pbe.defenses import SCHEDULES, get_schedule
    from pbe.defenses.pbe import DEFAULT_SCHEDULE
    if args.setting == "no-clean":
        args.schedule = args.schedule or DEFAULT_SCHEDULE
        sched = get_schedule(args.schedule)
        schedule = get_schedule(sched, pgd_config=_pgd_config(args, sched.pgd_config), lr=args.lr)
        defense = defenses.create("pbe", schedule=schedule,
                                  target=args.target)
    else:
        from pbe.defenses.aft import AFT_SCHEDULES
        schedule = args.schedule or AFT_SCHEDULES[0]
        if schedule not in AFT_SCHEDULES:
            raise PBEError(f"--schedule is PBE's {schedule!r} (--setting no-clean); AFT (--setting clean-extra) takes "
                           f"{' or '.join(AFT_SCHEDULES)}")
        if args.target is not None and schedule == "paper":
            raise PBEError("--target drives AFT's targeted schedule; the paper's (--schedule paper) does not take it")
        if schedule == "targeted" and (args.eps is not None or args.steps is not None):
            raise PBEError("--eps and --steps set the PGD of AFT's paper schedule; the targeted one (the default) "
                           "uses universal perturbations: drop them, or pass --schedule paper")
        defense = defenses.create("aft", schedule=schedule, pgd=_pgd_config(args, SCHEDULES["paper"].pgd_config),
                                  target=args.target, **({"lr": args.lr} if args.lr is not None else {}))
    return run_defense(args, defense)


METHOD_OPTIONS = {"universal": ("images", "l2_rms", "alpha", "with_train"),  # pbe detect's options of each --method
                  "kappa": ("probe_size", "threshold", "eps", "steps")}


def _method_options(args) -> None:
    """Refuse the options of the other --method (this one would ignore them), and --with-train with --split
    train (there is no test split to set against the training split)."""
    other = next(m for m in METHOD_OPTIONS if m != args.method)
    given = [f"--{n.replace('_', '-')}" for n in METHOD_OPTIONS[other]
             if getattr(args, n) is not None and getattr(args, n) is not False]  # (0 is given: --probe-size 0)
    if given:
        one = len(given) == 1
        raise PBEError(f"{', '.join(given)} {'is an option' if one else 'are options'} of --method {other}, which "
                       f"--method {args.method} does not use; drop {'it' if one else 'them'}, or pass --method {other}")
    if args.with_train and args.split == "train":
        raise PBEError("--with-train sets the labelled training split against a scan of the test split; with "
                       "--split train drop it, or scan --split test")


def cmd_detect(args) -> dict:
    from pbe import data
    from pbe.utils import resolve_device
    _method_options(args)
    if args.out:
        check_writable(args.out)
    model, meta, test = load_model_and_test(args)
    model.to(resolve_device(args.device))
    if args.method == "universal":
        from dataclasses import replace

        from pbe.detection import SCAN_BUDGETS, detect
        train = data.load(args.dataset, args.data_root, "train")  # also the unit of the epoch-equivalents
        ds = test if args.split == "test" else train
        budget = "detect" if args.images is None else replace(SCAN_BUDGETS["detect"], images=args.images)
        found = detect(model, ds, budget=budget, l2_rms=SCAN_L2_RMS if args.l2_rms is None else args.l2_rms,
                       alpha=ALPHA if args.alpha is None else args.alpha, seed=args.seed,
                       train_data=train if args.with_train else None, progress=not args.no_progress)
        result = {**found.as_dict(), "method": "universal", "train_size": len(train),
                  "epoch_equivalents": found.epoch_equivalents(len(train))}
        if found.suspected and found.evidence == "label_share":
            print(f"backdoor suspected from the training labels only: label {found.label} ({ds.classes[found.label]}) "
                  f"has {found.share[found.label]:.2f} times its test share (robust z {found.share_score:.2f}); the "
                  f"model's own statistics found nothing (score {found.score:.2f}, p-value {found.p_value:.2g})")
        elif found.suspected and found.label is not None:
            print(f"backdoor suspected: target label {found.label} ({ds.classes[found.label]}), evidence "
                  f"{found.evidence}, score {found.score:.2f}, p-value {found.p_value:.2g}")
        elif found.suspected:
            print(f"backdoor suspected with several poisoned labels: {found.cluster_labels}")
        elif found.label_map:
            print(f"backdoor suspected with no single target (all-to-all): source -> target {found.label_map}")
        else:
            print(f"no backdoor suspected (most reachable label {found.top_label}, score {found.score:.2f}, "
                  f"p-value {found.p_value:.2g} >= {found.alpha})")
        print(json.dumps(result))
        if args.out:
            from pbe.utils import write_json
            write_json(args.out / "detect.json", result)
        return result
    from pbe.activations import kappa_detect
    ds = test if args.split == "test" else data.load(args.dataset, args.data_root, "train")
    mon = kappa_detect(model, ds, PROBE_SIZE if args.probe_size is None else args.probe_size,
                       _pgd_config(args, MONITOR_PGD), seed=args.seed,
                       threshold=KAPPA_THRESHOLD if args.threshold is None else args.threshold).as_dict()
    verdict = (f"backdoor suspected: adversarial examples point to label {mon['top_label']} "
               f"({ds.classes[mon['top_label']]}), kappa {mon['top_kappa']:.2f} > {mon['threshold']}"
               if mon["suspected"] else f"no backdoor suspected (kappa {mon['top_kappa']:.2f} "
               f"<= {mon['threshold']})")
    print(verdict)
    print(json.dumps(mon))
    if args.out:
        from pbe.utils import write_json
        write_json(args.out / "detect.json", mon)
    return mon


def cmd_analyze(args) -> dict:
    import attacks
    from pbe.activations import kappa_detect, neuron_overlap, probe_indices
    from pbe.adversarial import adversarial_examples
    from pbe.models import last_conv_name
    from pbe.utils import resolve_device
    if args.out:
        check_writable(args.out)
    model, meta, test = load_model_and_test(args)
    model.to(resolve_device(args.device))
    attack = attacks.load(args.attack_state)
    idx = probe_indices(test.labels, args.probe_size, args.seed)
    idx = idx[test.labels[idx] != attack.target] if not attack.all_to_all else idx
    x = test.images[idx].float() / 255
    cfg = _pgd_config(args, MONITOR_PGD)
    x_adv = adversarial_examples(model, x, test.labels[idx], cfg)
    layers = args.layers or [last_conv_name(model)]
    out = {"layers": neuron_overlap(model, x, attack.apply(x), x_adv, layers, args.k),
           "monitor": kappa_detect(model, test, args.probe_size, cfg, seed=args.seed).as_dict()}
    print(json.dumps(out, indent=1))
    if args.out:
        from pbe.utils import write_json
        write_json(args.out / "analysis.json", out)
    return out


def cmd_demo(args) -> dict:
    import contextlib

    from pbe.demo import format_text, run_demo
    if args.threads is not None and args.threads < 1:
        raise PBEError(f"--threads must be at least 1, got {args.threads}")
    progress = args.verbose and not args.no_progress
    if args.json:  # stdout holds the JSON alone: training's per-epoch lines (--verbose) go to stderr
        with contextlib.redirect_stdout(sys.stderr):
            result = run_demo(args.seed, progress=progress, out=args.out, threads=args.threads)
        print(json.dumps(result, indent=1))
        return result
    print("pbe demo: plant a backdoor in a small CNN on the built-in 8x8 digits, then erase it with PBE\n"
          "without clean data (about 10 s).", flush=True)
    result = run_demo(args.seed, progress=progress, out=args.out, threads=args.threads,
                      say=lambda line: print(line, flush=True))
    print()
    print(format_text(result))
    if args.out is not None:
        print(f"Saved the models, PBE's report (report.json) and this result (demo.json) in {args.out}")
    return result


def _defense_data_args(p) -> None:
    add_model_arg(p, "model to purify (checkpoint directory or file)")
    p.add_argument("--clean-fraction", type=float,
                   help=f"clean-extra defences only: their share of the clean training set (default {CLEAN_FRACTION})")
    p.add_argument("--poison-from", help="`pbe attack --out` directory: rebuild its poisoned training set and "
                   "use its trigger and indices for evaluation only")
    p.add_argument("--train-data", help="no-clean defences only: the (poisoned) training set as a dataset name, "
                   "e.g. npz:/path")
    p.add_argument("--attack-state", help="attack state, to measure ASR (evaluation only)")


def _defense_parameters() -> str:
    """Every registered defence with its setting and its parameters' defaults, for ``--help``."""
    from pbe import defenses
    lines = ["defences and their parameters (--param KEY=VALUE; values are read as JSON):"]
    for name in defenses.available():
        cls = defenses.REGISTRY.get(name)
        params = " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in cls.defaults.items())
        lines.append(f"  {name:6s} [{cls.setting}] {params}")
    return "\n".join(lines)


def register(sub) -> None:
    """The commands of this module: erase, defend, detect, analyze, demo."""
    for add in (_register_erase, _register_defend, _register_detect, _register_analyze, _register_demo):
        add(sub)


def _register_erase(sub) -> None:
    """`pbe erase`: PBE without clean data, or AFT with a clean extra set."""
    from pbe.defenses import SCHEDULES
    from pbe.defenses.aft import AFT_SCHEDULES
    from pbe.defenses.pbe import DEFAULT_SCHEDULE
    p = sub.add_parser("erase", help="purify a model: PBE without clean data, or AFT with a clean extra set",
                       epilog="An option the chosen --setting does not use is refused.")
    add_common(p, model=True)
    _defense_data_args(p)
    p.add_argument("--setting", choices=["no-clean", "clean-extra"], default="no-clean")
    p.add_argument("--schedule", choices=sorted(set(SCHEDULES) | set(AFT_SCHEDULES)),
                   help=f"PBE's schedule (no-clean: {', '.join(sorted(SCHEDULES))}; default {DEFAULT_SCHEDULE}) or "
                        f"AFT's (clean-extra: {', '.join(AFT_SCHEDULES)}; default {AFT_SCHEDULES[0]})")
    p.add_argument("--target", type=int, help="a target label you already know or suspect (default: the target "
                   "scan names it, or none); not with AFT's paper schedule")
    p.add_argument("--lr", type=float, help="fine-tuning learning rate (default: the schedule's)")
    _pgd_args(p)
    p.set_defaults(func=cmd_erase)


def _register_defend(sub) -> None:
    """`pbe defend`: any registered defence."""
    from pbe import defenses
    p = sub.add_parser("defend", help="run any registered defence (" + " ".join(defenses.available()) + ")",
                       epilog=_defense_parameters(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common(p, model=True)
    _defense_data_args(p)
    p.add_argument("--defense", required=True, choices=defenses.available())
    p.add_argument("--param", action="append", metavar="KEY=VALUE",
                   help="defence parameter, e.g. --param epochs=20 --param retrain=quick (repeatable)")
    p.set_defaults(func=cmd_defend)


def _register_detect(sub) -> None:
    """`pbe detect`: the trigger-free target scan, or the kappa monitor."""
    p = sub.add_parser("detect", help="is a backdoor suspected, and which label is its target? (no trigger)",
                       epilog="An option of the other --method is refused. epoch_equivalents: image passes per "
                       "training-set size (the training split's, whichever --split is scanned).")
    add_common(p, without=("overwrite",), model=True)
    add_model_arg(p)
    p.add_argument("--split", choices=["train", "test"], default="test")
    p.add_argument("--method", choices=["universal", "kappa"], default="universal",
                   help="universal: one small targeted universal perturbation per label, null from the other "
                   "labels (default); kappa: PBE's adversarial-label concentration (the monitor)")
    p.add_argument("--images", type=int,
                   help=f"universal: images fitting each label's perturbation (as many measure it; default "
                   f"{SCAN_IMAGES}, scaled by {BUDGET_LABELS} / C with more than {BUDGET_LABELS} labels)")
    p.add_argument("--l2-rms", type=float, help="universal: L2 budget as the root-mean-square "
                   f"change per pixel (default {SCAN_L2_RMS:.4f}: norm 1 on a 3x32x32 image)")
    p.add_argument("--with-train", action="store_true", help="universal: also score the per-label train-test "
                   "accuracy gap on the labelled training split (finds clean-label backdoors such as SIG)")
    p.add_argument("--alpha", type=float, help=f"universal: p-value threshold (default {ALPHA})")
    p.add_argument("--probe-size", type=int, help=f"kappa: probe size (default {PROBE_SIZE})")
    p.add_argument("--threshold", type=float,
                   help=f"kappa: threshold on the chance-corrected attraction of the top label (default "
                   f"{KAPPA_THRESHOLD})")
    p.add_argument("--eps", type=float, help="kappa: PGD L-inf budget in [0, 1] pixel units (default "
                   f"{MONITOR_PGD.eps:.4f})")
    p.add_argument("--steps", type=int, help=f"kappa: PGD steps (default {MONITOR_PGD.steps})")
    p.set_defaults(func=cmd_detect)


def _register_analyze(sub) -> None:
    """`pbe analyze`: neurons excited by clean, triggered and adversarial inputs."""
    p = sub.add_parser("analyze", help="neurons excited by clean, triggered and adversarial inputs")
    add_common(p, without=("overwrite",), model=True)
    add_model_arg(p)
    p.add_argument("--attack-state", required=True)
    p.add_argument("--layers", nargs="*", help="layer names (default: the last conv layer)")
    p.add_argument("--k", type=int, default=10, help="top-k neurons per layer")
    p.add_argument("--probe-size", type=int, default=PROBE_SIZE)
    _pgd_args(p)
    p.set_defaults(func=cmd_analyze)


def _register_demo(sub) -> None:
    """`pbe demo`: plant a backdoor on the digits and erase it."""
    p = sub.add_parser("demo", help="plant a backdoor in a small CNN on the built-in digits and erase it with PBE "
                       "without clean data (~10 s at 1 thread, its default)",
                       description="Plant a Blend backdoor (target 0, 10 % poison) in a small CNN trained on the "
                       "built-in 8x8 digits, erase it with PBE without clean data, and print what was planted, what "
                       "PBE decided and clean accuracy / attack success rate before and after. Wall time measured on "
                       "a 2-core machine busy with two other runs: 8-11 s at 1 thread (the default), 17-36 s at 2 "
                       "threads (over 100 s in two of ten runs): the small model gained nothing from a second thread. "
                       "The numbers differ slightly with the thread count.")
    p.add_argument("--seed", type=int, default=0, help="seeds the trigger, the poison, the model and PBE (default 0)")
    p.add_argument("--threads", type=int, help="torch threads (default: OMP_NUM_THREADS if set, else 1)")
    p.add_argument("--out", type=Path, help="also save the models, the attack, PBE's report and the result here")
    p.add_argument("--json", action="store_true", help="print only the result as JSON (machine-readable)")
    p.add_argument("--verbose", action="store_true",
                   help="also show the training and PBE progress bars and per-epoch lines (on stderr with --json)")
    p.add_argument("--no-progress", action="store_true", help=argparse.SUPPRESS)  # the old switch: bars are off
    p.set_defaults(func=cmd_demo)
