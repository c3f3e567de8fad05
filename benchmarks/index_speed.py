"""Index speed: full build rate, one-file update latency, query latency, memory per chunk.

Corpus: real Python code copied from this venv's site-packages (sorted packages
until the wanted size), chunked by the index itself.

1. Build rate. On ~1,500-character chunks (line windows of the build corpus),
   the baseline, all-MiniLM-L6-v2 in fp32 at its default 256 tokens with the
   plain `SentenceTransformer.encode`, against the index's embedder on the same
   texts -> the ratio. Then a full `refresh()` of an empty index over the build
   corpus (model already loaded; every chunk embedded) -> chunks/s, characters/s
   and where the time went (scan, chunk, embed, store, faiss).
2. Update latency at `--chunks` (10,000) chunks: edit one file, time `refresh()`
   on the open index (what the language server holds), and `update_buffer()`.
3. Query latency p50/p95 at 10,000 and `--large` (100,000) chunks, and memory
   per chunk (RSS growth / chunks; database bytes / chunks).

For (2) and (3) the bulk of the vectors are *stand-ins* (a hash of the text
mapped to a unit vector) because embedding 100,000 chunks for real takes hours
on 2 shared cores; everything else is real — chunking, SQLite/FTS5, FAISS, the
Merkle walk — and the edited file's chunks and every query are embedded by the
real model. Vector values do not change FAISS's or FTS5's cost.

Run: `.venv/bin/python benchmarks/index_speed.py [--build-chunks 600] [--chunks 10000] [--large 100000]`
Large corpora are cached under ~/.cache/opencomposer/bench/.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
from opencomposer.index import CodebaseIndex

CACHE = Path(
    os.environ.get("OPENCOMPOSER_BENCH_CACHE", Path.home() / ".cache" / "opencomposer" / "bench")
)
SITE = Path(sysconfig.get_paths()["purelib"])
QUERIES = [
    "parse command line arguments into options",
    "retry a failed http request with exponential backoff",
    "render a table with colored columns",
    "read a configuration file and merge defaults",
    "convert a datetime to an ISO 8601 string",
    "compute the checksum of a file in chunks",
    "walk a directory tree ignoring hidden files",
    "validate that a value is a positive integer",
    "serialize an object to json with custom encoder",
    "cache the result of a function call",
    "TokenizerFast",
    "def __init__(self, config)",
]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_corpus(dest: Path, chars: int) -> Path:
    """Copy whole site-packages packages into dest until about `chars` characters of Python."""
    marker = dest / ".complete"
    if marker.exists():
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    total = 0
    skip = {"torch", "vllm", "nvidia", "triton", "sympy", "_pytest", "pip", "setuptools"}
    for pkg in sorted(p for p in SITE.iterdir() if p.is_dir() and not p.name.endswith(("-info", "__pycache__"))):  # fmt: skip
        if pkg.name in skip:
            continue
        for f in sorted(pkg.rglob("*.py")):
            if "__pycache__" in f.parts or "tests" in f.parts:
                continue
            try:
                size = f.stat().st_size
            except OSError:
                continue
            if size > 300_000 or size < 200:
                continue
            target = dest / f.relative_to(SITE)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
            total += size
            if total >= chars:
                break
        if total >= chars:
            break
    marker.write_text("")
    return dest


def standin(dim: int):
    def encode(texts: list[str], progress: object = None) -> np.ndarray:
        out = np.empty((len(texts), dim), dtype=np.float32)
        for i, t in enumerate(texts):
            seed = int.from_bytes(hashlib.blake2b(t.encode("utf-8", "replace"), digest_size=8).digest(), "little")  # fmt: skip
            out[i] = np.random.default_rng(seed).standard_normal(dim)
        return out / np.linalg.norm(out, axis=1, keepdims=True)

    return encode


def build_with_standins(root: Path, label: str) -> CodebaseIndex:
    index = CodebaseIndex.open(root)
    real = index.embedder.encode
    index.embedder.encode = standin(index.embedder.dim)  # type: ignore[method-assign]
    t0 = time.perf_counter()
    stats = index.refresh()
    index.embedder.encode = real  # type: ignore[method-assign]
    if stats.files_changed:
        print(f"  [{label}] built with stand-in vectors: {stats.files} files, {stats.chunks} chunks in {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
    return index


def latency(index: CodebaseIndex, reps: int) -> tuple[float, float]:
    index.search("warm up the model", k=10)
    times = []
    for _ in range(reps):
        for q in QUERIES:
            index._query_cache.clear()  # every query pays for its embedding
            t0 = time.perf_counter()
            index.search(q, k=10)
            times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.95 * (len(times) - 1))]


def bench_build(n_chunks: int) -> None:
    import torch
    from opencomposer.index.chunking import ChunkConfig, line_windows
    from opencomposer.index.core import embed_text
    from opencomposer.index.embed import Embedder, default_model_folder
    from sentence_transformers import SentenceTransformer

    corpus = make_corpus(CACHE / f"speed-build-{n_chunks}", n_chunks * 1100)
    root = CACHE / f"speed-build-{n_chunks}-ws"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(corpus, root)
    files = sorted(root.rglob("*.py"))
    # ~1,500-character chunks, as the target states them: windows of whole lines up to
    # 1,500 characters, those of at least 1,200, in the index's embedding layout.
    wide = ChunkConfig(max_chars=1500, window_lines=400)
    big = []
    for f in files:
        lines = f.read_text(errors="replace").splitlines()
        big += line_windows(f.relative_to(root).as_posix(), lines, 1, len(lines), wide)
    sample = [embed_text(c) for c in big if len(c.text) >= 1200][:256]
    print(f"~1,500-character chunks: {len(sample)}, mean {statistics.mean(len(t) for t in sample):.0f} characters")  # fmt: skip

    base = SentenceTransformer(str(default_model_folder()), device="cpu", model_kwargs={"dtype": torch.float32})  # fmt: skip
    threads = Embedder._threads(len(sample))  # the same thread policy as the index
    torch.set_num_threads(threads)
    base.encode(sample[:16])
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        base.encode(sample, batch_size=32)
    base_rate = len(sample) / (time.perf_counter() - t0)
    base_cpu = len(sample) / (time.process_time() - c0)
    print(f"  baseline MiniLM fp32, 256 tokens, sentence-transformers: {base_rate:.1f} chunks/s ({threads} threads); "
          f"{base_cpu:.1f} chunks per CPU-second", flush=True)  # fmt: skip

    index = CodebaseIndex.open(root)
    embedder = index.embedder
    embedder.encode(sample[:16])  # model load is not part of any rate
    t0, c0 = time.perf_counter(), time.process_time()
    embedder.encode(sample)
    own_rate = len(sample) / (time.perf_counter() - t0)
    own_cpu = len(sample) / (time.process_time() - c0)
    print(f"  index embedder ({embedder.config.dtype}, {embedder.config.max_tokens} tokens): {own_rate:.1f} chunks/s "
          f"-> {own_rate / base_rate:.2f}x the fp32 baseline; {own_cpu:.1f} chunks per CPU-second "
          f"({own_cpu / base_cpu:.2f}x)", flush=True)  # fmt: skip

    c0 = time.process_time()
    stats = index.refresh()
    build_cpu = stats.chunks_embedded / (time.process_time() - c0)
    rate = stats.chunks_per_s
    chars = statistics.mean(len(r[0]) for r in index.db.execute("SELECT text FROM chunks"))
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in stats.phases.items())
    print(f"  index full build from empty: {stats.files} files, {stats.chunks} chunks (mean {chars:.0f} characters), "
          f"{stats.chunks_embedded} embedded in {stats.seconds - stats.load_seconds:.1f} s -> {rate:.1f} chunks/s, "
          f"{rate * chars / 1000:.0f} k characters/s (baseline {base_rate * 1.5:.0f} k characters/s); "
          f"{build_cpu:.0f} chunks per CPU-second")  # fmt: skip
    print(f"  where the time went: {phases}")
    print("  target: 300 chunks/s of ~1,500 characters (3x a 100/s fp32 baseline)")
    index.close()


def bench_scale(n_chunks: int, reps: int, update: bool) -> None:
    corpus = make_corpus(CACHE / f"speed-{n_chunks}", n_chunks * 900)
    from opencomposer.index.embed import Embedder, EmbedderConfig

    Embedder(EmbedderConfig.resolve()).encode(["load the model before measuring memory"])
    rss0 = rss_mb()
    t0 = time.perf_counter()
    index = build_with_standins(corpus, f"{n_chunks}")
    rss1 = rss_mb()
    db = index.db_path.stat().st_size
    print(f"{len(index)} chunks (target {n_chunks}): opened in {time.perf_counter() - t0:.1f} s; "
          f"memory {(rss1 - rss0) * 1024 * 1024 / max(1, len(index)):.0f} B/chunk RSS, "
          f"{db / max(1, len(index)):.0f} B/chunk on disk; FAISS vectors {index._vectors.d * 4} B/chunk "
          f"({type(index._vectors).__name__})")  # fmt: skip
    p50, p95 = latency(index, reps)
    print(f"  query latency: p50 {p50:.1f} ms, p95 {p95:.1f} ms ({reps * len(QUERIES)} queries, k=10)", flush=True)  # fmt: skip
    if not update:
        index.close()
        return
    victim = max((p for p in corpus.rglob("*.py")), key=lambda p: (p.stat().st_size < 20_000, p.stat().st_size))  # fmt: skip
    rel = victim.relative_to(corpus).as_posix()
    original = victim.read_text()
    try:
        lines = original.splitlines()
        lines.insert(len(lines) // 2, "# an edit in the middle of the file")
        victim.write_text("\n".join(lines) + "\n")
        t0 = time.perf_counter()
        stats = index.refresh()
        dt = time.perf_counter() - t0
        print(f"  one-file edit ({rel}, {len(original)} chars): refresh {dt * 1000:.0f} ms, "
              f"{stats.files_changed} file changed, {stats.chunks_embedded} chunks re-embedded "
              f"({stats.embed_seconds * 1000:.0f} ms embedding) (target < 1000 ms)")  # fmt: skip
        buffer = original + "\ndef added_in_the_editor():\n    return 42\n"
        t0 = time.perf_counter()
        stats = index.update_buffer(rel, buffer)
        print(f"  update_buffer of the same file: {(time.perf_counter() - t0) * 1000:.0f} ms, {stats.chunks_embedded} chunks re-embedded")  # fmt: skip
        t0 = time.perf_counter()
        stats = index.refresh()
        print(f"  no-op refresh: {(time.perf_counter() - t0) * 1000:.0f} ms")
    finally:
        victim.write_text(original)
        index.drop_buffer(rel)
        index.refresh()
        index.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-chunks", type=int, default=600, help="size of the full-build corpus")
    ap.add_argument("--chunks", type=int, default=10_000, help="index size for update and latency")
    ap.add_argument("--large", type=int, default=100_000, help="second latency size (0 skips)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-build", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    if not args.skip_build:
        bench_build(args.build_chunks)
    bench_scale(args.chunks, args.reps, update=True)
    if args.large:
        bench_scale(args.large, args.reps, update=False)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
