"""Typical wrong answers to the dynamic engine's exercise (course/06_advanced/05_inference.ipynb: the KV block
allocator's release with reference counts and prefix caching)."""

from tests.mistakes import Mistake

MISTAKES = [
    Mistake("inference.release_blocks", "freed every released block, ignoring the other holders",
            says="while another request still holds it", code="""
for b in blocks:
    if self.block_ref_counts[b] <= 0:
        raise RuntimeError(f"block {b} released more often than it was allocated or retained")
    self.block_ref_counts[b] = 0
    if self.block_hashes[b] is not None:
        self._deregister(b)
    self.free_blocks.append(b)
"""),
    Mistake("inference.release_blocks", "freed a registered block at zero under LRU", says="cached prefix is lost",
            code="""
for b in blocks:
    if self.block_ref_counts[b] <= 0:
        raise RuntimeError(f"block {b} released more often than it was allocated or retained")
    self.block_ref_counts[b] -= 1
    if self.block_ref_counts[b] == 0:
        if self.block_hashes[b] is not None:
            self._deregister(b)
        self.free_blocks.append(b)
"""),
    Mistake("inference.release_blocks", "kept every block at zero cached, hash or not", says="a leak", code="""
for b in blocks:
    if self.block_ref_counts[b] <= 0:
        raise RuntimeError(f"block {b} released more often than it was allocated or retained")
    self.block_ref_counts[b] -= 1
    if self.block_ref_counts[b] == 0 and self.prefix_caching_eviction_policy == "ref_zero":
        if self.block_hashes[b] is not None:
            self._deregister(b)
        self.free_blocks.append(b)
"""),
    Mistake("inference.release_blocks", "no double-free check", says="double free", code="""
for b in blocks:
    self.block_ref_counts[b] -= 1
    if self.block_ref_counts[b] > 0:
        continue
    if self.block_hashes[b] is not None and self.prefix_caching_eviction_policy == "lru":
        continue
    if self.block_hashes[b] is not None:
        self._deregister(b)
    self.free_blocks.append(b)
"""),
]
