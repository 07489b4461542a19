"""The run's one device mesh: data parallel (``replicate`` x ``shard``), context parallel (``cp``) and tensor
parallel (``tp``), resolved once from ``distributed.*`` into a :class:`Mesh` value (the plan holds it) and built
once with ``init_device_mesh``. No other place makes process groups.

The ranks are laid out row-major over ``(replicate, shard, cp, tp)``, as torchtitan's ``ParallelDims`` does:
``tp`` innermost, so a tensor-parallel group is consecutive ranks, within a node (its all-reduces run on every
layer); ``replicate`` outermost, so HSDP's all-reduce is the one collective that crosses nodes.

- The data-parallel ranks, which split the global batch, are ``replicate x shard``; the ranks of one ``cp`` and
  ``tp`` group read the same sequences (``cp`` slices each along its length).
- FSDP shards the parameters over ``shard x cp`` (context parallel ranks hold different tokens of the same
  sequences, so their gradients are reduced like data parallel ones) and, with ``replicate`` > 1, replicates that
  over ``replicate`` (HSDP: reduce-scatter within, all-reduce across).
- ddp replicates over every rank (``replicate`` = the world).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

DIMS = ("replicate", "shard", "cp", "tp")
"""The mesh's dimensions, outermost first: their config keys are ``distributed.<name>``."""


class LayoutError(ValueError):
    """A parallel layout that cannot run on these ranks (exit 2); the message names the keys and the numbers."""


@dataclass(frozen=True)
class Mesh:
    """The sizes of the mesh's dimensions (:data:`DIMS`), their product the world; ``device_mesh`` once
    :meth:`build` made it (torch's ``DeviceMesh``, None before and for one process)."""

    replicate: int = 1
    shard: int = 1
    cp: int = 1
    tp: int = 1
    device_mesh: object = field(default=None, compare=False, repr=False)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in DIMS)

    @property
    def world(self) -> int:
        return self.replicate * self.shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """The data-parallel ranks: those that split the global batch."""
        return self.replicate * self.shard

    @property
    def fsdp_ranks(self) -> int:
        """The ranks FSDP shards each parameter over: ``shard x cp``."""
        return self.shard * self.cp

    def coordinate(self, rank: int) -> dict[str, int]:
        """``rank``'s index in each dimension (row-major over :data:`DIMS`)."""
        out = {}
        for name, size in reversed(list(zip(DIMS, self.sizes))):
            out[name] = rank % size
            rank //= size
        return {d: out[d] for d in DIMS}

    def dp_rank(self, rank: int) -> int:
        """``rank``'s data-parallel index: which slice of the global batch it reads."""
        c = self.coordinate(rank)
        return c["replicate"] * self.shard + c["shard"]

    def groups(self, name: str) -> list[list[int]]:
        """The ranks of each group along dimension ``name`` (those that differ in it alone), in rank order."""
        out: dict[tuple, list[int]] = {}
        for rank in range(self.world):
            c = self.coordinate(rank)
            out.setdefault(tuple(v for d, v in c.items() if d != name), []).append(rank)
        return list(out.values())

    def __str__(self) -> str:
        return " x ".join(f"{d} {s}" for d, s in zip(DIMS, self.sizes))

    def describe(self, rank: int) -> str:
        """The mesh and ``rank``'s place in it, e.g. ``replicate 2 x shard 2 x cp 1 x tp 1; rank 3 at (1, 1, 0,
        0)``."""
        at = ", ".join(str(v) for v in self.coordinate(rank).values())
        return f"{self}; rank {rank} at ({at})"

    def as_dict(self, rank: int) -> dict:
        """For ``plan.json``: each dimension's size, and ``rank``'s coordinates."""
        return {"sizes": dict(zip(DIMS, self.sizes)), "coordinate": self.coordinate(rank)}

    # -- torch's DeviceMesh and its submeshes ------------------------------------------------------------------

    def build(self, device_type: str) -> Mesh:
        """This mesh with its ``DeviceMesh`` made (every rank calls this once, after the process group exists): one
        dimension for each of size > 1, and ``shard`` always (FSDP needs a mesh to apply even at size 1); ``shard``
        and ``cp`` flattened into ``shard_cp`` when both are there (FSDP's)."""
        from torch.distributed.device_mesh import init_device_mesh

        names = [d for d, s in zip(DIMS, self.sizes) if s > 1 or d == "shard"]
        mesh = init_device_mesh(device_type, tuple(getattr(self, d) for d in names), mesh_dim_names=tuple(names))
        if self.cp > 1:
            mesh["shard", "cp"]._flatten("shard_cp")  # pinned by tests/test_mesh.py: a private API of DeviceMesh
        return replace(self, device_mesh=mesh)

    def fsdp_mesh(self):
        """FSDP's mesh: ``shard`` (``shard_cp`` with context parallel), with ``replicate`` before it for HSDP."""
        inner = "shard_cp" if self.cp > 1 else "shard"
        return self.device_mesh["replicate", inner] if self.replicate > 1 else self.device_mesh[inner]

    def tp_mesh(self):
        """The tensor-parallel dimension's mesh."""
        return self.device_mesh["tp"]

    def cp_mesh(self):
        """The context-parallel dimension's mesh."""
        return self.device_mesh["cp"]


