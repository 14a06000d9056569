"""PBE and AFT (``pbe.defense``) behind the common defence interface."""
from __future__ import annotations

from pbe.defense import SCHEDULES, Schedule, aft, erase, get_schedule
from pbe.defenses.base import Context, Defense
from pbe.utils import PBEError


class _Wrapped(Defense):
    """Runs a function of ``pbe.defense`` and keeps its report; its own cost counter replaces ours."""

    def _defend(self, model, data, ctx: Context):
        model, report = self._run(model, data, ctx)
        ctx.cost.forward_backward += report["passes"]["forward_backward"]
        ctx.cost.forward += report["passes"]["forward"]
        drop = {"defense", "setting", "seed", "before", "after", "der", "epoch_equivalents", "passes", "wall_s",
                "train_size"}  # the common report sets these
        return model, {k: v for k, v in report.items() if k not in drop}, None


class PBE(_Wrapped):
    name = "pbe"
    setting = "no-clean"
    # schedule: a name in pbe.defense.SCHEDULES or a Schedule; lr: None keeps the schedule's
    defaults = {"schedule": "fast", "lr": None}

    def _check(self):
        if not isinstance(self.params["schedule"], Schedule) and self.params["schedule"] not in SCHEDULES:
            raise PBEError(f"pbe: unknown schedule {self.params['schedule']!r}; available: {', '.join(SCHEDULES)}")
        if self.params["lr"] is not None and not self.params["lr"] > 0:
            raise PBEError(f"pbe: lr must be positive, got {self.params['lr']!r}")

    def _run(self, model, data, ctx):
        schedule = get_schedule(self.params["schedule"], lr=self.params["lr"])
        return erase(model, data, schedule, seed=ctx.seed, device=ctx.device, progress=ctx.progress,
                     evaluation=ctx.evaluation)


class AFT(_Wrapped):
    name = "aft"
    setting = "clean-extra"
    defaults = {"epochs": 20, "adv_epochs": 3, "lr": 1e-3, "pgd": None}  # pgd None: PGD-7 at 6/255

    def _run(self, model, data, ctx):
        return aft(model, data, epochs=self.params["epochs"], adv_epochs=self.params["adv_epochs"],
                   lr=self.params["lr"], pgd_config=self.params["pgd"], seed=ctx.seed, device=ctx.device,
                   progress=ctx.progress, evaluation=ctx.evaluation)
