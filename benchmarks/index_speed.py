"""Index speed: full build rate, one-file update latency, query latency, memory per chunk.

Corpus: real Python code copied from this venv's site-packages (sorted packages
until the wanted size), chunked by the index itself.

1. Build rate. On ~1,500-character chunks (line windows of the build corpus):
   the baseline, all-MiniLM-L6-v2 in fp32 through plain
   `SentenceTransformer.encode` at the index's token budget (64; the ~100/s
   figure of the target) and at its own default of 256, against the index's
   embedder at each precision (`--dtypes`, with fp32) -> chunks/s, the ratio to
   the baseline, and the cosine of each precision's vectors to fp32's. Then a
   full `refresh()` of an empty index at the default precision (model already
   loaded; every chunk embedded), twice: over the corpus with the index's own
   chunking, and over the same corpus chunked to ~1,500 characters -> chunks/s,
   the ratio to the baseline and where the time went (scan, chunk, embed,
   store, faiss).
2. Update latency at `--chunks` (10,000) chunks: edit one file, time `refresh()`
   on the open index (what the language server holds), and `update_buffer()`.
3. Query latency p50/p95 at 10,000 and `--large` (100,000) chunks, and memory
   per chunk (RSS growth / chunks; database bytes / chunks).

For (2) and (3) the bulk of the vectors are *stand-ins* (a hash of the text
mapped to a unit vector) because embedding 100,000 chunks for real takes hours
on 2 shared cores; everything else is real — chunking, SQLite/FTS5, FAISS, the
Merkle walk — and the edited file's chunks and every query are embedded by the
real model. Vector values do not change FAISS's or FTS5's cost.

Run: `.venv/bin/python benchmarks/index_speed.py [--build-chunks 2000] [--chunks 10000] [--large 100000]`
(`--build-only`: section 1 alone, about two minutes).
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
from opencomposer.index.chunking import ChunkConfig

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


def fp32_baseline(sample: list[str], tokens: int) -> tuple[float, float]:
    """MiniLM fp32 through plain `SentenceTransformer.encode` at `tokens`: (chunks/s, per CPU-second)."""
    import torch
    from opencomposer.index.embed import default_model_folder
    from sentence_transformers import SentenceTransformer

    base = SentenceTransformer(str(default_model_folder()), device="cpu", model_kwargs={"dtype": torch.float32})  # fmt: skip
    base.max_seq_length = tokens
    torch.set_num_threads(os.cpu_count() or 1)  # torch's own threads: its default use of the cores
    base.encode(sample[:16])
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        base.encode(sample, batch_size=32)
    return len(sample) / (time.perf_counter() - t0), len(sample) / (time.process_time() - c0)


def embed_rate(sample: list[str], dtype: str) -> tuple[float, float, np.ndarray]:
    """The index's embedder at `dtype` on the sample: (chunks/s, per CPU-second, vectors)."""
    from opencomposer.index.embed import Embedder, EmbedderConfig

    config = EmbedderConfig.resolve()
    embedder = Embedder(EmbedderConfig(folder=config.folder, dtype=dtype, max_tokens=config.max_tokens))  # fmt: skip
    embedder.encode(sample[:16])  # model load is not part of any rate
    best = (0.0, 0.0, np.zeros(0))
    for _ in range(2):
        t0, c0 = time.perf_counter(), time.process_time()
        vecs = embedder.encode(sample)
        rate = len(sample) / (time.perf_counter() - t0)
        if rate > best[0]:
            best = (rate, len(sample) / (time.process_time() - c0), vecs)
    return best


