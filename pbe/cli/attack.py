"""``pbe attack``: train an infected model and save it with its attack state and poison indices."""
from __future__ import annotations

from pbe.cli.common import add_common, train_and_save
from pbe.utils import parse_params


def cmd_attack(args) -> dict:
    import attacks
    from pbe.train import data_fingerprint, get_recipe
    from pbe.utils import write_json

    params = parse_params(args.param)
    attack = attacks.create(args.attack, target=args.target, all_to_all=args.all_to_all, seed=args.seed, **params)
    recipe = get_recipe(args.recipe, epochs=args.epochs, model=args.model, width=args.width)
    planted = {}

    def fit(model, train_set, test_set, log, state):
        planted["set"], _ = attack.plant(model, train_set, test_set, rate=args.rate, recipe=recipe, seed=args.seed,
                                         device=args.device, log_path=log, state_path=state,
                                         progress=not args.no_progress)

    def after(model, folder):
        poisoned = planted["set"]
        attack.save(folder / "attack")
        write_json(folder / "poison.json", {
            "rate": args.rate, "seed": args.seed, "poison_indices": poisoned.poison_indices.tolist(),
            "extra_indices": None if poisoned.extra_indices is None else poisoned.extra_indices.tolist(),
            "images_sha256": data_fingerprint(poisoned)})
    return train_and_save(args, recipe, fit, attack, {"attack": {"name": attack.name, **attack.params()},
                                                      "rate": args.rate}, after)


def register(sub) -> None:
    import attacks
    from pbe.train import RECIPES
    p = sub.add_parser("attack", help="train a backdoored model (writes model, attack state, poison indices)")
    add_common(p)
    p.add_argument("--attack", required=True, choices=attacks.available())
    p.add_argument("--recipe", default="tiny", choices=sorted(RECIPES))
    p.add_argument("--epochs", type=int, help="override the recipe's epochs")
    p.add_argument("--model", help="override the recipe's model (see pbe.models.available())")
    p.add_argument("--width", type=int, help="override the recipe's model width")
    p.add_argument("--rate", type=float, default=0.1, help="poison rate (default 0.1)")
    p.add_argument("--target", type=int, default=0, help="target label for all-to-one (default 0)")
    p.add_argument("--all-to-all", action="store_true", help="y -> (y + 1) mod C instead of all-to-one")
    p.add_argument("--param", action="append", metavar="KEY=VALUE",
                   help="attack parameter, e.g. --param size=4 --param mode=poison_label (repeatable)")
    p.add_argument("--download", action="store_true", help="download the dataset if missing (torchvision)")
    p.set_defaults(func=cmd_attack)
