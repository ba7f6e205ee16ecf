"""What every benchmark does with its figures: print the JSON, and write it where asked."""

from __future__ import annotations

import json
from pathlib import Path


def emit_json(result: dict, path: str | Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
