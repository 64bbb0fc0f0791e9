"""Asynchronous GRPO in a plan (``train.async.enabled``): the rollout and the update on
their own meshes at once, the new weights moved to the rollout mesh after each update.

Each side is compiled on its own devices (:meth:`~grpo.engine.planning.plan.Planner.side`):
the rollout mesh is the first ``train.async.rollout_devices`` devices (whole hosts when the
topology has several; default half) in the rollout style's layout, the update mesh the
rest in the training layout. Split by hosts, the weights move as the run moves them
(:func:`weight_sync_by_processes`), over ICI within a slice or the data-center network
between slices (:func:`sync_link`). In one host, the weight transfer is one resharding
copy of the rollout's weights: each rollout chip receives its shard (the rollout state's bytes per chip), and
the update chips send all the rollout chips' shards between them; its time is the larger
of the two per chip over half the chip's bidirectional ICI bandwidth, as the plan's
collectives (one slice: ICI even across hosts).

A step then costs ``max(rollout, update + sync)`` (:func:`pipelined`) against the
synchronous ``rollout + update`` on all the devices. The rollout's figure is the whole
batch (one-step-off: every row of the step decoded on the rollout mesh), and with the
continuous engine under a length profile also its steady state (partial rollouts: rows
run on across a weight update, so the rollout costs the step's valid tokens at its cost
per valid token, :func:`grpo.engine.planning.engine.steady_state`).
"""

from __future__ import annotations

from typing import Any

from grpo.core.errors import UserError


