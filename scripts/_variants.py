"""Benchmark variants named on the command line: ``name`` or ``name@key=value@key=value``."""

from __future__ import annotations


def parse_variant(variant: str, known: dict[str, dict]) -> dict:
    """The spec of ``variant`` in ``known``; ``@key=value`` parts add trainer overrides to an 'ours' variant.

    So one run can A/B a setting: ``ours-ddp,ours-ddp@distributed.split_tail=false``.
    """
    base, *overrides = variant.split("@")
    if base not in known:
        raise SystemExit(f"--variants: unknown variant '{base}' (known: {', '.join(known)})")
    spec = dict(known[base])
    if overrides:
        if spec["kind"] != "ours":
            raise SystemExit(f"--variants: '{variant}': overrides apply to ours-* variants only")
        spec["overrides"] = [*spec["overrides"], *overrides]
    return spec
