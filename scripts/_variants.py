"""Benchmark variants named on the command line: ``name`` or ``name@key=value@env:NAME=value``."""

from __future__ import annotations


def parse_variant(variant: str, known: dict[str, dict]) -> dict:
    """The spec of ``variant`` in ``known``; ``@key=value`` parts add trainer overrides to an 'ours' variant,
    ``@env:NAME=value`` parts set an environment variable in the variant's processes (any variant).

    So one run can A/B a setting: ``ours-ddp,ours-ddp@distributed.split_tail=false``, or an Inductor knob for a
    baseline and ours alike: ``torch.compile@env:TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1``. The spec's
    ``env`` holds the variables (empty without any).
    """
    base, *parts = variant.split("@")
    if base not in known:
        raise SystemExit(f"--variants: unknown variant '{base}' (known: {', '.join(known)})")
    spec = dict(known[base])
    spec["env"] = {}
    overrides = []
    for part in parts:
        if part.startswith("env:"):
            name, sep, value = part[len("env:") :].partition("=")
            if not sep or not name:
                raise SystemExit(f"--variants: '{variant}': expected env:NAME=value, got '{part}'")
            spec["env"][name] = value
        else:
            overrides.append(part)
    if overrides:
        if spec["kind"] != "ours":
            raise SystemExit(f"--variants: '{variant}': overrides apply to ours-* variants only")
        spec["overrides"] = [*spec["overrides"], *overrides]
    return spec
