"""A draft vocabulary: the token ids the draft head may propose (FR-Spec's frequency-ranked subset, EAGLE-3's d2t
map, SGLang's --speculative-token-map).

A draft step's largest read is the LM head's 248,320 rows, even at Q4_0 (BENCHMARKS.md §5, the Q4_0 draft head
row; §4, the draft vocabulary row, for what a subset buys end to end). Over n of them it reads n / V of those
bytes. Drafts outside the set are never proposed, which
lowers the acceptance rate only where the target would have chosen such a token; the target verifies with its full
head, so the output is unchanged. The set comes from a count of tokens over text like the requests' (`qspec
draft-vocab`), or, without one, the first n ids: BPE ids follow merge order, a rough proxy for frequency.

Files hold one id per line (`#` starts a comment), so a set can be read, diffed and edited by hand.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch


def check_ids(ids: Iterable[int], vocab: int) -> list[int]:
    """The ids sorted, once each; ValueError naming the problem when one lies outside [0, vocab) or none is given."""
    out = sorted({int(i) for i in ids})
    if not out:
        raise ValueError("the draft vocabulary is empty")
    if out[0] < 0 or out[-1] >= vocab:
        bad = out[0] if out[0] < 0 else out[-1]
        raise ValueError(f"draft vocabulary id {bad} is outside the model's vocabulary [0, {vocab})")
    return out


def first_ids(n: int, vocab: int, keep: Iterable[int] = ()) -> list[int]:
    """The first n ids and `keep` (the stop tokens, say, which then may be drafted)."""
    if not 1 <= n <= vocab:
        raise ValueError(f"a draft vocabulary of {n} ids: expected 1..{vocab}")
    return check_ids([*range(n), *keep], vocab)


def frequent_ids(token_lists: Iterable[Sequence[int]], n: int, vocab: int, keep: Iterable[int] = ()) -> list[int]:
    """The n most frequent ids over the token lists (ties to the lower id) and `keep`."""
    if not 1 <= n <= vocab:
        raise ValueError(f"a draft vocabulary of {n} ids: expected 1..{vocab}")
    counts: Counter[int] = Counter()
    for tokens in token_lists:
        counts.update(tokens)
    if not counts:
        raise ValueError("no tokens to count")
    top = sorted(counts, key=lambda t: (-counts[t], t))[:n]
    return check_ids([*top, *keep], vocab)


def read_ids(path: str | Path, vocab: int) -> list[int]:
    """The ids of a draft vocabulary file, checked against the vocabulary."""
    ids = []
    for no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            ids.append(int(text))
        except ValueError:
            raise ValueError(f"{path}:{no}: expected one token id per line, got {line.strip()!r}") from None
    try:
        return check_ids(ids, vocab)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def write_ids(path: str | Path, ids: Sequence[int], comment: str = "") -> None:
    lines = [f"# {c}" for c in comment.splitlines()] + [str(i) for i in ids]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


def ids_tensor(ids: Sequence[int] | torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """Checked ids as a sorted int64 tensor on `device` (the draft head's row map)."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return torch.tensor(check_ids(values, vocab), dtype=torch.long, device=device)
