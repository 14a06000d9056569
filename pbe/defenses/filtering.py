"""Data-filtering defences: score every training sample (higher = more suspicious), flag some, and
retrain the model from scratch without them. They see only the possibly poisoned training set and
the infected model; a subclass writes `score_and_flag`.

`retrain` names a training recipe of `pbe.train` (the infected model's recipe is the fair choice);
None skips retraining and returns the infected model unchanged with the flagged indices.
"""
from __future__ import annotations

import time
from abc import abstractmethod

import torch
import torch.nn as nn

from pbe.data import ImageDataset
from pbe.defenses.base import RETRAIN_STATE, Context, Defense, fresh_copy
from pbe.utils import PBEError

RETRAIN_RECIPE = "cpu"  # the zoo's infected models' recipe: retraining on the kept samples is then fair


class FilteringDefense(Defense):
    """Base of the filtering defences: a subclass scores and flags, this class retrains without the flags.

    Arguments every subclass takes:
        retrain (str | None): recipe of ``pbe.train`` to retrain on the kept samples (default "cpu";
            None: return the infected model with the flagged indices).
        retrain_epochs (int | None): override the recipe's epochs (default None).
    """

    setting = "no-clean"

    @abstractmethod
    def score_and_flag(self, model: nn.Module, data: ImageDataset,
                       ctx: Context) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Per-sample suspicion scores (float, len(data)), the boolean mask of flagged samples, and
        what the report should say about how they were flagged."""

    def _defend(self, model, data: ImageDataset, ctx: Context):
        from pbe.train import get_recipe, resumable_epochs, train
        scores, flagged, info = self.score_and_flag(model, data, ctx)
        if scores.shape != (len(data),) or flagged.shape != (len(data),):
            raise PBEError(f"{self.name}: scores/flags must have one entry per training sample")
        suspected = flagged.nonzero().flatten()
        keep = (~flagged).nonzero().flatten()
        report = {"scores": [round(float(s), 6) for s in scores], "flagged": len(suspected), "kept": len(keep),
                  **info}
        if self.params["retrain"] is None:
            return model, report, suspected
        if len(keep) == 0:
            raise PBEError(f"{self.name} flagged every training sample; nothing is left to retrain on")
        recipe = get_recipe(self.params["retrain"], epochs=self.params["retrain_epochs"])
        retrained = fresh_copy(model, ctx.seed)
        kept = data.subset(keep)
        state = None if ctx.state_dir is None else ctx.state_dir / RETRAIN_STATE  # resumable, as a Stage
        done = resumable_epochs(state, recipe, ctx.seed, kept) if state is not None and ctx.replaying else 0
        if state is not None and not done:
            state.unlink(missing_ok=True)  # the retrain of other kept samples (or after a loop that started over)
        start = time.time()
        history = train(retrained, kept, None, recipe, seed=ctx.seed, device=ctx.device, progress=ctx.progress,
                        state_path=state)
        if done:  # the wall time counts the retrain's epochs made before the interruption too
            ctx.start -= history[-1]["elapsed_s"] - (time.time() - start)
            ctx.resumed.append({"stage": "retrain", "epochs_done": done, "epochs": recipe.epochs})
        ctx.cost.forward_backward += recipe.epochs * len(keep)
        report["retrain"] = {"recipe": self.params["retrain"], "epochs": recipe.epochs, "log": history}
        return retrained, report, suspected
