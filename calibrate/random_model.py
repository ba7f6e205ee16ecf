"""A model directory of random weights in a public checkpoint's layout, for calibrating a profile of an
architecture whose weights are not here (step times do not depend on the weights' values):

    python -m calibrate.random_model --arch llada-8b --device cuda --out /tmp/llada-8b
    dls calibrate --model /tmp/llada-8b --device cuda --only profile --prompt-tokens 256

The architectures are ``bench.engine_speed``'s (``llada-8b``: LLaDA-8B's config, bf16; ``llada-small`` and
``llada-tiny`` for a CPU), written as LLaDA's layout (``config.json`` with ``model_type: llada``, one
``model.safetensors``), which ``services.worker.model.loading`` loads in the weights' own dtype. No tokenizer:
such a directory can be profiled, not asked anything. ``scripts/gpu-check.sh`` uses it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def llada_config(config: dict) -> dict:
    """LLaDA's config.json for ``bench.engine_speed``'s architecture ``config`` (``DLMConfig`` fields)."""
    return {
        "model_type": "llada", "architectures": ["LLaDAModelLM"],
        **{k: config[k] for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size",
                                  "rope_theta", "max_sequence_length", "mask_token_id", "eos_token_id",
                                  "pad_token_id")},
        "rope_full_precision": True,
    }


def write_random_model(arch: str, out: str | Path, device: str = "cpu", seed: int = 0) -> Path:
    import torch
    from safetensors.torch import save_file

    from bench.engine_speed import ARCHS, random_model

    spec = ARCHS[arch]
    model = random_model(spec, device, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "made_by": f"random weights, seed {seed}"})
    (out / "config.json").write_text(json.dumps({**llada_config(spec.config),
                                                 "torch_dtype": str(spec.dtype).removeprefix("torch.")}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.engine_speed import ARCHS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHS), required=True)
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: fast for 8B)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_random_model(args.arch, args.out, args.device, args.seed)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out}: {args.arch}, random weights (seed {args.seed}), {size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
