#!/usr/bin/env python3
"""A ColBERT checkpoint (PyLate layout) around all-MiniLM-L6-v2, for load
tests of text search: the encoder as it ships, a seeded random projection to
`--dim` (1_Dense, no bias), ColBERT's `[unused0]` / `[unused1]` query and
document markers (single tokens of BERT's vocabulary), queries of 32 tokens.

Its rankings mean nothing (the projection is untrained); what it costs to
encode a query is the trained model's. Standard library only.

    python3 bench/minilm_colbert.py --minilm DIR --out DIR [--dim 128] [--seed 0]
"""

import argparse
import json
import os
import random
import shutil
import struct


def write_f32_safetensors(path, name, rows, cols, values):
    header = json.dumps({name: {"dtype": "F32", "shape": [rows, cols], "data_offsets": [0, 4 * rows * cols]}})
    header += " " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header.encode())
        f.write(struct.pack(f"<{rows * cols}f", *values))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minilm", required=True, help="all-MiniLM-L6-v2 directory (config.json, model.safetensors, tokenizer.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(os.path.join(a.out, "1_Dense"), exist_ok=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(a.minilm, name)):
            shutil.copyfile(os.path.join(a.minilm, name), os.path.join(a.out, name))
    hidden = json.load(open(os.path.join(a.minilm, "config.json")))["hidden_size"]
    rng = random.Random(a.seed)
    scale = hidden ** -0.5
    values = [rng.gauss(0.0, scale) for _ in range(a.dim * hidden)]
    write_f32_safetensors(os.path.join(a.out, "1_Dense", "model.safetensors"), "linear.weight", a.dim, hidden, values)
    json.dump({"in_features": hidden, "out_features": a.dim, "bias": False,
               "activation_function": "torch.nn.modules.linear.Identity"},
              open(os.path.join(a.out, "1_Dense", "config.json"), "w"))
    json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}],
              open(os.path.join(a.out, "modules.json"), "w"))
    json.dump({"model_type": "ColBERT", "prompts": {"query": "", "document": ""}, "default_prompt_name": None,
               "similarity_fn_name": "MaxSim", "query_prefix": "[unused0]", "document_prefix": "[unused1]",
               "query_length": 32, "document_length": 180, "attend_to_expansion_tokens": False,
               "skiplist_words": [], "do_query_expansion": True},
              open(os.path.join(a.out, "config_sentence_transformers.json"), "w"))
    json.dump({"max_seq_length": 180, "do_lower_case": False}, open(os.path.join(a.out, "sentence_bert_config.json"), "w"))
    print(json.dumps({"out": a.out, "dim": a.dim, "hidden": hidden}))


if __name__ == "__main__":
    main()