def resolve(
    strategy: str, *, replicate: int, shard: int, cp: int, tp: int, world: int, local_world: int | None = None
) -> tuple[Mesh, list[str]]:
    """The mesh ``distributed.*`` asks for on ``world`` ranks (``local_world`` of them on this node), and notes for
    the log (a layout that has no effect in one process).

    Raises:
        LayoutError: a product that is not the world size, a ``shard=-1`` the rest cannot fill, tensor or context
            parallel without fsdp, ddp asked to shard, a ``tp`` larger than a node.
    """
    given = {"replicate": replicate, "shard": shard, "cp": cp, "tp": tp}
    asked = {k: v for k, v in given.items() if v not in (1, -1 if k == "shard" else 1)}
    if world == 1:
        notes = [f"distributed.{k}={v} has no effect in a single process (no torchrun)" for k, v in asked.items()]
        return Mesh(), notes
    if (tp > 1 or cp > 1) and strategy != "fsdp":
        key = "tp" if tp > 1 else "cp"
        raise LayoutError(
            f"distributed.{key}={given[key]} needs distributed.strategy=fsdp (got {strategy}): tensor and context "
            "parallel compose with FSDP on the data-parallel dimensions"
        )
    if strategy == "none":  # several processes, one model each: refused where the model is wrapped
        return Mesh(replicate=world), []
    if strategy == "ddp":
        if shard not in (-1, 1) or replicate not in (1, world):
            raise LayoutError(
                f"distributed.strategy=ddp replicates the model on every rank (distributed.replicate={world}, "
                f"distributed.shard=1); got replicate={replicate}, shard={shard}. To shard, set "
                "distributed.strategy=fsdp (replicate x shard is HSDP)"
            )
        return Mesh(replicate=world), []
    others = replicate * cp * tp
    if shard == -1:
        if world % others:
            raise LayoutError(
                f"distributed.shard=-1 takes the ranks the other dimensions leave, but {world} ranks are not a "
                f"multiple of distributed.replicate ({replicate}) x cp ({cp}) x tp ({tp}) = {others}"
            )
        shard = world // others
    if replicate * shard * cp * tp != world:
        raise LayoutError(
            f"distributed.replicate ({replicate}) x shard ({shard}) x cp ({cp}) x tp ({tp}) = "
            f"{replicate * shard * cp * tp}, but the job has {world} ranks; set distributed.shard=-1 to take the "
            "rest, or sizes whose product is the world size"
        )
    local = local_world if local_world is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if tp > 1 and (tp > local or local % tp):
        raise LayoutError(
            f"distributed.tp={tp} is larger than a node's {local} ranks (or does not divide them): a tensor-parallel "
            "group all-reduces on every layer and must stay on one node's fast links; use distributed.tp <= "
            f"{local} (a divisor of it), and shard or replicate across nodes"
        )
    return Mesh(replicate=replicate, shard=shard, cp=cp, tp=tp), []
