"""Speculative-decoding counters, per request and accumulated."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens committed by speculative rounds (accepted + 1 per round)
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted
    drafted_at: list[int] = field(default_factory=list)  # per draft position: times drafted

    def record(self, n_drafted: int, n_accepted: int, n_committed: int) -> None:
        self.rounds += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        self.tokens += n_committed
        while len(self.drafted_at) < n_drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(n_drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < n_accepted)

    @property
    def rejected(self) -> int:
        return self.drafted - self.accepted

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    def merge(self, o: SpecStats) -> None:
        self.rounds += o.rounds
        self.drafted += o.drafted
        self.accepted += o.accepted
        self.tokens += o.tokens
        for i in range(len(o.drafted_at)):
            if i >= len(self.drafted_at):
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[i] += o.drafted_at[i]
            self.accepted_at[i] += o.accepted_at[i]

    def as_dict(self) -> dict[str, object]:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "rejected": self.rejected, "tokens": self.tokens, "mean_accepted": round(self.mean_accepted, 4),
                "tokens_per_round": round(self.tokens_per_round, 4),
                "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position()]}
