"""The rows of a procedural instance: ``generate_table(spec)``, its features and target.

The kinds (``procedural_schema.KINDS``), each drawing binary, multiclass or regression targets:

  * ``linear``:   a linear / logistic model with pairwise interactions and categorical effects;
  * ``rules``:    tree-like threshold rules (a random full binary tree of depth 2-4), label noise;
  * ``clusters``: Gaussian clusters per class (multiclass, sometimes binary), label noise;
  * ``counts``:   overdispersed counts (Poisson-Gamma) with heavy noise, regression metrics;
  * ``tokens``:   a text-like column of synthetic tokens with class-dependent frequencies
    (classification), plus a few numeric columns.

A pure function of the spec: the rows come from the instance's stream-2 Generator
(``procedural_schema.instance_rng``), before any train / test split.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from sandbox.tasks.procedural_schema import InstanceSpec, instance_rng

SYLLABLES = ("ka", "lo", "mi", "ra", "tu", "se", "no", "vi", "de", "po", "zu", "ba", "ke", "fi",
             "go", "ha", "ju", "le", "mo", "ne", "pi", "qu", "ri", "sa", "to", "wy")


def _standardise(f: np.ndarray) -> np.ndarray:
    s = f.std()
    return (f - f.mean()) / (s if s > 0 else 1.0)


def _class_from_scores(rng, scores: np.ndarray, temperature: float) -> np.ndarray:
    """Samples a class per row from softmax(scores / temperature); scores [n, K]."""
    z = scores / max(temperature, 1e-3)
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    u = rng.random((len(p), 1))
    return np.minimum((p.cumsum(axis=1) < u).sum(axis=1), p.shape[1] - 1)


def _balance(rng, y: np.ndarray, k: int, min_frac: float) -> np.ndarray:
    """Relabels random rows so that every class holds at least ``min_frac`` of the rows."""
    y = y.copy()
    need = int(np.ceil(min_frac * len(y)))
    for c in range(k):
        short = need - int((y == c).sum())
        if short > 0:
            counts = np.bincount(y, minlength=k)
            donors = np.flatnonzero(y == int(np.argmax(counts)))
            y[rng.choice(donors, size=short, replace=False)] = c
    return y


def _latent(spec: InstanceSpec, rng) -> tuple[np.ndarray, list[np.ndarray]]:
    """Latent standard-normal numeric matrix [n, p] (correlated) and categorical codes."""
    n = spec.n_rows
    nums = [c for c in spec.columns if c.ftype in ("num", "int")]
    p = len(nums)
    a = rng.normal(size=(p, p)) * rng.uniform(0, 0.5)
    cov = np.eye(p) + a @ a.T
    L = np.linalg.cholesky(cov)
    z = rng.normal(size=(n, p)) @ L.T
    z = (z - z.mean(0)) / z.std(0)
    codes = []
    for c in spec.columns:
        if c.ftype == "cat":
            w = rng.dirichlet(np.full(len(c.levels), 2.0))
            codes.append(rng.choice(len(c.levels), size=n, p=w))
    return z, codes


def _signal(spec: InstanceSpec, rng, z: np.ndarray, codes: list[np.ndarray], k: int) -> np.ndarray:
    """Kind-specific noiseless scores [n, k] from the informative features."""
    nums = [c for c in spec.columns if c.ftype in ("num", "int")]
    cats = [c for c in spec.columns if c.ftype == "cat"]
    inf = [j for j, c in enumerate(nums) if c.informative]
    cat_inf = [j for j, c in enumerate(cats) if c.informative]
    n = spec.n_rows
    out = np.zeros((n, k))
    if spec.kind in ("linear", "counts", "tokens"):
        for col in range(k):
            beta = rng.normal(size=len(inf)) * rng.choice([0.3, 1.0], size=len(inf))
            f = z[:, inf] @ beta if inf else np.zeros(n)
            for _ in range(int(rng.integers(1, 4)) if len(inf) >= 2 else 0):
                i, j = rng.choice(inf, size=2, replace=False)
                f += rng.normal() * z[:, i] * z[:, j]
            if spec.kind == "counts" and inf:
                i = int(rng.choice(inf))
                f += 0.5 * np.abs(z[:, i])
            for j in cat_inf:
                f += rng.normal(scale=0.8, size=len(cats[j].levels))[codes[j]]
            out[:, col] = _standardise(f)
        return out
    if spec.kind == "rules":
        depth = int(rng.integers(2, 5))
        feats = np.column_stack([z[:, inf]] + [codes[j][:, None] + rng.normal(0, 1e-6, (n, 1))
                                               for j in cat_inf]) if (inf or cat_inf) else z
        n_nodes = 2**depth - 1
        node_feat = rng.integers(0, feats.shape[1], size=n_nodes)
        q = rng.uniform(0.2, 0.8, size=n_nodes)
        node_thr = np.array([np.quantile(feats[:, node_feat[i]], q[i]) for i in range(n_nodes)])
        node = np.zeros(n, dtype=np.int64)
        for _ in range(depth):
            go = feats[np.arange(n), node_feat[node]] > node_thr[node]
            node = 2 * node + 1 + go
        leaf = node - n_nodes
        leaf_vals = rng.normal(size=(2**depth, k)) * 2.0
        out = leaf_vals[leaf]
        if k == 1:
            out[:, 0] = _standardise(out[:, 0])
        return out
    # clusters: class centres in the informative dims, 1-2 centres per class
    dims = inf or list(range(z.shape[1]))
    sep = rng.uniform(0.8, 2.5)
    centres = rng.normal(size=(k, 2, len(dims))) * sep
    return np.stack([-np.min(((z[:, dims][:, None, :] - centres[c][None]) ** 2).sum(-1), axis=1)
                     for c in range(k)], axis=1)


def _tokens(spec: InstanceSpec, rng, y: np.ndarray, k: int) -> np.ndarray:
    """Space-separated synthetic tokens with class-dependent frequencies, one string per row."""
    v = int(rng.integers(30, 200))
    vocab = sorted({"".join(rng.choice(SYLLABLES, size=int(rng.integers(2, 4))))
                    for _ in range(v * 2)})[:v]
    vocab = np.array(vocab, dtype=object)
    background = rng.dirichlet(np.full(len(vocab), 0.5))
    strength = 1.0 - 0.8 * spec.noise
    topic = [rng.dirichlet(np.full(len(vocab), 0.1)) for _ in range(k)]
    lengths = np.maximum(1, rng.poisson(rng.uniform(4, 16), size=len(y)))
    out = []
    for yi, ln in zip(y, lengths):
        p = (1 - strength) * background + strength * 0.5 * topic[yi] + strength * 0.5 * background
        out.append(" ".join(rng.choice(vocab, size=int(ln), p=p / p.sum())))
    return np.array(out, dtype=object)


def generate_table(spec: InstanceSpec) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(features [n, f], target [n, 1]) of an instance, before splitting; deterministic."""
    rng = instance_rng(spec.kind, spec.index, 2)
    z, codes = _latent(spec, rng)
    n = spec.n_rows
    if spec.target_type == "regression":
        f = _signal(spec, rng, z, codes, 1)[:, 0]
        if spec.kind == "counts":
            mu = np.exp(rng.uniform(0.0, 2.5) + rng.uniform(0.3, 1.0) * f)
            shape = 0.5 + 5.0 * (1.0 - spec.noise)
            y = rng.poisson(mu * rng.gamma(shape, 1.0 / shape, size=n)).astype(np.float64)
        else:
            y = f + rng.normal(size=n) * (0.2 + 1.5 * spec.noise)
            scale, offset = float(np.exp(rng.uniform(0, 5))), float(rng.uniform(0, 100))
            y = y * scale + offset
            if spec.metric == "rmsle":
                y = y - y.min() + float(rng.uniform(0, 5))
            y = np.round(y, 3)
        target = pd.DataFrame({spec.target: y})
    else:
        k = len(spec.labels)
        if spec.kind == "tokens":
            y = _balance(rng, rng.choice(k, size=n, p=rng.dirichlet(np.full(k, 3.0))), k,
                         0.12 if k == 2 else 0.08)
        else:
            s = _signal(spec, rng, z, codes, k)
            if k == 2 and spec.kind == "linear":
                s[:, 1] = 0.0
            y = _class_from_scores(rng, s, temperature=0.15 + 1.2 * spec.noise)
            flip = rng.random(n) < 0.1 * spec.noise
            y[flip] = rng.integers(0, k, size=int(flip.sum()))
            y = _balance(rng, y, k, 0.12 if k == 2 else 0.08)
        labels = np.array(spec.labels, dtype=object)
        target = pd.DataFrame({spec.target: labels[y] if spec.labels != ("0", "1")
                               else y.astype(np.int64)})

    feats = {}
    nums = iter(range(z.shape[1]))
    cats = iter(codes)
    for c in spec.columns:
        if c.ftype in ("num", "int"):
            v = z[:, next(nums)]
            if c.skew:
                v = np.exp(c.skew * v)
            scale = max(c.scale, 5.0) if c.ftype == "int" else c.scale
            v = c.offset + scale * v
            decimals = max(c.decimals, int(np.ceil(-np.log10(scale / 50.0))))
            v = np.round(v) if c.ftype == "int" else np.round(v, decimals)
            col = pd.Series(v)
            if c.ftype == "int":
                col = col.astype("Int64")
        elif c.ftype == "cat":
            col = pd.Series(np.array(c.levels, dtype=object)[next(cats)], dtype=object)
        else:
            yi = (pd.Categorical(target.iloc[:, 0].astype(str), categories=list(spec.labels)).codes
                  if spec.labels else np.zeros(n, dtype=int))
            col = pd.Series(_tokens(spec, rng, np.asarray(yi), len(spec.labels or (0,))),
                            dtype=object)
        if c.missing > 0:
            col = col.mask(rng.random(n) < c.missing)
        feats[c.name] = col
    return pd.DataFrame(feats), target
