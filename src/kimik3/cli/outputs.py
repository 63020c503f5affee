"""The one rule for every command that writes files: never where it would overwrite what it reads.

`kimik3 lora merge BASE ADAPTER BASE` once replaced the installed demo model by its own merge. An output that is an
input, contains one (a folder around it) or lies inside one is refused before anything loads, whichever command
(convert, lora merge, lora export, atlas, train's out_dir, generate --output; a GGUF input counts with every part
of its gguf-split set) and whatever path spells it (symlinks and `..` resolved). Writing beside an input is fine.
"""

from __future__ import annotations

from pathlib import Path


def check_output(output: str | Path, flag: str, inputs: dict[str, str | Path | None]) -> None:
    """Raise ValueError if the path `output` (named `flag` in the message) is, contains or lies inside one of
    `inputs` ({its flag or argument name: path}; None entries are skipped), or is another part of an input's
    gguf-split set. Paths need not exist yet."""
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
        elif out in _gguf_parts(src):
            how = "is a gguf-split part of"
        else:
            continue
        raise ValueError(f"{flag} {output} {how} {name} {given}: writing there would overwrite what this command "
                         "reads; choose another output path")


def _gguf_parts(path: Path) -> list[Path]:
    """Every file of the GGUF at `path` (one part names its whole gguf-split set); nothing for anything else."""
    if not (path.name.endswith(".gguf") and path.is_file()):
        return []
    from kimik3.checkpoint.gguf_read import gguf_parts

    return [p.resolve() for p in gguf_parts(path)]
