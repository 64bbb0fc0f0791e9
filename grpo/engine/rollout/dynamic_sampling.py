"""Which rolled-out rows a step trains on, host side: DAPO's dynamic sampling (which
groups) and PODS's down-sampling (which samples of each group).

A group is *informative* when the advantages the update trains on are not all zero on
the tokens it trains, under the configured credit, baseline and scale
(:func:`~grpo.engine.training.advantages.informative_groups`, the one definition). An
uninformative group adds nothing to the policy gradient but still dilutes a
``token_mean`` loss. With ``train.dynamic_sampling`` the trainer rolls out
``prompts_per_step`` prompts per round, the next ones of the data order each time, and
:class:`GroupFilter` keeps the informative groups (judged over all K samples) until it
holds ``prompts_per_step`` of them or ``max_rounds`` rounds were made. Under sequence
credit that is a spread of the total rewards; under turn credit (``train.advantage.credit:
turn``) a group with equal totals is kept when a scope's own advantage is not zero on the
turns it credits.

The programs keep their compiled shapes: the update batch is always ``prompts_per_step``
groups. Informative groups beyond that are dropped (carrying them to the next step would
make the step's batch depend on state the checkpoint does not hold). A step that ends
short fills its batch with uninformative groups, earliest first, trained with exactly
zero advantage whatever the credit (the trainer zeroes their rows: no policy gradient),
their tokens in the loss's normaliser, the entropy bonus and the KL term, as plain GRPO
trains an equal-reward group. Masking them out instead was measured to collapse the
policy: on the quickstart (200 steps, max_rounds 4) the entropy bonus then acts only on
the few informative groups, the token entropy fell to 0.004 (2.16 without dynamic
sampling) and held-out pass@1 stalled at 0.27, against 0.46 with the fill trained (0.36
without dynamic sampling).

Down-sampling after the filter keeps the spread that made a group informative:
``max_variance`` keeps the largest reward variance (a spread whenever there is one, as
``keep`` >= 2), and ``random`` draws subsets holding at least one sample above and one
below the group mean (:func:`down_sample`). Both rank a group's samples by their total
rewards, or under turn credit, for a group whose totals are all equal, by the first scope
component that has a spread (:func:`selection_scores`). A subset that still trains with
all-zero advantage (turn-credit scopes cancelling on it) is counted by the trainer's
``down_sampling/degenerate_groups``.

On the continuous engine the groups stream (:class:`StreamFilter`): prompts are fed
while the rollout runs and each group is judged when its K samples have finished, the
batch taking the first ``prompts_per_step`` informative ones in finish order; groups fed
and unfinished when it is full are dropped (``dynamic_sampling/dropped_in_flight``).

Every process makes the same decision from the same globally gathered rewards, so the
picks are identical across processes; they depend on the rewards alone, so a resumed run
(same data position, same keys) picks the same groups.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def group_spread(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """Whether each group of ``rewards`` [G*K] (row ``g*K + j``: sample j of group g) has
    unequal rewards: [G] bool. Exact comparison: equal rewards are equal floats. (Whether
    a group is informative is :func:`~grpo.engine.training.advantages.informative_groups`
    of its advantages: under sequence credit the same verdict.)"""
    groups = np.asarray(rewards).reshape(-1, num_generations)  # G K
    return groups.max(axis=1) != groups.min(axis=1)


@dataclasses.dataclass
class GroupFilter:
    """One step's picks across rounds: :meth:`add` each round's verdicts (which groups
    are informative), in round order, until :attr:`done`; :meth:`picks` then says which
    groups form the batch."""

    want: int  # groups per step (train.prompts_per_step)
    max_rounds: int
    kept: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (round, group), informative
    spare: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (round, group), uninformative
    surplus: int = 0  # informative groups beyond `want`
    rounds: int = 0

    def add(self, informative: np.ndarray) -> None:
        """Record the next round's groups ([want] bool: informative or not)."""
        if self.done:
            raise RuntimeError(f"GroupFilter.add after the step is complete ({self.rounds} rounds, {len(self.kept)} kept)")
        verdicts = np.asarray(informative, bool)
        if verdicts.shape != (self.want,):
            raise ValueError(f"a round has {self.want} groups, got verdicts of shape {verdicts.shape}")
        for g, informative in enumerate(verdicts):
            if not informative:
                self.spare.append((self.rounds, g))
            elif len(self.kept) < self.want:
                self.kept.append((self.rounds, g))
            else:
                self.surplus += 1
        self.rounds += 1

    @property
    def done(self) -> bool:
        return len(self.kept) == self.want or self.rounds == self.max_rounds

    @property
    def short(self) -> bool:
        """The step trains on fewer informative groups than it asked for."""
        return len(self.kept) < self.want

    def picks(self) -> tuple[list[tuple[int, int]], int]:
        """``(groups, filled)``: the batch's ``want`` groups as (round, group) in batch order,
        the informative ones first, then ``filled`` uninformative ones (earliest first; the
        trainer gives their rows exactly zero advantage)."""
        filled = self.want - len(self.kept)
        return self.kept + self.spare[:filled], filled

    def metrics(self) -> dict[str, float]:
        """``dynamic_sampling/rounds``, ``/uninformative_groups`` (rolled out, all-zero
        advantage over their K samples), ``/dropped_groups`` (rolled out, left out of the
        batch: uninformative or surplus), ``/filled_groups`` (uninformative groups filling
        a short step, trained with zero advantage) and ``/short`` (1 when the filter found
        fewer informative groups than prompts_per_step). What the update then trains on is
        the trainer's ``advantage/informative_groups`` (= prompts_per_step - filled -
        ``down_sampling/degenerate_groups``)."""
        filled = self.want - len(self.kept)
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/uninformative_groups": float(len(self.spare)),
            "dynamic_sampling/dropped_groups": float(len(self.spare) - filled + self.surplus),
            "dynamic_sampling/filled_groups": float(filled),
            "dynamic_sampling/short": float(self.short),
        }


