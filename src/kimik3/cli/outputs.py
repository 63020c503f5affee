"""The one rule for every command that writes files: never where it would overwrite what it reads.

`kimik3 lora merge BASE ADAPTER BASE` once replaced the installed demo model by its own merge. An output that is an
input, contains one (a folder around it) or lies inside one is refused before anything loads, whichever command
(convert, lora merge, atlas, train's out_dir, generate --output, GGUF export) and whatever path spells it (symlinks
and `..` resolved). Writing beside an input is fine.
"""

from __future__ import annotations

from pathlib import Path


def check_output(output: str | Path, flag: str, inputs: dict[str, str | Path | None]) -> None:
    """Raise ValueError if the path `output` (named `flag` in the message) is, contains or lies inside one of
    `inputs` ({its flag or argument name: path}; None entries are skipped). Paths need not exist yet."""
    out = Path(output).expanduser().resolve()
    for name, given in inputs.items():
        if given is None:
            continue
        src = Path(given).expanduser().resolve()
        if out == src:
            how = "is"
        elif out in src.parents:
            how = "contains"
        elif src in out.parents:
            how = "lies inside"
        else:
            continue
        raise ValueError(f"{flag} {output} {how} {name} {given}: writing there would overwrite what this command "
                         "reads; choose another output path")
