"""A model's calibration bundle: the three measurements the scheduler decides with, and what they
were made for.

``dls calibrate`` writes one bundle for one model on one kind of device, by default inside the
model's directory (``<model>/calibration/``; ``DLS_CALIBRATION_DIR`` or ``--out`` put it elsewhere)::

    calibration/
      manifest.json     what it was made for (weights, tokenizer, device, dtype, torch, attention
                        backend), when, with which arguments, and each artefact's headline figures
      profile.json      step latencies per kind, batch size and TP degree (``shared.profiles``)
      predictor/        the step predictor (model.txt, recompute.txt, card.json) and oneshot/
      quality.json      accuracy per candidate threshold (``services.scheduler.core.threshold``)

Every service finds the bundle of the model it serves through ``find`` (the model directory and
``DLS_CALIBRATION_DIR``, ``ServiceSettings.calibration_dir``), and refuses one made for other weights
or another tokenizer (``CalibrationMismatch``, naming what differs). Its quality curve and predictor
follow the weights; its profile follows the device too, so a worker on another kind of device (or
another GPU model) refuses the profile alone, naming the difference (``profile_refusal``), and
measures its step times instead, as for an uncalibrated model. A model with no bundle is *uncalibrated*: the
services say so and serve it without steering blind (the highest candidate threshold only, step
times the workers measure, a model-free bound on the steps left; README "Serving your own
checkpoint").

The weights are identified by a fingerprint, not a full hash: the config, the tokenizer files, and
each weight file's name, size and a sample of its bytes (its first and last MiB and 16 slices
between), so that a service starting on a 16 GB checkpoint checks it in milliseconds; a fine-tune,
which changes every tensor, changes the sample.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

FORMAT = "dls-calibration/1"
DIRECTORY = "calibration"  # inside the model's directory
MANIFEST = "manifest.json"
PROFILE = "profile.json"
PREDICTOR = "predictor"
ONE_SHOT = "oneshot"  # inside PREDICTOR
QUALITY = "quality.json"

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json")
_SAMPLE = 1 << 20  # bytes read at each end of a weight file
_SLICES = 16  # and this many slices of 64 KiB between
_SLICE = 1 << 16
HOW_TO = "dls calibrate --model {model} (README: Serving your own checkpoint)"


class CalibrationError(ValueError):
    """A calibration bundle that cannot be used (unreadable, incomplete); the message says what."""


class CalibrationMismatch(CalibrationError):
    """A bundle made for other weights or another kind of device; the message names what differs."""


def _file_digest(path: Path, whole: bool) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        if whole or size <= 2 * _SAMPLE + _SLICES * _SLICE:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        else:
            offsets = [0, size - _SAMPLE]
            step = (size - 2 * _SAMPLE) // (_SLICES + 1)
            offsets[1:1] = [_SAMPLE + step * (i + 1) for i in range(_SLICES)]
            for offset in offsets:
                f.seek(offset)
                digest.update(f.read(_SAMPLE if offset in (0, size - _SAMPLE) else _SLICE))
    return digest.hexdigest()


def weights_fingerprint(model_dir: str | Path) -> str:
    """A short hash of the config and the weight files (sampled: module docstring)."""
    directory = Path(model_dir)
    digest = hashlib.sha256()
    config = directory / "config.json"
    if config.exists():
        digest.update(_file_digest(config, whole=True).encode())
    weights = sorted(p for p in directory.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        raise CalibrationError(f"{directory} has no weight file ({', '.join(WEIGHT_SUFFIXES)})")
    for path in weights:
        digest.update(_file_digest(path, whole=False).encode())
    return digest.hexdigest()[:16]


def tokenizer_fingerprint(model_dir: str | Path) -> str:
    directory = Path(model_dir)
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (directory / name).exists():
            digest.update(_file_digest(directory / name, whole=True).encode())
    return digest.hexdigest()[:16]


def device_kind(device: str) -> str:
    """``cpu`` or ``cuda`` (a ``cuda:N`` names a GPU of that kind)."""
    return device.split(":", 1)[0]


@dataclass(frozen=True)
class Calibration:
    """A bundle on disk and its manifest (``load`` checks that its artefacts are there)."""

    directory: Path
    manifest: dict

    @property
    def made_for(self) -> dict:
        return self.manifest["made_for"]

    @property
    def device(self) -> str:
        """The kind of device its profile was measured on: ``cpu`` or ``cuda``."""
        return self.made_for["device"]

    @property
    def device_name(self) -> str:
        return self.made_for.get("device_name", "")

    @property
    def profile_path(self) -> Path:
        return self.directory / PROFILE

    @property
    def predictor_dir(self) -> Path:
        return self.directory / PREDICTOR

    @property
    def quality_path(self) -> Path:
        return self.directory / QUALITY

    @property
    def label(self) -> str:
        """One line for logs: where, for what, when."""
        return (f"{self.directory} ({self.made_for.get('model', '?')} on {self.device} "
                f"{self.device_name}, made {self.manifest.get('created', '?')})")

    def _device_difference(self, device: str, device_name: str | None) -> str | None:
        """What differs between the device it was made on and ``device``: the kind, or on CUDA the GPU model
        (where both are known); None when nothing does."""
        if device_kind(device) != self.device:
            return f"device {self.device} vs {device_kind(device)}"
        if device_name and self.device == "cuda" and self.device_name and device_name != self.device_name:
            return f"GPU {self.device_name!r} vs {device_name!r}"
        return None

    def profile_refusal(self, device: str, device_name: str | None = None) -> str | None:
        """Why its profile does not time steps on ``device`` (another kind of device, or on CUDA another
        GPU model), or None."""
        difference = self._device_difference(device, device_name)
        if difference is None:
            return None
        return (f"the profile of {self.directory} was measured on another device ({difference}): not used; "
                f"calibrate for this one: dls calibrate --model <model> --device {device_kind(device)} --only profile")

    def check(self, model_dir: str | Path, device: str | None = None, device_name: str | None = None) -> None:
        """Refuse (``CalibrationMismatch``) a bundle made for other weights, another tokenizer or, where
        ``device`` is given, another kind of device (on CUDA, another GPU model when ``device_name`` is)."""
        made = self.made_for
        differences = []
        weights = weights_fingerprint(model_dir)
        if made.get("weights") != weights:
            differences.append(f"weights {made.get('weights')} (made for) vs {weights} (served)")
        tokenizer = tokenizer_fingerprint(model_dir)
        if made.get("tokenizer") != tokenizer:
            differences.append(f"tokenizer {made.get('tokenizer')} vs {tokenizer}")
        difference = self._device_difference(device, device_name) if device is not None else None
        if difference is not None:
            differences.append(difference)
        if differences:
            raise CalibrationMismatch(
                f"the calibration {self.directory} was made for another model or device than {model_dir}"
                f"{' on ' + device if device else ''}: {'; '.join(differences)}; calibrate this one: "
                + HOW_TO.format(model=model_dir)
                + (f" --device {device_kind(device)}" if device else ""))


def bundle_dir(model_dir: str | Path, calibration_dir: str | Path | None = None) -> Path:
    """Where the bundle of ``model_dir`` is (or goes): ``calibration_dir`` if set, else inside the model."""
    return Path(calibration_dir) if calibration_dir else Path(model_dir) / DIRECTORY


def load(directory: str | Path) -> Calibration:
    """The bundle in ``directory``; ``CalibrationError`` naming what is missing or unreadable."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise CalibrationError(f"{directory} has no {MANIFEST}: not a calibration bundle") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{directory / MANIFEST}: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise CalibrationError(f"{directory / MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    if not isinstance(manifest.get("made_for"), dict) or "device" not in manifest["made_for"]:
        raise CalibrationError(f"{directory / MANIFEST}: no made_for.device")
    calibration = Calibration(directory, manifest)
    missing = [str(p.relative_to(directory)) for p in (calibration.profile_path, calibration.quality_path,
                                                        calibration.predictor_dir / "model.txt")
               if not p.exists()]
    if missing:
        raise CalibrationError(f"the calibration {directory} is incomplete: no {', '.join(missing)} "
                               "(`dls calibrate` resumes where it stopped)")
    return calibration


def find(model_dir: str | Path, calibration_dir: str | Path | None = None, device: str | None = None,
         device_name: str | None = None) -> Calibration | None:
    """The checked bundle of ``model_dir`` (``calibration_dir`` if set, else ``<model>/calibration``), or
    None when there is none (the model is uncalibrated). A bundle that is there but incomplete or made
    for something else is an error, never silently ignored."""
    directory = bundle_dir(model_dir, calibration_dir)
    if not calibration_dir and not (directory / MANIFEST).exists():
        return None
    calibration = load(directory)
    calibration.check(model_dir, device, device_name)
    return calibration


def of_service(settings, device: str | None = None, device_name: str | None = None) -> Calibration | None:
    """The checked bundle of the model a service serves (its ``model_dir`` and ``calibration_dir``
    settings, ``shared.settings``), or None: uncalibrated."""
    return find(settings.model_dir, settings.calibration_dir or None, device, device_name)


def uncalibrated_message(model_dir: str | Path) -> str:
    """What every service says about a model served without a calibration."""
    return (f"{model_dir} is uncalibrated (no {Path(model_dir) / DIRECTORY / MANIFEST}): it is served at the "
            "highest candidate threshold only, planned with the step times the workers measure and a "
            f"model-free bound on the steps left; calibrate it: {HOW_TO.format(model=model_dir)}")


def made_for(model_dir: str | Path, device: str, device_name: str, dtype: str, torch_version: str,
             attention_backend: str) -> dict:
    """The manifest's ``made_for``: what a bundle measured (``Calibration.check`` compares the first
    three with what a service serves; the rest is said in logs and on ``/v1/models``)."""
    return {
        "model": Path(model_dir).resolve().name,
        "weights": weights_fingerprint(model_dir),
        "tokenizer": tokenizer_fingerprint(model_dir),
        "device": device_kind(device),
        "device_name": device_name,
        "dtype": dtype,
        "torch": torch_version,
        "attention_backend": attention_backend,
    }


def write_manifest(directory: str | Path, manifest: dict) -> Path:
    """Write ``manifest.json`` atomically (the last file a finished calibration writes)."""
    path = Path(directory) / MANIFEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **manifest}, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path
