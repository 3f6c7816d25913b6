"""pass@k, the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
Trained on Code", section 2.1).

With n samples of a task of which c are correct, the probability that at least one of k
samples drawn without replacement from them is correct is

    pass@k = 1 - C(n - c, k) / C(n, k)

and the benchmark's pass@k is its mean over tasks. Binomials overflow floats for large n, so it
is computed as the product 1 - prod_{i = n-c+1}^{n} (1 - k / i), the form of the paper's
numpy snippet (equal term for term: C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (i - k) / i).
"""

from __future__ import annotations

from collections.abc import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: `n` samples, `c` of them correct (ValueError when
    k < 1, k > n or c outside 0..n)."""
    if n < 1:
        raise ValueError(f"pass@k needs at least one sample (n={n})")
    if not 0 <= c <= n:
        raise ValueError(f"c={c} correct of n={n} samples is impossible")
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1 (k={k})")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task (n={n})")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """pass@k over tasks: the mean of `pass_at_k(n, c, k)` over their (n, c) pairs."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("pass@k of no tasks")
    return sum(values) / len(values)
