"""A second solution of the dynamic engine's exercise (issue 40). NOT blind: written by the exercise's author in a
different shape (a counter per call, then one pass), as a stand-in until someone who has not seen the reference,
the tests or the named mistakes writes it from the notebook's text (CONTRIBUTING.md, step 5)."""

SOLUTIONS = [
    dict(exercise='inference.release_blocks', name="author's stand-in (not blind)", code='''
from collections import Counter
drops = Counter(blocks)
for b, n in drops.items():
    if self.block_ref_counts[b] < n:
        raise RuntimeError(f"block {b} is released {n} times but held {self.block_ref_counts[b]} times")
for b, n in drops.items():
    self.block_ref_counts[b] -= n
    if self.block_ref_counts[b]:
        continue
    registered = self.block_hashes[b] is not None
    if registered and self.prefix_caching_eviction_policy == "lru":
        continue
    if registered:
        self._deregister(b)
    self.free_blocks.append(b)
'''),
]