@dataclasses.dataclass
class StreamFilter:
    """One step's picks when groups stream (``rollout.engine: continuous``): prompts are
    fed, the next ones of the data order, and each group is judged once its K samples have
    finished, in finish order, until ``want`` informative groups finished or ``limit``
    prompts were fed and every one of them finished. Groups fed and still unfinished then
    are dropped (``in_flight``). :meth:`to_feed` says how many prompts to feed now: as many
    as, at the informative rate seen so far in this step (with one informative and one
    uninformative group of prior, so the first feed is 2 x ``want``), should finish the
    ``want - kept`` informative groups still missing, less those in flight. The decision
    depends only on the verdicts and their order, so a rerun or a resumed run feeds and
    picks alike."""

    want: int
    limit: int  # most prompts fed (train.dynamic_sampling.max_rounds x prompts_per_step)
    fed: int = 0
    kept: list[int] = dataclasses.field(default_factory=list)  # fed-order indices, informative, in finish order
    spare: list[int] = dataclasses.field(default_factory=list)  # uninformative, in finish order
    surplus: int = 0  # informative groups finished beyond `want` (at the boundary that filled the step)
    finished: int = 0

    def to_feed(self) -> int:
        """Prompts to feed now (0 once the step is done or the limit is fed)."""
        if self.done:
            return 0
        missing = self.want - len(self.kept)
        rate = (len(self.kept) + self.surplus + 1) / (self.finished + 2)
        need = math.ceil(missing / rate) - (self.fed - self.finished)
        return max(0, min(need, self.limit - self.fed))

    def add(self, group: int, informative: bool) -> None:
        """Record that fed group ``group`` finished, and its verdict."""
        if group >= self.fed:
            raise ValueError(f"group {group} finished but only {self.fed} were fed")
        self.finished += 1
        if not informative:
            self.spare.append(group)
        elif len(self.kept) < self.want:
            self.kept.append(group)
        else:
            self.surplus += 1

    @property
    def done(self) -> bool:
        return len(self.kept) == self.want or (self.fed == self.limit and self.finished == self.fed)

    @property
    def in_flight(self) -> int:
        """Groups fed and not finished (dropped when the step ends)."""
        return self.fed - self.finished

    def picks(self) -> tuple[list[int], int]:
        """``(groups, filled)``: the batch's ``want`` groups (fed-order indices) in batch
        order, the informative ones in finish order, then ``filled`` uninformative ones in
        finish order (zero advantage, as :meth:`GroupFilter.picks`)."""
        filled = self.want - len(self.kept)
        return self.kept + self.spare[:filled], filled

    def metrics(self) -> dict[str, float]:
        """:meth:`GroupFilter.metrics`' (``rounds`` as prompts fed / prompts_per_step),
        and ``dynamic_sampling/dropped_in_flight``: groups fed and unfinished when the step
        was full (dropped, partly rolled out, not in ``dropped_groups``)."""
        filled = self.want - len(self.kept)
        return {
            "dynamic_sampling/rounds": self.fed / self.want,
            "dynamic_sampling/uninformative_groups": float(len(self.spare)),
            "dynamic_sampling/dropped_groups": float(len(self.spare) - filled + self.surplus),
            "dynamic_sampling/dropped_in_flight": float(self.in_flight),
            "dynamic_sampling/filled_groups": float(filled),
            "dynamic_sampling/short": float(filled > 0),
        }


