"""The codebase index: tree-sitter chunks, MiniLM vectors in FAISS, BM25 over split identifiers.

    from opencomposer.index import CodebaseIndex
    index = CodebaseIndex.open(Path("."))   # loads .opencomposer/index/ or creates it
    index.refresh()                         # Merkle diff against disk, embeds what changed
    index.search("where retries back off", k=8, path="src/")

Imports nothing else of opencomposer; heavy libraries load on first use.
"""

from .core import CodebaseIndex, Hit, IndexProblem, IndexStats

__all__ = ["CodebaseIndex", "Hit", "IndexProblem", "IndexStats"]
