"""The bundle directory as `dls calibrate` fills it, and what makes it resumable.

Every file is written atomically (a temporary file, then a rename), the artefacts of
``shared.calibration``'s layout at the top and the intermediate files under ``work/``:

    work/<stage>.json            a finished stage: the key it was made with, its headline figures,
                                 what it was made for, its seconds
    work/profile-partial.json    step times measured so far (per TP degree and batch)
    work/traces-<split>.csv      collected predictor traces (+ .json: their key, rows, seconds)
    work/quality/<mode>-<t>.json one threshold's answers and scores

A *key* is a flat dict of what a result depends on (argument values, file digests, the weights'
fingerprint, the device). A rerun keeps a result whose key is the same and redoes one whose key is
not, saying what changed. ``manifest.json`` is removed before anything is redone and written last
(``shared.calibration.write_manifest``), so a stopped run leaves none: services then treat the model as
uncalibrated.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from shared.calibration import MANIFEST, PREDICTOR

WORK = "work"
STAGES = ("profile", "predictor", "quality")


def write_json(path: Path, data) -> Path:
    """``data`` as JSON at ``path``, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_json(path: Path) -> dict | None:
    """A JSON object written by ``write_json`` (None when missing or unreadable: redone)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def key_changes(old: dict | None, new: dict) -> list[str]:
    """What differs between two keys, one ``name: old -> new`` each."""
    if old is None:
        return []
    names = list(dict.fromkeys([*new, *old]))
    return [f"{n}: {_short(old.get(n))} -> {_short(new.get(n))}" for n in names if old.get(n) != new.get(n)]


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


class Bundle:
    """A bundle directory being made."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.work = self.directory / WORK

    def check_writable(self) -> str | None:
        """Why the bundle cannot be written here (None: it can)."""
        try:
            self.work.mkdir(parents=True, exist_ok=True)
            probe = self.work / ".probe"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            return f"cannot write {self.directory} ({exc.strerror or exc})"
        return None

    def path(self, name: str) -> Path:
        return self.directory / name

    def work_path(self, name: str) -> Path:
        return self.work / name

    # --- finished stages ------------------------------------------------------------------------

    def record(self, stage: str) -> dict | None:
        return read_json(self.work_path(f"{stage}.json"))

    def status(self, stage: str, key: dict, artefact: Path) -> tuple[bool, list[str]]:
        """(done with this key and its artefact there, what changed since the last run of it)."""
        record = self.record(stage)
        if record is None:
            return False, []
        changes = key_changes(record.get("key"), key)
        return not changes and artefact.exists(), changes

    def finish(self, stage: str, key: dict, summary: dict, made_for: dict, elapsed_s: float) -> None:
        write_json(self.work_path(f"{stage}.json"),
                   {"key": key, "summary": summary, "made_for": made_for, "elapsed_s": round(elapsed_s, 1)})

    def forget(self, stage: str) -> None:
        self.work_path(f"{stage}.json").unlink(missing_ok=True)

    # --- the manifest and the predictor directory ------------------------------------------------

    def remove_manifest(self) -> bool:
        path = self.path(MANIFEST)
        if path.exists():
            path.unlink()
            return True
        return False

    def replace_predictor(self, made: Path) -> Path:
        """Move a predictor directory written under ``work/`` into the bundle, in place of the old one."""
        target = self.path(PREDICTOR)
        old = self.work_path("predictor.old")
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            os.replace(target, old)
        os.replace(made, target)
        shutil.rmtree(old, ignore_errors=True)
        return target
