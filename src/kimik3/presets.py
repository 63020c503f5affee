"""Named configs and the demo model, shipped inside the package (found the same way from a source checkout, an
editable install or a wheel; nothing here reads the repository).

    kimik3/configs/<name>.json      presets: `k3` (the released config.json), `tiny`, `demo`, `mid`, `slice-*`
    kimik3/configs/train/<name>.toml  training presets (`kimik3 train tiny`); their data and tokenizer paths
                                    start with `{kimik3}/` (the package folder) where the package ships them
    kimik3/demo/k3-shakespeare/     the small K3 trained by our own trainer (its MODEL_CARD.md)
    kimik3/demo/k3-shakespeare-draft/  its speculative drafter: the drafter preset `demo-draft`

The repository's `configs/*.json` and `configs/train` are links into the first folder, so `configs/tiny.json` and
`configs/train/tiny.toml` work from its root.
"""

from __future__ import annotations

from pathlib import Path

from kimik3.config import K3Config

PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE_DIR / "configs"
TRAIN_CONFIG_DIR = CONFIG_DIR / "train"
DEMO_MODEL = PACKAGE_DIR / "demo" / "k3-shakespeare"
DEMO_DRAFTER = PACKAGE_DIR / "demo" / "k3-shakespeare-draft"  # its DSpark-style drafter (docs/speculative.md)


# drafter presets (`--speculative-model demo-draft`), and the drafter a shipped model runs with
# `--speculative-method draft` when none is named
DRAFTER_PRESETS = {"demo-draft": DEMO_DRAFTER}
SHIPPED_DRAFTERS = {DEMO_MODEL: DEMO_DRAFTER}


def resolve_drafter(name_or_path: str | Path | None, model: str | Path | None) -> Path:
    """The drafter folder for `--speculative-method draft`: a folder, a drafter preset (`demo-draft`), or, when
    None, the one shipped with `model` (None: the demo model). An existing folder wins over a preset name."""
    if name_or_path is None:
        target = Path(model).resolve() if model is not None else DEMO_MODEL
        if target not in SHIPPED_DRAFTERS:
            raise ValueError(f"--speculative-method draft needs --speculative-model PATH (the drafter's folder): "
                             f"no drafter ships with {model}; presets: {', '.join(DRAFTER_PRESETS)}")
        return SHIPPED_DRAFTERS[target]
    p = Path(name_or_path)
    if p.is_dir():
        return p
    if str(name_or_path) in DRAFTER_PRESETS:
        return DRAFTER_PRESETS[str(name_or_path)]
    raise FileNotFoundError(f"--speculative-model {name_or_path}: no such folder, and no drafter preset of that name "
                            f"(presets: {', '.join(DRAFTER_PRESETS)})")


def preset_names() -> list[str]:
    return sorted(f.stem for f in CONFIG_DIR.glob("*.json"))


def resolve_config(name_or_path: str | Path) -> Path:
    """A path to a config.json (or a checkpoint folder), or the name of a shipped preset (`k3`, `tiny`, ...).

    An existing path wins over a preset of the same name.
    """
    p = Path(name_or_path)
    if p.exists():
        return p / "config.json" if p.is_dir() else p
    preset = CONFIG_DIR / f"{name_or_path}.json"
    if preset.is_file():
        return preset
    raise FileNotFoundError(f"no config file or folder at '{name_or_path}', and no preset of that name "
                            f"(presets: {', '.join(preset_names()) or 'none found'})")


def load_config(name_or_path: str | Path) -> K3Config:
    return K3Config.from_file(resolve_config(name_or_path))


def train_preset_names() -> list[str]:
    return sorted(f.stem for f in TRAIN_CONFIG_DIR.glob("*.toml"))


def resolve_train_config(name_or_path: str | Path) -> Path:
    """A training TOML file, or the name of a shipped training preset (`tiny`, `demo`, `mid`, `demo-draft`).

    An existing file wins over a preset of the same name.
    """
    p = Path(name_or_path)
    if p.is_file():
        return p
    preset = TRAIN_CONFIG_DIR / f"{name_or_path}.toml"
    if not p.suffix and preset.is_file():
        return preset
    raise FileNotFoundError(f"no training config at {name_or_path}, and no training preset of that name (presets: "
                            f"{', '.join(train_preset_names()) or 'none found'})")