def selection_scores(totals: np.ndarray, components: dict[str, np.ndarray], num_generations: int) -> np.ndarray:
    """What down-sampling ranks each group's samples by, [G*K]: the total rewards, except
    in a group whose totals are all equal, which under turn credit takes the first of
    ``components`` (scope -> [G*K] weighted rewards, in scope order) that has a spread:
    the spread that can make the group informative. ``components`` empty (sequence
    credit): the totals."""
    k = num_generations
    scores = np.asarray(totals, np.float64).reshape(-1, k).copy()  # G K
    spread = group_spread(scores, k)
    for component in components.values():
        c = np.asarray(component, np.float64).reshape(-1, k)
        take = ~spread & group_spread(c, k)
        scores[take] = c[take]
        spread |= take
    return scores.reshape(-1)


def _spread_draw(row: np.ndarray, keep: int, rng: np.random.Generator) -> np.ndarray:
    """``keep`` of a group's samples, drawn from ``rng``: one uniformly among those above
    the group mean and one among those below it, the rest uniformly from the others, so
    a group with a spread keeps one; a uniform draw without a spread (or with keep < 2)."""
    above, below = np.flatnonzero(row > row.mean()), np.flatnonzero(row < row.mean())
    if keep < 2 or not (above.size and below.size):
        return rng.choice(len(row), size=keep, replace=False)
    pair = [int(rng.choice(above)), int(rng.choice(below))]
    rest = np.setdiff1d(np.arange(len(row)), pair)
    return np.concatenate([pair, rng.choice(rest, size=keep - 2, replace=False)])


def down_sample(rewards: np.ndarray, num_generations: int, keep: int, *, rule: str = "max_variance",
                rng: np.random.Generator | None = None) -> np.ndarray:
    """PODS's down-sampling (Xu et al. 2025): the rows [G*keep] to train on of ``rewards``
    [G*K] (row ``g*K + j``: sample j of group g; :func:`selection_scores`), ``keep`` of
    each group, ascending within their group, groups in order.

    ``max_variance``: the ``keep`` rewards of largest variance, which are the ``i`` highest
    and ``keep - i`` lowest of the group for some ``i`` (the paper's lemma), so each ``i``
    is tried over the sorted rewards in O(K log K); ties go to the smallest ``i``, then to
    the earlier row among equal rewards (a stable sort), so every process picks alike.
    ``random``: drawn from ``rng``, keeping the group's spread: one sample above the group
    mean and one below it (each uniform among its side), the other ``keep - 2`` uniformly
    from the rest; a group without a spread gets a uniform draw. A uniform subset instead
    loses the spread of rewards [1, 0, 0, 0] at keep 2 in half the draws, and the group
    then trains with zero advantage after the filter kept it for its spread."""
    groups = np.asarray(rewards, np.float64).reshape(-1, num_generations)  # G K
    n = num_generations
    if not 1 <= keep <= n:
        raise ValueError(f"keep must be in [1, {n}], got {keep}")
    picks = []
    for g, row in enumerate(groups):
        if rule == "random":
            if rng is None:
                raise ValueError("down_sample(rule='random') needs an rng")
            chosen = _spread_draw(row, keep, rng)
        elif rule == "max_variance":
            order = np.argsort(row, kind="stable")
            cum = np.concatenate([[0.0], np.cumsum(row[order])])
            cum2 = np.concatenate([[0.0], np.cumsum(row[order] ** 2)])
            top = np.arange(keep + 1)  # i highest, keep - i lowest
            total = cum[keep - top] + cum[n] - cum[n - top]
            total2 = cum2[keep - top] + cum2[n] - cum2[n - top]
            i = int(np.argmax(total2 / keep - (total / keep) ** 2))
            chosen = np.concatenate([order[:keep - i], order[n - i:]])
        else:
            raise ValueError(f"unknown down-sampling rule {rule!r}; choose max_variance or random")
        picks.append(g * n + np.sort(chosen))
    return np.concatenate(picks).astype(np.int64) if picks else np.zeros(0, np.int64)


__all__ = ["GroupFilter", "StreamFilter", "down_sample", "group_spread", "selection_scores"]
