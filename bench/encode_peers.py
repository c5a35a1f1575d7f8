"""transformers on the passages crates/colbert/examples/encode_bench.rs
encodes, timed the same way: batches of 32 passages, each tokenized
(truncated to 180 tokens, the ColBERT document length, padded to the
batch's longest) and run through the encoder, the token embeddings
L2-normalized; one untimed batch first, then passes over all passages,
documents per second of each, the median last.

    python3 bench/encode_peers.py --model-dir models/all-MiniLM-L6-v2 --docs passages.txt \
        [--device cpu|cuda] [--dtype f32|bf16|f16] [--threads N] [--runs 3]

Prints one JSON line per run and one with the median.
"""
import argparse
import json
import os
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--docs", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=180)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(a.threads)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, None: None}[a.dtype]
    if dtype is None:
        dtype = torch.float16 if a.device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModel.from_pretrained(a.model_dir, dtype=dtype).to(a.device).eval()
    docs = [l.strip() for l in open(a.docs) if l.strip()]

    def encode(batch):
        t = tok(batch, truncation=True, max_length=a.max_length, padding="longest", return_tensors="pt").to(a.device)
        with torch.inference_mode():
            h = model(**t).last_hidden_state
            h = torch.nn.functional.normalize(h, dim=-1)
        if a.device == "cuda":
            torch.cuda.synchronize()
        return int(t["attention_mask"].sum())

    encode(docs[: a.batch])
    rates = []
    for run in range(a.runs):
        tokens = 0
        t0 = time.perf_counter()
        for i in range(0, len(docs), a.batch):
            tokens += encode(docs[i : i + a.batch])
        s = time.perf_counter() - t0
        rates.append(len(docs) / s)
        print(json.dumps({"impl": "transformers", "torch": torch.__version__, "run": run, "documents": len(docs),
                          "tokens": tokens, "seconds": s, "docs_per_s": len(docs) / s, "tokens_per_s": tokens / s,
                          "device": a.device, "dtype": str(dtype), "threads": a.threads, "batch": a.batch}), flush=True)
    rates.sort()
    print(json.dumps({"impl": "transformers", "summary": "median", "docs_per_s": rates[len(rates) // 2]}))


if __name__ == "__main__":
    main()
