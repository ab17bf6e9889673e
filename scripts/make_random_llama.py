"""Write a Llama-shaped model with random weights as a Hugging Face directory, for calibrating and
validating the cost model on a model larger than the built-in tiny one (no download).

Default shape (``--shape 100m``): 12 layers, hidden 768, 12 query / 4 key-value heads of 64, SwiGLU 2048,
vocab 32000, tied embeddings: 100,092,672 parameters (about 400 MB in float32), 8,192 positions.

Usage: .venv/bin/python scripts/make_random_llama.py OUT_DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import math

from schedspec.gpu_backend.config import tiny_model_config
from schedspec.gpu_backend.weights import expected_tensor_shapes, random_weights, save_model_dir

SHAPES = {
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=True,
                 max_position_embeddings=8192),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="100m")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = tiny_model_config(**SHAPES[args.shape])
    params = sum(math.prod(s) for s in expected_tensor_shapes(config).values())
    path = save_model_dir(args.out, config, random_weights(config, args.seed))
    print(f"wrote {path}: {params:,} parameters")


if __name__ == "__main__":
    main()
