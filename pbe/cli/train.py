"""``pbe train | evaluate | data``: train a model, measure a saved one, inspect a dataset."""
from __future__ import annotations

import json
from pathlib import Path

from pbe.cli.common import add_common, add_model_arg, load_both, load_model_and_test, train_and_save


def cmd_train(args) -> dict:
    from pbe.train import get_recipe, train

    recipe = get_recipe(args.recipe, epochs=args.epochs, model=args.model, width=args.width)

    def fit(model, train_set, test_set, log, state):
        train(model, train_set, test_set, recipe, seed=args.seed, device=args.device, log_path=log,
              state_path=state, progress=not args.no_progress)
    return train_and_save(args, recipe, fit)


def cmd_evaluate(args) -> dict:
    from pbe import metrics
    from pbe.utils import check_writable, resolve_device
    if args.out:
        check_writable(args.out)
    model, _, test_set = load_model_and_test(args)
    model.to(resolve_device(args.device))
    attack = None
    if args.attack_state:
        import attacks
        attack = attacks.load(args.attack_state)
    result = metrics.evaluate(model, test_set, attack)
    print(json.dumps(result))
    if args.out:
        from pbe.utils import write_json
        write_json(Path(args.out) / "evaluation.json", result)
    return result


def cmd_data(args) -> dict:
    train_set, test_set = load_both(args)
    info = {"train": train_set.summary(), "test": test_set.summary()}
    print(json.dumps(info, indent=1))
    return info


def register(sub) -> None:
    from pbe.train import RECIPES
    p = sub.add_parser("train", help="train a model on a dataset and save it with its metrics")
    add_common(p)
    p.add_argument("--recipe", default="tiny", choices=sorted(RECIPES), help="training recipe (default: tiny)")
    p.add_argument("--epochs", type=int, help="override the recipe's epochs")
    p.add_argument("--model", help="override the recipe's model (see pbe.models.available())")
    p.add_argument("--width", type=int, help="override the recipe's model width")
    p.add_argument("--download", action="store_true", help="download the dataset if missing (torchvision)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="clean accuracy (and ASR/RA with --attack-state) of a saved model")
    add_common(p, without=("seed", "overwrite"), model=True)
    add_model_arg(p)
    p.add_argument("--attack-state", help="attack state file saved by `pbe attack`, to measure ASR and RA")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("data", help="load a dataset (decode and cache it) and print its summary")
    add_common(p, without=("device", "seed", "out", "progress", "overwrite"))
    p.add_argument("--download", action="store_true", help="download the dataset if missing (torchvision)")
    p.set_defaults(func=cmd_data)