def full_build(root: Path, label: str, chunking: ChunkConfig | None, base_rate: float) -> float:
    """refresh() of an empty index over root (model already loaded): chunks/s over the whole build."""
    from opencomposer.index.embed import Embedder, EmbedderConfig

    index = CodebaseIndex(root, Embedder(EmbedderConfig.resolve()))
    if chunking:
        index.chunk_config = chunking
    index._connect()
    index.embedder.encode(["load the model before the clock starts"])
    c0, load0 = time.process_time(), os.getloadavg()[0]
    stats = index.refresh()
    build_cpu = stats.chunks_embedded / (time.process_time() - c0)
    rate = stats.chunks_per_s
    texts = [r[0] for r in index.db.execute("SELECT text FROM chunks")]
    chars = statistics.mean(len(t) for t in texts)
    tokenizer = (
        index.embedder.model.tokenizer if hasattr(index.embedder.model, "tokenizer") else None
    )
    cap = index.embedder.config.max_tokens
    at_cap = ""
    if tokenizer is not None:
        lengths = [len(ids) for ids in tokenizer(texts[:2000], truncation=True, max_length=cap)["input_ids"]]  # fmt: skip
        at_cap = f", {sum(n >= cap for n in lengths) / len(lengths):.0%} of them at the {cap}-token budget"  # fmt: skip
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in stats.phases.items())
    print(f"  full build from empty, {label} ({index.embedder.config.dtype}): {stats.files} files, {stats.chunks} chunks "
          f"(mean {chars:.0f} characters{at_cap}), {stats.chunks_embedded} embedded in "
          f"{stats.seconds - stats.load_seconds:.1f} s -> {rate:.1f} chunks/s = {rate / base_rate:.2f}x the fp32 "
          f"64-token baseline; {build_cpu:.0f} chunks per CPU-second; load {load0:.1f} -> {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"    where the time went: {phases}")
    index.close()
    return rate


def bench_build(n_chunks: int, dtypes: list[str]) -> None:
    """Embedding rates per precision on ~1,500-character chunks, then full builds at the default."""
    from opencomposer.index.chunking import line_windows
    from opencomposer.index.core import embed_text
    from opencomposer.index.embed import EmbedderConfig

    corpus = make_corpus(CACHE / f"speed-build-{n_chunks}", n_chunks * 1100)
    root = CACHE / f"speed-build-{n_chunks}-ws"
    files = sorted(corpus.rglob("*.py"))
    # ~1,500-character chunks, as the target states them: windows of whole lines up to
    # 1,500 characters, those of at least 1,200, in the index's embedding layout.
    wide = ChunkConfig(max_chars=1500, window_lines=400)
    big = []
    for f in files:
        lines = f.read_text(errors="replace").splitlines()
        big += line_windows(f.relative_to(corpus).as_posix(), lines, 1, len(lines), wide)
    sample = [embed_text(c) for c in big if len(c.text) >= 1200][:256]
    print(f"~1,500-character chunks: {len(sample)}, mean {statistics.mean(len(t) for t in sample):.0f} characters")  # fmt: skip

    default = EmbedderConfig.resolve()
    base_rate, base_cpu = fp32_baseline(sample, default.max_tokens)
    print(f"  baseline MiniLM fp32, {default.max_tokens} tokens, sentence-transformers, {os.cpu_count()} torch threads: "
          f"{base_rate:.1f} chunks/s; {base_cpu:.1f} chunks per CPU-second", flush=True)  # fmt: skip
    long_rate, _ = fp32_baseline(sample[:64], 256)
    print(f"  baseline MiniLM fp32, 256 tokens (its default): {long_rate:.1f} chunks/s", flush=True)

    exact = None
    for dtype in dict.fromkeys(["fp32", *dtypes]):
        rate, cpu, vecs = embed_rate(sample, dtype)
        exact = vecs if dtype == "fp32" else exact
        cos = np.sum(vecs * exact, axis=1)
        print(f"  index embedder {dtype:>4} ({default.max_tokens} tokens): {rate:6.1f} chunks/s = {rate / base_rate:.2f}x "
              f"the fp32 baseline ({rate / long_rate:.1f}x the 256-token one); {cpu:.1f} chunks per CPU-second; "
              f"cosine to fp32 mean {cos.mean():.4f}, min {cos.min():.4f}{'  <- default' if dtype == default.dtype else ''}",
              flush=True)  # fmt: skip

    for label, chunking, src in (
        ("site-packages, the index's chunking", None, corpus),
        ("~1,500-character chunks (min_chars = min_def_chars = 1200)",
         ChunkConfig(min_chars=1200, min_def_chars=1200, window_lines=400), corpus),
    ):  # fmt: skip
        if root.exists():
            shutil.rmtree(root)
        shutil.copytree(src, root)
        full_build(root, label, chunking, base_rate)
    print("  target: 300 chunks/s of ~1,500 characters (3x a 100/s fp32 baseline)")


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
    ap.add_argument(
        "--build-chunks",
        type=int,
        default=2000,
        help="size of the full-build corpus (a build of ~1,500-character chunks gets ~1,750 of them)",
    )
    ap.add_argument("--chunks", type=int, default=10_000, help="index size for update and latency")
    ap.add_argument("--large", type=int, default=100_000, help="second latency size (0 skips)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--build-only", action="store_true", help="only the build rates (section 1)")
    ap.add_argument("--dtypes", default="bf16,int8", help="precisions to time besides fp32")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    if not args.skip_build:
        bench_build(args.build_chunks, [d for d in args.dtypes.split(",") if d])
    if args.build_only:
        return 0
    bench_scale(args.chunks, args.reps, update=True)
    if args.large:
        bench_scale(args.large, args.reps, update=False)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
