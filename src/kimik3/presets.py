"""Named configs shipped in the repository's `configs/` folder (`k3` = the released config.json)."""

from __future__ import annotations

from pathlib import Path

from kimik3.config import K3Config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def resolve_config(name_or_path: str | Path) -> Path:
    """A path to a config.json (or a checkpoint folder), or the name of a shipped preset (`k3`, `tiny`)."""
    p = Path(name_or_path)
    if p.exists():
        return p / "config.json" if p.is_dir() else p
    preset = CONFIG_DIR / f"{name_or_path}.json"
    if preset.is_file():
        return preset
    names = sorted(f.stem for f in CONFIG_DIR.glob("*.json")) if CONFIG_DIR.is_dir() else []
    raise FileNotFoundError(f"no config file or folder at '{name_or_path}', and no preset of that name "
                            f"(presets: {', '.join(names) or 'none found'})")


def load_config(name_or_path: str | Path) -> K3Config:
    return K3Config.from_file(resolve_config(name_or_path))

# the small K3 trained by our own trainer and shipped in the repository (see its MODEL_CARD.md)
DEMO_MODEL = Path(__file__).resolve().parents[2] / "models" / "k3-shakespeare"