def split_devices(*, devices: int, per_process: int, processes: int, rollout_devices: int | None) -> tuple[int, int]:
    """``(rollout, update)`` device counts: the first ``rollout_devices`` (None: half) for
    the rollout; with several hosts, whole hosts only. Refuses a split that leaves a side
    without devices, naming the field."""
    k = devices // 2 if rollout_devices is None else rollout_devices
    if processes > 1 and rollout_devices is None:  # the run's default (split.default_rollout_devices)
        k = (processes // 2) * per_process
    if not 0 < k < devices:
        raise UserError(f"train.async.rollout_devices={k} must leave devices to both sides: between 1 and "
                        f"{devices - 1} of the topology's {devices}.")
    if processes > 1 and k % per_process:
        raise UserError(f"train.async.rollout_devices={k}: with {processes} hosts of {per_process} devices the "
                        f"split is by whole hosts (a multiple of {per_process}).")
    return k, devices - k


def weight_sync(*, rollout_bytes_per_chip: float, rollout_chips: int, update_chips: int,
                ici_bandwidth: float, adapter_bytes_per_chip: float | None = None) -> dict[str, Any]:
    """One step's transfer of the rollout's weights from the update mesh: bytes each
    rollout chip receives and each update chip sends (all the rollout chips' shards, split
    evenly), time ``max(received, sent) / (ici_bandwidth / 2)``. Under LoRA
    (``adapter_bytes_per_chip``: the adapters as the rollout side holds them) a step moves
    only the adapters; the base moved once, at the start (``full_bytes_per_chip``: what a
    step would move with the whole weights; ``share``: the step's part of it)."""
    full = rollout_bytes_per_chip
    received = full if adapter_bytes_per_chip is None else adapter_bytes_per_chip
    sent = received * rollout_chips / update_chips
    return {"received_bytes_per_chip": received, "sent_bytes_per_chip": sent,
            "seconds": max(received, sent) / (ici_bandwidth / 2),
            "moves": "weights" if adapter_bytes_per_chip is None else "adapters",
            "full_bytes_per_chip": full, "share": received / full if full else None}


def sync_link(chip: Any, rollout: list[Any], update: list[Any]) -> dict[str, Any]:
    """What the weights cross between the sides (``rollout``/``update``: the devices, with
    their ``slice_index``), paired as the exchange pairs them
    (:func:`~grpo.engine.parallel.exchange.route`: rollout device ``i`` and update device
    ``i mod len(update)``, and back): ``ici`` when every pair is on one slice (ICI links a
    slice's chips even across hosts), else ``dcn`` (the data-center network, at the chip's
    share of its host's NICs, ``chip.dcn_bandwidth``): ``{"link", "bandwidth_bytes_per_s"}``,
    the bandwidth one chip receives at."""
    def slice_of(d):
        return getattr(d, "slice_index", 0) or 0

    k, u = len(rollout), len(update)
    pairs = [(rollout[i], update[i % u]) for i in range(k)] + [(rollout[j % k], update[j]) for j in range(u)]
    if any(slice_of(a) != slice_of(b) for a, b in pairs):
        return {"link": "dcn", "bandwidth_bytes_per_s": chip.dcn_bandwidth}
    return {"link": "ici", "bandwidth_bytes_per_s": chip.ici_bandwidth / 2}


def weight_sync_by_processes(*, sent_bytes: float, rollout_chips: int, update_chips: int,
                             link: str = "ici", bandwidth_bytes_per_s: float) -> dict[str, Any]:
    """One on-device move of the weights between sides of whole hosts, as the run makes it
    (:meth:`~grpo.engine.parallel.exchange.SideExchange.swap_arrays`): the sent tree
    (``sent_bytes``, whole) arrives on every rollout chip, each update chip sending it
    once a round, ``ceil(rollout / update)`` rounds; the time is ``max(received, sent) /
    bandwidth`` over the ``link`` :func:`sync_link` names (ICI within a slice: half the
    chip's bidirectional figure; DCN across slices: the chip's share of its host's NICs)
    (``bytes``: what ``weight_sync/bytes`` logs)."""
    rounds = -(-rollout_chips // update_chips)
    received, sent = sent_bytes, sent_bytes * rounds
    return {"received_bytes_per_chip": received, "sent_bytes_per_chip": sent, "bytes": sent_bytes, "link": link,
            "seconds": max(received, sent) / bandwidth_bytes_per_s}


def pipelined(*, rollout_s: float, update_s: float, sync_s: float) -> float:
    """The pipelined step: the rollout of the next steps runs while the update trains on
    this one and then sends its weights."""
    return max(rollout_s, update_s + sync_s)


def async_section(*, split: tuple[int, int], synchronous_s: float, rollout: dict[str, Any], update_s: float,
                  sync: dict[str, float], valid_tokens: float | None, update_fits: bool,
                  rollout_fits: bool) -> dict[str, Any]:
    """The ``async`` section of a plan: the pipelined step beside the synchronous one,
    whole-batch and (where there is one) with partial rollouts (``rollout``: ``whole_s``
    and optionally ``steady_s``; ``engine`` and ``costed_as`` say how ``whole_s`` was
    costed)."""
    whole = pipelined(rollout_s=rollout["whole_s"], update_s=update_s, sync_s=sync["seconds"])
    out: dict[str, Any] = {
        "rollout_devices": split[0], "update_devices": split[1],
        "synchronous_step_s": synchronous_s, "rollout_s": rollout["whole_s"], "update_s": update_s,
        "weight_sync": sync, "pipelined_step_s": whole, "ratio": whole / synchronous_s if synchronous_s else None,
        "rollout_fits": rollout_fits, "update_fits": update_fits, "fits": rollout_fits and update_fits,
        # How the rollout side was costed (as the synchronous headline: the programs at the
        # cap, or the config's engine's simulated schedule).
        "rollout_engine": rollout.get("engine"), "rollout_costed_as": rollout.get("costed_as"),
    }
    if rollout.get("steady_s") is not None:
        part = pipelined(rollout_s=rollout["steady_s"], update_s=update_s, sync_s=sync["seconds"])
        out.update({"rollout_partial_s": rollout["steady_s"], "rollout_slots": rollout.get("slots"),
                    "pipelined_partial_step_s": part,
                    "partial_ratio": part / synchronous_s if synchronous_s else None})
    if valid_tokens:
        out["valid_tokens_per_step"] = valid_tokens
        out["valid_tokens_per_s_synchronous"] = valid_tokens / synchronous_s
        out["valid_tokens_per_s"] = valid_tokens / whole
        if "pipelined_partial_step_s" in out:
            out["valid_tokens_per_s_partial"] = valid_tokens / out["pipelined_partial_step_s"]
    return out


__all__ = ["async_section", "pipelined", "split_devices", "sync_link", "weight_sync", "weight_sync_by_processes"]
