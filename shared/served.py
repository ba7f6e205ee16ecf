"""The served models: which they are, what each is called and which calibration bundle it reads.

One home for what every model-serving service (gateway, scheduler, predictor, reconfigurator, node agent)
and ``dls up`` decide about the models a cluster serves:

- the list: a service's ``served_model_dirs`` (``shared.settings.ServesModels``: ``model_dirs``, else the
  one ``model_dir``), in order, the first served first;
- a model's name: its directory's basename, as requests, heartbeats and plans name it (``model_name``;
  a path with none, such as ``.``, is named by the directory it resolves to);
- two directories of one name are refused (``DuplicateModelName``, naming the setting and both);
- ``DLS_CALIBRATION_DIR`` (``ServiceSettings.calibration_dir``, ``dls up --calibration``) is the first
  model's calibration bundle; every other model reads the bundle inside its own directory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.calibration import find

if TYPE_CHECKING:
    from shared.calibration import Calibration


class DuplicateModelName(ValueError):
    """Two served directories share a basename, so one name would mean two models."""

    def __init__(self, setting: str, name: str, first: str, second: str) -> None:
        super().__init__(f"{setting}: {first} and {second} are both the model {name!r} (a model's name is its "
                         "directory's basename): rename one")
        self.setting = setting  # the setting that lists them (a service's, or a flag)
        self.name = name  # the name they share
        self.directories = (first, second)  # the two directories, in the setting's order


def model_name(directory: str | Path) -> str:
    """A served model's name: its directory's basename (what requests, heartbeats and plans call it; no
    symlink is resolved), or, for a path with none (``.``), that of the directory it resolves to."""
    path = Path(directory)
    return path.name or path.resolve().name


@dataclass(frozen=True)
class ServedModelDir:
    """One served model, as the settings give it."""

    name: str  # its name: the directory's basename (``model_name``)
    directory: str  # its directory, as the setting spells it
    calibration_dir: str = ""  # its calibration bundle's directory ("": the one inside the model)

    def calibration(self, device: str | None = None, device_name: str | None = None) -> Calibration | None:
        """Its checked calibration bundle (``shared.calibration.find``: ``CalibrationMismatch`` naming what
        differs when made for other weights), or None: uncalibrated."""
        return find(self.directory, self.calibration_dir or None, device, device_name)


def served_models(model_dirs: Iterable[str | Path], calibration_dir: str | Path = "",
                  setting: str = "DLS_MODEL_DIRS") -> list[ServedModelDir]:
    """The served models of ``model_dirs``, in order: each named by its basename, ``calibration_dir``
    (``DLS_CALIBRATION_DIR``) the first one's, the others' inside them. ``DuplicateModelName`` naming
    ``setting`` and both directories when two share a name."""
    by_name: dict[str, ServedModelDir] = {}  # model name -> the model
    for i, directory in enumerate(model_dirs):
        name = model_name(directory)
        if name in by_name:
            raise DuplicateModelName(setting, name, by_name[name].directory, str(directory))
        by_name[name] = ServedModelDir(name, str(directory), str(calibration_dir or "") if i == 0 else "")
    return list(by_name.values())


def served_models_of(settings, setting: str) -> list[ServedModelDir]:
    """The models a service's settings serve (``served_model_dirs``, ``calibration_dir``); ``setting``:
    the variable its errors name (``DLS_<SERVICE>_MODEL_DIRS``)."""
    return served_models(settings.served_model_dirs, settings.calibration_dir, setting)
